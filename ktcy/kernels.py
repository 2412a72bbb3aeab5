"""Low-level face of the GEMM kernels: pack a weight matrix, multiply activations by it.

Contract (used from outside the repo): ``pack(W, format=...)`` and ``linear(X, packed, isa=None)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Tuple

import ml_dtypes
import numpy as np

from ktcy import _native
from ktcy.formats import DEFAULT_INT4_GROUP, FORMATS, canonical_format, descriptor, has_groups, weight_group

_CODE = {name: i for i, name in enumerate(FORMATS)}
INT8_MAX_K = _native.INT8_MAX_K
_FLOAT_INPUTS = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)
# E2M1 (MXFP4 element) code -> value, written out from the format's definition
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _padded(fmt, n, k, group):
    """(n_pad, k_pad, block_k) by the C layout rules."""
    return _native.padded_shape(_CODE[fmt], n, k, group)


def expand_block_scale(scale, n, k, block=128):
    """A [ceil(n/block), ceil(k/block)] scale grid as one scale per element of W[n][k]."""
    return np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:n, :k]


def as_float32_matrix(a, what):
    """A C-contiguous float32 [rows, cols] copy or view of a float array, or a clear error."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D, got shape {a.shape}")
    native = a.dtype.newbyteorder("=")  # a byte-swapped float is still that float
    if native != np.float32 and not any(native == t for t in _FLOAT_INPUTS):
        raise TypeError(f"{what} must be float32, float64, float16 or bfloat16, got {a.dtype}")
    return c_array(a, np.float32)


def c_array(a, dtype=None):
    """a as a C-contiguous, aligned array of dtype (a copy where it is not one): C code reads
    these through typed pointers, and a view at an odd offset (of a file, of a byte buffer) is
    undefined behaviour there."""
    return np.require(a, dtype, ["C", "A"])


# Integer sums of the int8-activation formats reach 2^31 in size; times a weight scale up to
# 2^96 they stay below float32's largest value (2^128) where the weight scale comes first (INT4,
# INT4_ZP, INT4_MIN, whose mins multiply group sums of at most 2^14 by the same bound; INT8
# applies the activation scale first, see README "Numbers worth knowing").
_MAX_INT_SCALE = 2.0 ** 96
# Formats whose codes are unsigned (zero points, mins) store code - offset: nibbles 0..15, bytes 0..255.
_CODE_OFFSET = {"u4": 8, "s8": 128}


def _scale_problem(fmt, scale, what="scale"):
    """Why scales cannot be packed, or None: a NaN or infinite scale would turn every output of
    its channel into NaN, and an integer format's scale beyond _MAX_INT_SCALE overflows its float
    sums.  The position is in the array as given."""
    scale = np.asarray(scale, np.float32)
    if not np.isfinite(scale).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(scale))[0])
        return f"{fmt} {what} at {where} is {scale[where]}; {what} must be finite"
    if descriptor(fmt)["activations"] == "int8" and scale.size and np.abs(scale).max() > _MAX_INT_SCALE:
        return f"{fmt} {what} {np.abs(scale).max():.3g} exceeds {_MAX_INT_SCALE:.3g}: its integer sums may overflow float32"
    return None


def _check_finite_scales(fmt, scale, what="scale"):
    """Scales (and INT4_MIN's mins) refused where they come in (a released checkpoint, a packed
    file, codes packed by hand), not found in the results (_scale_problem)."""
    problem = None if scale is None else _scale_problem(fmt, scale, what)
    if problem:
        raise ValueError(problem)


