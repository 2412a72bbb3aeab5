"""FP8 E4M3 weights: exact decode on every ISA, quantization rules, both scale kinds, aliases."""
import ml_dtypes
import numpy as np
import pytest

from conftest import bf16_round, rel_err_rows, runnable_variants
from ktcy import _native, kernels
from ktcy.formats import canonical_format, fp8_scale_kind

ALL_CODES = np.arange(256, dtype=np.uint8)
FLUSHING = 0x8040  # MXCSR's FTZ and DAZ, what torch.set_flush_denormal(True) sets


def flushed(call):
    """(call(), MXCSR as call() left it) under a caller's FTZ and DAZ; the caller's word back."""
    old = _native.mxcsr(_native.mxcsr() | FLUSHING)
    try:
        return call(), _native.mxcsr()
    finally:
        _native.mxcsr(old)


def test_scalar_decode_matches_ml_dtypes_for_all_256_codes():
    got = _native.e4m3_to_bf16_bits(ALL_CODES)
    expect = ALL_CODES.view(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16).view(np.uint16)
    got_f, exp_f = got.view(ml_dtypes.bfloat16).astype(np.float32), ALL_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(exp_f)
    assert nan.sum() == 2 and np.all(np.isnan(got_f[nan]))            # 0x7F and 0xFF
    assert np.array_equal(got[~nan], expect[~nan])                      # bf16 bits, signed zeros included
    assert np.array_equal(got_f[~nan], exp_f[~nan])


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_every_isa_decodes_all_256_codes_exactly(fmt):
    # W[n][k] = code 16n + k (16 channels x 16 codes), unit scales; one-hot rows of X pick each
    # column, so Y[k, n] is the decoded value itself.  NaN codes would poison their whole
    # channel through 0 * NaN, so they get their own channels below.
    # Three panels (the second holds the codes in reverse, the third with its columns reversed)
    # so that one- and two-row calls take the AVX2 two-panel tile and a one-panel one; X is fed
    # 1, 2, 3, 4 rows at a time (decode tiles) and all 16 (prefill).
    # A weight without NaN codes takes the AVX2 bit-move decode; one with them, the checked one.
    grid = ALL_CODES.reshape(16, 16).copy()
    grid[(grid & 0x7F) == 0x7F] = 0
    codes = np.concatenate([grid, grid[::-1, ::-1], grid[:, ::-1]])
    scale = np.ones(48, np.float32) if fmt == "FP8_PERCHANNEL" else np.ones((1, 1), np.float32)
    packed = kernels.pack_quantized(codes, scale, fmt)
    X = np.eye(16, dtype=np.float32)
    expect = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).T
    # the NaN weight holds every other code too (channels 16-63): its checked decode must keep them
    nan_w = np.concatenate([np.zeros((16, 16), np.uint8), codes])
    nan_w[3, 5], nan_w[9, 0], nan_w[12, 15] = 0x7F, 0xFF, 0x7F
    nan_scale = np.ones(64, np.float32) if fmt == "FP8_PERCHANNEL" else scale
    nan_packed = kernels.pack_quantized(nan_w, nan_scale, fmt)
    nan_channels = [3, 9, 12]
    for v in runnable_variants(fmt):
        for rows in (1, 2, 3, 4, 16):
            for r0 in range(0, 16, rows):
                got = kernels.linear_variant(X[r0:r0 + rows], packed, v)
                assert np.array_equal(got, expect[r0:r0 + rows]), (v, rows, r0)
                y = kernels.linear_variant(X[r0:r0 + rows], nan_packed, v)
                assert np.isnan(y[:, nan_channels]).all(), (v, rows)
                assert np.all(np.delete(y[:, :16], nan_channels, axis=1) == 0), (v, rows)
                assert np.array_equal(y[:, 16:], expect[r0:r0 + rows]), (v, rows, r0)


def test_encode_matches_ml_dtypes_with_saturation():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5000) * 100, rng.standard_normal(2000) * 1e-3,
                        [0.0, -0.0, 448.0, 464.0, 479.0, 500.0, -1e6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11]])
    x = x.astype(np.float32)
    got = _native.f32_to_e4m3(x)
    expect = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(got, expect)


