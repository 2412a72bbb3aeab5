"""Behaviour that mutation testing found unpinned (a plausible one-line bug in the code under
test left every other test passing): edge values of the readers' and packers' range checks,
router rules on paths the fixture checkpoints never take, the aligned copy of a tensor at an odd
file offset; in the C kernels, AVX2 FP8's wide-row decode of weights holding NaN codes, the
threshold of that decode, and the engine's down bias on a hidden size that is not a multiple of
16.  Each test here fails under the mutant it was written for."""
import numpy as np
import pytest

import ktcy
from checkpoints import nibbles_to_int32
from conftest import bf16_round, isa_params
from ktcy import kernels
from ktcy.quant_readers import (QuantScheme, mxfp4_released, read_compressed_tensors, read_gptq,
                                scheme_from_config)
from ktcy.routing import Router, router_kind
from ktcy.safetensors_io import CheckpointError


class FakeCkpt:
    """The three things the quant readers use of a Checkpoint."""
    path = "fake"

    def __init__(self, tensors):
        self.t = tensors

    def get(self, name):
        if name not in self.t:
            raise CheckpointError(f"no {name}")
        return self.t[name]

    def __contains__(self, name):
        return name in self.t


# R3: routing.py `norm_topk_prob and k > 1`
def test_deepseek_top1_weight_is_the_raw_score_times_the_factor():
    rng = np.random.default_rng(0)
    E, H = 8, 16
    W = rng.standard_normal((E, H)).astype(np.float32)
    h = rng.standard_normal((5, H)).astype(np.float32)
    r = Router("deepseek_v3", W, top_k=1, norm_topk_prob=True, bias=np.zeros(E, np.float32), n_group=1,
               topk_group=1, routed_scaling_factor=2.5)
    ids, w = r(h)
    scores = 1 / (1 + np.exp(-(h.astype(np.float64) @ W.T.astype(np.float64))))
    np.testing.assert_allclose(w, np.take_along_axis(scores, ids, 1) * 2.5, rtol=1e-5)


# R7: routing.py mixtral detection without model_type
def test_router_kind_without_model_type_follows_the_tensor_names():
    assert router_kind({}, "model.layers.1.block_sparse_moe", "cfg") == "mixtral"
    assert router_kind({}, "model.layers.1.mlp", "cfg") == "softmax"


# Q2: quant_readers._group accepting 0
@pytest.mark.parametrize("q", [
    {"quant_method": "gptq", "bits": 4, "group_size": 0},
    {"quant_method": "awq", "bits": 4, "group_size": 0},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 0}}}},
])
def test_group_size_zero_is_refused(q):
    with pytest.raises(CheckpointError, match="group_size"):
        scheme_from_config({"quantization_config": q})


