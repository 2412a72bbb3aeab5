"""MXFP4 (OCP microscaling: E2M1 codes, one E8M0 power-of-two scale per channel and 32 K values,
GPT-OSS's expert format): exact decode on every kernel, the quantizer's rounding, refusals,
GEMM and MoE accuracy on every ISA, packed files."""
import ml_dtypes
import numpy as np
import pytest

import ktcy
from conftest import I16_PATH_OFF, I16_PATH_ON, MXFP4_I16_PATHS, bf16_round, rel_err_rows, runnable_variants
from ktcy import _native, kernels
from ktcy.packed_io import load_layer, pack_layer, write_layer
from ktcy.safetensors_io import CheckpointError

# E2M1 from its definition: sign, exponent bits e (bias 1), mantissa bit m; e = 0 is subnormal.
E2M1 = np.array([(-1) ** (c >> 3) * ((((c >> 1) & 3) == 0) * (c & 1) * 0.5
                                     + (((c >> 1) & 3) > 0) * (1 + (c & 1) / 2) * 2.0 ** (((c >> 1) & 3) - 1))
                 for c in range(16)])


def test_definition_table_matches():
    assert np.array_equal(np.abs(E2M1[:8]), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert np.array_equal(kernels.E2M1_VALUES, E2M1)


def test_every_code_and_exponent_decodes_exactly():
    lo, hi = _native.E8M0_RANGE
    codes = np.tile(np.arange(16, dtype=np.uint8), hi - lo + 1)
    exps = np.repeat(np.arange(lo, hi + 1, dtype=np.uint8), 16)
    got = _native.mxfp4_to_bf16_bits(codes, exps).view(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(got, E2M1[codes] * np.exp2(exps.astype(np.float64) - 127))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 40])  # <= 4 rows decode in registers, more decode panels first
# whole panels, a last panel of 5 and of 13 channels; 7 panels: one row takes 4 panels per tile on
# AVX2, then 2, then the partial one
@pytest.mark.parametrize("n", [48, 37, 45, 101])
def test_every_kernel_decodes_exactly(rows, n):
    """Identity activations read every weight back into its own output: a value in another
    channel's place (AVX2 decodes with channels 0-3, 8-11 | 4-7, 12-15 and reorders at the
    store) or a block scale from another channel fails."""
    rng = np.random.default_rng(rows + n)
    k = 96
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    lo, hi = _native.E8M0_RANGE  # every block scale the format allows, at its extremes too
    exps = rng.integers(lo, hi + 1, (n, k // 32)).astype(np.uint8)
    exps[0, 0], exps[1, 0] = lo, hi
    p = kernels.pack_quantized(codes, exps, "MXFP4")
    W = E2M1[codes] * np.exp2(np.repeat(exps.astype(np.float64), 32, axis=1) - 127)
    assert np.array_equal(p.dequantize(), W)
    eye = np.eye(k, dtype=np.float32)
    for start in range(0, k, rows):
        X = eye[start:start + rows]
        for v in runnable_variants("MXFP4"):
            assert np.array_equal(kernels.linear_variant(X, p, v), W[:, start:start + rows].T.astype(np.float32)), v


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (1, 101, 200), (2, 101, 200), (3, 40, 100), (17, 80, 200),
                                   (64, 64, 1024), (512, 32, 96)])
def test_gemm_matches_float64_on_every_variant(m, n, k):
    rng = np.random.default_rng(m + n + k)
    W = rng.standard_normal((n, k)).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    p = kernels.pack(W, "MXFP4")
    ref = bf16_round(X).astype(np.float64) @ p.dequantize().T
    variants = runnable_variants("MXFP4")
    assert {"mxfp4_ref", "amx_emu_mxfp4"} <= set(variants)
    for v in variants:
        assert rel_err_rows(kernels.linear_variant(X, p, v), ref) <= 1e-5, v