def test_per_channel_quantization_rule_bit_exact():
    rng = np.random.default_rng(1)
    W = (rng.standard_normal((40, 300)) * 0.05).astype(np.float32)
    p = kernels.pack(W, "FP8_PERCHANNEL")
    s = (np.abs(W).max(axis=1) / np.float32(448)).astype(np.float32)
    q = np.clip(W / s[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(p.scale[:40], s)
    assert np.array_equal(p.codes(), q.view(np.uint8))
    assert np.array_equal(p.dequantize(), q.astype(np.float64) * s[:, None].astype(np.float64))


def test_block_quantization_rule_bit_exact():
    rng = np.random.default_rng(2)
    W = (rng.standard_normal((200, 300)) * 0.05).astype(np.float32)
    W[130:140] *= 50  # a block with a different range
    p = kernels.pack(W, "FP8")
    assert p.format == "FP8_BLOCK" and p.scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = W[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            s = np.float32(np.abs(blk).max() / np.float32(448))
            assert p.scale[i, j] == s
            q = np.clip(blk / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            assert np.array_equal(p.codes()[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)], q)


def test_deepseek_convention_multiplies_by_scale_inv():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (130, 260), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes
    scale_inv = rng.uniform(0.5, 2, (2, 3)).astype(np.float32)
    p = kernels.pack_quantized(codes.view(ml_dtypes.float8_e4m3fn), scale_inv, "FP8")
    big = np.repeat(np.repeat(scale_inv.astype(np.float64), 128, 0), 128, 1)[:130, :260]
    assert np.array_equal(p.dequantize(), codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * big)


def test_per_channel_scale_accepts_n_by_1():
    codes = np.full((20, 64), 0x38, np.uint8)  # 1.0
    p = kernels.pack_quantized(codes, np.full((20, 1), 0.5, np.float32), "FP8_PERCHANNEL")
    assert np.all(p.dequantize() == 0.5)


def test_all_zero_channel_and_block_decode_to_zero():
    W = np.zeros((256, 256), np.float32)
    W[0, 0] = 1.0
    for fmt in ("FP8_PERCHANNEL", "FP8_BLOCK"):
        p = kernels.pack(W, fmt)
        d = p.dequantize()
        assert np.isfinite(d).all() and abs(d[0, 0] - 1.0) < 1e-6 and np.count_nonzero(d) == 1


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 50, 100), (17, 130, 300), (40, 200, 260), (64, 96, 128),
                                   (5, 260, 1000)])
def test_gemm_every_isa_within_1e5_of_float64(fmt, m, n, k):
    rng = np.random.default_rng(m + n + k)
    W = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    p = kernels.pack(W, fmt)
    ref = bf16_round(X) @ p.dequantize().T
    for v in runnable_variants(fmt):
        assert rel_err_rows(kernels.linear_variant(X, p, v), ref) <= 1e-5, v


def test_backend_aliases():
    assert canonical_format("FP8") == "FP8_BLOCK"
    assert canonical_format("FP8", per_channel=True) == "FP8_PERCHANNEL"
    assert canonical_format("FP8", per_channel=False) == "FP8_BLOCK"
    assert canonical_format("FP8_PERCHANNEL") == "FP8_PERCHANNEL"
    assert canonical_format("AMXINT8") == "INT8" and canonical_format("AMXBF16") == "BF16"
    assert canonical_format("amxint4") == "INT4"
    with pytest.raises(ValueError, match="unknown"):
        canonical_format("FP4")


def test_scale_format_detector():
    assert fp8_scale_kind("x.weight_scale_inv", (2, 3), (200, 300)) == "FP8_BLOCK"
    assert fp8_scale_kind("x.weight_scale", (200,), (200, 300)) == "FP8_PERCHANNEL"
    assert fp8_scale_kind("x.weight_scale", (200, 1), (200, 300)) == "FP8_PERCHANNEL"
    assert fp8_scale_kind("x.weight_scale", (2, 3), (200, 300)) == "FP8_BLOCK"
    with pytest.raises(ValueError, match="fits neither"):
        fp8_scale_kind("x.weight_scale", (7,), (200, 300))
    with pytest.raises(ValueError, match="must be"):
        fp8_scale_kind("x.weight_scale_inv", (200,), (200, 300))


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_prefill_rows_agree_whichever_tile_decodes_the_panels(fmt):
    """A prefill group's first row tile may decode the panels itself and keep them for the other
    tiles (AVX-512 VBMI): a row must come out with the same bits in that first tile as in a
    later one reading the kept panels, and match float64 on the dequantized weights."""
    rng = np.random.default_rng(11)
    n, k = 72, 416  # 4 full panels and a partial one; K not a multiple of the 128 scale block
    W = (rng.standard_normal((n, k)) * 0.5).astype(np.float32)
    W[:, 128:256] *= 30.0
    packed = kernels.pack(W, fmt)
    # 12 rows and 4 + 12: no one-row tile anywhere (those sum even and odd rows apart)
    X = rng.standard_normal((12, k)).astype(np.float32)
    shifted = np.concatenate([rng.standard_normal((4, k)).astype(np.float32), X])
    ref = bf16_round(X).astype(np.float64) @ packed.dequantize().astype(np.float64).T
    for v in runnable_variants(fmt):
        first = kernels.linear_variant(X, packed, v)         # X's rows 0-3 in the first tile
        later = kernels.linear_variant(shifted, packed, v)[4:]  # the same rows in later tiles
        assert np.array_equal(first, later), v
        assert np.abs(first - ref).max() / np.abs(ref).max() < 1e-5, v


