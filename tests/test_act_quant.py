"""The activation conversions' AVX2 and AVX-512 versions (act_quant.h: int8 codes with row scales
and group sums, bf16 bits) against the portable ones, byte for byte, and all of them against
numpy's rule: the kernels see the same inputs whichever machine converted the tokens."""
import ml_dtypes
import numpy as np
import pytest

from conftest import isa_params, quantize_rows_int8
from ktcy import _native
from ktcy.errors import UnsupportedISAError

QUANT_ISAS = ("ref", "avx2", "avx512")


def quant_params():
    """The vector ISAs (and ref) with conftest's skips where this machine lacks one."""
    return [p for p in isa_params() if p.id in QUANT_ISAS]


def rows(rng, m, k):
    """Rows that reach every path: scales from 1e-30 to 1e30, exact ties of the rounding (x * inv
    landing on .5), zeros, negative zeros, a subnormal-only row and non-finite rows."""
    x = rng.standard_normal((m, k)).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, (m, 1))
    x = x.astype(np.float32)
    if m > 3 and k > 2:
        x[0] = 0.0
        x[1] = -0.0
        x[1, k // 2] = -3.0
        x[2] = (np.arange(k, dtype=np.float32) - k / 2) * np.float32(0.5)  # many exact .5 products
        x[3] = np.float32(1e-40) * rng.integers(-3, 4, k)  # subnormals
    if m > 6 and k > 1:
        x[4, k - 1] = np.nan  # in the tail lanes
        x[5, 0] = np.inf
        x[6, k // 3] = -np.inf
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("isa", quant_params())
@pytest.mark.parametrize("k", [1, 7, 8, 15, 16, 17, 31, 33, 64, 129, 768, 2050])
@pytest.mark.parametrize("group", [0, 32, 64])
def test_same_bytes_as_portable(isa, k, group):
    rng = np.random.default_rng(k * 7 + group)
    k_pad = -(-k // 64) * 64 + (64 if k % 3 == 0 else 0)  # some rows with padding past the block
    x = rows(rng, 11, k)
    q0, s0, g0 = _native.quantize_act_int8("ref", x, k_pad, group)
    q1, s1, g1 = _native.quantize_act_int8(isa, x, k_pad, group)
    np.testing.assert_array_equal(q1, q0)
    np.testing.assert_array_equal(s1.view(np.uint32), s0.view(np.uint32))  # NaN scales included
    if group:
        np.testing.assert_array_equal(g1, g0)
        np.testing.assert_array_equal(g1, q1.reshape(len(x), -1, group).sum(axis=2, dtype=np.int32))
    assert not q1[:, k:].any()  # the padding is written (the buffer started as ones)
    finite = np.isfinite(x).all(axis=1)
    assert np.isnan(s1[~finite]).all() and not q1[~finite].any()
    tiny = finite & (np.abs(np.where(np.isfinite(x), x, 0)).max(axis=1) < np.float32(2.0 ** -120))
    assert (s1[tiny] == 0).all() and not q1[tiny].any()  # zero rows too; 127/amax would overflow
    normal = finite & ~tiny
    q_ref, s_ref = quantize_rows_int8(x[normal])
    np.testing.assert_array_equal(q1[normal, :k], q_ref)
    np.testing.assert_array_equal(s1[normal], s_ref)


@pytest.mark.parametrize("isa", quant_params())
def test_no_rows(isa):
    q, s, g = _native.quantize_act_int8(isa, np.zeros((0, 5), np.float32), 64, 32)
    assert q.shape == (0, 64) and s.shape == (0,) and g.shape == (0, 2)


def test_bad_arguments():
    x = np.ones((2, 70), np.float32)
    with pytest.raises(ValueError, match="unknown quantizer ISA"):
        _native.quantize_act_int8("amx", x, 128)
    with pytest.raises(ValueError, match="does not hold"):
        _native.quantize_act_int8("ref", x, 64)
    with pytest.raises(ValueError, match="does not hold"):
        _native.quantize_act_int8("ref", x, 128, 48)
    for isa in ("avx2", "avx512"):
        if isa not in _native.available_isas():
            with pytest.raises(UnsupportedISAError):
                _native.quantize_act_int8(isa, x, 128)


@pytest.mark.parametrize("isa", [p for p in quant_params() if p.id != "avx512"])
@pytest.mark.parametrize("k_pad", [0, 32, 64, 2048])
def test_e2m1_starts_are_minus_12_times_the_word_sums(isa, k_pad):
    """MXFP4_A8's block sums: per 32-K block, -12 x the codes at K = 0, 1 (mod 4) in the low 16
    bits and at K = 2, 3 in the high 16, down to the largest (+-16 x 127, both words)."""
    rng = np.random.default_rng(k_pad)
    q = rng.integers(-127, 128, (9, k_pad)).astype(np.int8)
    q[0], q[1] = 127, -127
    q[2, :] = np.where(np.arange(k_pad) % 4 < 2, 127, -127)
    q[3] = 0
    blocks = q.astype(np.int64).reshape(9, k_pad // 32, 8, 4)
    low, high = -12 * blocks[..., :2].sum(axis=(2, 3)), -12 * blocks[..., 2:].sum(axis=(2, 3))
    want = ((low & 0xFFFF) | ((high & 0xFFFF) << 16)).astype(np.uint32).view(np.int32)
    got = _native.act_e2m1_starts(isa, q)
    assert got.shape == (9, k_pad // 32)
    np.testing.assert_array_equal(got, want)
    if k_pad:
        assert got.view(np.uint32)[0, 0] == (0x10000 - 24384) * 0x10001
    with pytest.raises(ValueError, match="32-K blocks"):
        _native.act_e2m1_starts(isa, np.zeros((2, 48), np.int8))


def bf16_rows(rng, m, k):
    """Rounding ties both ways, values that round up to infinity, subnormals, signed zeros, NaNs
    with payloads (signalling and quiet, both signs) and infinities."""
    bits = rng.integers(0, 2 ** 32, (m, k), dtype=np.uint64).astype(np.uint32)
    bits[:, ::5] = (bits[:, ::5] & 0xFFFF0000) | 0x8000  # exact ties
    bits[:, 1::7] = 0x7F7FFFFF  # largest finite: rounds up to infinity
    bits[:, 2::9] = 0x00000001  # smallest subnormal
    bits[:, 3::11] = 0x80000000  # -0
    bits[:, 4::13] = 0x7F800001  # signalling NaN
    bits[:, 5::13] = 0xFFC12345  # quiet negative NaN with a payload
    bits[:, 6::17] = 0xFF800000  # -inf
    return bits.view(np.float32)


def bf16_expected(x):
    """ktcy_f32_to_bf16 written in numpy: round to nearest even on the bits, NaN quieted."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


@pytest.mark.parametrize("isa", quant_params())
@pytest.mark.parametrize("k", [1, 7, 8, 15, 16, 17, 33, 768, 2050])
def test_bf16_same_bits_as_portable(isa, k):
    rng = np.random.default_rng(k)
    x = bf16_rows(rng, 5, k)
    k_pad = -(-k // 32) * 32 + (32 if k % 2 else 0)
    out = _native.convert_act_bf16(isa, x, k_pad)
    np.testing.assert_array_equal(out, _native.convert_act_bf16("ref", x, k_pad))
    np.testing.assert_array_equal(out[:, :k], bf16_expected(x))
    assert not out[:, k:].any()
    finite = np.isfinite(x)  # and numpy's own bfloat16 agrees where both are numbers
    np.testing.assert_array_equal(out[:, :k][finite], x[finite].astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bf16_bad_arguments():
    with pytest.raises(ValueError, match="does not hold"):
        _native.convert_act_bf16("ref", np.ones((1, 40), np.float32), 32)
    with pytest.raises(ValueError, match="unknown quantizer ISA"):
        _native.convert_act_bf16("amx_emu", np.ones((1, 4), np.float32), 32)
