"""Expert weights released already quantized, read as stored: compressed-tensors `pack-quantized`
INT4 (Kimi-K2) and INT8 and `int-quantized` INT8 (W8A16, W8A8), GPTQ INT4 and INT8, AWQ INT4, and
GPT-OSS's MXFP4 blocks.

A reader returns one projection as (codes [N, K], spec), the form MoE.from_experts packs without
re-quantizing: symmetric INT4 -> int8 codes in [-8, 7] with {"format": "INT4", "scale",
"group_size"}; with zero points -> uint8 codes 0..15 with {"format": "INT4_ZP", "scale",
"zero_points", "group_size"} (w = s * (q - z)); symmetric 8-bit -> int8 codes (-128 included:
compressed-tensors' scale is amax / 127.5) with {"format": "INT8_GROUP", "scale", "group_size"},
or {"format": "INT8", "scale"} with a scale per output channel (GPTQ group_size -1,
compressed-tensors' channel strategy); MXFP4 -> E2M1 codes 0..15 with {"format": "MXFP4",
"exponents"}.  A 4-bit scale per output channel is kept as groups of CHANNEL_GROUP, each scale
repeated: the same values in a layout ktcy packs.  Every tensor's dtype and shape is checked
against config.json first.

Packings (each documented by its library; written here from those descriptions):
  compressed-tensors  pack-quantized: weight_packed int32 [N, ceil(K/8)], value k at bits 4*(k % 8)
                      of word k // 8, stored as q + 8; weight_zero_point (asymmetric) packed the
                      same way along N: int32 [ceil(N/8), groups]; weight_shape = [N, K]; with
                      actorder weight_g_idx [K] (the group of each K column).  num_bits 8: 4 per
                      word (value k at bits 8*(k % 4)), stored as q + 128.  int-quantized: weight
                      int8 [N, K] as it is, weight_zero_point int8 [N, groups].  weight_scale
                      [N, groups] ([N, 1] for the channel strategy).
  GPTQ                qweight int32 [K/8, N] packed along K (row k at bits 4*(k % 8));
                      qzeros int32 [groups, N/8] packed along N; scales [groups, N]; g_idx [K]
                      (group of each K row; desc_act permutes it).  checkpoint_format "gptq" (v1,
                      AutoGPTQ) stores z - 1, "gptq_v2" stores z.  bits 8: 4 bytes per int32
                      (value k at bits 8*(k % 4)), qweight [K/4, N], qzeros [groups, N/4];
                      symmetric means z = 128.
  AWQ (gemm)          qweight int32 [K, N/8] and qzeros [groups, N/8] packed along N in AWQ's
                      order: nibble i holds channel 8c + AWQ_ORDER[i]; scales [groups, N].
  MXFP4 (GPT-OSS)     *_blocks uint8 [E, N, K/32, 16], element 2j in the low nibble of byte j,
                      2j+1 in the high one; *_scales uint8 [E, N, K/32] E8M0 exponents (bias 127).
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ktcy import _native
from ktcy.formats import INT4_GROUP_SIZES, group_sizes
from ktcy.kernels import E2M1_VALUES
from ktcy.safetensors_io import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_FLOAT_SCALES = ("bfloat16", "float16", "float32")
# quant_method values whose experts the float/FP8 readers handle (codes stored as E4M3 bytes)
_FLOAT_METHODS = ("fp8",)
_CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized", "dense")
_CT_INT_FORMATS = ("pack-quantized", "int-quantized")
CHANNEL_GROUP = 128  # the group a 4-bit scale per output channel is kept in (the largest: the fastest)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's expert weights are quantized, from config.json's quantization_config."""
    method: str                 # "compressed-tensors" | "gptq" | "awq" | "mxfp4"
    group_size: Optional[int]   # K values per scale; None: per output channel (GPTQ group_size -1) or MXFP4
    symmetric: bool = True
    zero_offset: int = 0        # GPTQ v1 stores z - 1
    desc_act: bool = False
    bits: int = 4               # GPTQ and compressed-tensors: 4 or 8
    packing: str = "pack-quantized"  # compressed-tensors: or "int-quantized" (int8 weights as they are)

    @property
    def native_format(self):
        if self.method == "mxfp4":
            return "MXFP4"
        if self.bits == 8:  # asymmetric 8-bit has no ktcy twin: the reader says so (a method dequantizes it)
            return "INT8" if self.group_size is None else "INT8_GROUP"
        return "INT4" if self.symmetric else "INT4_ZP"

    @property
    def kept_group_size(self):
        """The group size the stored codes are kept in (None: no groups, MXFP4 and per-channel
        INT8); a 4-bit per-channel scale's is CHANNEL_GROUP."""
        if self.method == "mxfp4" or self.native_format == "INT8":
            return None
        return CHANNEL_GROUP if self.group_size is None else self.group_size

    @property
    def weight_suffix(self):
        if self.method == "compressed-tensors" and self.packing == "int-quantized":
            return "weight"
        return {"compressed-tensors": "weight_packed", "gptq": "qweight", "awq": "qweight"}.get(self.method)