def extreme_case(fmt, m, sizes, mix=True):
    """Weights holding E4M3 subnormals; row i of X scaled by sizes[i % len(sizes)], row 2 (m > 2,
    mix) mixing 2^100 and 2^-100; the float64 reference on the bf16-rounded rows."""
    rng = np.random.default_rng(m)
    W = (rng.standard_normal((40, 300)) * 0.02).astype(np.float32)
    W[:, :40] *= 1e-4                                  # E4M3 subnormals after the channel scaling
    p = kernels.pack(W, fmt)
    codes = p.codes()
    assert np.any(((codes & 0x78) == 0) & ((codes & 0x07) != 0))
    X = rng.standard_normal((m, 300)).astype(np.float32)
    for i in range(m):
        X[i] *= np.float32(sizes[i % len(sizes)])
    if m > 2 and mix:
        X[2] = rng.standard_normal(300).astype(np.float32)
        X[2, ::2] *= np.float32(2.0 ** 100)
        X[2, 1::2] *= np.float32(2.0 ** -100)
    ref = bf16_round(X).astype(np.float64) @ p.dequantize().astype(np.float64).T
    assert np.isfinite(ref).all()
    return X, p, ref


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 40])
def test_rows_far_from_one_stay_within_1e5_of_float64(fmt, m):
    """Every variant, in the decode tiles (1-3 rows) and prefill (7, 40), for rows of size 2^-100
    to 2^100.  (Beyond: a code times an activation over ~2^117 overflows where the channel scale
    comes last, and AVX512-BF16/AMX dot products read bf16 subnormals as zeros.)"""
    X, p, ref = extreme_case(fmt, m, [2.0 ** 100, 2.0 ** -100, 1e30, 1e-3, 0.0])
    for v in runnable_variants(fmt):
        got = kernels.linear_variant(X, p, v)
        assert rel_err_rows(got, ref) <= 1e-5, v


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("sizes", [[2.0 ** 10, 2.0 ** -120, 1e-3, 2.0 ** -126, 2.0 ** -130, 0.0],
                                   [2.0 ** 120, 3e37, 1e30, 2.0 ** 100, 2.0 ** 16, 0.0]])
def test_avx2_rows_anywhere_in_the_bf16_range_stay_within_1e5_of_float64(fmt, m, sizes):
    """AVX2 decodes codes to their value x 2^-120 and widens each activation row times a power of
    two chosen from its largest value; a call holding a row of 2^15 or more takes the wide decode
    (2^-8 weights, rows past 2^100 scaled down).  Rows down to bf16 subnormals (first case) and up
    to 1e38 (second) must come out as float64 computes them."""
    if "fp8_avx2" not in runnable_variants(fmt):
        pytest.skip("this CPU cannot run the AVX2 kernels")
    X, p, ref = extreme_case(fmt, m, sizes, mix=sizes[0] > 2.0 ** 15)  # the 2^100 row is wide
    assert rel_err_rows(kernels.linear_variant(X, p, "fp8_avx2"), ref) <= 1e-5


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_infinite_activations_give_what_float_arithmetic_gives(fmt):
    rng = np.random.default_rng(5)
    W = (rng.standard_normal((32, 64)) * 0.02).astype(np.float32)
    p = kernels.pack(W, fmt)
    X = rng.standard_normal((3, 64)).astype(np.float32)
    X[0, 7] = np.inf
    X[2, 1] = np.nan
    with np.errstate(invalid="ignore"):
        ref = bf16_round(X).astype(np.float64) @ p.dequantize().astype(np.float64).T
    for v in runnable_variants(fmt):
        for rows in (slice(0, 3), slice(0, 1), slice(1, 2)):
            got, want = kernels.linear_variant(X[rows], p, v), ref[rows]
            assert np.array_equal(np.isnan(got), np.isnan(want)), (v, rows)
            finite = np.isfinite(want)
            assert np.array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)]), (v, rows)
            assert np.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6), (v, rows)


