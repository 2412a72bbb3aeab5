"""Low-level face of the GEMM kernels: pack a weight matrix, multiply activations by it.

Contract (used from outside the repo): ``pack(W, format=...)`` and ``linear(X, packed, isa=None)``.
"""
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ktcy import _native
from ktcy.formats import DEFAULT_INT4_GROUP, FORMATS, INT4_GROUP_SIZES, canonical_format

_CODE = {name: i for i, name in enumerate(FORMATS)}
# INT8 sums (q_x + 128) * q_w in int32 on VNNI (then subtracts 128 * column sum): 255 * 127 * K
# stays below 2^31 up to K = 66311.
INT8_MAX_K = 65536
_FLOAT_INPUTS = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)


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
    if not any(a.dtype == t for t in _FLOAT_INPUTS):
        raise TypeError(f"{what} must be float32, float64, float16 or bfloat16, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


@dataclass(eq=False)
class PackedWeight:
    """W[N][K] in a ktcy packed layout (the same bytes on every ISA)."""
    format: str
    shape: tuple
    data: np.ndarray          # uint8 blocks
    scale: np.ndarray         # float32; per format, see include/ktcy/types.h
    colsum: np.ndarray = None  # INT8 only
    group_size: int = 0       # INT4 only
    _view: object = field(default=None, repr=False)

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (self.data, self.scale, self.colsum) if a is not None)

    @property
    def k_pad(self):
        return _padded(self.format, *self.shape, self.group_size)[1]

    @property
    def n_pad(self):
        return _padded(self.format, *self.shape, self.group_size)[0]

    def native(self):
        """The C descriptor over these arrays (made once)."""
        if self._view is None:
            self._view = _native.Weight(_CODE[self.format], self.group_size, self.shape[0], self.shape[1],
                                        self.data, self.scale.reshape(-1), self.colsum)
        return self._view

    def codes(self):
        """The stored codes as [N, K]: int8 (INT8, INT4), E4M3 bytes (FP8) or bf16 bits (BF16).
        Read back from the block layout with numpy, independently of the C packer."""
        n, k = self.shape
        n_pad, k_pad, block_k = _padded(self.format, n, k, self.group_size)
        panels, kb = n_pad // 16, k_pad // block_k
        if self.format == "INT4":
            d = self.data.reshape(panels, kb, 512)
            nib = np.concatenate([d & 0x0F, d >> 4], axis=2).astype(np.int8) - 8
            blocks = nib.reshape(panels, kb, 16, 16, 4)
        elif self.format == "INT8":
            blocks = self.data.view(np.int8).reshape(panels, kb, 16, 16, 4)
        elif self.format == "BF16":
            blocks = self.data.view(np.uint16).reshape(panels, kb, 16, 16, 2)
        else:
            blocks = self.data.reshape(panels, kb, 16, 16, 2)
        # (panel, kblock, row r, channel, j) -> (panel, channel, kblock, r, j)
        full = blocks.transpose(0, 3, 1, 2, 4).reshape(n_pad, k_pad)
        return full[:n, :k]

    def dequantize(self, dtype=np.float64):
        """W as the kernels see it: codes times scales, exactly (in float64 by default)."""
        n, k = self.shape
        c = self.codes()
        if self.format == "BF16":
            return c.view(ml_dtypes.bfloat16).astype(dtype)
        if self.format == "INT8":
            return c.astype(dtype) * self.scale[:n, None].astype(dtype)
        if self.format == "INT4":
            s = np.repeat(self.scale[:, :n].T.astype(dtype), self.group_size, axis=1)[:, :k]
            return c.astype(dtype) * s
        values = c.view(ml_dtypes.float8_e4m3fn).astype(dtype)
        if self.format == "FP8_PERCHANNEL":
            return values * self.scale[:n, None].astype(dtype)
        return values * expand_block_scale(self.scale.astype(dtype), n, k)


def pack(W, format="INT8", group_size=DEFAULT_INT4_GROUP):
    """Quantize (if the format asks) and pack a float weight matrix W[N][K] (out x in)."""
    fmt = canonical_format(format)
    if fmt == "INT4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    W = np.asarray(W)
    if fmt == "BF16" and W.dtype == ml_dtypes.bfloat16 and W.ndim == 2:
        return pack_quantized(np.ascontiguousarray(W).view(np.uint16), None, "BF16")
    w = as_float32_matrix(W, "W")
    n, k = w.shape
    if fmt == "BF16":
        return pack_quantized(_native.to_bf16_bits(w), None, fmt)
    codes, scale = _native.quantize_weights(_CODE[fmt], w, group_size if fmt == "INT4" else 0)
    return pack_quantized(codes[:, :k], scale, fmt, group_size=group_size if fmt == "INT4" else None)