def _setting(q, where, key, kinds, default=None):
    value = q.get(key, default)
    if value is None or isinstance(value, bool) != (kinds is bool) or not isinstance(value, kinds):
        raise CheckpointError(f"{where}: quantization_config.{key} is {value!r:.60}, expected "
                              f"{'true or false' if kinds is bool else getattr(kinds, '__name__', kinds)}")
    return value


def _four_bits(q, where, key, value):
    if value != 4:
        raise CheckpointError(f"{where}: quantization_config.{key} is {value!r:.40}; ktcy reads 4-bit weights only")


def scheme_from_config(cfg, where="config.json"):
    """The QuantScheme of a parsed config.json, None for unquantized or FP8 (E4M3) checkpoints;
    CheckpointError for a method or setting ktcy cannot read as stored."""
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None and isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object")
    method = q.get("quant_method")
    method = method.lower() if isinstance(method, str) else method
    if method in _FLOAT_METHODS:
        return None
    if method == "mxfp4":
        return QuantScheme("mxfp4", None)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    if method == "gptq":
        bits = _setting(q, where, "bits", int)
        if bits not in (4, 8):
            raise CheckpointError(f"{where}: quantization_config.bits is {bits!r:.40}; ktcy reads 4- and 8-bit GPTQ weights")
        group = _setting(q, where, "group_size", int, 128)
        fmt = _setting(q, where, "checkpoint_format", str, "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: quantization_config.checkpoint_format {fmt!r:.40} is not gptq or gptq_v2")
        return QuantScheme("gptq", _group(group, where), _setting(q, where, "sym", bool, True),
                           1 if fmt == "gptq" else 0, _setting(q, where, "desc_act", bool, False), bits)
    if method == "awq":
        bits = q.get("bits", q.get("w_bit"))
        _four_bits(q, where, "bits", bits)
        version = _setting(q, where, "version", str, "gemm")
        if version.lower() != "gemm":
            raise CheckpointError(f"{where}: AWQ version {version!r:.40}; ktcy reads the gemm packing only")
        group = q.get("group_size", q.get("q_group_size", 128))
        if not _setting(q, where, "zero_point", bool, True):
            raise CheckpointError(f"{where}: AWQ without zero points (zero_point: false) is not supported")
        return QuantScheme("awq", _group(group, where), symmetric=False)
    raise CheckpointError(f"{where}: unknown quant_method {method!r:.60} in quantization_config (ktcy reads "
                          "compressed-tensors pack-quantized, gptq, awq, mxfp4 and fp8)")


def _group(group, where):
    if isinstance(group, bool) or not isinstance(group, int) or (group < 1 and group != -1):
        raise CheckpointError(f"{where}: quantization_config group_size {group!r:.40} must be a positive integer or -1")
    return None if group == -1 else group