# Q6: compressed-tensors asymmetric int8 zero points outside [-8, 7]
def test_ct_int8_zero_point_8_is_refused():
    n, k, g = 16, 64, 32
    q = np.zeros((n, k), np.uint8)
    t = {"w.weight_packed": nibbles_to_int32(q, 1), "w.weight_shape": np.array([n, k], np.int64),
         "w.weight_scale": np.ones((n, k // g), np.float32),
         "w.weight_zero_point": np.full((n, k // g), 8, np.int8)}
    with pytest.raises(CheckpointError, match="outside"):
        read_compressed_tensors(FakeCkpt(t), "w", n, k, QuantScheme("compressed-tensors", g, symmetric=False))


def gptq_tensors(n, k, g):
    groups = k // g
    return {"w.qweight": nibbles_to_int32(np.zeros((k, n)), 0), "w.qzeros": nibbles_to_int32(np.full((groups, n), 7), 1),
            "w.scales": np.ones((groups, n), np.float16)}


# Q7: g_idx == groups must be refused
def test_gptq_g_idx_equal_to_the_group_count_is_refused():
    n, k, g = 16, 64, 32
    t = gptq_tensors(n, k, g)
    g_idx = np.arange(k, dtype=np.int32) // g
    g_idx[5] = k // g
    t["w.g_idx"] = g_idx
    with pytest.raises(CheckpointError, match=r"g_idx\[5\] = 2 is outside \[0, 2\)"):
        read_gptq(FakeCkpt(t), "w", n, k, QuantScheme("gptq", g, True, 1))


# Q8: GPTQ N not a multiple of 8
def test_gptq_n_not_a_multiple_of_8_is_refused():
    n, k, g = 12, 64, 32
    t = {"w.qweight": nibbles_to_int32(np.zeros((k, 16)), 0)[:, :n], "w.qzeros": np.zeros((k // g, 1), np.int32),
         "w.scales": np.ones((k // g, n), np.float16)}
    with pytest.raises(CheckpointError, match="multiples of 8"):
        read_gptq(FakeCkpt(t), "w", n, k, QuantScheme("gptq", g, True, 1))


# Q9: MXFP4 exponent below E8M0_RANGE's low end in a used block
def test_mxfp4_exponent_below_the_exact_range_is_refused_by_the_reader():
    blocks = np.zeros((16, 2, 16), np.uint8)
    blocks[3, 1, 0] = 0x02  # code 2 (1.0) in block 1 of row 3
    scales = np.full((16, 2), 127, np.uint8)
    scales[3, 1] = 1
    with pytest.raises(CheckpointError, match=r"exponent 1 \(row 3, block 1\)"):
        mxfp4_released(FakeCkpt({}), "x.gate_up_proj", blocks, scales)


# K4: INT4 codes one past either end (8 would wrap to -8 in the nibble: silently wrong sums)
@pytest.mark.parametrize("code", [8, -9])
def test_int4_codes_one_past_the_range_are_refused(code):
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        kernels.pack_quantized(np.full((16, 64), code, np.int8), np.ones((16, 1), np.float32), "INT4")


# MO5: moe._checked_bias without its isfinite check
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_bias_is_refused(bad):
    E, H, I = 4, 64, 32
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, E, I, H)).astype(np.float32) * 0.1
    down = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    b = np.zeros((E, I), np.float32)
    b[1, 3] = bad
    with pytest.raises(ValueError, match="gate bias holds NaN or infinity"):
        ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("BF16")), gate, up, down, bias={"gate": b})


# P4: packed_io.map_layer's expert range check (< E)
def test_map_layer_refuses_expert_number_e(tmp_path):
    from ktcy.moe import stacked_experts
    from ktcy.packed_io import map_layer, pack_layer, write_layer
    E, H, I = 4, 64, 32
    rng = np.random.default_rng(0)
    g, u = (rng.standard_normal((2, E, I, H)) * 0.1).astype(np.float32)
    d = (rng.standard_normal((E, H, I)) * 0.1).astype(np.float32)
    cfg = ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8"))
    arrays = pack_layer(E, "INT8", 64, stacked_experts(cfg, g, u, d))
    path = tmp_path / "ktcy_layer_0001.safetensors"
    write_layer(path, arrays, "INT8", 64, E, 2, H, I, 1)
    assert map_layer(path, experts=[E - 1]).weights["gate"][E - 1] is not None
    with pytest.raises(CheckpointError, match=r"holds experts 0\.\.3; asked for \[4\]"):
        map_layer(path, experts=[E])


# S3: safetensors_io.SafetensorsFile.get copies a tensor at an odd offset
def test_tensor_at_an_odd_offset_is_handed_out_aligned(tmp_path):
    from ktcy.safetensors_io import SafetensorsFile, write
    path = tmp_path / "odd.safetensors"
    write(path, {"a": np.zeros(3, np.uint8), "b": np.arange(4, dtype=np.float32)})  # b starts at byte 3
    t = SafetensorsFile(path).get("b")
    assert t.flags.aligned and not t.flags.writeable
    np.testing.assert_array_equal(t, np.arange(4, dtype=np.float32))


# ---- C kernels (a build per mutant) ----

def _fp8_codes(rng, n, k):
    codes = rng.integers(0, 256, size=(n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes but the ones placed below
    return codes


@pytest.mark.skipif("avx2" not in ktcy.available_isas(), reason="needs AVX2")
@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_fp8_avx2_wide_row_call_with_nan_codes_matches_ref(fmt):
    """fmt_fp8.h wrow_wide: a block row holding a NaN code is decoded through the table into the
    lane-split order.  Only a call that holds a row of 2^15 or more (the wide decode) AND a weight
    with NaN codes goes there: every channel of that block row must keep its place."""
    rng = np.random.default_rng(7)
    n, k = 32, 128
    codes = _fp8_codes(rng, n, k)
    codes[3, 5], codes[20, 70] = 0x7F, 0xFF
    scale = np.full(n, 0.01, np.float32) if fmt == "FP8_PERCHANNEL" else np.full((1, 1), 0.01, np.float32)
    p = kernels.pack_quantized(codes, scale, fmt)
    X = rng.standard_normal((3, k)).astype(np.float32)
    X[1, 9] = 40000.0  # a wide row (>= 2^15): the whole call takes wrow_wide
    want = kernels.linear(X, p, isa="ref")
    got = kernels.linear(X, p, isa="avx2")
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert sorted(set(np.nonzero(np.isnan(got))[1])) == [3, 20]
    fin = ~np.isnan(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("isa", isa_params())
def test_down_bias_with_hidden_size_not_a_multiple_of_16(isa):
    """_moe_engine.pxi down phase: the bias loop over the last panel must stop at H.  All the
    suite's biased layers have H % 16 == 0; here H = 40, and one expert holds several tokens
    (the bias of row r's padding columns would land on row r + 1)."""
    E, K, H, I = 3, 2, 40, 32
    rng = np.random.default_rng(5)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    bias = {"gate": rng.standard_normal((E, I), np.float32), "up": rng.standard_normal((E, I), np.float32),
            "down": rng.standard_normal((E, H), np.float32)}
    T = 6
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.array([[0, 1], [1, 0], [2, 1], [1, 2], [0, 2], [2, 0]])
    w = rng.random((T, K)).astype(np.float32)
    cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig("BF16"), isa=isa)
    layer = ktcy.MoE.from_weights(cfg, gate, up, down, bias=bias)
    y = layer.forward(x, ids, w)
    dq = {n: [getattr(layer, n)[e].dequantize() for e in range(E)] for n in ("gate", "up", "down")}
    xb = bf16_round(x)
    exact = np.zeros((T, H))
    for t in range(T):
        for j, e in enumerate(ids[t]):
            g = xb[t] @ dq["gate"][e].T + bias["gate"][e]
            u = xb[t] @ dq["up"][e].T + bias["up"][e]
            h = bf16_round(g / (1 + np.exp(-g)) * u)
            exact[t] += w[t, j] * (h @ dq["down"][e].T + bias["down"][e])
    np.testing.assert_allclose(y, exact, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("isa", ["avx2"])  # AVX-512's bf16 path flushes a product this small (vdpbf16ps)
@pytest.mark.parametrize("big", [2.0 ** 15, 40000.0, 65000.0])
def test_fp8_rows_from_2_15_keep_tiny_products_exact(isa, big):
    """numeric.h KTCY_E4M3_WIDE_FIELD: rows from 2^15 on take the wide decode (AVX2).  A row of
    [2^15, 2^16) whose only product meeting a non-zero weight is a full-mantissa activation near
    2^-126 times a subnormal code must come out as float64 has it (the bit-move decode with
    k = 110 would round that product to 8 bits).  AVX-512's bf16 path gives 0 here: vdpbf16ps
    flushes a product below float's normal range (README, Range)."""
    if isa not in ktcy.available_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    codes = np.full((16, 64), 0x07, np.uint8)  # 7 * 2^-9, subnormal
    codes[:, 0] = 0
    X = np.zeros((1, 64), np.float32)
    X[0, 0] = big
    X[0, 1] = np.float32(1.9921875 * 2.0 ** -126)  # bf16-exact, 8 significant bits
    scale = np.full(16, 2.0 ** 20, np.float32)
    p = kernels.pack_quantized(codes, scale, "FP8_PERCHANNEL")
    want = float(X[0, 1]) * 7 * 2.0 ** -9 * 2.0 ** 20
    got = kernels.linear(X, p, isa=isa)[0]
    assert np.all(np.abs(got - want) <= 1e-6 * want), (got[:4], want)