def pack_quantized(codes, scale, format, group_size=None):
    """Pack codes that are already quantized: int8 [N,K] + scale [N] (INT8); int8 in [-8,7] +
    scale [K_pad/group, N_pad] or [N, K/group] (INT4); E4M3 bytes or float8_e4m3fn [N,K] + scale
    [N] / [N,1] (FP8 per channel) or [ceil(N/128), ceil(K/128)] (FP8 block); bf16 bits (BF16)."""
    fmt = canonical_format(format)
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D, got shape {codes.shape}")
    n, k = codes.shape
    n_pad = _padded("INT8", n, k, 0)[0]
    group = 0
    if fmt == "BF16":
        if codes.dtype == ml_dtypes.bfloat16:
            codes = codes.view(np.uint16)
        _expect_dtype(codes, np.uint16, "BF16 codes (bf16 bits)")
        scale = np.zeros(n_pad, np.float32)
    elif fmt == "INT8":
        _expect_dtype(codes, np.int8, "INT8 codes")
        if k > INT8_MAX_K:
            raise ValueError(f"INT8 weights with K = {k} > {INT8_MAX_K} would overflow the int32 sums; use BF16 or INT4")
        scale = _channel_scale(scale, n, n_pad)
    elif fmt == "INT4":
        group = group_size or DEFAULT_INT4_GROUP
        if group not in INT4_GROUP_SIZES:
            raise ValueError(f"INT4 group_size must be one of {INT4_GROUP_SIZES}, got {group}")
        _expect_dtype(codes, np.int8, "INT4 codes")
        if codes.size and (codes.min() < -8 or codes.max() > 7):
            raise ValueError("INT4 codes must lie in [-8, 7]")
        groups = _padded("INT4", n, k, group)[1] // group
        scale = np.asarray(scale, np.float32)
        if scale.shape == (n, -(-k // group)):
            full = np.zeros((groups, n_pad), np.float32)
            full[: scale.shape[1], :n] = scale.T
            scale = full
        if scale.shape != (groups, n_pad):
            raise ValueError(f"INT4 scale must be [{groups}, {n_pad}] or [{n}, {-(-k // group)}], got {scale.shape}")
        scale = np.ascontiguousarray(scale)
    else:
        if codes.dtype == ml_dtypes.float8_e4m3fn:
            codes = codes.view(np.uint8)
        _expect_dtype(codes, np.uint8, "FP8 codes (E4M3 bytes or float8_e4m3fn)")
        if fmt == "FP8_PERCHANNEL":
            scale = _channel_scale(scale, n, n_pad)
        else:
            grid = (-(-n // 128), -(-k // 128))
            scale = np.ascontiguousarray(scale, np.float32)
            if scale.shape != grid:
                raise ValueError(f"FP8 block scale_inv must be {grid} for a {n}x{k} weight, got {scale.shape}")
    data, colsum = _native.layout(_CODE[fmt], np.ascontiguousarray(codes), n, k, group)
    return PackedWeight(fmt, (n, k), data, scale, colsum, group)


def _expect_dtype(a, dtype, what):
    if a.dtype != dtype:
        raise TypeError(f"{what} must be {np.dtype(dtype)}, got {a.dtype}")


def _channel_scale(scale, n, n_pad):
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


def linear(X, packed, isa=None, out=None):
    """Y[M, N] = X[M, K] @ W.T in float32 with the packed weight, on the chosen or given ISA."""
    if not isinstance(packed, PackedWeight):
        raise TypeError("packed must come from ktcy.kernels.pack")
    _, variant = _native.resolve(packed.format, isa)
    return linear_variant(X, packed, variant, out)


def linear_variant(X, packed, variant, out=None):
    """linear() on one named kernel variant (see ktcy._native.variants()), for tests and benchmarks
    that must reach variants the dispatcher would not pick on this CPU."""
    act = prepare_activations(X, packed)
    m, n = np.shape(X)[0], packed.shape[0]
    if out is None:
        out = np.empty((m, n), np.float32)
    elif out.shape != (m, n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {(m, n)}")
    if m and n:
        _native.gemm(packed.format, variant, act, packed.native(), out)
    return out