WIDE_ROWS = [(1e38, 1e-5), (3.38e38, 1e-20), (1e35, 1e-20), (1e30, 1e-12), (1e6, 1e-25), (1e20, 1e-20),
             (3e4, 1e-30)]


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("big,small", WIDE_ROWS)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_a_huge_value_whose_weights_are_zero_leaves_the_small_ones_exact(fmt, big, small, m, one_thread):
    """A row's small values decide its outputs when its huge value meets a zero weight column: the
    bit-move decodes (weights x 2^-120, rows scaled from their largest value: AVX2, AVX-512 one-row
    calls) would push their products below the normal range, so rows from 2^15 on take the wide
    (AVX2) or bf16 (AVX-512) decode.  The huge value sits in an even K column, then in an odd one
    (the two bf16 of a pair).  Under a caller's DAZ and FTZ (torch.set_flush_denormal) too."""
    rng = np.random.default_rng(m)
    W = (rng.standard_normal((40, 96)) * 0.02).astype(np.float32)
    W[:, [0, 37]] = 0
    p = kernels.pack(W, fmt)
    variants = [v for v in runnable_variants(fmt) if "amx" not in v]
    for column in (0, 37):
        X = (rng.standard_normal((m, 96)) * small).astype(np.float32)
        X[0, column] = big
        ref = bf16_round(X).astype(np.float64) @ p.dequantize().astype(np.float64).T
        for v in variants:
            assert rel_err_rows(kernels.linear_variant(X, p, v), ref) <= 1e-5, (v, column)
            got, _ = flushed(lambda: kernels.linear_variant(X, p, v))
            assert rel_err_rows(got, ref) <= 1e-5, (v, column)


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_a_caller_flushing_subnormals_changes_nothing(fmt, m, one_thread):
    """torch.set_flush_denormal(True) sets MXCSR's DAZ and FTZ: AVX2's decode makes E4M3
    subnormals float subnormals, which DAZ would read as zeros.  The GEMM clears DAZ while it
    runs and restores the caller's control word."""
    rng = np.random.default_rng(m)
    W = (rng.standard_normal((48, 256)) * 0.02).astype(np.float32)
    W[:, ::3] *= 1e-4
    p = kernels.pack(W, fmt)
    X = rng.standard_normal((m, 256)).astype(np.float32)
    for v in runnable_variants(fmt):
        plain = kernels.linear_variant(X, p, v)
        flushing = _native.mxcsr() | FLUSHING
        got, after = flushed(lambda: kernels.linear_variant(X, p, v))
        assert (after & ~0x3F) == (flushing & ~0x3F), v  # the control bits; flags may be raised
        assert np.array_equal(got, plain), v