def _check_colsum(p):
    """The column sums the VNNI kernels subtract (they add 128 to the activations) must be the
    codes' own: a damaged or foreign file would otherwise give wrong numbers on some kernels
    only.  One pass over the codes, once per weight."""
    n_pad, k_pad, _ = _padded(p.format, int(p.shape[0]), int(p.shape[1]), p.group_size)
    codes = np.asarray(p.data).reshape(-1).view(np.int8)
    sums = _native.int8_column_sums(codes, n_pad, k_pad)
    stored = np.asarray(p.colsum).reshape(-1)[:n_pad]
    if not np.array_equal(sums, stored):
        bad = int(np.flatnonzero(sums != stored)[0])
        raise ValueError(f"{p.format} weight {tuple(p.shape)}: stored column sum of channel {bad} does not match "
                         f"its codes (damaged or foreign data)")


def _check_block_exponents(p):
    """The E8M0 exponents kept in the blocks must lie in the range the packer allows wherever a
    block holds a non-zero code: past it the paths part ways (some clamp to 2^127, some decode inf
    or a subnormal scale), so a damaged or foreign file would give different numbers per ISA.  The
    codes are read only when an exponent is out of range (a block of zeros may carry any)."""
    n, k = (int(v) for v in p.shape)
    e = p.block_exponents()
    lo, hi = _native.E8M0_RANGE
    if ((e < lo) | (e > hi)).any():
        try:
            _e8m0_exponents(e, p.codes(), n, k, p.format)
        except ValueError as err:
            raise ValueError(f"{p.format} weight {tuple(p.shape)}: {err} (damaged or foreign data)") from None


def _same_source(a, b):
    """Whether two (format, shape, group, arrays...) tuples name the same things: the arrays by
    identity (a view holds their addresses), the rest by value."""
    return a[:3] == b[:3] and all(x is y for x, y in zip(a[3:], b[3:]))