@pytest.mark.parametrize("m", [1, 3, 8, 40])
@pytest.mark.parametrize("top", [1e30, 1e36])
def test_activations_up_to_1e36_stay_finite_and_within_1e5_on_every_variant(m, top):
    """The paths that scale after the lookup (AVX2, AVX-512 calls of up to 4 rows) multiply codes of
    up to 6 by the activations: the README promises them finite up to 1e36 (a block's 32 products
    of 6 x 1e36 stay below float's maximum), with large and small values in one row."""
    rng = np.random.default_rng(m)
    W = rng.standard_normal((48, 96)).astype(np.float32)
    p = kernels.pack(W, "MXFP4")
    X = rng.standard_normal((m, 96)).astype(np.float32)
    X[:, :32] = np.float32(top) * np.sign(X[:, :32])   # a whole block at the limit
    ref = bf16_round(X).astype(np.float64) @ p.dequantize().astype(np.float64).T
    for v in runnable_variants("MXFP4"):
        got = kernels.linear_variant(X, p, v)
        assert np.all(np.isfinite(got)), v
        assert rel_err_rows(got, ref) <= 1e-5, v


def test_quantizer_rounds_to_nearest_even_with_the_shared_exponent_rule():
    rng = np.random.default_rng(9)
    W = (rng.standard_normal((32, 256)) * np.exp2(rng.integers(-6, 6, (32, 1)))).astype(np.float32)
    W[0, :32] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7] * 4) * 0.5  # ties, amax 3.5 -> exponent 1 - 2
    p = kernels.pack(W, "MXFP4")
    blocks = W.reshape(32, 8, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=2)
    e = np.floor(np.log2(amax)) - 2
    assert np.array_equal(p.block_exponents().astype(np.float64) - 127, e)
    scaled = blocks / np.exp2(e)[:, :, None]
    grid = np.abs(E2M1[:8])
    dist = np.abs(np.abs(scaled)[..., None] - grid)
    best = dist.min(axis=-1, keepdims=True)
    ties_even = np.where(np.isclose(dist, best, rtol=0, atol=0), np.arange(8) % 2, 9)  # prefer even codes on ties
    expect = np.sign(scaled) * grid[np.argmin(ties_even, axis=-1)]
    got = p.dequantize().reshape(32, 8, 32) / np.exp2(e)[:, :, None]
    assert np.array_equal(got, expect)


