"""INT8 with a scale per (K group, channel) (w = s * q; llama.cpp's Q8_0 and Q5_0 as group 32,
Q6_K as group 16, GPTQ's symmetric 8-bit as group 128): layout round trip, the same bits on
every ISA as a float32 reference built from the integers, the quantizer, bad input.  The MoE
engine and packed files: tests/test_int4_zp.py's shared test."""
import numpy as np
import pytest

from conftest import int4_exact_reference, per_channel_groups, runnable_variants
from ktcy import kernels

GROUPS = [16, 32, 64, 128]


def _released(rng, n, k, group, lo=-128, hi=127):
    codes = rng.integers(lo, hi + 1, (n, k)).astype(np.int8)
    scale = rng.uniform(0.001, 0.01, (n, -(-k // group))).astype(np.float32)
    return codes, scale


@pytest.mark.parametrize("group", GROUPS)
def test_codes_and_scales_round_trip_exactly(group):
    rng = np.random.default_rng(group)
    n, k = 37, 300
    codes, scale = _released(rng, n, k, group)
    p = kernels.pack_quantized(codes, scale, "INT8_GROUP", group_size=group)
    assert p.codes().dtype == np.int8 and np.array_equal(p.codes(), codes)
    assert p.colsum is None and p.zero is None and p.group_size == group
    assert np.array_equal(p.dequantize(), codes * np.repeat(scale.astype(np.float64), group, axis=1)[:, :k])
    groups = p.k_pad // group
    assert p.scale.shape == (3, groups, 16)
    assert np.array_equal(per_channel_groups(p.scale, n)[:, :-(-k // group)], scale)
    assert np.array_equal(p.group_scales()[:, :n][:-(-k // group)], scale.T)
    assert p.padding_is_clear()


@pytest.mark.parametrize("fmt", ["INT8_GROUP", "INT8_MIN"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 48, 100), (17, 80, 192), (40, 130, 300), (512, 32, 256),
                                   (2, 1000, 520), (6, 40, 160), (12, 96, 448), (13, 48, 16)])
def test_gemm_bit_identical_on_every_isa(fmt, group, m, n, k):
    """INT8_GROUP and INT8_MIN (tests/test_int8_min.py: its layout and quantizer)."""
    rng = np.random.default_rng(m * 1000 + n + k + group)
    W = (rng.standard_normal((n, k)) * 0.02 + rng.uniform(-0.01, 0.01, (n, 1))).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    p = kernels.pack(W, fmt, group_size=group)
    ref = int4_exact_reference(X, p)
    variants = runnable_variants(fmt)
    row = fmt.lower()
    assert {f"{row}_ref", f"amx_emu_{row}"} <= set(variants)
    for v in variants:
        assert np.array_equal(kernels.linear_variant(X, p, v), ref), v
    exact = X.astype(np.float64) @ p.dequantize().T
    assert np.linalg.norm(ref - exact) / np.linalg.norm(exact) < 0.01  # the int8 activations' error


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_codes_and_activations_stay_exact(group, sign):
    """Codes -128 and 127 against activations that quantize to +-127: the largest sums a group
    reaches, where AVX-512 VNNI multiplies code + 128 (0 to 255) and takes 128 x the activation
    sum off, and AVX2's and AVX-512 BW's vpmaddubsw pairs of |w| come nearest to int16's limit
    (2 x 128 x 127)."""
    n, k = 48, 256
    codes = np.full((n, k), 127, np.int8)
    codes[::3] = -128
    codes[1::5, ::2] = 0
    p = kernels.pack_quantized(codes, np.ones((n, k // group), np.float32), "INT8_GROUP", group_size=group)
    for m in (1, 2, 3, 4, 8, 37):
        X = np.full((m, k), 3.0 * sign, np.float32)
        X[1::2] *= -1
        ref = int4_exact_reference(X, p)
        assert np.abs(ref).max() > 0
        for v in runnable_variants("INT8_GROUP"):
            assert np.array_equal(kernels.linear_variant(X, p, v), ref), (v, m)


def test_quantizer_keeps_each_group_largest_value_and_beats_per_channel_int8():
    rng = np.random.default_rng(6)
    W = rng.standard_normal((32, 256)).astype(np.float32) * np.exp(rng.uniform(-4, 4, (32, 8))).repeat(32, 1)
    p = kernels.pack(W, "INT8_GROUP", group_size=32)
    Wg = W.reshape(32, 8, 32).astype(np.float64)
    amax = np.abs(Wg).max(axis=2)
    D = p.dequantize()
    err = np.abs(D - W).reshape(32, 8, 32).max(axis=2)
    assert (err <= amax / 127 * 0.5 * (1 + 1e-6)).all()  # every weight within half a step
    assert np.array_equal(p.group_scales()[:, :32].T, (amax.astype(np.float32) / np.float32(127)))
    per_channel = kernels.pack(W, "INT8").dequantize()
    assert np.linalg.norm(D - W) < 0.5 * np.linalg.norm(per_channel - W)


def test_zero_groups_and_a_short_last_group():
    W = np.zeros((16, 100), np.float32)
    W[2, 40:50] = np.linspace(-1, 1, 10)
    W[5, 96:] = 3.0  # the last group of 16 holds four values, the padding the rest
    p = kernels.pack(W, "INT8_GROUP", group_size=16)
    assert p.k_pad == 128 and np.allclose(p.dequantize()[5, 96:], 3.0, rtol=1e-6, atol=0)
    assert not p.group_scales()[:, 0].any() and p.padding_is_clear()
    X = np.random.default_rng(1).standard_normal((5, 100)).astype(np.float32)
    for v in runnable_variants("INT8_GROUP"):
        assert np.array_equal(kernels.linear_variant(X, p, v), int4_exact_reference(X, p)), v


@pytest.mark.parametrize("bad,match", [("dtype", "int8"),
                                       ("missing", "needs its group scales"), ("group", "group_size must be one of"),
                                       ("nan", "must be finite"), ("zero_points", "has no zero points"),
                                       ("mins", "has no mins")])
def test_bad_input_is_refused(bad, match):
    codes, scale = _released(np.random.default_rng(2), 16, 64, 32)
    kw = {"group_size": 32}
    if bad == "dtype":
        codes = codes.astype(np.int16)
    if bad == "missing":
        scale = None
    if bad == "group":
        kw["group_size"] = 8
    if bad == "nan":
        scale[1, 1] = np.nan
    if bad == "zero_points":
        kw["zero_points"] = np.zeros((16, 2), np.uint8)
    if bad == "mins":
        kw["mins"] = np.zeros((16, 2), np.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.pack_quantized(codes, scale, "INT8_GROUP", **kw)


def test_code_minus_128_is_a_code_as_released():
    """GPTQ's symmetric 8-bit codes (q - 128 with q in 0..255) reach -128; every kernel takes it
    (per-channel INT8 too: tests/test_review_core.py)."""
    codes, scale = _released(np.random.default_rng(3), 16, 64, 32)
    codes[:, ::3] = -128
    p = kernels.pack_quantized(codes, scale, "INT8_GROUP", group_size=32)
    assert p.codes().min() == -128
    X = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    for v in runnable_variants("INT8_GROUP"):
        assert np.array_equal(kernels.linear_variant(X, p, v), int4_exact_reference(X, p)), v


def test_long_rows_are_not_limited_to_int8_per_channel_k():
    """Per-channel INT8 refuses K past INT8_MAX_K (its one int32 sum per row could overflow); a
    group's sum cannot, so INT8_GROUP takes any K."""
    k = kernels.INT8_MAX_K + 64
    rng = np.random.default_rng(4)
    codes, scale = _released(rng, 16, k, 128)
    p = kernels.pack_quantized(codes, scale, "INT8_GROUP", group_size=128)
    X = rng.standard_normal((2, k)).astype(np.float32)
    assert np.array_equal(kernels.linear(X, p), int4_exact_reference(X, p))