def _compressed_tensors(q, where):
    fmt = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: compressed-tensors quantization_config has no config_groups")
    found = set()
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise CheckpointError(f"{where}: config_groups.{name} must be a JSON object")
        g_fmt = g.get("format") or fmt
        w = g.get("weights")
        if g_fmt in _CT_FLOAT_FORMATS:
            continue
        if g_fmt not in _CT_INT_FORMATS:
            raise CheckpointError(f"{where}: compressed-tensors format {g_fmt!r:.40} (config group {name}); ktcy "
                                  "reads pack-quantized INT4 and INT8, int-quantized INT8 and float-quantized FP8")
        if not isinstance(w, dict):
            raise CheckpointError(f"{where}: config_groups.{name}.weights must be a JSON object")
        key = f"config_groups.{name}.weights"
        bits = w.get("num_bits")
        if bits not in ((4, 8) if g_fmt == "pack-quantized" else (8,)) or isinstance(bits, bool):
            raise CheckpointError(f"{where}: quantization_config.{key}.num_bits is {bits!r:.40}; ktcy reads "
                                  + ("4- and 8-bit pack-quantized" if g_fmt == "pack-quantized" else "8-bit int-quantized")
                                  + " weights")
        strategies = ("group", "channel") if bits == 8 else ("group",)
        if w.get("type", "int") != "int" or w.get("strategy") not in strategies:
            raise CheckpointError(f"{where}: {key} is {w.get('type')!r:.20} {w.get('strategy')!r:.20}; ktcy reads "
                                  f"{bits}-bit int weights with {' or '.join(strategies)} strategy")
        _check_activations(g.get("input_activations"), bits, where, name)
        symmetric = w.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise CheckpointError(f"{where}: {key}.symmetric must be true or false")
        if w["strategy"] == "channel":
            group = None
        else:
            group = _group(w.get("group_size"), where)
            if group is None:
                raise CheckpointError(f"{where}: compressed-tensors group strategy without a group_size")
        found.add((group, symmetric, bits, g_fmt))
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(f"{where}: compressed-tensors config groups disagree on group size, symmetry, bits or "
                              f"packing ({sorted(found, key=str)}); ktcy reads one integer scheme per model")
    group, symmetric, bits, packing = found.pop()
    return QuantScheme("compressed-tensors", group, symmetric, bits=bits, packing=packing)


def _check_activations(acts, bits, where, name):
    """Weight-only schemes, and 8-bit weights with dynamic int8 activations (W8A8): ktcy's 8-bit
    kernels quantize each token's activations as they run, as a dynamic scheme does.  Static
    activation scales would be ignored, so they are refused."""
    if acts is None:
        return
    dynamic = isinstance(acts, dict) and acts.get("dynamic") is True
    if bits != 8 or not dynamic:
        raise CheckpointError(f"{where}: config_groups.{name} quantizes activations "
                              + ("with static scales" if bits == 8 else f"beside {bits}-bit weights")
                              + "; ktcy reads weight-only schemes, and 8-bit weights with dynamic activations")


@dataclass
class Released:
    """One projection as stored: codes [N, K] and the spec MoE.from_experts takes; `problem` says
    why it cannot be kept in its own layout (then only an exact dequantization is usable)."""
    codes: np.ndarray
    spec: dict
    problem: Optional[str] = None

    def dequantize(self):
        """Exact float32 weights (codes times power-of-two or bf16/f16 scales fit float32)."""
        return dequantize_released(self.codes, self.spec)


def dequantize_released(codes, spec):
    """w from (codes, spec) in numpy: s * (q - z) per (channel, K group), or E2M1 * 2^(e - 127).
    spec may also carry "g_idx" (GPTQ desc_act: the group of each K column)."""
    n, k = codes.shape
    if spec["format"] == "MXFP4":
        exps = np.repeat(spec["exponents"].astype(np.float64) - 127, 32, axis=1)[:, :k]
        return (E2M1_VALUES[codes] * np.exp2(exps)).astype(np.float32)
    if spec["format"] == "INT8":  # a scale per output channel
        return (codes.astype(np.float64) * spec["scale"][:, None].astype(np.float64)).astype(np.float32)
    g_idx = spec.get("g_idx")
    if g_idx is None:
        g_idx = np.arange(k) // spec["group_size"]
    scale = spec["scale"][:, g_idx].astype(np.float64)
    q = codes.astype(np.float64)
    if spec.get("zero_points") is not None:  # INT4_ZP, 8-bit GPTQ with zero points
        q = q - spec["zero_points"][:, g_idx].astype(np.float64)
    return (q * scale).astype(np.float32)