@dataclass(eq=False)
class PackedWeight:
    """W[N][K] in a ktcy packed layout (the same bytes on every ISA).  The arrays are checked
    against the format descriptor when the C descriptor is first made (native())."""
    format: str
    shape: Tuple[int, int]
    data: np.ndarray                     # uint8 blocks
    scale: Optional[np.ndarray]          # float32 as formats.descriptor(format)["scale"] says; None when
    #                                      "none" (group scales panel-major [N_pad/16][groups][16]: see group_scales();
    #                                      INT4_MIN's [N_pad/16][groups][32], 16 scales then 16 mins: group_mins())
    colsum: Optional[np.ndarray] = None  # formats whose descriptor keeps colsum (INT8)
    group_size: int = 0                  # formats with group scales (INT4, INT4_ZP, INT4_MIN, INT8_GROUP, INT8_MIN)
    zero: Optional[np.ndarray] = None    # formats with zero points (INT4_ZP): uint8, laid out like the group scales
    _view: object = field(default=None, init=False, repr=False)  # the C descriptor, and what it was
    _made_from: Optional[tuple] = field(default=None, init=False, repr=False)  # made from (native())

    def __repr__(self):
        group = f", group {self.group_size}" if self.group_size else ""
        return (f"PackedWeight({self.format}, N={self.shape[0]}, K={self.shape[1]}{group}, "
                f"{self.nbytes / 2**20:.2f} MiB)")

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (self.data, self.scale, self.colsum, self.zero) if a is not None)

    @property
    def k_pad(self):
        return _padded(self.format, *self.shape, self.group_size)[1]

    @property
    def n_pad(self):
        return _padded(self.format, *self.shape, self.group_size)[0]

    def native(self):
        """The C descriptor over these arrays (made once, after checking every array's shape; made
        again if an array, the shape or the group was replaced since: never a stale view)."""
        source = (self.format, tuple(self.shape), self.group_size, self.data, self.scale, self.colsum, self.zero)
        if self._view is not None and not _same_source(self._made_from, source):
            self._view = None
        if self._view is None:
            if self.format not in _CODE:
                raise ValueError(f"unknown weight format {self.format!r}; known: {', '.join(FORMATS)}")
            n, k = (int(v) for v in self.shape)
            view = _native.Weight(_CODE[self.format], int(self.group_size or 0), n, k, self.data,
                                  self.scale, self.colsum, self.zero)
            _check_finite_scales(self.format, self.scale)
            if self.colsum is not None:
                _check_colsum(self)
            if descriptor(self.format)["scale"] == "e8m0_in_block":
                _check_block_exponents(self)
            self._view, self._made_from = view, source
        return self._view

    def codes(self):
        """The stored codes as [N, K]: int8 (INT8, INT8_GROUP, INT4), uint8 0..255 (INT8_MIN), uint8 nibbles 0..15 (INT4_ZP, INT4_MIN,
        MXFP4's E2M1), E4M3 bytes (FP8) or bf16 bits (BF16).  Read back from the block layout with numpy,
        independently of the C packer."""
        n, k = self.shape
        d = descriptor(self.format)
        n_pad, k_pad, block_k = _padded(self.format, n, k, self.group_size)
        panels, kb = n_pad // 16, k_pad // block_k
        per_lane = 4 if d["activations"] == "int8" else 2  # K values of a channel in one block row
        if d["code"] == "e2m1":  # 32-K sub-blocks; row pair q: 32 bytes, row 2q in the low nibbles, 2q+1 in the high
            kb, per_lane = k_pad // 32, 2
            raw = self.data.reshape(panels, kb, 272)[:, :, :256].reshape(panels, kb, 8, 1, 32)
            codes = np.concatenate([raw & 0x0F, raw >> 4], axis=3)
        elif d["code"] == "u4":
            raw = self.data.reshape(panels, kb, d["block_bytes"])
            codes = np.concatenate([raw & 0x0F, raw >> 4], axis=2)
            if not (d["zero_points"] or d["mins"]):
                codes = codes.astype(np.int8) - 8
        elif d["code"] == "s8":
            codes = self.data.view(np.int8)
            if d["mins"]:  # INT8_MIN: the unsigned code u, stored as u - 128
                codes = (codes.astype(np.int16) + 128).astype(np.uint8)
        elif d["code"] == "bf16":
            codes = self.data.view(np.uint16)
        else:
            codes = self.data
        blocks = codes.reshape(panels, kb, 16, 16, per_lane)
        # (panel, kblock, row r, channel, j) -> (panel, channel, kblock, r, j)
        full = blocks.transpose(0, 3, 1, 2, 4).reshape(n_pad, k_pad)
        return full[:n, :k]

    def padding_is_clear(self):
        """True when every code past N and past K (the layout's padding) is the zero code, as every
        packer writes it.  A file whose metadata claims a smaller N or K than its codes fill
        (hidden_size 64 edited to 49: the same array sizes) would otherwise run on a truncated
        matrix.  Reads only the last panel and the last K unit of each panel."""
        n, k = self.shape
        n_pad, k_pad, _ = _padded(self.format, n, k, self.group_size)
        if n == n_pad and k == k_pad:
            return True
        d = descriptor(self.format)
        # unsigned codes (INT4_ZP, INT4_MIN nibbles, INT8_MIN bytes): padding is the stored zero, code + offset
        zero = _CODE_OFFSET[d["code"]] if d["zero_points"] or d["mins"] else 0
        panels = n_pad // 16
        per_panel = self.data.size // panels

        def codes_of(data, shape):
            return PackedWeight(self.format, shape, np.ascontiguousarray(data).reshape(-1), None,
                                group_size=self.group_size).codes()

        if n < n_pad and (codes_of(self.data[-per_panel:], (16, k_pad))[n - (panels - 1) * 16:] != zero).any():
            return False
        unit = _padded(self.format, 1, 1, self.group_size)[1]  # K padding comes in whole units
        if k < k_pad:
            tails = self.data.reshape(panels, k_pad // unit, -1)[:, -1]
            if (codes_of(tails, (n_pad, unit))[:, k - (k_pad - unit):] != zero).any():
                return False
        return True

    def _groups(self):
        if descriptor(self.format)["scale"] != "group":
            raise ValueError(f"{self.format} has no group scales")
        return self.k_pad // self.group_size

    def group_scales(self):
        """Group scales as [groups, N_pad] float32 (a copy; the kernels read them panel-major)."""
        groups = self._groups()
        if descriptor(self.format)["mins"]:
            return group_major(self.scale.reshape(-1, groups, 32)[:, :, :16], groups)
        return group_major(self.scale, groups)

    def group_mins(self):
        """INT4_MIN's mins (the value of code 0) as [groups, N_pad] float32 (a copy), or None for a
        format without them."""
        groups = self._groups()
        if not descriptor(self.format)["mins"]:
            return None
        return group_major(self.scale.reshape(-1, groups, 32)[:, :, 16:], groups)

    def group_zero_points(self):
        """Zero points as [groups, N_pad] uint8 (a copy), or None for a format without them."""
        groups = self._groups()
        return None if self.zero is None else group_major(self.zero, groups)

    def block_exponents(self):
        """MXFP4, MXFP4_A8: the E8M0 scale exponents kept in the blocks, as [N, ceil(K/32)] uint8."""
        d = descriptor(self.format)
        if d["scale"] != "e8m0_in_block":
            raise ValueError(f"{self.format} keeps no scales in its blocks")
        n, k = self.shape
        n_pad, k_pad, _ = _padded(self.format, n, k, self.group_size)
        tail = self.data.reshape(n_pad // 16, k_pad // 32, 272)[:, :, 256:]
        return tail.transpose(0, 2, 1).reshape(n_pad, k_pad // 32)[:n, :-(-k // 32)]

    def dequantize(self, dtype=np.float64):
        """W as the kernels see it: codes times scales, exactly (in float64 by default)."""
        n, k = self.shape
        d = descriptor(self.format)
        c = self.codes()
        if d["code"] == "bf16":
            values = c.view(ml_dtypes.bfloat16).astype(dtype)
        elif d["code"] == "e2m1":
            return E2M1_VALUES[c].astype(dtype) * np.exp2(np.repeat(self.block_exponents().astype(dtype) - 127,
                                                                    32, axis=1)[:, :k])
        elif d["code"] == "e4m3":
            values = c.view(ml_dtypes.float8_e4m3fn).astype(dtype)
        else:
            values = c.astype(dtype)
        kind = d["scale"]
        if kind == "none":
            return values
        if kind == "per_channel":
            return values * self.scale.reshape(-1)[:n, None].astype(dtype)
        if kind == "group":
            if d["zero_points"]:
                zero = self.group_zero_points()
                values = values - np.repeat(zero[:, :n].T.astype(dtype), self.group_size, axis=1)[:, :k]
            values = values * np.repeat(self.group_scales()[:, :n].T.astype(dtype), self.group_size, axis=1)[:, :k]
            if d["mins"]:
                values = values + np.repeat(self.group_mins()[:, :n].T.astype(dtype), self.group_size, axis=1)[:, :k]
            return values
        return values * expand_block_scale(self.scale.astype(dtype), n, k)


def pack(W: np.ndarray, format: str = "INT8", group_size: int = DEFAULT_INT4_GROUP) -> PackedWeight:
    """Quantize (if the format asks) and pack a float weight matrix W[N][K] (out x in).
    format: a format or KTransformers backend name (ktcy.FORMATS); group_size: for grouped formats
    (INT4, INT4_ZP, INT4_MIN: 32, 64, 128; INT8_GROUP and INT8_MIN also 16).  Raises ValueError for unknown formats, bad group sizes or
    non-finite weights, TypeError for non-float input."""
    fmt = canonical_format(format)
    group = group_size if has_groups(fmt) else weight_group(fmt)
    if has_groups(fmt) and group not in descriptor(fmt)["group_sizes"]:
        raise ValueError(f"{fmt} group_size must be one of {tuple(descriptor(fmt)['group_sizes'])}, got {group_size}")
    W = np.asarray(W)
    if fmt == "BF16" and W.dtype == ml_dtypes.bfloat16 and W.ndim == 2:
        return pack_quantized(np.ascontiguousarray(W).view(np.uint16), None, "BF16")
    w = as_float32_matrix(W, "W")
    n, k = w.shape
    if fmt == "BF16":
        _refuse_non_finite(w)
        bits = _native.to_bf16_bits(w)
        beyond = ((bits & 0x7F80) == 0x7F80).any(axis=1)
        if beyond.any():
            row = int(np.flatnonzero(beyond)[0])
            raise ValueError(f"weight row {row} holds {float(w[row][np.argmax(np.abs(w[row]))]):.5g}, which rounds to "
                             "infinity in bf16 (its largest value is 3.3895e38); it cannot be packed")
        return pack_quantized(bits, None, fmt)
    quantized = _native.quantize_weights(_CODE[fmt], w, group)
    if descriptor(fmt)["scale"] == "e8m0_in_block":
        codes, exps = quantized
        return pack_quantized(codes[:, :k], exps, fmt)
    if descriptor(fmt)["zero_points"]:
        codes, scale, zero = quantized
        _refuse_unrepresentable(fmt, scale, w)
        return pack_quantized((codes[:, :k] + 8).astype(np.uint8), scale, fmt, group_size=group, zero_points=zero)
    if descriptor(fmt)["mins"]:
        codes, scale, mins = quantized
        _refuse_unrepresentable(fmt, np.concatenate([scale, mins]), w)
        unsigned = codes[:, :k].astype(np.int16) + _CODE_OFFSET[descriptor(fmt)["code"]]
        return pack_quantized(unsigned.astype(np.uint8), scale, fmt, group_size=group, mins=mins)
    codes, scale = quantized
    _refuse_unrepresentable(fmt, scale, w)
    return pack_quantized(codes[:, :k], scale, fmt, group_size=group or None)


def _refuse_unrepresentable(fmt, scale, w):
    """Finite weights so large that their integer format's scales overflow (or pass
    _MAX_INT_SCALE): a ValueError that says so, before the scale check's generic one."""
    if _scale_problem(fmt, scale):
        raise ValueError(f"{fmt} cannot hold weights as large as {float(np.abs(w).max()):.3g} (its scales would "
                         f"pass {_MAX_INT_SCALE:.3g}); BF16 holds up to 3.4e38")


def _refuse_non_finite(w):
    bad = ~np.isfinite(w).all(axis=1)
    if bad.any():
        raise ValueError(f"weight row {int(np.flatnonzero(bad)[0])} holds NaN or infinity; it cannot be packed")


def pack_quantized(codes: np.ndarray, scale: Optional[np.ndarray], format: str, group_size: Optional[int] = None,
                   zero_points: Optional[np.ndarray] = None, mins: Optional[np.ndarray] = None) -> PackedWeight:
    """Pack codes that are already quantized: int8 [N,K] in -128..127 + scale [N] (INT8); int8 [N,K] + scale
    [K_pad/group, N_pad] or [N, K/group] (INT8_GROUP: w = s * q, q in -128..127, llama.cpp's Q8_0,
    Q6_K, Q5_0, GPTQ's symmetric 8-bit); int8 in [-8,7] +
    scale [K_pad/group, N_pad] or [N, K/group] (INT4); unsigned codes 0..15 [N,K] + scale and
    zero_points 0..15, each [K_pad/group, N_pad] or [N, K/group] (INT4_ZP: w = s * (q - z); a packed
    weight's own are group_scales() and group_zero_points(), not .scale/.zero, which are panel-major);
    unsigned codes 0..15 [N,K] + scale and float mins, each [K_pad/group, N_pad] or [N, K/group]
    (INT4_MIN: w = s * q + min, llama.cpp's Q4_K and Q4_1; group_mins() gives them back);
    unsigned codes 0..255 [N,K] + scale and float mins likewise (INT8_MIN: w = s * u + min,
    llama.cpp's Q5_K and Q5_1);
    E4M3 bytes or float8_e4m3fn [N,K] + scale [N] / [N,1] (FP8 per channel) or
    [ceil(N/128), ceil(K/128)] (FP8 block); bf16 bits (BF16); E2M1 codes 0..15 [N,K] + E8M0
    exponents uint8 [N, ceil(K/32)] (MXFP4 and MXFP4_A8, the scale 2^(e - 127) of each channel's 32
    values)."""
    fmt = canonical_format(format)
    d = descriptor(fmt)
    codes = np.asarray(codes)
    if codes.ndim != 2 or 0 in codes.shape:
        raise ValueError(f"codes must be 2-D and non-empty, got shape {codes.shape}")
    n, k = codes.shape
    if mins is not None and not d["mins"]:
        raise ValueError(f"{fmt} has no mins; got some")
    n_pad = _padded(fmt, n, k, weight_group(fmt))[0]
    group = 0 if has_groups(fmt) else weight_group(fmt)
    code = d["code"]
    if code == "bf16":
        if codes.dtype == ml_dtypes.bfloat16:
            codes = codes.view(np.uint16)
        _expect_dtype(codes, np.uint16, f"{fmt} codes (bf16 bits)")
        if ((codes & 0x7F80) == 0x7F80).any():
            row = int(np.flatnonzero(((codes & 0x7F80) == 0x7F80).any(axis=1))[0])
            raise ValueError(f"weight row {row} holds NaN or infinity; it cannot be packed")
    elif code == "e2m1":
        if not np.issubdtype(codes.dtype, np.integer) or codes.min() < 0 or codes.max() > 15:
            raise ValueError(f"{fmt} codes must be integers 0..15 (E2M1 bit patterns)")
        codes = codes.astype(np.uint8)
    elif code == "e4m3":
        if codes.dtype == ml_dtypes.float8_e4m3fn:
            codes = codes.view(np.uint8)
        _expect_dtype(codes, np.uint8, f"{fmt} codes (E4M3 bytes or float8_e4m3fn)")
    elif d["zero_points"] or d["mins"]:
        offset = _CODE_OFFSET[code]  # the layout stores the unsigned code minus the offset
        if not np.issubdtype(codes.dtype, np.integer):
            raise TypeError(f"{fmt} codes must be integers 0..{2 * offset - 1}, got {codes.dtype}")
        if codes.min() < 0 or codes.max() > 2 * offset - 1:
            raise ValueError(f"{fmt} codes must lie in [0, {2 * offset - 1}]")
        codes = (codes.astype(np.int16) - offset).astype(np.int8)
    else:
        _expect_dtype(codes, np.int8, f"{fmt} codes")
        if code == "s8" and d["scale"] != "group" and k > INT8_MAX_K:
            raise ValueError(f"{fmt} weights with K = {k} > {INT8_MAX_K} would overflow the int32 sums; use BF16 or INT4")
        if code == "u4" and (codes.min() < -8 or codes.max() > 7):
            raise ValueError(f"{fmt} codes must lie in [-8, 7]")
    kind = d["scale"]
    if kind not in ("none", "e8m0_in_block"):
        _check_finite_scales(fmt, scale)
    block_scales = None
    if kind == "none":
        if scale is not None:
            raise ValueError(f"{fmt} has no scales; got one")
    elif kind == "e8m0_in_block":
        block_scales = _e8m0_exponents(scale, codes, n, k, fmt)
        scale = None
    elif kind == "per_channel":
        scale = _channel_scale(scale, n, n_pad)
    elif kind == "group":
        group = group_size or DEFAULT_INT4_GROUP
        if group not in d["group_sizes"]:
            raise ValueError(f"{fmt} group_size must be one of {tuple(d['group_sizes'])}, got {group}")
        groups = _padded(fmt, n, k, group)[1] // group
        if scale is None:
            raise ValueError(f"{fmt} needs its group scales")
        scale = _kernel_group_array(scale, np.float32, 0, n, k, group, groups, n_pad, f"{fmt} scale")
        if d["mins"]:
            if mins is None:
                raise ValueError(f"{fmt} needs its mins (the value of code 0 per group)")
            if not np.issubdtype(np.asarray(mins).dtype, np.floating):
                raise TypeError(f"{fmt} mins must be floats, got {np.asarray(mins).dtype}")
            _check_finite_scales(fmt, mins, "mins")  # positions as given
            mins = _kernel_group_array(mins, np.float32, 0, n, k, group, groups, n_pad, f"{fmt} mins")
            # each panel's group: its 16 scales, then its 16 mins (formats.h, ktcy_side_width)
            scale = np.ascontiguousarray(np.concatenate([scale, mins], axis=2))
        if d["zero_points"]:
            if zero_points is None:
                raise ValueError(f"{fmt} needs zero points")
            z = np.asarray(zero_points)
            if not np.issubdtype(z.dtype, np.integer) or (z.size and (z.min() < 0 or z.max() > 15)):
                raise ValueError(f"{fmt} zero points must be integers in [0, 15]")
            zero_points = _kernel_group_array(z, np.uint8, 8, n, k, group, groups, n_pad, f"{fmt} zero points")
        elif zero_points is not None:
            raise ValueError(f"{fmt} has no zero points; got some")
    else:
        grid = (-(-n // 128), -(-k // 128))
        scale = c_array(scale, np.float32)
        if scale.shape != grid:
            raise ValueError(f"{fmt} block scale_inv must be {grid} for a {n}x{k} weight, got {scale.shape}")
    data, colsum = _native.layout(_CODE[fmt], codes, n, k, group, block_scales)  # it makes them C-ordered, aligned
    return PackedWeight(fmt, (n, k), data, scale, colsum, group, zero_points if d["zero_points"] else None)


def _e8m0_exponents(exps, codes, n, k, fmt):
    """E8M0 exponents [N, ceil(K/32)] as uint8, refused where a non-zero code would leave the
    range the kernels decode exactly (or where the exponent is 255, E8M0's NaN)."""
    if exps is None:
        raise ValueError(f"{fmt} needs its E8M0 scale exponents [{n}, {-(-k // 32)}]")
    e = np.asarray(exps)
    if e.shape != (n, -(-k // 32)) or not np.issubdtype(e.dtype, np.integer) or e.min() < 0 or e.max() > 255:
        raise ValueError(f"{fmt} scale exponents must be integers 0..255 shaped [{n}, {-(-k // 32)}], "
                         f"got {e.dtype} {e.shape}")
    pad = np.zeros((n, e.shape[1] * 32), np.uint8)
    pad[:, :k] = codes & 7
    used = pad.reshape(n, -1, 32).any(axis=2)
    lo, hi = _native.E8M0_RANGE
    bad = used & ((e < lo) | (e > hi))
    if bad.any():
        r, b = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{fmt} scale 2^({int(e[r, b])} - 127) of row {r}, K block {b} is outside the range "
                         f"[2^({lo} - 127), 2^({hi} - 127)] ktcy computes exactly")
    return e.astype(np.uint8)


def panel_major(a):
    """[groups, N_pad] per-(group, channel) values as the kernels read them: [N_pad/16][groups][16],
    each 16-channel panel's groups together (include/ktcy/formats.h, ktcy_group_index)."""
    groups, n_pad = a.shape
    return np.ascontiguousarray(a.reshape(groups, n_pad // 16, 16).transpose(1, 0, 2))


def group_major(a, groups):
    """The inverse of panel_major: [N_pad/16][groups][16] (or flat) -> [groups, N_pad] (a copy)."""
    flat = np.asarray(a).reshape(-1)
    panels = flat.size // (groups * 16)
    return np.ascontiguousarray(flat.reshape(panels, groups, 16).transpose(1, 0, 2).reshape(groups, panels * 16))


def _kernel_group_array(a, dtype, fill, n, k, group, groups, n_pad, what):
    """A per-(channel, group) array given as [N, ceil(K/group)] or [groups, N_pad] as the kernels
    read it (panel_major), padding filled with `fill`."""
    a = np.asarray(a)
    if a.shape == (n, -(-k // group)):
        full = np.full((groups, n_pad), fill, dtype)
        full[: a.shape[1], :n] = a.T
        a = full
    if a.shape != (groups, n_pad):
        raise ValueError(f"{what} must be [{groups}, {n_pad}] or [{n}, {-(-k // group)}], got {a.shape}")
    return panel_major(np.asarray(a, dtype))


def _expect_dtype(a, dtype, what):
    if a.dtype != dtype:
        raise TypeError(f"{what} must be {np.dtype(dtype)}, got {a.dtype}")


def _channel_scale(scale, n, n_pad):
    if scale is None:
        raise ValueError(f"per-channel scale [{n}] is missing")
    s = np.asarray(scale, np.float32)
    if s.shape not in ((n,), (n, 1)):
        raise ValueError(f"per-channel scale must be [{n}] or [{n}, 1], got {s.shape}")
    out = np.zeros(n_pad, np.float32)
    out[:n] = s.reshape(-1)
    return out


def prepare_activations(X, packed):
    """X converted once for packed's format (int8 + row scales, or bf16), as the kernels read it."""
    x = as_float32_matrix(X, "X")
    if x.shape[1] != packed.shape[1]:
        raise ValueError(f"X has {x.shape[1]} columns but the weight has K = {packed.shape[1]}")
    return _native.Activations(_CODE[packed.format], x, packed.k_pad, packed.group_size)


def linear(X: np.ndarray, packed: PackedWeight, isa: Optional[str] = None,
           out: Optional[np.ndarray] = None) -> np.ndarray:
    """Y[M, N] = X[M, K] @ W.T in float32 with the packed weight, on the chosen or given ISA
    (one of ktcy.available_isas()).  Raises UnsupportedISAError for an ISA this CPU cannot
    run, ValueError/TypeError for shapes or arrays that do not fit."""
    if not isinstance(packed, PackedWeight):
        raise TypeError("packed must come from ktcy.kernels.pack")
    _, variant = _native.resolve(packed.format, isa)
    return linear_variant(X, packed, variant, out)


def linear_variant(X, packed, variant, out=None, **tiles):
    """linear() on one named kernel variant (see ktcy._native.variants()), for tests and benchmarks
    that must reach variants the dispatcher would not pick on this CPU.  tiles: tile choices by name
    (one_panel_rows=0, i16_rows=4, ...: ktcy._native.TILE_CHOICE_LIMITS, registry.h) that this CPU
    would not make; None or absent for this CPU's."""
    tiles = {name: operator.index(value) for name, value in tiles.items() if value is not None}
    weight = packed.native()  # checks every array against the descriptor first
    act = prepare_activations(X, packed)
    m, n = np.shape(X)[0], packed.shape[0]
    if out is None:
        out = np.empty((m, n), np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != (m, n) or out.dtype != np.float32 \
            or not out.flags.c_contiguous or not out.flags.aligned or not out.flags.writeable:
        got = type(out).__name__
        if isinstance(out, np.ndarray):
            got += f" {out.dtype} {out.shape}" + ("" if out.flags.c_contiguous else ", not C-contiguous") \
                + ("" if out.flags.aligned else ", not aligned") + ("" if out.flags.writeable else ", read-only")
        raise ValueError(f"out must be a writable, aligned, C-contiguous float32 numpy array of shape {(m, n)}, "
                         f"got {got}")
    if m and n:
        _native.gemm(packed.format, variant, act, weight, out, **tiles)
    return out
