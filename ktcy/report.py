"""What this machine can run: the data behind `ktcy info` and tools/check_cpu_features.py."""
from ktcy import _native
from ktcy.version import __version__
from ktcy.errors import UnsupportedISAError
from ktcy.formats import FORMATS, canonical_format
from ktcy.threads import get_num_threads

ISA_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                "avx512_bf16", "avx512_vbmi", "amx_tile", "amx_int8", "amx_bf16")
OS_STATE = ("os_avx", "os_avx512", "os_amx", "amx_permitted")

# KTransformers backend -> the features its ideal kernel needs here.
BACKEND_NEEDS = {
    "AMXINT8": ("amx_tile", "amx_int8", "os_amx", "amx_permitted"),
    "AMXINT4": ("amx_tile", "amx_int8", "os_amx", "amx_permitted"),
    "AMXBF16": ("amx_tile", "amx_bf16", "os_amx", "amx_permitted"),
    "FP8": ("avx512f", "avx512bw", "avx512_bf16", "avx512_vbmi", "os_avx512"),
    "FP8_PERCHANNEL": ("avx512f", "avx512bw", "avx512_bf16", "avx512_vbmi", "os_avx512"),
    "INT8": ("avx512f", "avx512bw", "avx512_vnni", "os_avx512"),
    "BF16": ("avx512f", "avx512bw", "avx512_bf16", "os_avx512"),
}
# the ISAs that run each backend's ideal path (what BACKEND_NEEDS asks for) or a faster one
BACKEND_ISAS = {"AMXINT8": ("amx",), "AMXINT4": ("amx",), "AMXBF16": ("amx",), "FP8": ("avx512", "amx"),
                "FP8_PERCHANNEL": ("avx512", "amx"), "INT8": ("avx512", "amx"), "BF16": ("avx512", "amx")}


def kernel_choices():
    """{format: {isa, variant, reason}} or {format: {"error": ...}} when a forced ISA can't run it."""
    out = {}
    for fmt in FORMATS:
        try:
            isa, variant = _native.resolve(fmt)
            out[fmt] = {"isa": isa, "variant": variant, "reason": _native._policy["reasons"].get(fmt, "")}
        except (UnsupportedISAError, ValueError) as e:  # ValueError: an invalid KTCY_ISA
            out[fmt] = {"error": str(e)}
    return out


def info():
    feats = _native.cpu_features()
    return {
        "version": __version__,
        "cpu": _native.cpu_model_name(),
        "features": feats,
        "available_isas": _native.available_isas(),
        "policy": {"forced_isa": _native._policy["forced"], "amx_enabled": _native._policy["amx_enabled"]},
        "kernels": kernel_choices(),
        "build": _native.build_info(),
        "threads": get_num_threads(),
        "tiles": _native.tile_choice(),
    }


def backend_readiness():
    """Per KTransformers backend: the ISA that will run it here, what the ideal path misses, and
    whether it is the one that runs (ideal: the features are there and the policy picks it)."""
    feats = _native.cpu_features()
    rows = {}
    for backend, needs in BACKEND_NEEDS.items():
        fmt = canonical_format(backend)
        missing = [f for f in needs if not feats[f]]
        try:
            isa, variant = _native.resolve(fmt)
        except (UnsupportedISAError, ValueError) as e:  # ValueError: an invalid KTCY_ISA
            isa, variant = None, str(e)
        rows[backend] = {"format": fmt, "ideal": not missing and isa in BACKEND_ISAS[backend], "missing": missing,
                         "isa": isa, "variant": variant}
    return rows


def avx2_usable():
    f = _native.cpu_features()
    return f["avx2"] and f["fma"] and f["os_avx"]
