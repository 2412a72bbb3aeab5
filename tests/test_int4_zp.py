"""INT4 with zero points (w = s * (q - z) per channel and K group, as GPTQ/AWQ/compressed-tensors
store it): layout round trip, the same numbers on every ISA as an integer numpy reference,
symmetric INT4 as the case z = 8, the quantizer's range, MoE and packed files.  The kernel tests
take INT4_MIN too (w = s * q + min: the same kernels, z = 0 and a float term per group;
tests/test_int4_min.py has the rest of it)."""
import numpy as np
import pytest

import ktcy
from conftest import int4_exact_reference, per_channel_groups, runnable_variants
from ktcy import kernels
from ktcy.packed_io import load_layer, pack_layer, write_layer


@pytest.mark.parametrize("group", [32, 64, 128])
def test_codes_and_zero_points_round_trip_exactly(group):
    rng = np.random.default_rng(group)
    n, k = 37, 300
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.1, 1, (n, -(-k // group))).astype(np.float32)
    zero = rng.integers(0, 16, (n, -(-k // group)), dtype=np.uint8)
    p = kernels.pack_quantized(codes, scale, "INT4_ZP", group_size=group, zero_points=zero)
    assert p.codes().dtype == np.uint8 and np.array_equal(p.codes(), codes)
    rep = lambda a: np.repeat(a.astype(np.float64), group, axis=1)[:, :k]  # noqa: E731
    assert np.array_equal(p.dequantize(), (codes - rep(zero)) * rep(scale))
    # stored panel-major (the documented index, read independently), given back as [groups, N_pad]
    groups = -(-k // group)
    assert p.scale.shape == (3, groups, 16) and p.zero.shape == (3, groups, 16)
    assert np.array_equal(per_channel_groups(p.scale, n), scale)
    assert np.array_equal(per_channel_groups(p.zero, n), zero)
    assert np.array_equal(p.group_scales()[:, :n], scale.T) and np.array_equal(p.group_zero_points()[:, :n], zero.T)
    assert not p.group_scales()[:, n:].any() and (p.group_zero_points()[:, n:] == 8).all()


ASYMMETRIC = ["INT4_ZP", "INT4_MIN"]


@pytest.mark.parametrize("fmt", ASYMMETRIC)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 48, 100), (17, 80, 192), (40, 130, 300), (512, 32, 256),
                                   (2, 1000, 520), (6, 40, 160), (12, 96, 448), (13, 48, 192)])
def test_gemm_bit_identical_on_every_isa(fmt, group, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k + group)
    W = (rng.standard_normal((n, k)) * 0.02 + 0.01).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    p = kernels.pack(W, fmt, group_size=group)
    ref = int4_exact_reference(X, p)
    variants = runnable_variants(fmt)
    assert {"int4_ref", "amx_emu_int4"} <= set(variants)
    for v in variants:
        assert np.array_equal(kernels.linear_variant(X, p, v), ref), v
    # and within the int8 activations' error of float64 on the same dequantized weights
    exact = X.astype(np.float64) @ p.dequantize().T
    assert np.linalg.norm(ref - exact) / np.linalg.norm(exact) < 0.02


def test_symmetric_int4_is_the_case_z_8():
    rng = np.random.default_rng(5)
    W = rng.standard_normal((48, 256)).astype(np.float32)
    X = rng.standard_normal((5, 256)).astype(np.float32)
    sym = kernels.pack(W, "INT4", group_size=64)
    zp = kernels.pack_quantized(sym.codes() + 8, sym.group_scales(), "INT4_ZP", group_size=64,
                                zero_points=np.full(sym.group_scales().shape, 8, np.uint8))
    for v in runnable_variants("INT4"):
        assert np.array_equal(kernels.linear_variant(X, zp, v), kernels.linear_variant(X, sym, v)), v


def test_quantizer_covers_each_group_range():
    rng = np.random.default_rng(6)
    W = (rng.standard_normal((32, 192)) + np.linspace(-2, 2, 32)[:, None]).astype(np.float32)
    p = kernels.pack(W, "INT4_ZP", group_size=32)
    Wg = W.reshape(32, 6, 32)
    step = (np.maximum(Wg.max(axis=2), 0) - np.minimum(Wg.min(axis=2), 0)) / 15
    err = np.abs(p.dequantize() - W).reshape(32, 6, 32).max(axis=2)
    assert (err <= step * 0.5 + 1e-6).all()  # every weight within half a step: no clipping


@pytest.mark.parametrize("bad", ["codes", "zero", "missing"])
def test_bad_codes_and_zero_points_are_refused(bad):
    codes = np.zeros((16, 64), np.uint8)
    zero = np.full((16, 1), 8, np.uint8)
    if bad == "codes":
        codes[3, 3] = 16
    if bad == "zero":
        zero[2, 0] = 200
    with pytest.raises(ValueError):
        kernels.pack_quantized(codes, np.ones((16, 1), np.float32), "INT4_ZP", group_size=64,
                               zero_points=None if bad == "missing" else zero)


@pytest.mark.parametrize("fmt,group", [(f, 32) for f in ASYMMETRIC] + [("INT8_GROUP", 16), ("INT8_MIN", 16)])
def test_moe_and_packed_file(tmp_path, fmt, group):
    rng = np.random.default_rng(7)
    E, k, H, I = 5, 2, 128, 96
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.05 + 0.01 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.05
    method = "INT4_ASYM" if fmt == "INT4_ZP" else fmt  # KTransformers' name for INT4_ZP
    cfg = ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(method, group_size=group))
    layer = ktcy.MoE.from_weights(cfg, gate, up, down)
    x = rng.standard_normal((6, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 1], [0, 2], [3, 0], [1, 2]])  # expert 4 gets no tokens
    w = rng.random((6, k)).astype(np.float32)
    y = layer.forward(x, ids, w)
    exact = sum(w[:, j:j + 1] * np.stack([
        (lambda g, u: (g / (1 + np.exp(-g)) * u) @ layer.down[e].dequantize().T)(
            x[t].astype(np.float64) @ layer.gate[e].dequantize().T, x[t].astype(np.float64) @ layer.up[e].dequantize().T)
        for t, e in enumerate(ids[:, j])]) for j in range(k))
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.03  # int8 activation error only
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        other = ktcy.MoE(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt, group_size=group), isa=isa),
                         layer.gate, layer.up, layer.down)
        assert np.array_equal(other.forward(x, ids, w), y), isa
    experts = {e: {p: (a[e], None) for p, a in (("gate", gate), ("up", up), ("down", down))} for e in range(E)}
    write_layer(str(tmp_path / "l.safetensors"), pack_layer(E, fmt, group, experts.__getitem__), fmt, group,
                E, k, H, I, 0)
    loaded = load_layer(str(tmp_path / "l.safetensors"))
    assert loaded.format == fmt and np.array_equal(loaded.forward(x, ids, w), y)


