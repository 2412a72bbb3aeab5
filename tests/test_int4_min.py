"""INT4 with float mins (w = s * q + min per channel and K group, as llama.cpp's Q4_K and Q4_1
store it): layout round trip, the same bits on every ISA as a float32 reference built from the
integers, the quantizer's range, bad input, released codes, packed files.  The shape sweep, the
extreme-sums test and the MoE test it shares with INT4_ZP are in tests/test_int4_zp.py."""
import numpy as np
import pytest

import ktcy
from conftest import int4_exact_reference, per_channel_group_pairs, runnable_variants
from ktcy import kernels
from ktcy.packed_io import load_layer, pack_layer, write_layer
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write


def _released(rng, n, k, group):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, -(-k // group))).astype(np.float32)
    mins = -rng.uniform(0, 1, (n, -(-k // group))).astype(np.float32)
    return codes, scale, mins


@pytest.mark.parametrize("group", [32, 64, 128])
def test_codes_scales_and_mins_round_trip_exactly(group):
    rng = np.random.default_rng(group)
    n, k = 37, 300
    codes, scale, mins = _released(rng, n, k, group)
    p = kernels.pack_quantized(codes, scale, "INT4_MIN", group_size=group, mins=mins)
    assert p.codes().dtype == np.uint8 and np.array_equal(p.codes(), codes)
    rep = lambda a: np.repeat(a.astype(np.float64), group, axis=1)[:, :k]  # noqa: E731
    assert np.array_equal(p.dequantize(), codes * rep(scale) + rep(mins))
    # stored panel-major, each group's 16 scales then 16 mins (the documented index, read
    # independently), given back as [groups, N_pad]
    groups = -(-k // group)
    assert p.scale.shape == (3, groups, 32) and p.zero is None
    read_scale, read_mins = per_channel_group_pairs(p.scale, n)
    assert np.array_equal(read_scale, scale) and np.array_equal(read_mins, mins)
    assert np.array_equal(p.group_scales()[:, :n], scale.T) and np.array_equal(p.group_mins()[:, :n], mins.T)
    assert not p.group_scales()[:, n:].any() and not p.group_mins()[:, n:].any()
    assert p.padding_is_clear()


def test_released_codes_on_every_isa_and_every_row_count():
    rng = np.random.default_rng(3)
    n, k = 80, 512
    p = kernels.pack_quantized(*_released(rng, n, k, 32)[:2], "INT4_MIN", group_size=32,
                               mins=_released(rng, n, k, 32)[2])
    for m in (1, 2, 3, 4, 5, 8, 13, 16, 33, 130):
        X = rng.standard_normal((m, k)).astype(np.float32)
        ref = int4_exact_reference(X, p)
        for v in runnable_variants("INT4_MIN"):
            assert np.array_equal(kernels.linear_variant(X, p, v), ref), (v, m)


def test_quantizer_keeps_each_group_range_and_beats_symmetric_int4_on_shifted_weights():
    rng = np.random.default_rng(6)
    W = (rng.uniform(0, 1, (32, 192)) + np.linspace(-2, 2, 32)[:, None]).astype(np.float32)
    p = kernels.pack(W, "INT4_MIN", group_size=32)
    Wg = W.reshape(32, 6, 32).astype(np.float64)
    step = (Wg.max(axis=2) - Wg.min(axis=2)) / 15
    D = p.dequantize()
    err = np.abs(D - W).reshape(32, 6, 32).max(axis=2)
    assert (err <= step * 0.5 + 1e-6).all()  # every weight within half a step: no clipping
    assert np.array_equal(p.group_mins()[:, :32].T, Wg.min(axis=2).astype(np.float32))  # min exact
    sym = kernels.pack(W, "INT4", group_size=32).dequantize()
    assert np.linalg.norm(D - W) < 0.6 * np.linalg.norm(sym - W)


def test_constant_groups_are_exact():
    W = np.full((16, 64), -0.375, np.float32)
    W[3] = 2.5
    p = kernels.pack(W, "INT4_MIN", group_size=32)
    assert np.array_equal(p.dequantize(), W.astype(np.float64))
    X = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    for v in runnable_variants("INT4_MIN"):
        assert np.array_equal(kernels.linear_variant(X, p, v), int4_exact_reference(X, p)), v


@pytest.mark.parametrize("bad,match", [("codes", "0, 15"), ("missing", "needs its mins"),
                                       ("nan", r"mins at \(2, 1\) is nan"), ("shape", "mins must be"),
                                       ("huge", "INT4_MIN mins 1e\\+38 exceeds"), ("on_int4", "has no mins"),
                                       ("signed", "integers"), ("int_mins", "mins must be floats")])
def test_bad_codes_and_mins_are_refused(bad, match):
    codes = np.zeros((16, 64), np.uint8)
    mins = np.zeros((16, 2), np.float32)
    fmt = "INT4_MIN"
    if bad == "codes":
        codes[3, 3] = 16
    if bad == "nan":
        mins[2, 1] = np.nan
    if bad == "shape":
        mins = np.zeros((16, 3), np.float32)
    if bad == "huge":
        mins[0, 0] = 1e38
    if bad == "on_int4":
        fmt, codes = "INT4", codes.astype(np.int8)
    if bad == "signed":
        codes = codes.astype(np.float32)
    if bad == "int_mins":
        mins = mins.astype(np.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.pack_quantized(codes, np.ones((16, 2), np.float32), fmt, group_size=32,
                               mins=None if bad == "missing" else mins)


def test_a_layout_1_file_of_int4_min_is_refused(tmp_path):
    """Layout 1 (group-major scales) predates INT4_MIN: a file labelled so is foreign."""
    rng = np.random.default_rng(7)
    E, k, H, I = 2, 1, 64, 64
    experts = {e: {p: (rng.standard_normal((I, H), np.float32) * 0.05, None) for p in ("gate", "up", "down")}
               for e in range(E)}
    path = str(tmp_path / "l.safetensors")
    write_layer(path, pack_layer(E, "INT4_MIN", 32, experts.__getitem__), "INT4_MIN", 32, E, k, H, I, 0)
    assert load_layer(path).format == "INT4_MIN"
    now = SafetensorsFile(path)
    tensors = {name: np.array(now.get(name)) for name in now.keys()}
    write(path, tensors, dict(now.metadata, layout_version="1"))
    with pytest.raises(CheckpointError, match="layout version 1 predates INT4_MIN"):
        load_layer(path)


def test_released_codes_are_kept_by_from_experts():
    rng = np.random.default_rng(8)
    E, k, H, I = 3, 2, 64, 96
    stored = {}
    for e in range(E):
        stored[e] = {}
        for proj, (n, kk) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            codes, scale, mins = _released(rng, n, kk, 32)
            stored[e][proj] = (codes, {"format": "INT4_MIN", "scale": scale, "mins": mins, "group_size": 32})
    cfg = ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("INT4_MIN", group_size=32))
    layer = ktcy.MoE.from_experts(cfg, stored.__getitem__)
    for e in range(E):
        codes, spec = stored[e]["down"]
        assert np.array_equal(layer.down[e].codes(), codes)
        assert np.array_equal(layer.down[e].group_mins()[:3, :H], spec["mins"].T)  # K 96: 3 of 4 padded groups
    # another format dequantizes the released values exactly, then quantizes them
    as_bf16 = ktcy.MoE.from_experts(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("BF16")), stored.__getitem__)
    codes, spec = stored[1]["up"]
    want = codes * np.repeat(spec["scale"], 32, axis=1) + np.repeat(spec["mins"], 32, axis=1)
    assert np.abs(as_bf16.up[1].dequantize() - want).max() <= np.abs(want).max() * 2 ** -8