def _tensor(ckpt, name, dtypes, shape):
    t = ckpt.get(name)
    if t.dtype.name not in dtypes:
        raise CheckpointError(f"{ckpt.path}: {name} is {t.dtype}; expected {' or '.join(dtypes)}")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{ckpt.path}: {name} has shape {tuple(t.shape)}; config.json implies {tuple(shape)}")
    return t


def _unpack(words, axis, bits):
    """int32 words -> their 32 / bits fields (bits * i at position i) laid out along `axis`, uint8."""
    w, per = np.asarray(words).view(np.uint32), 32 // bits
    fields = np.stack([(w >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=axis + 1).astype(np.uint8)
    shape = list(w.shape)
    shape[axis] *= per
    return fields.reshape(shape)


def _unpack_nibbles(words, axis):
    """int32 words -> their 8 nibbles (bits 4i at position i) laid out along `axis`, uint8."""
    return _unpack(words, axis, 4)


def _groups(ckpt, base, k, group):
    """(group size, number of groups), checked: K must split into whole groups."""
    g = k if group is None else group
    if k % g:
        raise CheckpointError(f"{ckpt.path}: {base}: group size {g} does not divide K = {k}")
    return g, k // g


def _int4_result(ckpt, name, scale_name, codes_u, scale, zero, g, symmetric):
    """Released INT4 / INT4_ZP from unsigned codes [N, K], scale and zeros [N, groups] (name: the
    zero points' tensor, scale_name the scales')."""
    problem = None if g in INT4_GROUP_SIZES else f"group size {g} (ktcy's INT4 layouts take {INT4_GROUP_SIZES})"
    scale = np.asarray(scale, np.float32)
    if not np.isfinite(scale).all():
        raise CheckpointError(f"{ckpt.path}: {scale_name} holds NaN or infinite scales")
    if symmetric:
        if (zero != 8).any():
            r, c = (int(v) for v in np.argwhere(zero != 8)[0])
            raise CheckpointError(f"{ckpt.path}: {name}: the config says symmetric, but the zero point of channel {r}, "
                                  f"group {c} is {int(zero[r, c]) - 8} (stored {int(zero[r, c])}), not 0")
        spec = {"format": "INT4", "scale": scale, "group_size": g}
        return Released((codes_u.astype(np.int8) - 8).astype(np.int8), spec, problem)
    if zero.max(initial=0) > 15:  # GPTQ v1 stores z - 1: a stored 15 means 16, exact but not a nibble
        r, c = (int(v) for v in np.argwhere(zero > 15)[0])
        problem = problem or (f"{name}: zero point {int(zero[r, c])} of channel {r}, group {c} (GPTQ v1's stored 15) "
                              "does not fit INT4_ZP's 0..15")
    spec = {"format": "INT4_ZP", "scale": scale, "zero_points": zero, "group_size": g}
    return Released(codes_u, spec, problem)


def _weight_shape(ckpt, base, n, k):
    shape_name = f"{base}.weight_shape"
    shape = np.asarray(ckpt.get(shape_name))
    if shape.shape != (2,) or not np.issubdtype(shape.dtype, np.integer) or tuple(int(v) for v in shape) != (n, k):
        raise CheckpointError(f"{ckpt.path}: {shape_name} is {shape.tolist()!r:.60}; config.json implies [{n}, {k}]")


def read_compressed_tensors(ckpt, base, n, k, scheme):
    if scheme.bits == 8:
        return _read_compressed_tensors_8(ckpt, base, n, k, scheme)
    g, groups = _groups(ckpt, base, k, scheme.group_size)
    packed = _tensor(ckpt, f"{base}.weight_packed", ("int32",), (n, -(-k // 8)))
    _weight_shape(ckpt, base, n, k)
    codes = _unpack_nibbles(packed, axis=1)[:, :k]
    scale = _tensor(ckpt, f"{base}.weight_scale", _FLOAT_SCALES, (n, groups))
    zname = f"{base}.weight_zero_point"
    if scheme.symmetric:
        zero = np.full((n, groups), 8, np.int32)
        if zname in ckpt:  # some writers store zeros for symmetric schemes too: they must be zero
            z = np.asarray(ckpt.get(zname))
            if z.dtype.name == "int32" and z.shape == (-(-n // 8), groups):
                zero = _unpack_nibbles(z, axis=0)[:n].astype(np.int32)
            elif z.shape == (n, groups) and np.issubdtype(z.dtype, np.integer):
                zero = z.astype(np.int32) + 8
            else:
                raise CheckpointError(f"{ckpt.path}: {zname} is {z.dtype} {z.shape}; expected int32 "
                                      f"{(-(-n // 8), groups)} or int8 {(n, groups)}")
    else:
        z = ckpt.get(zname)
        if z.dtype.name == "int32" and z.shape == (-(-n // 8), groups):
            zero = _unpack_nibbles(z, axis=0)[:n].astype(np.int32)  # stored as z + 8, like the weights
        elif z.dtype.name == "int8" and z.shape == (n, groups):
            zero = np.asarray(z).astype(np.int32) + 8
        else:
            raise CheckpointError(f"{ckpt.path}: {zname} is {z.dtype} {tuple(z.shape)}; expected int32 "
                                  f"{(-(-n // 8), groups)} (packed) or int8 {(n, groups)}")
        if ((zero < 0) | (zero > 15)).any():
            raise CheckpointError(f"{ckpt.path}: {zname} holds zero points outside [-8, 7]")
    result = _int4_result(ckpt, f"{base}.weight_zero_point" if not scheme.symmetric else base, f"{base}.weight_scale", codes,
                          np.asarray(scale, np.float32), zero, g, scheme.symmetric)
    return _with_g_idx(ckpt, f"{base}.weight_g_idx", result, k, g, groups)


def _read_compressed_tensors_8(ckpt, base, n, k, scheme):
    """8-bit compressed-tensors: pack-quantized (4 codes per int32, stored as q + 128) or
    int-quantized (int8 codes); codes and zero points read as q + 128, 0..255, as GPTQ's."""
    g, groups = _groups(ckpt, base, k, scheme.group_size)
    if scheme.packing == "pack-quantized":
        packed = _tensor(ckpt, f"{base}.weight_packed", ("int32",), (n, -(-k // 4)))
        _weight_shape(ckpt, base, n, k)
        codes = _unpack(packed, 1, 8)[:, :k]
    else:
        codes = (np.asarray(_tensor(ckpt, f"{base}.weight", ("int8",), (n, k))).astype(np.int16) + 128).astype(np.uint8)
    scale = _tensor(ckpt, f"{base}.weight_scale", _FLOAT_SCALES, (n, groups))
    zname = f"{base}.weight_zero_point"
    zero = np.full((n, groups), 128, np.int32)
    if zname in ckpt or not scheme.symmetric:  # symmetric writers may store zeros: they must be zero
        z = ckpt.get(zname)
        if z.dtype.name == "int32" and z.shape == (-(-n // 4), groups) and scheme.packing == "pack-quantized":
            zero = _unpack(z, 0, 8)[:n].astype(np.int32)  # stored as z + 128, like the weights
        elif z.dtype.name == "int8" and z.shape == (n, groups):
            zero = np.asarray(z).astype(np.int32) + 128
        else:
            packed_zero = f"int32 {(-(-n // 4), groups)} (packed) or " if scheme.packing == "pack-quantized" else ""
            raise CheckpointError(f"{ckpt.path}: {zname} is {z.dtype} {tuple(z.shape)}; expected {packed_zero}int8 "
                                  f"{(n, groups)}")
    result = _int8_result(ckpt, zname, f"{base}.weight_scale", codes,
                          np.asarray(scale, np.float32), zero, g, scheme.symmetric, scheme.group_size is None)
    return _with_g_idx(ckpt, f"{base}.weight_g_idx", result, k, g, groups)


def _per_channel_as_groups(k, g, scale, zero):
    """(group, scale, zero) of a weight as ktcy keeps it: a single group spanning K (a scale per
    output channel) becomes groups of CHANNEL_GROUP, each scale and zero point repeated."""
    if g != k:
        return g, scale, zero
    reps = -(-k // CHANNEL_GROUP)
    return CHANNEL_GROUP, np.repeat(scale, reps, axis=1), np.repeat(zero, reps, axis=1)


def _int8_result(ckpt, name, scale_name, codes_u, scale, zero, g, symmetric, per_channel):
    """Released 8-bit weights from unsigned codes [N, K] (q + 128), scale and zeros [N, groups]:
    symmetric (z = 128) as codes q - 128, INT8 where the scheme has a scale per output channel,
    else INT8_GROUP; zero points otherwise, which no ktcy format keeps."""
    scale = np.asarray(scale, np.float32)
    k = codes_u.shape[1]
    if not np.isfinite(scale).all():
        raise CheckpointError(f"{ckpt.path}: {scale_name} holds NaN or infinite scales")
    if per_channel:
        problem = None if k <= _native.INT8_MAX_K else f"K = {k} (ktcy's INT8 sums overflow past {_native.INT8_MAX_K})"
    else:
        problem = None if g in group_sizes("INT8_GROUP") else \
            f"group size {g} (ktcy's INT8_GROUP takes {group_sizes('INT8_GROUP')})"
    if symmetric and (zero != 128).any():
        r, c = (int(v) for v in np.argwhere(zero != 128)[0])
        raise CheckpointError(f"{ckpt.path}: {name}: the config says symmetric, but the zero point of channel {r}, "
                              f"group {c} is {int(zero[r, c]) - 128} (stored {int(zero[r, c])}), not 0")
    if not symmetric:  # s * (q - z): exact once dequantized, but no ktcy format keeps 8-bit zero points
        spec = {"format": "INT8_GROUP", "scale": scale, "group_size": g, "zero_points": zero}
        return Released(codes_u, spec, problem or f"{name}: 8-bit zero points (no ktcy format keeps them)")
    codes = (codes_u.astype(np.int16) - 128).astype(np.int8)
    if per_channel:
        return Released(codes, {"format": "INT8", "scale": np.ascontiguousarray(scale[:, 0])}, problem)
    return Released(codes, {"format": "INT8_GROUP", "scale": scale, "group_size": g}, problem)


def read_gptq(ckpt, base, n, k, scheme):
    g, groups = _groups(ckpt, base, k, scheme.group_size)
    if scheme.bits == 8:
        if k % 4 or n % 4:
            raise CheckpointError(f"{ckpt.path}: {base}: 8-bit GPTQ packs 4 values per int32; N = {n} and K = {k} "
                                  "must be multiples of 4")
        q = _unpack(_tensor(ckpt, f"{base}.qweight", ("int32",), (k // 4, n)), 0, 8)  # [K, N]
        zero = _unpack(_tensor(ckpt, f"{base}.qzeros", ("int32",), (groups, n // 4)), 1, 8)
        zero = zero.astype(np.int32) + scheme.zero_offset
        scale = _tensor(ckpt, f"{base}.scales", _FLOAT_SCALES, (groups, n))
        result = _int8_result(ckpt, f"{base}.qzeros", f"{base}.scales", np.ascontiguousarray(q.T),
                              np.asarray(scale, np.float32).T, np.ascontiguousarray(zero.T), g, scheme.symmetric,
                              scheme.group_size is None)
        return _with_g_idx(ckpt, f"{base}.g_idx", result, k, g, groups)
    if k % 8 or n % 8:
        raise CheckpointError(f"{ckpt.path}: {base}: GPTQ packs 8 values per int32; N = {n} and K = {k} must be "
                              "multiples of 8")
    q = _unpack_nibbles(_tensor(ckpt, f"{base}.qweight", ("int32",), (k // 8, n)), axis=0)  # [K, N]
    zero = _unpack_nibbles(_tensor(ckpt, f"{base}.qzeros", ("int32",), (groups, n // 8)), axis=1)
    zero = zero.astype(np.int32) + scheme.zero_offset
    scale = _tensor(ckpt, f"{base}.scales", _FLOAT_SCALES, (groups, n))
    g_kept, scale, zero = _per_channel_as_groups(k, g, np.asarray(scale, np.float32).T, np.ascontiguousarray(zero.T))
    result = _int4_result(ckpt, f"{base}.qzeros", f"{base}.scales", np.ascontiguousarray(q.T), scale, zero, g_kept,
                          scheme.symmetric)
    return _with_g_idx(ckpt, f"{base}.g_idx", result, k, g, groups)


def _with_g_idx(ckpt, gname, result, k, g, groups):
    """result, checked against the group index of each K column when the checkpoint stores one
    (GPTQ g_idx, compressed-tensors weight_g_idx)."""
    if gname not in ckpt:
        return result
    g_idx = np.asarray(_tensor(ckpt, gname, ("int32", "int64"), (k,)))
    if g_idx.min() < 0 or g_idx.max() >= groups:
        bad = int(np.flatnonzero((g_idx < 0) | (g_idx >= groups))[0])
        raise CheckpointError(f"{ckpt.path}: {gname}[{bad}] = {int(g_idx[bad])} is outside [0, {groups})")
    if not np.array_equal(g_idx, np.arange(k) // g):
        # desc_act / actorder: the K columns of a group are scattered.  Packed layouts need
        # contiguous groups, and permuting K would permute the activations per expert: exact
        # dequantization (a conversion) is offered instead.
        result.spec["g_idx"] = g_idx.astype(np.int64)
        result.problem = result.problem or (f"{gname} is a desc_act permutation (act-order); its groups are "
                                            "not contiguous in K")
    return result


def read_awq(ckpt, base, n, k, scheme):
    g, groups = _groups(ckpt, base, k, scheme.group_size)
    if n % 8:
        raise CheckpointError(f"{ckpt.path}: {base}: AWQ packs 8 channels per int32; N = {n} must be a multiple of 8")
    inverse = np.argsort(AWQ_ORDER)  # channel j of each 8 sits at nibble inverse[j]

    def channels(words):
        nib = _unpack_nibbles(words, axis=1)  # [rows, N] in nibble order
        rows = nib.shape[0]
        return nib.reshape(rows, n // 8, 8)[:, :, inverse].reshape(rows, n)
    q = channels(_tensor(ckpt, f"{base}.qweight", ("int32",), (k, n // 8)))          # [K, N]
    zero = channels(_tensor(ckpt, f"{base}.qzeros", ("int32",), (groups, n // 8)))   # [groups, N]
    scale = _tensor(ckpt, f"{base}.scales", _FLOAT_SCALES, (groups, n))
    g_kept, scale, zero = _per_channel_as_groups(k, g, np.asarray(scale, np.float32).T,
                                                 np.ascontiguousarray(zero.T).astype(np.int32))
    return _int4_result(ckpt, f"{base}.qzeros", f"{base}.scales", np.ascontiguousarray(q.T), scale, zero, g_kept,
                        symmetric=False)


READERS = {"compressed-tensors": read_compressed_tensors, "gptq": read_gptq, "awq": read_awq}


def read_mxfp4_stack(ckpt, prefix, proj, num_experts, n, k):
    """(blocks, scales) views of a stacked GPT-OSS MXFP4 projection ({prefix}.{proj}_blocks
    [E, N, K/32, 16] and _scales [E, N, K/32]), shapes checked."""
    if k % 32:
        raise CheckpointError(f"{ckpt.path}: {prefix}.{proj}_blocks: K = {k} is not a multiple of the MXFP4 block (32)")
    blocks = _tensor(ckpt, f"{prefix}.{proj}_blocks", ("uint8",), (num_experts, n, k // 32, 16))
    scales = _tensor(ckpt, f"{prefix}.{proj}_scales", ("uint8",), (num_experts, n, k // 32))
    return blocks, scales


def mxfp4_released(ckpt, name, blocks, scales):
    """Released MXFP4 from one expert's blocks [N, K/32, 16] and E8M0 scales [N, K/32]; the
    exponent of every block holding a non-zero value must be one ktcy decodes exactly."""
    b = np.asarray(blocks)
    n = b.shape[0]
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1)
    exps = np.ascontiguousarray(scales)
    lo, hi = _native.E8M0_RANGE
    used = (codes & 7).reshape(n, -1, 32).any(axis=2)
    bad = used & ((exps < lo) | (exps > hi))
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad)[0])
        raise CheckpointError(f"{ckpt.path}: {name}_scales: exponent {int(exps[r, c])} (row {r}, block {c}) is outside "
                              f"[{lo}, {hi}], the range ktcy decodes exactly (255 is E8M0's NaN)")
    return Released(codes, {"format": "MXFP4", "exponents": exps})
