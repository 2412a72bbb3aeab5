"""Quantization and packed layouts (issue: AVX-512 kernels, packing)."""
import ml_dtypes
import numpy as np
import pytest

from conftest import runnable_variants
from ktcy import _native, kernels


def test_int8_codes_and_scales_follow_the_rule():
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((70, 130)) * 0.05).astype(np.float32)
    p = kernels.pack(W, "INT8")
    s = (np.abs(W).max(axis=1) / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint(W / s[:, None]), -127, 127).astype(np.int8)
    assert np.array_equal(p.scale[:70], s)
    assert np.array_equal(p.codes(), q)
    assert np.array_equal(p.colsum[:70], q.astype(np.int32).sum(axis=1))
    err = np.abs(p.dequantize() - W.astype(np.float64))
    assert np.all(err <= s[:, None].astype(np.float64) / 2 * (1 + 1e-6))


def test_int8_round_half_to_even():
    # amax 127 gives scale 1: x.5 values must round to even
    W = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 56] * 16, np.float32)
    codes = kernels.pack(W, "INT8").codes()[0, :8]
    assert codes.tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_bf16_rounds_to_nearest_even_and_keeps_specials():
    rng = np.random.default_rng(1)
    W = rng.standard_normal((16, 64)).astype(np.float32)
    p = kernels.pack(W, "BF16")
    assert np.array_equal(p.codes(), W.astype(ml_dtypes.bfloat16).view(np.uint16))
    # the rounding itself keeps specials; packing refuses them (test_non_finite_weights_are_refused)
    W[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    got = _native.to_bf16_bits(W)
    expect = W.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(got[:, 1:], expect[:, 1:])
    assert np.isnan(got[0, :1].view(ml_dtypes.bfloat16).astype(np.float32)).all()


@pytest.mark.parametrize("fmt", ["BF16", "INT8", "INT4", "FP8_PERCHANNEL", "FP8_BLOCK"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused(fmt, bad):
    W = np.ones((20, 64), np.float32)
    W[13, 5] = bad
    with pytest.raises(ValueError, match="row 13"):
        kernels.pack(W, fmt)


def test_finite_weights_beyond_bf16s_range_are_refused_as_such():
    W = np.ones((3, 8), np.float32)
    W[2, 5] = -3.4e38  # finite in float32, infinite once rounded to bf16
    with pytest.raises(ValueError, match=r"weight row 2 holds -3.4e\+38, which rounds to infinity in bf16"):
        kernels.pack(W, "BF16")
    W[2, 5] = -3.3895e38  # bf16's largest magnitude: kept
    assert kernels.pack(W, "BF16").dequantize()[2, 5] == -3.3895313892515355e38


@pytest.mark.parametrize("fmt", ["INT8", "INT4", "BF16", "FP8_PERCHANNEL", "FP8_BLOCK"])
def test_zero_row_gives_zero_output(fmt):
    rng = np.random.default_rng(2)
    W = rng.standard_normal((32, 128)).astype(np.float32)
    W[3] = 0.0
    p = kernels.pack(W, fmt)
    X = rng.standard_normal((4, 128)).astype(np.float32)
    for v in runnable_variants(fmt):
        y = kernels.linear_variant(X, p, v)
        assert np.all(np.isfinite(y)), v
        assert np.all(y[:, 3] == 0.0), v


@pytest.mark.parametrize("fmt", ["INT8", "INT4", "BF16", "FP8_PERCHANNEL", "FP8_BLOCK"])
def test_non_contiguous_and_fortran_inputs(fmt):
    rng = np.random.default_rng(3)
    base = rng.standard_normal((64, 300)).astype(np.float32)
    W = base[:, ::2]                       # strided view
    F = np.asfortranarray(W)
    ref = kernels.pack(np.ascontiguousarray(W), fmt)
    for variant in (W, F, W.astype(np.float64)):
        p = kernels.pack(variant, fmt)
        assert np.array_equal(p.data, ref.data) and np.array_equal(p.scale, ref.scale)
    X = rng.standard_normal((3, 300)).astype(np.float32)[:, ::2]
    assert np.array_equal(kernels.linear(X, ref), kernels.linear(np.ascontiguousarray(X), ref))


def test_zero_activation_row_and_nan_row():
    p = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    X = np.zeros((3, 64), np.float32)
    X[1, 0] = np.nan
    X[2] = 1.0
    y = kernels.linear(X, p)
    assert np.all(y[0] == 0) and np.all(np.isnan(y[1])) and np.allclose(y[2], 64.0)


def test_pack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown weight format"):
        kernels.pack(np.ones((16, 64), np.float32), "INT3")
    with pytest.raises(ValueError, match="2-D"):
        kernels.pack(np.ones(64, np.float32), "INT8")
    with pytest.raises(TypeError, match="float"):
        kernels.pack(np.ones((16, 64), np.int16), "INT8")
    with pytest.raises(ValueError, match="group_size"):
        kernels.pack(np.ones((16, 64), np.float32), "INT4", group_size=48)
    with pytest.raises(ValueError, match="per-channel scale"):
        kernels.pack_quantized(np.ones((16, 64), np.int8), np.ones(15, np.float32), "INT8")
    with pytest.raises(TypeError, match="int8"):
        kernels.pack_quantized(np.ones((16, 64), np.float32), np.ones(16, np.float32), "INT8")


def test_layout_is_the_documented_block_order():
    # INT8 block: byte r*64 + n*4 + j holds W[n][4r + j]
    codes = (np.arange(16 * 64) % 251 - 125).astype(np.int8).reshape(16, 64)
    p = kernels.pack_quantized(codes, np.ones(16, np.float32), "INT8")
    for n, k in [(0, 0), (3, 5), (15, 63), (7, 32)]:
        assert p.data.view(np.int8)[(k // 4) * 64 + n * 4 + k % 4] == codes[n, k]
    # BF16 block: half r*32 + n*2 + j holds W[n][2r + j]
    bits = np.arange(16 * 32, dtype=np.uint16).reshape(16, 32)
    pb = kernels.pack_quantized(bits, None, "BF16")
    for n, k in [(0, 0), (5, 3), (15, 31)]:
        assert pb.data.view(np.uint16)[(k // 2) * 32 + n * 2 + k % 2] == bits[n, k]


def test_int8_k_beyond_int32_range_is_refused():
    with pytest.raises(ValueError, match="overflow"):
        kernels.pack_quantized(np.ones((16, kernels.INT8_MAX_K + 64), np.int8), np.ones(16, np.float32), "INT8")
