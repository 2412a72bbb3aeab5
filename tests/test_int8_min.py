"""INT8 with a scale and a min per (K group, channel) (w = s * u + min, u in 0..255: llama.cpp's
Q5_K and Q5_1 as group 32): layout round trip, the same bits on every ISA as a float32 reference
built from the integers (with INT8_GROUP's: tests/test_int8_group.py), the quantizer, bad input.
GGUF: tests/test_gguf.py."""
import numpy as np
import pytest

from conftest import int4_exact_reference, per_channel_group_pairs, runnable_variants
from ktcy import kernels

GROUPS = [16, 32, 64, 128]


def _released(rng, n, k, group, top=255):
    codes = rng.integers(0, top + 1, (n, k)).astype(np.uint8)
    groups = -(-k // group)
    scale = rng.uniform(0.001, 0.01, (n, groups)).astype(np.float32)
    mins = rng.uniform(-0.5, 0.1, (n, groups)).astype(np.float32)
    return codes, scale, mins


@pytest.mark.parametrize("group", GROUPS)
def test_codes_scales_and_mins_round_trip_exactly(group):
    rng = np.random.default_rng(group)
    n, k = 37, 300
    codes, scale, mins = _released(rng, n, k, group)
    p = kernels.pack_quantized(codes, scale, "INT8_MIN", group_size=group, mins=mins)
    assert p.codes().dtype == np.uint8 and np.array_equal(p.codes(), codes)
    assert p.colsum is None and p.zero is None and p.group_size == group
    rep = lambda a: np.repeat(a.astype(np.float64), group, axis=1)[:, :k]  # noqa: E731
    assert np.array_equal(p.dequantize(), codes * rep(scale) + rep(mins))
    groups = p.k_pad // group
    assert p.scale.shape == (3, groups, 32)
    got_s, got_m = per_channel_group_pairs(p.scale, n)
    assert np.array_equal(got_s[:, :-(-k // group)], scale) and np.array_equal(got_m[:, :-(-k // group)], mins)
    assert np.array_equal(p.group_mins()[:, :n][:-(-k // group)], mins.T)
    assert p.padding_is_clear()


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_codes_and_activations_stay_exact(group, sign):
    """Codes 0 and 255 (stored -128 and 127) against activations that quantize to +-127: the
    largest sums a group reaches, where AVX-512 VNNI multiplies u (0 to 255) and the others
    the stored byte plus 128 x the activation sum."""
    n, k = 48, 256
    codes = np.full((n, k), 255, np.uint8)
    codes[::3] = 0
    codes[1::5, ::2] = 128
    ones = np.ones((n, k // group), np.float32)
    p = kernels.pack_quantized(codes, ones, "INT8_MIN", group_size=group, mins=-128 * ones)
    for m in (1, 2, 3, 4, 8, 37):
        X = np.full((m, k), 3.0 * sign, np.float32)
        X[1::2] *= -1
        ref = int4_exact_reference(X, p)
        assert np.abs(ref).max() > 0
        for v in runnable_variants("INT8_MIN"):
            assert np.array_equal(kernels.linear_variant(X, p, v), ref), (v, m)


def test_quantizer_keeps_each_group_ends_and_beats_int8_group_on_offset_weights():
    rng = np.random.default_rng(6)
    W = (rng.standard_normal((32, 256)) * 0.01 + 0.05).astype(np.float32)  # one-signed groups
    p = kernels.pack(W, "INT8_MIN", group_size=32)
    Wg = W.reshape(32, 8, 32).astype(np.float64)
    lo, hi = Wg.min(axis=2), Wg.max(axis=2)
    D = p.dequantize()
    step = (hi - lo) / 255
    err = np.abs(D - W).reshape(32, 8, 32).max(axis=2)
    assert (err <= step * 0.5 * (1 + 1e-4) + 1e-9).all()  # every weight within half a step
    assert np.array_equal(p.group_mins()[:, :32].T, lo.astype(np.float32))
    symmetric = kernels.pack(W, "INT8_GROUP", group_size=32).dequantize()
    assert np.linalg.norm(D - W) < 0.5 * np.linalg.norm(symmetric - W)


def test_constant_groups_and_a_short_last_group():
    W = np.zeros((16, 100), np.float32)
    W[2, 40:50] = np.linspace(-1, 1, 10)
    W[5, 96:] = 3.0  # the last group of 16 holds four values, the padding the rest
    W[7] = -2.5      # constant groups: s = 0, exactly the min
    p = kernels.pack(W, "INT8_MIN", group_size=16)
    assert p.k_pad == 128 and np.array_equal(p.dequantize()[5, 96:], np.full(4, 3.0))
    assert np.array_equal(p.dequantize()[7], np.full(100, -2.5)) and p.padding_is_clear()
    X = np.random.default_rng(1).standard_normal((5, 100)).astype(np.float32)
    for v in runnable_variants("INT8_MIN"):
        assert np.array_equal(kernels.linear_variant(X, p, v), int4_exact_reference(X, p)), v


@pytest.mark.parametrize("bad,match", [("dtype", "integers 0..255"), ("range", r"\[0, 255\]"),
                                       ("missing", "needs its group scales"), ("group", "group_size must be one of"),
                                       ("nan", "must be finite"), ("no_mins", "needs its mins"),
                                       ("zero_points", "has no zero points")])
def test_bad_input_is_refused(bad, match):
    codes, scale, mins = _released(np.random.default_rng(2), 16, 64, 32)
    kw = {"group_size": 32, "mins": mins}
    if bad == "dtype":
        codes = codes.astype(np.float32)
    if bad == "range":
        codes = codes.astype(np.int16) - 1
    if bad == "missing":
        scale = None
    if bad == "group":
        kw["group_size"] = 8
    if bad == "nan":
        mins[1, 1] = np.nan
    if bad == "no_mins":
        kw["mins"] = None
    if bad == "zero_points":
        kw["zero_points"] = np.zeros((16, 2), np.uint8)
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.pack_quantized(codes, scale, "INT8_MIN", **kw)