def mixed_codes(rng, n, k, subnormal_share):
    """E4M3 bytes of both signs, no NaN: a share of them subnormal (magnitude 1-7), in every byte
    position of the packed rows."""
    codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01
    small = rng.random((n, k)) < subnormal_share
    codes[small] = (codes[small] & 0x80) | rng.integers(1, 8, int(small.sum())).astype(np.uint8)
    return codes


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("n,k", [(50, 200), (64, 256), (16, 32), (131, 389)])
@pytest.mark.parametrize("share", [0.0, 0.002, 0.3])
def test_one_row_calls_with_subnormal_codes_anywhere(fmt, n, k, share):
    """One-row calls: the AVX-512 float decode takes a row pair holding subnormal codes apart
    (as normal floats, in sums of their own); those sums must land where float64 puts them,
    with panels and K groups that do not fill their blocks."""
    rng = np.random.default_rng(n * k)
    codes = mixed_codes(rng, n, k, share)
    scale = (rng.random(n) + 0.5).astype(np.float32) * 1e-2 if fmt == "FP8_PERCHANNEL" else \
        (rng.random((-(-n // 128), -(-k // 128))) + 0.5).astype(np.float32) * 1e-2
    p = kernels.pack_quantized(codes, scale, fmt)
    x = rng.standard_normal((1, k)).astype(np.float32)
    ref = bf16_round(x).astype(np.float64) @ p.dequantize().astype(np.float64).T
    for v in runnable_variants(fmt):
        assert rel_err_rows(kernels.linear_variant(x, p, v), ref) <= 1e-5, v


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("n,k", [(50, 200), (131, 389)])
def test_few_row_calls_on_the_float_path_equal_one_row_calls(fmt, n, k, one_thread):
    """AVX-512 calls of up to f32_rows rows (an Intel choice: 4, AMD: 1) take the float path,
    each row with its own factor (2^k from its largest value) and sums: row i of a 2-4-row call
    equals the one-row call on it bit for bit and float64 within 1e-5, with subnormal codes
    anywhere, rows of very different sizes, and a row of 2^15 or more sending the whole call
    to the bf16 tiles.  Both vendors' choices are reached here on any AVX-512 CPU."""
    rng = np.random.default_rng(n + k)
    codes = mixed_codes(rng, n, k, 0.01)
    scale = (rng.random(n) + 0.5).astype(np.float32) * 1e-2 if fmt == "FP8_PERCHANNEL" else \
        (rng.random((-(-n // 128), -(-k // 128))) + 0.5).astype(np.float32) * 1e-2
    p = kernels.pack_quantized(codes, scale, fmt)
    variants = [v for v in runnable_variants(fmt) if v.startswith("fp8_avx512")]
    if not variants:
        pytest.skip("this CPU cannot run the AVX-512 kernels")
    sizes = [1.0, 2.0 ** -100, 4e4, 2.0 ** 10, 0.5]  # vdpbf16ps (the bf16 tiles) reads bf16 subnormals as 0
    X = rng.standard_normal((5, k)).astype(np.float32) * np.array(sizes, np.float32)[:, None]
    for m in (2, 3, 4):
        for rows in ([0, 1, 2, 3][:m], [3, 1, 0, 4][:m]):
            x = X[rows]
            ref = bf16_round(x).astype(np.float64) @ p.dequantize().astype(np.float64).T
            for v in variants:
                floats = kernels.linear_variant(x, p, v, f32_rows=4)
                assert rel_err_rows(floats, ref) <= 1e-5, (v, m)
                assert rel_err_rows(kernels.linear_variant(x, p, v, f32_rows=1), ref) <= 1e-5, (v, m)
                if 2 in rows:  # 4e4 >= 2^15: the call keeps the bf16 tiles
                    assert floats.tobytes() == kernels.linear_variant(x, p, v, f32_rows=0).tobytes(), (v, m)
                    continue
                # the float path ran: the bf16 tiles' sums round elsewhere
                assert floats.tobytes() != kernels.linear_variant(x, p, v, f32_rows=0).tobytes(), (v, m)
                for i in range(m):
                    one = kernels.linear_variant(x[i:i + 1], p, v, f32_rows=4)
                    assert floats[i].tobytes() == one[0].tobytes(), (v, m, i)


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("size", [2.0 ** -130, 2.0 ** -126, 2.0 ** -120, 1e-3, 1.0, 2.0 ** 10, 1.5e4, 2.0 ** 15, 1e30])
def test_one_row_calls_anywhere_in_the_bf16_range(fmt, size):
    """The float decodes (AVX2, and AVX-512 for one row) widen the row times 2^k from its largest
    value: rows down to bf16 subnormals come out as float64 computes them; rows from 2^15 on take
    the bf16 (AVX-512) or wide (AVX2) decode.  The bf16 dot products of AMX read bf16 subnormals
    as zeros, so AMX is held to this for normal rows only."""
    X, p, ref = extreme_case(fmt, 1, [size])
    for v in runnable_variants(fmt):
        if "amx" in v and size < 2.0 ** -100:
            continue
        assert rel_err_rows(kernels.linear_variant(X, p, v), ref) <= 1e-5, (v, size)


@pytest.mark.parametrize("small,scale,flushing", [(-126, 0.613, False), (-126, 0.7071, False), (-126, 0.8191, False),
                                                   (-126, 0.9337, False), (-110, 0.613 * 2.0 ** -10, True)])
def test_tiny_outputs_of_wide_rows_keep_their_bits(small, scale, flushing, one_thread):
    """A row of 2^14 (row factor 2^9 in the float decodes) whose only product meeting a non-zero
    weight is tiny: the block scale must take the sums after the row factor, or a normal output
    near 2^-117 passes through float subnormals (9 bits lost), and to zero under a caller's FTZ
    where the products themselves are normal (the last case)."""
    codes = np.full((16, 128), 0x38, np.uint8)  # 1.0
    codes[:, 0] = 0
    X = np.zeros((1, 128), np.float32)
    X[0, 0] = 2.0 ** 14
    X[0, 1] = np.float32(1.875 * 2.0 ** small)
    p = kernels.pack_quantized(codes, np.array([[scale]], np.float32), "FP8_BLOCK")
    want = float(X[0, 1]) * float(np.float32(scale))
    for v in runnable_variants("FP8_BLOCK"):
        if "amx" in v:
            continue
        got = float(kernels.linear_variant(X, p, v)[0, 0])
        assert abs(got - want) <= 1e-6 * want, (v, got, want)
        if flushing:
            got = float(flushed(lambda: kernels.linear_variant(X, p, v))[0][0, 0])
            assert abs(got - want) <= 1e-6 * want, (v, "DAZ+FTZ", got, want)


def test_a_scale_near_the_float_maximum_does_not_overflow_one_row_calls():
    """Per-channel scale 2e36 and a row of 2^13 (row factor 2^8 in the float decodes): the output
    2.56e38 is finite on every path (AVX2 multiplies such a scale by the sums before the row
    factor: kt_times_scale_row)."""
    codes = np.zeros((16, 32), np.uint8)
    codes[:, 1] = 0x08  # 2^-6
    X = np.zeros((1, 32), np.float32)
    X[0, 1] = 2.0 ** 13
    p = kernels.pack_quantized(codes, np.full(16, 2e36, np.float32), "FP8_PERCHANNEL")
    want = 2.0 ** 7 * float(np.float32(2e36))
    for v in runnable_variants("FP8_PERCHANNEL"):
        got = float(kernels.linear_variant(X, p, v)[0, 0])
        assert abs(got - want) <= 1e-6 * want, (v, got)


def test_block_sums_whose_k_halves_cancel_are_scaled_whole_on_every_path():
    """A 128 x 128 block whose products split into two large parts that cancel: the float path
    of few-row calls sums K elements in two halves, and scaling each half by a block scale of
    1e35 overflowed (NaN) where the block's sum times the scale is 3.2e36."""
    n, k = 16, 256
    codes = np.zeros((n, k), np.uint8)
    plus, minus = [128 + 4 * i for i in range(8)], [130 + 4 * i for i in range(8)]  # one per half
    codes[:, plus], codes[:, minus] = 0x7E, 0xFE  # +448, -448
    codes[:, minus[-1]] = 0xFD  # -416: the block's sum is 32
    p = kernels.pack_quantized(codes, np.array([[1.0, 1e35]], np.float32), "FP8_BLOCK")
    X = np.zeros((2, k), np.float32)
    X[:, plus + minus] = 1.0
    want = float(np.float32(1e35)) * 32
    for v in runnable_variants("FP8_BLOCK"):
        for rows in (1, 2):
            for f32_rows in (0, 1, 4):
                got = kernels.linear_variant(X[:rows], p, v, f32_rows=f32_rows)[:, 0]
                assert np.all(np.abs(got - want) <= 1e-6 * want), (v, rows, f32_rows, got)


@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e-9, 3e-7])
@pytest.mark.parametrize("m", [2, 5, 40])
def test_tiny_scales_beside_a_wide_row_keep_every_row(fmt, scale, m, one_thread):
    """A call holding a row of 2^15 or more takes AVX2's wide decode, whose row factors reach
    2^-112: multiplied into a scale of 1e-30 first they made zero, and every row of the call came
    out 0 (a scale of 1e-9 with rows near 1e-7: 3e-3 off).  Every output here is a normal float,
    and every path must give it within 1e-5."""
    rng = np.random.default_rng(m)
    codes = rng.integers(0, 0x78, (40, 96), dtype=np.uint8)
    codes[:, ::2] |= 0x80  # both signs
    scales = np.full(40, scale, np.float32) if fmt == "FP8_PERCHANNEL" else np.full((1, 1), scale, np.float32)
    p = kernels.pack_quantized(codes, scales, fmt)
    X = rng.standard_normal((m, 96)).astype(np.float32) * np.float32(1e-7)
    X[0] *= np.float32(1e7)        # a row near 1
    X[m - 1, 3] = 40000.0          # the wide row (>= 2^15)
    ref = bf16_round(X).astype(np.float64) @ p.dequantize().astype(np.float64).T
    assert np.all(np.abs(ref) > 2.0 ** -126)
    for v in runnable_variants(fmt):
        assert rel_err_rows(kernels.linear_variant(X, p, v), ref) <= 1e-5, v