@pytest.mark.parametrize("fmt", ASYMMETRIC)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_codes_and_activations_stay_exact(fmt, group, sign):
    """Codes 15 (and 0) against activations that quantize to +-127 everywhere: the largest sums a
    row of products can reach, where AVX2 tiles of 2 or more rows add 8 rows of vpmaddubsw pairs
    in int16 (2 x 15 x 127 x 8 = 30480) before widening.  Every variant must still equal the
    integer reference, at every decode tile height and prefill row counts."""
    n, k = 48, 256
    codes = np.full((n, k), 15, np.uint8)
    codes[::3] = 0
    scale = np.ones((n, k // group), np.float32)
    side = {"zero_points": np.zeros((n, k // group), np.uint8)} if fmt == "INT4_ZP" else \
        {"mins": np.full((n, k // group), -7.5, np.float32)}  # the largest group sums times a min too
    p = kernels.pack_quantized(codes, scale, fmt, group_size=group, **side)
    for m in (1, 2, 3, 4, 8, 37):
        X = np.full((m, k), 3.0 * sign, np.float32)
        X[1::2] *= -1
        ref = int4_exact_reference(X, p)
        assert np.abs(ref).max() > 0
        for v in runnable_variants(fmt):
            assert np.array_equal(kernels.linear_variant(X, p, v), ref), (v, m)


def test_group_accessors_refuse_formats_without_group_scales():
    p = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    with pytest.raises(ValueError, match="no group scales"):
        p.group_scales()
    assert kernels.pack(np.ones((16, 64), np.float32), "INT4").group_zero_points() is None
