"""A MoE layer whose down projection has its own format (MoeConfig.down_quant_config): what a
GGUF Q4_K_M layer needs (INT4_MIN gate and up, INT8_GROUP down), and any other pair, across
activation kinds (int8 for one side, bf16 for the other).  Against float64 on the same
dequantized weights, the same bits on every ISA and amx_emu, slots, refusals."""
import numpy as np
import pytest

import ktcy
from conftest import ordered_slot_sum
from ktcy import kernels

E, K_TOP, H, I = 6, 2, 144, 80   # H, I not multiples of the 64-wide blocks
PAIRS = [(("INT4_MIN", 32), ("INT8_GROUP", 16)), (("BF16", None), ("INT8", None)), (("INT8", None), ("BF16", None)),
         (("INT4", 64), ("MXFP4_A8", None)), (("FP8_PERCHANNEL", None), ("INT4_ZP", 32)),
         (("INT8_GROUP", 32), ("INT8_GROUP", 16))]


def _quant(fmt, group):
    return ktcy.QuantConfig(fmt, group_size=group) if group else ktcy.QuantConfig(fmt)


def _layer(gate_up, down, isa=None, seed=0):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    w_down = rng.standard_normal((E, H, I), np.float32) * 0.1
    cfg = ktcy.MoeConfig(E, K_TOP, H, I, _quant(*gate_up), isa=isa, down_quant_config=_quant(*down))
    return ktcy.MoE.from_weights(cfg, gate, up, w_down)


def _reference(layer, x, ids, w):
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            if e < 0:
                continue
            xt = x[t].astype(np.float64)
            g, u = layer.gate[e].dequantize() @ xt, layer.up[e].dequantize() @ xt
            out[t] += w[t, j] * (layer.down[e].dequantize() @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("gate_up,down", PAIRS, ids=[f"{a[0]}+{b[0]}" for a, b in PAIRS])
def test_each_projection_runs_in_its_own_format(gate_up, down):
    layer = _layer(gate_up, down)
    assert (layer.format, layer.down_format) == (gate_up[0], down[0])
    assert all(w.format == down[0] for w in layer.down) and all(w.format == gate_up[0] for w in layer.gate + layer.up)
    if down[1]:
        assert layer.down[0].group_size == down[1]
    rng = np.random.default_rng(1)
    for T in (1, 3, 40):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = np.stack([rng.permutation(E - 1)[:K_TOP] for _ in range(T)])  # expert E - 1 gets no tokens
        if T > 1:
            ids[1, 1] = -1  # a slot handled elsewhere
        w = rng.random((T, K_TOP)).astype(np.float32)
        y = layer.forward(x, ids, w)
        ref = _reference(layer, x, ids, w)
        # int8 or bf16 activations' error only (MXFP4_A8 and FP8 sides: their activations' too)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.03, T
        slots = layer.forward_slots(x, ids, w)
        assert np.array_equal(ordered_slot_sum(slots), y)
        for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
            other = ktcy.MoE(ktcy.MoeConfig(E, K_TOP, H, I, _quant(*gate_up), isa=isa, down_quant_config=_quant(*down)),
                             layer.gate, layer.up, layer.down)
            got = other.forward(x, ids, w)
            if {gate_up[0], down[0]} <= {"INT8", "INT8_GROUP", "INT4", "INT4_ZP", "INT4_MIN", "MXFP4_A8"}:
                assert np.array_equal(got, y), (isa, T)  # integer formats: the same bits everywhere
            else:
                assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.03, (isa, T)


def test_the_big_and_small_kernels_of_each_side_are_chosen_by_its_own_rows():
    layer = _layer(("INT4_MIN", 32), ("INT8_GROUP", 16), isa="amx_emu")
    engine = layer._engine
    assert "gate and up; down: INT8_GROUP on amx_emu" in layer.kernel
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K_TOP] for _ in range(64)])
    w = rng.random((64, K_TOP)).astype(np.float32)
    y = layer.forward(x, ids, w)
    engine.big_min_rows = 1  # both sides on the AMX kernel at every row count
    assert engine.big_min_rows_down == 1
    assert np.array_equal(layer.forward(x, ids, w), y)
    engine.big_min_rows_down = 10**9  # down on its decode kernel only
    assert engine.big_min_rows == 1 and np.array_equal(layer.forward(x, ids, w), y)


def test_weights_that_do_not_fit_their_side_are_refused():
    layer = _layer(("INT4_MIN", 32), ("INT8_GROUP", 16))
    cfg = layer.config
    with pytest.raises(ValueError, match=r"down\[0\] is INT4_MIN .* expected INT8_GROUP"):
        ktcy.MoE(cfg, layer.gate, layer.up, layer.gate[:1] * E)
    same = ktcy.MoeConfig(E, K_TOP, H, I, cfg.quant_config)  # no down format: INT4_MIN for all three
    with pytest.raises(ValueError, match=r"down\[0\] is INT8_GROUP .* expected INT4_MIN"):
        ktcy.MoE(same, layer.gate, layer.up, layer.down)
    regrouped = [kernels.pack(w.dequantize(np.float32), "INT8_GROUP", group_size=32) for w in layer.down]
    with pytest.raises(ValueError, match=r"down\[1\] has group size 32, the layer's down 16"):
        ktcy.MoE(cfg, layer.gate, layer.up, layer.down[:1] + regrouped[1:])
    with pytest.raises(TypeError, match="down_quant_config must be a ktcy.QuantConfig"):
        ktcy.MoeConfig(E, K_TOP, H, I, cfg.quant_config, down_quant_config="INT8")
    with pytest.raises(ValueError, match="INT8 down experts with K = 70000"):
        ktcy.MoeConfig(E, K_TOP, 64, 70000, ktcy.QuantConfig("BF16"), down_quant_config=ktcy.QuantConfig("INT8"))
