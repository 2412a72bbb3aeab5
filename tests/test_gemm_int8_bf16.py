"""INT8 and BF16 GEMM on every ISA over one packed layout (issues: AVX-512 kernels, AMX kernels)."""
import ml_dtypes
import numpy as np
import pytest

from conftest import (bf16_round, int8_exact_reference, isa_params, quantize_rows_int8, rel_err_rows,
                      runnable_variants)
import ktcy
from ktcy import _native
from ktcy import kernels

AMX_GRID = [(m, n, k) for m in (1, 3, 16, 17, 40) for n in (16, 48, 80) for k in (64, 100, 192)]
WIDE = [(1, 1024, 1024), (4, 1000, 1000), (64, 256, 1024), (512, 96, 160), (33, 1024, 72), (2, 17, 1)]


def weights(rng, n, k):
    return (rng.standard_normal((n, k)) * 0.02).astype(np.float32)


def int8_reference(x, packed):
    q_x, s_x = quantize_rows_int8(x)
    return int8_exact_reference(q_x, s_x, packed.codes(), packed.scale[: packed.shape[0]])


@pytest.mark.parametrize("m,n,k", AMX_GRID + WIDE)
def test_int8_all_variants_bit_identical_to_integer_reference(m, n, k):
    rng = np.random.default_rng(m * 100003 + n * 101 + k)
    W, X = weights(rng, n, k), rng.standard_normal((m, k)).astype(np.float32)
    packed = kernels.pack(W, "INT8")
    ref = int8_reference(X, packed)
    variants = runnable_variants("INT8")
    assert {"int8_ref", "amx_emu_int8"} <= set(variants)
    for v in variants:
        y = kernels.linear_variant(X, packed, v)
        assert np.array_equal(y, ref), f"{v} differs from the integer reference at {(m, n, k)}"


@pytest.mark.parametrize("m,n,k", AMX_GRID + WIDE)
def test_bf16_all_variants_match_float64(m, n, k):
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    W, X = weights(rng, n, k), rng.standard_normal((m, k)).astype(np.float32)
    packed = kernels.pack(W, "BF16")
    ref = bf16_round(X) @ packed.dequantize().T
    for v in runnable_variants("BF16"):
        y = kernels.linear_variant(X, packed, v)
        assert rel_err_rows(y, ref) <= 1e-5, v


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt", ["INT8", "BF16"])
def test_public_linear_per_isa(isa, fmt):
    rng = np.random.default_rng(5)
    W, X = weights(rng, 80, 192), rng.standard_normal((17, 192)).astype(np.float32)
    packed = kernels.pack(W, fmt)
    y = kernels.linear(X, packed, isa=isa)
    ref = int8_reference(X, packed) if fmt == "INT8" else bf16_round(X) @ packed.dequantize().T
    if fmt == "INT8":
        assert np.array_equal(y, ref)
    else:
        assert rel_err_rows(y, ref) <= 1e-5


def test_bf16_input_weights_and_activations():
    rng = np.random.default_rng(1)
    W = weights(rng, 48, 100).astype(ml_dtypes.bfloat16)
    X = rng.standard_normal((5, 100)).astype(ml_dtypes.bfloat16)
    packed = kernels.pack(W, "BF16")
    assert np.array_equal(packed.codes(), W.view(np.uint16))
    y = kernels.linear(X, packed)
    assert rel_err_rows(y, X.astype(np.float64) @ W.astype(np.float64).T) <= 1e-5


def test_threads_do_not_change_int8_results():
    rng = np.random.default_rng(2)
    W, X = weights(rng, 1000, 512), rng.standard_normal((9, 512)).astype(np.float32)
    packed = kernels.pack(W, "INT8")
    old, most = ktcy.get_num_threads(), _native.usable_cpus()
    if most < 2:
        pytest.skip("one usable CPU: no second thread count to compare")
    try:
        ktcy.set_num_threads(1)
        one = kernels.linear(X, packed)
        ktcy.set_num_threads(most)
        many = kernels.linear(X, packed)
    finally:
        ktcy.set_num_threads(old)
    assert np.array_equal(one, many)


@pytest.mark.parametrize("bad", [0, -2, 10**5, "4", 2.0, True])
def test_thread_count_is_bounded_by_usable_cpus(bad):
    before = ktcy.get_num_threads()
    with pytest.raises((ValueError, TypeError), match="thread count"):
        ktcy.set_num_threads(bad)
    assert ktcy.get_num_threads() == before


def test_empty_inputs():
    packed = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    assert kernels.linear(np.zeros((0, 64), np.float32), packed).shape == (0, 16)


def test_linear_rejects_bad_input():
    packed = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    with pytest.raises(ValueError, match="K = 64"):
        kernels.linear(np.ones((2, 63), np.float32), packed)
    with pytest.raises(ValueError, match="2-D"):
        kernels.linear(np.ones(64, np.float32), packed)
    with pytest.raises(TypeError, match="float32"):
        kernels.linear(np.ones((2, 64), np.int32), packed)
    with pytest.raises(TypeError, match="ktcy.kernels.pack"):
        kernels.linear(np.ones((2, 64), np.float32), "not packed")
    with pytest.raises(ValueError, match="out must be"):
        kernels.linear(np.ones((2, 64), np.float32), packed, out=np.empty((2, 15), np.float32))


def test_forced_isa_the_cpu_lacks():
    packed = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    missing = [i for i in ("amx", "avx512", "avx2") if i not in ktcy.available_isas()]
    if not missing:
        pytest.skip("every ISA runs here")
    with pytest.raises(ktcy.UnsupportedISAError):
        kernels.linear(np.ones((1, 64), np.float32), packed, isa=missing[0])
