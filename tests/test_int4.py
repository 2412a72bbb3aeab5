"""INT4 group-wise weights: layout round trip, bit-identical GEMM on every ISA, accuracy."""
import numpy as np
import pytest

from conftest import int4_exact_reference, runnable_variants
from ktcy import kernels


@pytest.mark.parametrize("group", [32, 64, 128])
def test_codes_round_trip_exactly(group):
    rng = np.random.default_rng(group)
    n, k = 37, 300
    codes = rng.integers(-8, 8, (n, k), dtype=np.int8)
    scale = rng.uniform(0.1, 1, (n, -(-k // group))).astype(np.float32)
    p = kernels.pack_quantized(codes, scale, "INT4", group_size=group)
    assert np.array_equal(p.codes(), codes)
    d = p.dequantize()
    assert np.array_equal(d, codes * np.repeat(scale.astype(np.float64), group, axis=1)[:, :k])


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 48, 100), (17, 80, 192), (40, 130, 300), (64, 64, 1024),
                                   (512, 32, 256), (2, 1000, 520), (6, 40, 160), (12, 96, 448), (13, 48, 192)])
def test_gemm_bit_identical_on_every_isa(group, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k + group)
    W = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    p = kernels.pack(W, "INT4", group_size=group)
    ref = int4_exact_reference(X, p)
    variants = runnable_variants("INT4")
    assert {"int4_ref", "amx_emu_int4"} <= set(variants)
    for v in variants:
        assert np.array_equal(kernels.linear_variant(X, p, v), ref), v


def symmetric_amax_error(W, X, group):
    """The plain alternative: scale = amax/7, codes in [-7, 7]."""
    n, k = W.shape
    Wg = W.reshape(n, k // group, group).astype(np.float64)
    s = np.abs(Wg).max(axis=2, keepdims=True) / 7
    Wq = (np.clip(np.rint(Wg / np.where(s > 0, s, 1)), -7, 7) * s).reshape(n, k)
    ref = X.astype(np.float64) @ W.astype(np.float64).T
    return np.linalg.norm(X.astype(np.float64) @ Wq.T - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("group,bound", [(64, 0.095), (32, 0.085)])
def test_accuracy_on_gaussian_weights(group, bound):
    rng = np.random.default_rng(42)
    W = (rng.standard_normal((512, 2048)) * 0.02).astype(np.float32)
    X = rng.standard_normal((64, 2048)).astype(np.float32)
    p = kernels.pack(W, "INT4", group_size=group)
    ref = X.astype(np.float64) @ W.astype(np.float64).T
    err = np.linalg.norm(kernels.linear(X, p) - ref) / np.linalg.norm(ref)
    plain = symmetric_amax_error(W, X, group)
    print(f"\nINT4 group {group}: relative L2 error {err:.4f} (searched [-8,7] scales, int8 activations); "
          f"plain amax/7 [-7,7] weights alone: {plain:.4f}")
    assert err < bound
    assert err < plain


def test_aliases_and_defaults():
    W = np.ones((16, 128), np.float32)
    for name in ("INT4", "AMXINT4", "int4"):
        p = kernels.pack(W, name)
        assert p.format == "INT4" and p.group_size == 64
    assert kernels.pack(W, "INT4").nbytes < kernels.pack(W, "INT8").nbytes


def test_codes_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        kernels.pack_quantized(np.full((16, 64), 9, np.int8), np.ones((16, 1), np.float32), "INT4")
