"""AVX2 MXFP4 puts each activation row on a 16-bit fixed-point grid per 32-value block: step
2^(E - 141) for the block's largest bf16 exponent field E, so values within 2^7 of the block's
largest are exact and smaller ones round to the nearest step (ties to even).  Decode and
prefill tiles multiply those integers by the codes exactly (vpmaddwd), so both give the same
bits.  A row holding inf or NaN sends the call down the float route.
The reference below builds the grid in numpy from the format's description."""
import ml_dtypes
import numpy as np
import pytest

from ktcy import kernels
from conftest import runnable_variants


def _avx2_mxfp4():
    names = [v for v in runnable_variants("MXFP4") if "avx2" in v]
    if not names:
        pytest.skip("no runnable AVX2 variant of MXFP4 on this CPU")
    return names[0]


def _on_grid(X):
    """X rounded to bf16, then to its blocks' fixed-point steps (float64)."""
    xb = X.astype(ml_dtypes.bfloat16)
    fields = (xb.view(np.uint16).astype(np.int64) >> 7) & 0xFF
    m, k = X.shape
    pad = -k % 32
    fields = np.pad(fields, ((0, 0), (0, pad))).reshape(m, -1, 32).max(axis=2)
    step = np.repeat(np.exp2(fields.astype(np.float64) - 141), 32, axis=1)[:, :k]
    return np.round(xb.astype(np.float64) / step) * step  # np.round: ties to even


def _relative(got, ref):
    return np.abs(got - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_rows_on_the_block_grid_match_float64_and_decode_equals_prefill(rows):
    variant = _avx2_mxfp4()
    rng = np.random.default_rng(11)
    n, k = 37, 160  # a partial panel; 5 blocks
    W = rng.standard_normal((n, k)).astype(np.float32)
    packed = kernels.pack(W, "MXFP4")
    Wd = packed.dequantize().astype(np.float64)
    # every block spans 2^0 .. 2^-14: many values below 2^-7 of the block's largest get rounded
    X = (rng.standard_normal((rows, k)) * np.exp2(-rng.integers(0, 15, (rows, k)))).astype(np.float32)
    got = kernels.linear_variant(X, packed, variant)
    ref = _on_grid(X) @ Wd.T
    assert _relative(got, ref) < 2e-6, f"{rows} rows: {_relative(got, ref):.2e} from the grid's float64 result"
    plain = X.astype(ml_dtypes.bfloat16).astype(np.float64) @ Wd.T
    assert _relative(got, plain) < 1e-4  # the grid's own rounding: 2^-15 of a block's largest at most
    alone = np.concatenate([kernels.linear_variant(X[i:i + 1], packed, variant) for i in range(rows)])
    assert np.array_equal(got, alone), "rows of a call differ from the rows computed alone"


def test_extreme_block_exponents_stay_exact_on_the_grid():
    """Blocks at 2^110 (the scale's two-factor and no-magic cases), at 2^-120 and of bf16
    subnormals: decode and prefill rows agree and match the grid."""
    variant = _avx2_mxfp4()
    rng = np.random.default_rng(12)
    n, k = 16, 96
    W = (rng.standard_normal((n, k)) * 2.0 ** -40).astype(np.float32)
    packed = kernels.pack(W, "MXFP4")
    Wd = packed.dequantize().astype(np.float64)
    X = rng.standard_normal((4, k)).astype(np.float32)
    X[0, :32] *= np.float32(2.0 ** 110)
    X[1, 32:64] *= np.float32(2.0 ** -120)
    X[2, 64:] = np.float32(1e-39) * rng.integers(-100, 100, 32).astype(np.float32)  # bf16 subnormals
    X[3] *= np.float32(2.0 ** -60)
    got = kernels.linear_variant(X, packed, variant)
    ref = _on_grid(X) @ Wd.T
    for i in range(4):
        assert np.abs(got[i] - ref[i]).max() <= 2e-6 * np.abs(ref[i]).max() + 1e-44, f"row {i}"
    many = kernels.linear_variant(np.repeat(X, 2, axis=0), packed, variant)  # 8 rows: prefill
    assert np.array_equal(many[::2], got) and np.array_equal(many[1::2], got)


@pytest.mark.parametrize("rows", [3, 9])
def test_inf_and_nan_activations_take_the_float_route(rows):
    variant = _avx2_mxfp4()
    rng = np.random.default_rng(13)
    n, k = 24, 64
    W = rng.standard_normal((n, k)).astype(np.float32)
    W[:, 5] = 0.0  # a zero code under the NaN: NaN all the same
    packed = kernels.pack(W, "MXFP4")
    Wd = packed.dequantize().astype(np.float64)
    X = rng.standard_normal((rows, k)).astype(np.float32)
    X[0, 5] = np.nan
    X[1, 9] = np.inf
    got = kernels.linear_variant(X, packed, variant)
    with np.errstate(invalid="ignore"):
        ref = X.astype(ml_dtypes.bfloat16).astype(np.float64) @ Wd.T
    assert np.isnan(got[0]).all()
    assert np.array_equal(np.isnan(got[1]), np.isnan(ref[1])) and np.array_equal(got[1][np.isinf(ref[1])], ref[1][np.isinf(ref[1])])
    finite = slice(2, rows)
    assert _relative(got[finite], ref[finite]) < 1e-5  # the float route: bf16 inputs, float sums