@pytest.mark.parametrize("case", ["nan_exponent", "tiny_exponent", "code_16", "shape"])
def test_bad_codes_and_exponents_are_refused(case):
    codes = np.ones((16, 64), np.uint8)
    exps = np.full((16, 2), 127, np.uint8)
    if case == "nan_exponent":
        exps[3, 1] = 255
    if case == "tiny_exponent":
        exps[3, 1] = 1
    if case == "code_16":
        codes[0, 0] = 16
    if case == "shape":
        exps = exps[:, :1]
    with pytest.raises(ValueError):
        kernels.pack_quantized(codes, exps, "MXFP4")
    if case == "tiny_exponent":  # a block of zero codes may carry any exponent
        codes[3, 32:] = 0
        kernels.pack_quantized(codes, exps, "MXFP4")


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_blocks_of_zeros_with_any_exponent_give_zeros(rows):
    """Packing checks exponents only where a code is non-zero; the kernels that scale block sums
    must not turn a zero block's sum into NaN (0 x 2^128) or anything but zero."""
    rng = np.random.default_rng(rows)
    n, k = 32, 192
    codes = rng.integers(1, 16, (n, k)).astype(np.uint8)
    exps = rng.integers(120, 130, (n, k // 32)).astype(np.uint8)
    for i, e in enumerate([255, 254, 253, 0, 1]):  # outside the checked range, on blocks of zeros
        codes[i, 32 * i:32 * (i + 1)] = 0
        exps[i, i] = e
    p = kernels.pack_quantized(codes, exps, "MXFP4")
    W = E2M1[codes] * np.exp2(np.repeat(exps.astype(np.float64), 32, axis=1) - 127)
    W[codes == 0] = 0  # 0 x 2^(255 - 127) is 0 here, not NaN
    X = rng.standard_normal((rows, k)).astype(np.float32)
    ref = bf16_round(X).astype(np.float64) @ W.T
    for v in runnable_variants("MXFP4"):
        y = kernels.linear_variant(X, p, v)
        assert np.isfinite(y).all() and rel_err_rows(y, ref) <= 1e-5, v


INTEGER_PATHS = MXFP4_I16_PATHS


def integer_path_definition(X, codes, exps):
    """What the 16-bit integer path computes, from its definition (fmt_mxfp4.h): each 32-K block
    of a bf16 row as integers q = x * 2^(141 - F) rounded half to even (F: the exponent field of the
    block's largest |x|; blocks of zeros and subnormals count as zero), the block's exact dot
    product c with twice the E2M1 values, then in block order acc = fl32(acc + c 2^(F - 142) 2^(e - 127))."""
    xb = bf16_round(X)
    bits = np.asarray(X, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    m, k = X.shape
    twice = (2 * E2M1[codes]).astype(np.int64)
    y = np.zeros((m, codes.shape[0]), np.float32)
    for g in range(k // 32):
        field = ((bits[:, 32 * g:32 * g + 32] & 0x7FFF) >> 7).max(axis=1).astype(np.int64)
        q = np.rint(xb[:, 32 * g:32 * g + 32] * np.exp2(141.0 - field)[:, None]).astype(np.int64)
        q[field == 0] = 0
        c = q @ twice[:, 32 * g:32 * g + 32].T
        part = c * np.exp2(field - 142.0)[:, None] * np.exp2(exps[:, g].astype(np.float64) - 127)[None, :]
        with np.errstate(over="ignore"):  # a part past float's top is inf, as the fma's product
            y = (y + part.astype(np.float32)).astype(np.float32)  # exact part, one rounding as in the fma
    return y


def integer_path_or_skip(variant):
    if variant not in runnable_variants("MXFP4"):
        pytest.skip(f"{variant} does not run on this CPU/build")


@pytest.mark.parametrize("variant", list(INTEGER_PATHS))
@pytest.mark.parametrize("n", [16, 37, 101])
def test_integer_path_matches_its_definition_bit_for_bit(variant, n):
    """Rows 1-4 through the 16-bit integer path (both panel widths, a partial last panel) equal the
    definition above bit for bit: Gaussian rows with outlier columns (so values below 2^-8 of a
    block's largest round), exact ties, a block of zeros, one of subnormals, tiny and huge rows
    inside the range and blocks at its two ends.  Rows in range do not change each other's bits,
    and the path differs from the bf16 path (it ran)."""
    integer_path_or_skip(variant)
    rng = np.random.default_rng(n)
    k = 256
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    exps = rng.integers(110, 140, (n, k // 32)).astype(np.uint8)
    p = kernels.pack_quantized(codes, exps, "MXFP4")
    X = rng.standard_normal((4, k)).astype(np.float32)
    X[:, ::37] *= 500.0
    X[0, 0:4] = [1.0, 2.0 ** -9 * 3, -(2.0 ** -9) * 5, 2.0 ** -9 * 7]  # q = 16384, 1.5, -2.5, 3.5: ties
    X[1, 64:96] = 0.0
    X[1, 96:128] = np.float32(2.0 ** -128) * rng.uniform(-1, 1, 32)  # bf16 subnormals only
    X[2] *= np.float32(2.0 ** -100)
    X[3] *= np.float32(2.0 ** 100)
    X[2, 160:192] = np.float32(2.0 ** -111) * rng.uniform(1.0, 1.99, 32)  # F = 16, the smallest taken
    X[3, 224:256] = np.float32(2.0 ** 118) * rng.uniform(1.0, 1.99, 32)  # F = 245, the largest
    expect = integer_path_definition(X, codes, exps)
    for m in (1, 2, 3, 4):
        got = kernels.linear_variant(X[:m], p, variant, **I16_PATH_ON)
        assert got.tobytes() == expect[:m].tobytes(), m
    tiles = kernels.linear_variant(X, p, variant, **I16_PATH_OFF)
    if INTEGER_PATHS[variant]:
        assert tiles.tobytes() == kernels.linear_variant(X, p, INTEGER_PATHS[variant]).tobytes()
    assert tiles.tobytes() != expect.tobytes()
    W = E2M1[codes] * np.exp2(np.repeat(exps.astype(np.float64), 32, axis=1) - 127)
    assert rel_err_rows(expect[:3], bf16_round(X[:3]) @ W.T) <= 1e-4  # row 3's 2^118 block overflows float


@pytest.mark.parametrize("variant", list(INTEGER_PATHS))
@pytest.mark.parametrize("value", [2.0 ** 119, 2.0 ** 125, 2.0 ** -112, 2.0 ** -126, np.inf, np.nan])
def test_integer_path_leaves_rows_outside_its_range_to_the_bf16_path(variant, value):
    """A block whose largest |x| lies outside [2^-111, 2^119) would take the factors out of float's
    normal range: the whole call keeps the bf16 path, bit for bit (its other rows too)."""
    integer_path_or_skip(variant)
    rng = np.random.default_rng(3)
    n, k = 40, 128
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    exps = rng.integers(120, 130, (n, k // 32)).astype(np.uint8)
    p = kernels.pack_quantized(codes, exps, "MXFP4")
    for m in (1, 3):
        X = rng.standard_normal((m, k)).astype(np.float32)
        X[m - 1, 32:64] = np.float32(value) * rng.uniform(1.0, 1.9, 32)
        got = kernels.linear_variant(X, p, variant, **I16_PATH_ON)
        assert got.tobytes() == kernels.linear_variant(X, p, variant, **I16_PATH_OFF).tobytes(), (value, m)


@pytest.mark.parametrize("variant", list(INTEGER_PATHS))
def test_integer_path_is_a_small_share_of_the_bf16_error(variant):
    """Against float64 on the float32 activations the integer path's error is the bf16 path's:
    the 16-bit rounding adds a small share to the bf16 rounding every path makes."""
    integer_path_or_skip(variant)
    rng = np.random.default_rng(5)
    W = rng.standard_normal((96, 512)).astype(np.float32) * 0.02
    p = kernels.pack(W, "MXFP4")
    X = rng.standard_normal((4, 512)).astype(np.float32)
    X[:, ::97] *= 300.0
    ref = X.astype(np.float64) @ p.dequantize().T
    ints = rel_err_rows(kernels.linear_variant(X, p, variant, **I16_PATH_ON), ref)
    tiles = rel_err_rows(kernels.linear_variant(X, p, variant, **I16_PATH_OFF), ref)
    assert ints <= 1.1 * tiles and tiles <= 4e-3


@pytest.mark.parametrize("variant", list(INTEGER_PATHS))
def test_moe_up_projection_reuses_its_gates_rows(variant):
    """The engine's up projection reads the 16-bit rows its gate call left in scratch, or the
    gate's refusal: each expert's output equals its three projections called one by one (the same
    variant and rows), including an expert whose rows hold one out of the path's range (both of
    its calls must refuse) and experts run one after another on the same thread's scratch."""
    integer_path_or_skip(variant)
    isa = "avx512" if "avx512" in variant else "avx2"
    choice = "i16_rows" if isa == "avx512" else "avx2_i16_rows"
    if _native.tile_choice()[choice] == 0:
        pytest.skip(f"this CPU keeps {isa} MXFP4's bf16 path in the engine (ktcy_{choice} 0)")
    rng = np.random.default_rng(17)
    E, k, H, I = 4, 2, 160, 96
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.05 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.05
    x = rng.standard_normal((3, H)).astype(np.float32)
    x[1, 32:64] = np.float32(2.0 ** -115) * rng.uniform(1.0, 1.9, 32)  # refused: F = 12
    ids = np.array([[0, 1], [2, 1], [3, 0]])
    w = rng.random((3, k)).astype(np.float32)
    for threads in (1, 2):
        cfg = ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("MXFP4"), isa=isa, num_threads=threads)
        layer = ktcy.MoE.from_weights(cfg, gate, up, down)
        assert layer.decode_variant == variant
        y = layer.forward(x, ids, w)
        ref = np.zeros_like(y)
        for e in range(E):
            rows = [t for t in range(3) for j in range(k) if ids[t, j] == e]
            g = kernels.linear_variant(x[rows], layer.gate[e], variant)
            u = kernels.linear_variant(x[rows], layer.up[e], variant)
            h = (g / (1 + np.exp(-g.astype(np.float64))) * u).astype(np.float32)
            d = kernels.linear_variant(h, layer.down[e], variant)
            for i, t in enumerate(rows):
                ref[t] += w[t, list(ids[t]).index(e)] * d[i]
        assert rel_err_rows(y, ref.astype(np.float64)) <= 1e-5, threads


def test_moe_on_every_isa_and_packed_file(tmp_path):
    rng = np.random.default_rng(11)
    E, k, H, I = 4, 2, 160, 96
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.05 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.05
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 1], [3, 0], [2, 0]])
    w = rng.random((5, k)).astype(np.float32)
    outs = {}
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("MXFP4"), isa=isa), gate, up, down)
        outs[isa] = layer.forward(x, ids, w)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    dq = {name: [getattr(layer, name)[e].dequantize() for e in range(E)] for name in ("gate", "up", "down")}
    xb = bf16_round(x).astype(np.float64)
    exact = sum(w[:, j:j + 1] * np.stack([
        bf16_round((silu(xb[t] @ dq["gate"][e].T) * (xb[t] @ dq["up"][e].T)).astype(np.float32)).astype(np.float64)
        @ dq["down"][e].T for t, e in enumerate(ids[:, j])]) for j in range(k))
    for isa, y in outs.items():
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 4e-3, isa
    experts = {e: {p: (a[e], None) for p, a in (("gate", gate), ("up", up), ("down", down))} for e in range(E)}
    path = str(tmp_path / "l.safetensors")
    write_layer(path, pack_layer(E, "MXFP4", 0, experts.__getitem__), "MXFP4", 0, E, k, H, I, 0)
    assert np.array_equal(load_layer(path, isa="ref").forward(x, ids, w), outs["ref"])


@pytest.mark.parametrize("fmt", ["MXFP4", "MXFP4_A8"])
@pytest.mark.parametrize("exponent", [0, 1, 253, 254, 255])
def test_packed_file_with_scales_outside_the_range_is_refused_but_blocks_of_zeros_may_carry_any(tmp_path, fmt, exponent):
    """A packed layer file is checked as pack_quantized checks its input: past [2, 252] the paths
    part ways (clamped, inf or subnormal scales), so a damaged or foreign file must not load, but an
    all-zero block's exponent is free (it scales nothing)."""
    rng = np.random.default_rng(11)
    E, H, I = 2, 64, 32
    mats = {p: rng.standard_normal((E, *shape)).astype(np.float32) * 0.05
            for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    mats["gate"][0, 0, :32] = 0.0  # expert 0's channel 0, K block 0: a block of zeros
    experts = {e: {p: (a[e], None) for p, a in mats.items()} for e in range(E)}
    arrays = pack_layer(E, fmt, 0, experts.__getitem__)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids, w = np.array([[0, 1]] * 3, np.int32), np.full((3, 2), 0.5, np.float32)
    path = str(tmp_path / "good.safetensors")
    write_layer(path, arrays, fmt, 0, E, 2, H, I, 0)
    expect = load_layer(path, isa="ref").forward(x, ids, w)
    zero_block = {k: a.copy() for k, a in arrays.items()}
    zero_block["gate.data"][0, 256] = exponent  # panel 0, block 0, channel 0 of expert 0
    path = str(tmp_path / "zero_block.safetensors")
    write_layer(path, zero_block, fmt, 0, E, 2, H, I, 0)
    for isa in _native.available_isas():  # the same numbers as the file without the odd exponent
        good = load_layer(str(tmp_path / "good.safetensors"), isa=isa).forward(x, ids, w)
        assert np.array_equal(load_layer(path, isa=isa).forward(x, ids, w), good), isa
    assert np.array_equal(load_layer(path, isa="ref").forward(x, ids, w), expect)
    used = {k: a.copy() for k, a in arrays.items()}
    used["gate.data"][1, 256] = exponent  # the same block of expert 1, which holds codes
    path = str(tmp_path / "used.safetensors")
    write_layer(path, used, fmt, 0, E, 2, H, I, 0)
    with pytest.raises(CheckpointError, match=rf"gate\[1\]: .*2\^\({exponent} - 127\) of row 0, K block 0 is outside"):
        load_layer(path)
