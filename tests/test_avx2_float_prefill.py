"""The AVX2 prefill of the bf16-activation formats (BF16, FP8 per channel and 128x128 blocks,
MXFP4) is a float GEMM over panels decoded once to floats (a slice of K at a time), in 6/4/2-row
tiles and chunks of KTCY_AVX2_F32_ROWS rows.  Each output is one FMA chain in K order, exactly as
in the decode tiles, so every row of a many-row call must equal the same row computed alone (bit
for bit), and both must match float64 on the same dequantized weights and bf16-rounded
activations."""
import ml_dtypes
import numpy as np
import pytest

import ktcy
from ktcy import kernels
from conftest import I16_PATH_OFF, runnable_variants
from test_moe import dequantized, reference

FORMATS = ["BF16", "FP8_PERCHANNEL", "FP8_BLOCK", "MXFP4"]
# around the tile sizes (6, 4, 2), the float GEMM's thresholds (FP8 and MXFP4: 6 rows, but 7 and 8
# take decode tiles, and 5 runs as 4 + 1; BF16: 20 rows) and the 36-row chunks
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 19, 20, 21, 35, 36, 37, 42, 73]


def _avx2_variant(fmt):
    names = [v for v in runnable_variants(fmt) if "avx2" in v]
    if not names:
        pytest.skip(f"no runnable AVX2 variant of {fmt} on this CPU")
    return names[0]


# 40: a partial panel; 104: 7 panels, so one-row tiles of 4 panels (MXFP4), 2 and 1;
# 200: two 128-channel block rows of FP8 block scales; K 288: not a multiple of 128 (FP8
# block's last K group is short), a 256-value slice (KTCY_F32_SLICE) and a short one; 800:
# three whole slices, then 32 values
@pytest.mark.parametrize("n,k", [(40, 288), (104, 288), (200, 288), (40, 800)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_of_a_prefill_equal_rows_alone_and_float64(fmt, n, k):
    rng = np.random.default_rng(7)
    W = (rng.standard_normal((n, k)) * 0.3).astype(np.float32)
    if fmt == "FP8_BLOCK":
        W[:, 128:256] *= 40.0  # block scales that differ per K group
        W[128:] *= 0.05        # and per block row
    packed = kernels.pack(W, fmt)
    Wd = packed.dequantize().astype(np.float64)
    variant = _avx2_variant(fmt)
    X = (rng.standard_normal((max(ROWS), k)) * 2).astype(np.float32)
    # on the float paths: MXFP4's calls of a few rows may take its 16-bit integer path (avx2_i16_rows)
    alone = np.concatenate([kernels.linear_variant(X[i:i + 1], packed, variant, **I16_PATH_OFF) for i in range(len(X))])
    Xr = X.astype(ml_dtypes.bfloat16).astype(np.float64)
    for m in ROWS:
        got = kernels.linear_variant(X[:m], packed, variant, **I16_PATH_OFF)
        assert np.array_equal(got, alone[:m]), f"{variant}: {m} rows differ from the rows computed alone"
        ref = Xr[:m] @ Wd.T
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{variant}: {m} rows, relative error {err:.2e}"


def test_nan_weights_stay_in_their_channels():
    """An FP8 NaN code poisons its own output channel in the float path too, no other."""
    variant = _avx2_variant("FP8_PERCHANNEL")
    codes = np.full((24, 64), 0x38, np.uint8)  # 1.0
    codes[5, 17] = 0x7F
    packed = kernels.pack_quantized(codes, np.ones(24, np.float32), "FP8_PERCHANNEL")
    y = kernels.linear_variant(np.ones((30, 64), np.float32), packed, variant)
    assert np.isnan(y[:, 5]).all()
    assert np.all(np.delete(y, 5, axis=1) == 64.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_up_projection_on_the_rows_its_gate_widened(fmt):
    """In a MoE on AVX2 the up projection reads the rows its gate widened to floats (with their
    factors and FP8's wide flag) where every call of that row count takes the float GEMM in one
    chunk.  Experts get row counts around where that holds (5, 7 and 8 rows split, fewer take
    decode tiles, BF16 starts at 20, 36 rows a chunk), and some tokens hold a value of 2^15 or more
    (FP8's wide decode for their experts' chunks): each token within 1% of float64."""
    if "avx2" not in ktcy.available_isas():
        pytest.skip("this CPU runs no AVX2")
    rng = np.random.default_rng(11)
    counts = [1, 4, 5, 6, 7, 8, 9, 19, 20, 36, 37]
    E, H, I = len(counts), 1040, 96
    ids = rng.permutation(np.repeat(np.arange(E), counts))[:, None].astype(np.int64)
    x = rng.standard_normal((len(ids), H)).astype(np.float32)
    # wide tokens first and last in the experts of 1, 4, 5, 7, 8, 9 and 36 rows: below 5 rows, and
    # in both halves of a split call, a wide row sends gate and up to the float GEMM, where the
    # rows left in scratch are not the up call's own (the decode tiles widened theirs over them,
    # H above 1024; or the gate's second half is there), so they must not be reused
    for e in (0, 1, 2, 4, 5, 6, 9):
        x[np.nonzero(ids[:, 0] == e)[0][[0, -1]], 3] = 40000.0
    gate, up, down = ((rng.standard_normal(s) * 0.02).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I)))
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 1, H, I, ktcy.QuantConfig(fmt), isa="avx2"), gate, up, down)
    w = np.ones(ids.shape, np.float32)
    y = layer.forward(x, ids, w)
    with np.errstate(over="ignore"):  # silu of the wide tokens' large negative sums
        ref = reference(x.astype(ml_dtypes.bfloat16).astype(np.float64), ids, w, *dequantized(layer))
    err = np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert err.max() < 0.01, f"token {err.argmax()} (expert {ids[err.argmax(), 0]}): relative error {err.max():.2e}"


