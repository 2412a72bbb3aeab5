"""MXFP4_A8: MXFP4's codes and E8M0 exponents, multiplied by int8 activations.  The same stored
bytes as MXFP4 (bit-exact both ways), the documented integer epilogue bit for bit on every
kernel, the MoE within the int8 activations' error of float64 on the same weights, released
GPT-OSS codes kept as stored, packed files, refusals."""
import numpy as np
import pytest

import ktcy
from conftest import mxfp4_a8_exact_reference, quantize_rows_int8, runnable_variants
from ktcy import _native, kernels
from ktcy.formats import canonical_format
from ktcy.packed_io import load_layer, pack_layer, write_layer

E2M1 = kernels.E2M1_VALUES


def released(rng, n, k, lo=118, hi=132):
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    exps = rng.integers(lo, hi + 1, (n, -(-k // 32))).astype(np.uint8)
    return codes, exps


@pytest.mark.parametrize("n,k", [(16, 64), (37, 96), (45, 33), (48, 2880), (20, 1)])
def test_same_codes_and_exponents_as_mxfp4(n, k):
    """K = 96 and 33 leave MXFP4_A8's last 64-K block half empty (an extra sub-block of zeros)."""
    rng = np.random.default_rng(n + k)
    codes, exps = released(rng, n, k)
    a8, mx = kernels.pack_quantized(codes, exps, "MXFP4_A8"), kernels.pack_quantized(codes, exps, "MXFP4")
    assert a8.group_size == 32 and a8.k_pad % 64 == 0
    assert np.array_equal(a8.codes(), codes) and np.array_equal(a8.block_exponents(), exps)
    assert np.array_equal(a8.dequantize(), mx.dequantize())
    # where K is a multiple of 64 the two formats hold the same bytes
    if k % 64 == 0:
        assert np.array_equal(a8.data, mx.data)
    W = np.random.default_rng(k).standard_normal((n, k)).astype(np.float32)
    pa, pm = kernels.pack(W, "MXFP4_A8"), kernels.pack(W, "MXFP4")
    assert np.array_equal(pa.codes(), pm.codes()) and np.array_equal(pa.block_exponents(), pm.block_exponents())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 33, 97])
@pytest.mark.parametrize("n,k", [(16, 64), (37, 96), (101, 200), (48, 1), (80, 2880)])
def test_every_kernel_gives_the_integer_epilogue_bit_for_bit(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    codes, exps = released(rng, n, k, 100, 150)
    p = kernels.pack_quantized(codes, exps, "MXFP4_A8")
    X = rng.standard_normal((m, k)).astype(np.float32)
    ref = mxfp4_a8_exact_reference(X, p)
    variants = runnable_variants("MXFP4_A8")
    assert {"mxfp4_a8_ref", "mxfp4_a8_avx2", "amx_emu_mxfp4_a8"} <= set(variants) or \
        "mxfp4_a8_avx2" not in [v["name"] for v in _native.variants() if v["runnable"]]
    for v in variants:
        assert np.array_equal(kernels.linear_variant(X, p, v), ref), v
    # and the epilogue is the dot product of the rounded activations with the weights
    q_x, s_x = quantize_rows_int8(X)
    exact = (q_x.astype(np.float64) * s_x[:, None].astype(np.float64)) @ p.dequantize().T
    norms = np.maximum(np.linalg.norm(exact, axis=1, keepdims=True), 1e-30)
    assert np.max(np.abs(ref - exact) / norms) < 1e-5


def test_every_weight_reads_back_through_identity_activations():
    """x = e_j puts weight column j in the output (times 127 and the row scale fl(1/127): within
    two float32 roundings): a value in another channel's place (the AVX2 halves hold channels
    0-3, 8-11 | 4-7, 12-15) or another block's exponent fails."""
    rng = np.random.default_rng(4)
    n, k = 45, 128
    codes, exps = released(rng, n, k, 2, 252)
    p = kernels.pack_quantized(codes, exps, "MXFP4_A8")
    W = p.dequantize()
    for rows in (1, 3, 6):
        for start in range(0, k, rows):
            X = np.eye(k, dtype=np.float32)[start:start + rows]
            want = W[:, start:start + rows].T
            for v in runnable_variants("MXFP4_A8"):
                y = kernels.linear_variant(X, p, v).astype(np.float64)
                assert np.all(np.abs(y - want) <= 2.5e-7 * np.abs(want)), v


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_blocks_of_zeros_with_any_exponent_give_zeros(rows):
    rng = np.random.default_rng(rows)
    n, k = 32, 192
    codes, exps = released(rng, n, k)
    codes[codes == 0] = 1
    for i, e in enumerate([255, 254, 253, 0, 1]):  # outside the checked range, on blocks of zeros
        codes[i, 32 * i:32 * (i + 1)] = 0
        exps[i, i] = e
    p = kernels.pack_quantized(codes, exps, "MXFP4_A8")
    X = rng.standard_normal((rows, k)).astype(np.float32)
    ref = mxfp4_a8_exact_reference(X, p)
    for v in runnable_variants("MXFP4_A8"):
        y = kernels.linear_variant(X, p, v)
        assert np.isfinite(y).all() and np.array_equal(y, ref), v


@pytest.mark.parametrize("m", [1, 2, 9])
def test_extreme_codes_do_not_overflow_the_int16_sums(m):
    """Codes of 2 x 6 = 12 in size (stored 24 and 0 with the zero point 12) against activations of
    +-127: the AVX2 kernels add a block's 8 rows of vpmaddubsw pairs in int16, where the stored
    codes' sums reach 16 x 24 x 127 = 48768 and wrap; each word starts from -12 x its activations,
    so it ends at most 16 x 12 x 127 = 24384 in size.  Activations on one word of each dword only
    tell the two words apart: with their starts swapped, the sums would wrap differently."""
    n, k = 32, 256
    codes = np.full((n, k), 7, np.uint8)
    codes[1::2] = 15  # -6
    codes[2::4, 2::4] = 15
    exps = np.full((n, k // 32), 127, np.uint8)
    p = kernels.pack_quantized(codes, exps, "MXFP4_A8")
    low_word = (np.arange(k) % 4 < 2).astype(np.float32)
    signs = np.random.default_rng(m).choice([-1.0, 1.0], (m, k)).astype(np.float32)
    for uniform, X in ((True, np.ones((m, k), np.float32)), (True, -np.ones((m, k), np.float32)),
                       (False, np.tile(low_word, (m, 1))), (False, np.tile(1 - low_word, (m, 1))),
                       (False, -np.tile(low_word, (m, 1))), (False, signs)):
        ref = mxfp4_a8_exact_reference(X, p)
        if uniform:
            assert np.allclose(ref[0, :2], [6 * k * X[0, 0], -6 * k * X[0, 0]])
        assert np.allclose(ref, X.astype(np.float64) @ p.dequantize().T, rtol=1e-6, atol=1e-6)
        for v in runnable_variants("MXFP4_A8"):
            assert np.array_equal(kernels.linear_variant(X, p, v), ref), v


def test_moe_from_released_codes_on_every_isa_and_packed_file(tmp_path):
    """GPT-OSS-style released MXFP4 (codes + exponents) packed as MXFP4_A8 keeps the codes; the
    forward is the same bits on every ISA and within the int8 activations' error of float64."""
    rng = np.random.default_rng(12)
    E, k, H, I = 4, 2, 160, 96
    spec = {}
    for e in range(E):
        spec[e] = {}
        for proj, (n, kk) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            c, x = released(rng, n, kk, 120, 124)
            spec[e][proj] = (c, {"format": "MXFP4", "exponents": x})
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 1], [3, 0], [2, 0]])
    w = rng.random((5, k)).astype(np.float32)
    outs = {}
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        layer = ktcy.MoE.from_experts(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("MXFP4_A8"), isa=isa),
                                      spec.__getitem__)
        outs[isa] = layer.forward(x, ids, w)
    for e in range(E):
        for proj in ("gate", "up", "down"):
            kept = getattr(layer, proj)[e]
            assert kept.format == "MXFP4_A8"
            assert np.array_equal(kept.codes(), spec[e][proj][0])
            assert np.array_equal(kept.block_exponents(), spec[e][proj][1]["exponents"])
    first = next(iter(outs.values()))
    assert all(np.array_equal(first, y) for y in outs.values())  # integer kernels: the same bits
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    dq = {name: [getattr(layer, name)[e].dequantize() for e in range(E)] for name in ("gate", "up", "down")}
    xd = x.astype(np.float64)
    exact = sum(w[:, j:j + 1] * np.stack([
        (silu(xd[t] @ dq["gate"][e].T) * (xd[t] @ dq["up"][e].T)) @ dq["down"][e].T
        for t, e in enumerate(ids[:, j])]) for j in range(k))
    assert np.linalg.norm(first - exact) / np.linalg.norm(exact) < 2.5e-2
    path = str(tmp_path / "l.safetensors")
    write_layer(path, pack_layer(E, "MXFP4_A8", 0, spec.__getitem__), "MXFP4_A8", 0, E, k, H, I, 0)
    mapped = load_layer(path, isa="ref")
    assert mapped.format == "MXFP4_A8" and np.array_equal(mapped.forward(x, ids, w), outs["ref"])


@pytest.mark.parametrize("group", [0, 64])
def test_a_hand_made_weight_with_another_group_is_refused(group):
    p = kernels.pack(np.ones((16, 64), np.float32), "MXFP4_A8")
    hand = kernels.PackedWeight("MXFP4_A8", p.shape, p.data, None, None, group)
    with pytest.raises(ValueError, match="group"):
        kernels.linear(np.ones((1, 64), np.float32), hand)


@pytest.mark.parametrize("group", [0, 64])
def test_activations_for_another_group_are_refused(group):
    """The block sums are a word pair per 32-K block: no other group gets them written."""
    for rows in (3, 0):  # refused before any row is read
        with pytest.raises(ValueError, match="group 32"):
            _native.Activations(kernels._CODE["MXFP4_A8"], np.ones((rows, 128), np.float32), 128, group)


def test_names_and_descriptor():
    assert canonical_format("mxfp4_a8") == "MXFP4_A8" == canonical_format("MXFP4_INT8ACT")
    d = kernels.descriptor("MXFP4_A8")
    assert d["activations"] == "int8" and d["code"] == "e2m1" and d["block_k"] == 64 and d["group_sizes"] == [32]
