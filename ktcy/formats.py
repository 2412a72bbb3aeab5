"""Weight format names: ktcy's own (read from the C descriptor table), the KTransformers backend
spellings, and the FP8 scale detector."""
from ktcy import _native

#: {format name: descriptor} from include/ktcy/formats.h: code kind, block geometry, activation
#: kind ("int8" | "bf16"), scale kind ("none" | "per_channel" | "group" | "block_128x128"),
#: allowed group sizes, zero points, colsum, mins.
DESCRIPTORS = {d["name"]: d for d in _native.format_descriptors()}
FORMATS = tuple(DESCRIPTORS)
INT4_GROUP_SIZES = tuple(DESCRIPTORS["INT4"]["group_sizes"])
DEFAULT_INT4_GROUP = 64
#: the formats with a scale per (K group, channel), and every group size one of them takes
GROUPED_FORMATS = tuple(f for f, d in DESCRIPTORS.items() if d["scale"] == "group")
GROUP_SIZES = tuple(sorted({g for f in GROUPED_FORMATS for g in DESCRIPTORS[f]["group_sizes"]}))


def descriptor(fmt):
    """The descriptor of a canonical format name."""
    return DESCRIPTORS[fmt]


def has_groups(fmt):
    return DESCRIPTORS[fmt]["scale"] == "group"


def group_sizes(fmt):
    """The group sizes a grouped format takes (INT4 family: 32, 64, 128; INT8_GROUP and INT8_MIN also 16)."""
    return tuple(DESCRIPTORS[fmt]["group_sizes"])


def grouped_names():
    """The grouped formats, as a user message names them."""
    return " / ".join(GROUPED_FORMATS)


def weight_group(fmt, group_size=None):
    """The group a packed weight of fmt carries: group_size (default 64) for group-scale formats,
    MXFP4_A8's E8M0 block (32, the K span of its activation sums), else 0."""
    d = DESCRIPTORS[fmt]
    if d["scale"] == "group":
        return group_size or DEFAULT_INT4_GROUP
    return d["group_sizes"][0] if d["group_sizes"] else 0

def keeps_codes(stored, fmt):
    """True when packing in fmt keeps codes released in format `stored` as they are: the same
    format, or MXFP4 codes as MXFP4_A8 (the same bytes, multiplied by int8 activations)."""
    return fmt == stored or (stored, fmt) == ("MXFP4", "MXFP4_A8")

# KTransformers backend / method names -> ktcy format.  "FP8" alone is the DeepSeek-V3 release
# format (128x128 block scales); per-channel FP8 is FP8_PERCHANNEL or FP8 with per_channel=True.
_ALIASES = {
    "BF16": "BF16", "AMXBF16": "BF16",
    "INT8": "INT8", "AMXINT8": "INT8",
    "INT4": "INT4", "AMXINT4": "INT4",
    "INT4_ZP": "INT4_ZP", "INT4_ASYM": "INT4_ZP", "INT4_MIN": "INT4_MIN", "INT8_GROUP": "INT8_GROUP",
    "INT8_MIN": "INT8_MIN",
    "MXFP4": "MXFP4", "MXFP4_A8": "MXFP4_A8", "MXFP4_INT8ACT": "MXFP4_A8",
    "FP8": "FP8_BLOCK", "FP8_BLOCK": "FP8_BLOCK", "AMXFP8": "FP8_BLOCK",
    "FP8_PERCHANNEL": "FP8_PERCHANNEL", "AMXFP8_PERCHANNEL": "FP8_PERCHANNEL", "FP8PERCHANNEL": "FP8_PERCHANNEL",
}
# Backends that ask for AMX by name; on a CPU without usable AMX they fall back (with a log line).
AMX_BACKENDS = frozenset({"AMXBF16", "AMXINT8", "AMXINT4", "AMXFP8", "AMXFP8_PERCHANNEL"})


def canonical_format(name, per_channel=None):
    """ktcy format for a format/backend/method name; per_channel picks the FP8 scale kind."""
    if not isinstance(name, str):
        raise TypeError(f"format must be a string, got {type(name).__name__}")
    key = name.strip().upper().replace("-", "_")
    if key not in _ALIASES:
        raise ValueError(f"unknown weight format or backend {name!r}; known: {', '.join(sorted(_ALIASES))}")
    fmt = _ALIASES[key]
    if fmt.startswith("FP8") and per_channel is not None and key in ("FP8", "AMXFP8"):
        fmt = "FP8_PERCHANNEL" if per_channel else "FP8_BLOCK"
    return fmt


def fp8_scale_kind(scale_name, scale_shape, weight_shape, block=128):
    """Which FP8 scale convention a checkpoint tensor follows.

    `weight_scale_inv` is always the 128x128 block grid (DeepSeek-V3).  `weight_scale` is per
    channel when shaped [N] or [N, 1], and a block grid when shaped [ceil(N/128), ceil(K/128)]
    (some checkpoints name block scales that way).  Anything else is an error."""
    n, k = weight_shape
    grid = ((n + block - 1) // block, (k + block - 1) // block)
    shape = tuple(int(d) for d in scale_shape)
    leaf = scale_name.rsplit(".", 1)[-1]
    if leaf == "weight_scale_inv":
        if shape != grid:
            raise ValueError(f"{scale_name}: block scales of a {n}x{k} weight must be {grid}, got {shape}")
        return "FP8_BLOCK"
    if leaf == "weight_scale":
        if shape in ((n,), (n, 1)):
            return "FP8_PERCHANNEL"
        if shape == grid:
            return "FP8_BLOCK"
        raise ValueError(f"{scale_name}: shape {shape} fits neither per-channel ({n},) / ({n}, 1) "
                         f"nor 128x128 blocks {grid} of a {n}x{k} weight")
    raise ValueError(f"{scale_name}: not an FP8 scale tensor (expected weight_scale or weight_scale_inv)")