@pytest.mark.parametrize("nan_code", [False, True])
@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_fp8_panels_decoded_to_normal_floats_give_the_same_bits(fmt, nan_code):
    """ktcy_fp8_normal_panels: AVX2 FP8's float prefill may decode its panels times 2^8, so that
    subnormal codes become normal floats (an Intel core multiplies subnormals through a microcode
    assist), and widen the rows times 2^8 less: each product is the same number, so either way every
    row has the bits it has computed alone, for rows from 2^-130 to just below the wide decode's
    2^15 and for weights with subnormal codes (and a NaN code: the checked decode)."""
    variant = _avx2_variant(fmt)
    rng = np.random.default_rng(5)
    n, k = 200, 544
    W = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    W[:, :96] *= 1e-4  # E4M3 subnormal codes after the scaling
    packed = kernels.pack(W, fmt)
    codes = packed.codes()
    if nan_code:
        codes[7, 300] = 0x7F
        packed = kernels.pack_quantized(codes, packed.scale[:n] if fmt == "FP8_PERCHANNEL" else packed.scale, fmt)
    assert np.mean(((codes & 0x78) == 0) & ((codes & 0x07) != 0)) > 0.01
    sizes = [1.0, 2.0 ** -60, 2.0 ** -126, 2.0 ** -130, 2.0 ** 14 * 1.9, 3e-3, 0.0]
    X = rng.uniform(-1, 1, (40, k)).astype(np.float32)  # row i below sizes[i]: no row reaches 2^15
    for i in range(len(X)):
        X[i] *= np.float32(sizes[i % len(sizes)])
    assert np.abs(X).max() < 2.0 ** 15
    lifted = kernels.linear_variant(X, packed, variant, fp8_normal_panels=1)
    plain = kernels.linear_variant(X, packed, variant, fp8_normal_panels=0)
    alone = np.concatenate([kernels.linear_variant(X[i:i + 1], packed, variant) for i in range(len(X))])
    assert lifted.tobytes() == plain.tobytes(), f"{variant}: the panels times 2^8 changed bits"
    assert lifted.tobytes() == alone.tobytes(), f"{variant}: rows of the prefill differ from the rows alone"
    assert np.isnan(lifted[:, 7]).all() == nan_code and np.isfinite(np.delete(lifted, 7, axis=1)).all()
