"""INT4 checkpoints as released (compressed-tensors pack-quantized, GPTQ v1/v2, AWQ): tensors packed
in the tests from each format's description, loaded as stored with exact dequantization, MoE
forward against float64, the same numbers on every ISA, convert -> load bit-exact, refusals."""
import json
import os

import numpy as np
import pytest

import ktcy
from checkpoints import make_released_checkpoint, nibbles_to_int32
from ktcy.convert import convert
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write

CASES = {  # id: (kind, group, symmetric, stored format)
    "ct_sym_g32": ("ct", 32, True, "INT4"),       # Kimi-K2's scheme
    "ct_asym_g64": ("ct", 64, False, "INT4_ZP"),
    "gptq_v1_sym_g32": ("gptq", 32, True, "INT4"),
    "gptq_v1_asym_g64": ("gptq", 64, False, "INT4_ZP"),
    "gptq_v2_asym_g32": ("gptq_v2", 32, False, "INT4_ZP"),
    "awq_g64": ("awq", 64, False, "INT4_ZP"),
    "gptq8_sym_g32": ("gptq8", 32, True, "INT8_GROUP"),   # 8-bit: codes q - 128, -128 included
    "gptq8_sym_g64": ("gptq8", 64, True, "INT8_GROUP"),
    "gptq8_sym_channel": ("gptq8", None, True, "INT8"),       # group_size -1: a scale per channel
    "gptq_v1_sym_channel": ("gptq", None, True, "INT4"),      # 4-bit: kept as groups of 128
    "awq_channel": ("awq", None, False, "INT4_ZP"),
    "ct8_sym_g32": ("ct8", 32, True, "INT8_GROUP"),           # compressed-tensors W8A16
    "ct8_sym_channel": ("ct8", None, True, "INT8"),
    "ct8_int_sym_channel": ("ct8_int", None, True, "INT8"),   # W8A8: int8 weights as they are
    "ct8_int_sym_g64": ("ct8_int", 64, True, "INT8_GROUP"),
}
KEPT_GROUP = 128  # the group a 4-bit scale per output channel is kept in
E, H, I, K = 4, 128, 64, 2


class Quiet:
    def bar(self, *a):
        pass

    def line(self, text):
        pass


def _kept_group(case):
    _, group, _, fmt = CASES[case]
    return 0 if fmt == "INT8" else group or KEPT_GROUP


def build(tmp_path, case, **kw):
    kind, group, sym, _ = CASES[case]
    path = tmp_path / case
    return path, make_released_checkpoint(path, kind, group=group, sym=sym, E=E, H=H, I=I, top_k=K, **kw)


def moe_reference(x, ids, w, truth, L):
    """float64 SwiGLU MoE on the dequantized weights."""
    out = np.zeros((x.shape[0], H))
    xd = x.astype(np.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g, u = truth[L]["gate"][e] @ xd[t], truth[L]["up"][e] @ xd[t]
            out[t] += w[t, j] * (truth[L]["down"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


def inputs(seed=1, T=6):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    return x, ids, rng.random((T, K)).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_loaded_as_stored_with_exact_dequantization(tmp_path, case):
    path, truth = build(tmp_path, case)
    moe = ktcy.load_experts(path, 1)
    assert moe.format == CASES[case][3] and moe.gate[0].group_size == _kept_group(case)
    for proj in ("gate", "up", "down"):
        for e in range(E):
            assert np.array_equal(getattr(moe, proj)[e].dequantize(), truth[1][proj][e]), (proj, e)
    x, ids, w = inputs()
    y = moe.forward(x, ids, w)
    ref = moe_reference(x, ids, w, truth, 1)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.03  # the int8 activations' error only
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        assert np.array_equal(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, w), y), isa


@pytest.mark.parametrize("case", ["ct_sym_g32", "gptq_v1_asym_g64", "awq_g64", "gptq8_sym_g32", "ct8_sym_channel",
                                  "ct8_int_sym_g64"])
def test_convert_keeps_the_codes_bit_exact(tmp_path, case):
    path, _ = build(tmp_path, case)
    out = tmp_path / "packed"
    assert convert(path, out, progress=Quiet()) == [1]
    x, ids, w = inputs(2)
    original, packed = ktcy.load_experts(path, 1), ktcy.load_experts(out, 1)
    group = _kept_group(case)
    assert packed.format == original.format and packed.gate[0].group_size == group
    assert np.array_equal(packed.forward(x, ids, w), original.forward(x, ids, w))
    for proj in ("gate", "up", "down"):
        assert np.array_equal(getattr(packed, proj)[3].codes(), getattr(original, proj)[3].codes())
    record = json.loads((out / "ktcy_model.json").read_text())["layer_records"]["1"]
    assert record["weight_format"] == CASES[case][3] and record["group_size"] == group


def test_other_methods_dequantize_exactly_first(tmp_path):
    path, truth = build(tmp_path, "gptq_v2_asym_g32")
    x, ids, w = inputs(3)
    ref = moe_reference(x, ids, w, truth, 1)
    bf16 = ktcy.load_experts(path, 1, method="BF16")
    import ml_dtypes
    assert np.array_equal(bf16.up[2].dequantize(), truth[1]["up"][2].astype(ml_dtypes.bfloat16).astype(np.float64))
    int8 = ktcy.load_experts(path, 1, method="INT8")
    assert np.linalg.norm(int8.forward(x, ids, w) - ref) / np.linalg.norm(ref) < 0.03
    assert ktcy.load_experts(path, 1, method="INT4_ZP", group_size=64).gate[0].group_size == 64


def test_gptq_desc_act_is_refused_as_stored_and_converts_exactly(tmp_path):
    path, truth = build(tmp_path, "gptq_v2_asym_g32", permute=True)
    with pytest.raises(CheckpointError, match="g_idx.*desc_act"):
        ktcy.load_experts(path, 1)
    moe = ktcy.load_experts(path, 1, method="BF16")
    import ml_dtypes
    assert np.array_equal(moe.down[1].dequantize(), truth[1]["down"][1].astype(ml_dtypes.bfloat16).astype(np.float64))
    asked = ktcy.load_experts(path, 1, method="INT4_ZP")  # asked for by name: quantized again, groups in order
    assert asked.format == "INT4_ZP" and asked.gate[0].group_size == 32
    x, ids, w = inputs(7)
    ref = moe_reference(x, ids, w, truth, 1)
    assert np.linalg.norm(asked.forward(x, ids, w) - ref) / np.linalg.norm(ref) < 0.15  # one more INT4 rounding


def test_gptq_8_bit_with_zero_points_is_refused_as_stored_and_dequantized_exactly(tmp_path):
    path = tmp_path / "gptq8"
    truth = make_released_checkpoint(path, "gptq8", group=32, sym=False, E=E, H=H, I=I, top_k=K)
    with pytest.raises(CheckpointError, match="8-bit zero points"):
        ktcy.load_experts(path, 1)
    import ml_dtypes
    moe = ktcy.load_experts(path, 1, method="BF16")
    assert np.array_equal(moe.up[1].dequantize(), truth[1]["up"][1].astype(ml_dtypes.bfloat16).astype(np.float64))
    kept = make_released_checkpoint(tmp_path / "sym", "gptq8", group=32, sym=True, E=E, H=H, I=I, top_k=K)
    codes = ktcy.load_experts(tmp_path / "sym", 1).gate[0].codes()
    assert codes.min() == -128 and codes.max() == 127  # the whole range, as released
    assert kept[1]["gate"][0].min() < 0


@pytest.mark.parametrize("kind", ["ct8", "ct8_int"])
def test_compressed_tensors_8_bit_with_zero_points_is_refused_as_stored_and_dequantized_exactly(tmp_path, kind):
    import ml_dtypes
    path = tmp_path / kind
    truth = make_released_checkpoint(path, kind, group=32, sym=False, E=E, H=H, I=I, top_k=K)
    with pytest.raises(CheckpointError, match="8-bit zero points"):
        ktcy.load_experts(path, 1)
    moe = ktcy.load_experts(path, 1, method="BF16")
    assert np.array_equal(moe.down[2].dequantize(), truth[1]["down"][2].astype(ml_dtypes.bfloat16).astype(np.float64))


def test_gptq_v1_zero_point_16_is_refused_as_stored(tmp_path):
    path, truth = build(tmp_path, "gptq_v1_asym_g64")
    name = "model.layers.1.mlp.experts.0.gate_proj.qzeros"
    tensors = _tensors(path)
    z = np.asarray(tensors[name]).copy()
    z[0, 0] |= 0xF  # stored 15: GPTQ v1's z - 1 of 16
    tensors[name] = z
    write(str(path / "model.safetensors"), tensors, {"format": "pt"})
    with pytest.raises(CheckpointError, match="zero point 16"):
        ktcy.load_experts(path, 1)
    assert ktcy.load_experts(path, 1, method="BF16").format == "BF16"


def test_model_blocks_route_over_released_experts(tmp_path):
    path, truth = build(tmp_path, "ct_sym_g32")
    model = ktcy.MoEModel.from_pretrained(path)
    block = model.blocks["model.layers.1.mlp.experts"]
    assert block.experts.format == "INT4"
    x = inputs(4)[0]
    ids, w = block.route(x)
    ref = moe_reference(x, ids, w, truth, 1)
    y = block.forward(x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.03


def _tensors(path):
    f = SafetensorsFile(str(path / "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.keys()}


def _tamper(path, edit):
    tensors = _tensors(path)
    edit(tensors)
    os.remove(path / "model.safetensors")
    write(str(path / "model.safetensors"), tensors, {"format": "pt"})


EXPERT0 = "model.layers.1.mlp.experts.0"
TAMPERED = {
    "weight_shape": ("ct_sym_g32", lambda t: t.__setitem__(f"{EXPERT0}.gate_proj.weight_shape", np.array([64, 64])),
                     "weight_shape"),
    "ct_scale_shape": ("ct_sym_g32", lambda t: t.__setitem__(f"{EXPERT0}.up_proj.weight_scale",
                                                             t[f"{EXPERT0}.up_proj.weight_scale"][:, :2]), "weight_scale"),
    "ct_packed_dtype": ("ct_sym_g32", lambda t: t.__setitem__(f"{EXPERT0}.gate_proj.weight_packed",
                                                              t[f"{EXPERT0}.gate_proj.weight_packed"].view(np.float32)),
                        "weight_packed"),
    "ct_zero_point_out_of_range": ("ct_asym_g64", lambda t: t.__setitem__(
        f"{EXPERT0}.down_proj.weight_zero_point", np.full((H, 1), 20, np.int8)), "weight_zero_point"),
    "ct_missing_zero_point": ("ct_asym_g64", lambda t: t.pop(f"{EXPERT0}.down_proj.weight_zero_point"),
                              "weight_zero_point"),
    "gptq_missing_qzeros": ("gptq_v1_asym_g64", lambda t: t.pop(f"{EXPERT0}.up_proj.qzeros"), "qzeros"),
    "gptq_scales_shape": ("gptq_v1_asym_g64", lambda t: t.__setitem__(f"{EXPERT0}.up_proj.scales",
                                                                      t[f"{EXPERT0}.up_proj.scales"][:, :8]), "scales"),
    "gptq_g_idx_out_of_range": ("gptq_v2_asym_g32", lambda t: t[f"{EXPERT0}.gate_proj.g_idx"].__setitem__(5, 99),
                                "g_idx"),
    "gptq_sym_with_zero_points": ("gptq_v1_sym_g32", lambda t: t.__setitem__(
        f"{EXPERT0}.gate_proj.qzeros", nibbles_to_int32(np.full((4, I), 3), axis=1)), "symmetric"),
    "awq_qweight_shape": ("awq_g64", lambda t: t.__setitem__(f"{EXPERT0}.down_proj.qweight",
                                                             t[f"{EXPERT0}.down_proj.qweight"][:32]), "qweight"),
    "ct8_packed_shape": ("ct8_sym_g32", lambda t: t.__setitem__(f"{EXPERT0}.gate_proj.weight_packed",
                                                                t[f"{EXPERT0}.gate_proj.weight_packed"][:, :8]),
                         "weight_packed"),
    "ct8_channel_scale_shape": ("ct8_sym_channel", lambda t: t.__setitem__(
        f"{EXPERT0}.up_proj.weight_scale", np.repeat(t[f"{EXPERT0}.up_proj.weight_scale"], 2, axis=1)), "weight_scale"),
    "ct8_int_weight_dtype": ("ct8_int_sym_channel", lambda t: t.__setitem__(
        f"{EXPERT0}.down_proj.weight", t[f"{EXPERT0}.down_proj.weight"].astype(np.int16)), "down_proj.weight is int16"),
    "ct8_int_sym_with_zero_points": ("ct8_int_sym_g64", lambda t: t.__setitem__(
        f"{EXPERT0}.gate_proj.weight_zero_point", np.full((I, 2), 3, np.int8)), "symmetric"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_tampered_tensors_are_refused_naming_the_tensor(tmp_path, case):
    kind, edit, named = TAMPERED[case]
    path, _ = build(tmp_path, kind)
    _tamper(path, edit)
    with pytest.raises(CheckpointError, match=named):
        moe = ktcy.load_experts(path, 1)
        moe.forward(*inputs())


CONFIGS = {
    "unknown_method": ({"quant_method": "bitsandbytes"}, "unknown quant_method"),
    "gptq_3_bits": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "4- and 8-bit"),
    "gptq_8_bits_on_4_bit_tensors": ({"quant_method": "gptq", "bits": 8, "group_size": 32},
                                     r"qweight has shape \(16, 64\); config.json implies \(32, 64\)"),
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "gemm"),
    "group_does_not_divide_k": ({"quant_method": "gptq", "bits": 4, "group_size": 48, "sym": False,
                                 "checkpoint_format": "gptq_v2"}, "does not divide"),
    "ct_activations": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8}}}}, "activations beside 4-bit weights"),
    "ct8_static_activations": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "dynamic": False, "strategy": "tensor"}}}}, "activations with static scales"),
    "ct_int_quantized_4_bits": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}, "8-bit int-quantized"),
    "ct8_tensor_strategy": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "tensor"}}}}, "group or channel strategy"),
    "ct_channel_4_bits": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, "4-bit int weights with group strategy"),
    "ct_two_bit_widths": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}},
        "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32}}}}, "disagree"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_bad_quantization_configs_are_refused(tmp_path, case):
    path, _ = build(tmp_path, "gptq_v2_asym_g32")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = CONFIGS[case][0]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=CONFIGS[case][1]):
        ktcy.load_experts(path, 1)


def test_convert_cli_keeps_gptq_codes(tmp_path):
    import subprocess
    import sys
    path, _ = build(tmp_path, "gptq_v1_asym_g64")
    out = tmp_path / "cli_out"
    r = subprocess.run([sys.executable, "-m", "ktcy", "convert", "--input", str(path), "--output", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "INT4_ZP" in r.stderr
    x, ids, w = inputs(5)
    assert np.array_equal(ktcy.load_experts(out, 1).forward(x, ids, w), ktcy.load_experts(path, 1).forward(x, ids, w))


def test_shared_expert_released_like_the_routed_ones(tmp_path):
    """A Qwen2-MoE-style block whose shared expert is stored pack-quantized too: packed as stored
    and added, gated by sigmoid(h . shared_expert_gate)."""
    import ml_dtypes
    from checkpoints import released_tensors
    S = 96
    path, truth = build(tmp_path, "ct_sym_g32", extra_config={"model_type": "qwen2_moe", "norm_topk_prob": False,
                                                              "shared_expert_intermediate_size": S})
    rng = np.random.default_rng(11)
    shared = {}

    def add(t):
        for proj, (n, k) in (("gate", (S, H)), ("up", (S, H)), ("down", (H, S))):
            q, s = rng.integers(0, 16, (n, k)), rng.uniform(0.001, 0.01, (n, k // 32)).astype(np.float32)
            t.update(released_tensors("ct", f"model.layers.1.mlp.shared_expert.{proj}_proj", q, np.full(s.shape, 8), s,
                                      32, rng))
            stored = s.astype(ml_dtypes.bfloat16).astype(np.float64)
            shared[proj] = (q - 8) * np.repeat(stored, 32, axis=1)
        gate = (rng.standard_normal((1, H)) * 0.1).astype(ml_dtypes.bfloat16)
        t["model.layers.1.mlp.shared_expert_gate.weight"] = gate
        shared["gate_w"] = gate.astype(np.float64)
    _tamper(path, add)
    block = ktcy.MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"]
    assert block.shared.moe.format == "INT4" and block.shared.moe.gate[0].group_size == 32
    assert np.array_equal(block.shared.moe.down[0].dequantize(), shared["down"])
    x = inputs(6)[0]
    ids, w = block.route(x)
    xd = x.astype(np.float64)
    g, u = xd @ shared["gate"].T, xd @ shared["up"].T
    extra = ((g / (1 + np.exp(-g)) * u) @ shared["down"].T) / (1 + np.exp(-(xd @ shared["gate_w"].T)))
    ref = moe_reference(x, ids, w, truth, 1) + extra
    y = block.forward(x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.03


# ---- property: any quantization_config or replaced expert tensor -> a scheme / layer, or CheckpointError ----

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ktcy.quant_readers import scheme_from_config  # noqa: E402

SHORT = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=2000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SCALARS = st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=6) \
    | st.sampled_from(["gptq", "awq", "mxfp4", "compressed-tensors", "pack-quantized", "int-quantized", "group",
                       "channel", "int", "gemm", "gptq_v2"])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["weights", "num_bits", "group_size", "strategy", "symmetric", "type", "format", "g",
                     "input_activations", "dynamic"]), inner,
    max_size=4), max_leaves=10)
CONFIG_KEYS = st.sampled_from(["quant_method", "bits", "w_bit", "group_size", "sym", "desc_act", "checkpoint_format",
                               "version", "zero_point", "format", "config_groups"])
CONFIGS_ST = st.dictionaries(CONFIG_KEYS, VALUES, max_size=6)


def _config_property(q):
    try:
        scheme = scheme_from_config({"quantization_config": q})
    except CheckpointError:
        return
    assert scheme is None or scheme.native_format in ("INT4", "INT4_ZP", "INT8_GROUP", "MXFP4")


@SHORT
@given(CONFIGS_ST)
def test_any_quantization_config_gives_a_scheme_or_checkpoint_error(q):
    _config_property(q)


@LONG
@given(CONFIGS_ST)
@pytest.mark.fuzz
def test_any_quantization_config_long(q):
    _config_property(q)


REPLACEMENTS = st.tuples(st.sampled_from(["int32", "int8", "uint8", "float16", "int64", "float32"]),
                         st.lists(st.integers(0, 70), min_size=0, max_size=3), st.integers(0, 2**32 - 1))


def _replaced_tensor_property(tmp_path, case, which, replacement):
    path, _ = build(tmp_path, case)
    tensors = _tensors(path)
    names = sorted(n for n in tensors if ".experts.0." in n or ".experts.1." in n)
    name = names[which % len(names)]
    dtype, shape, seed = replacement
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape, dtype=np.int64))
    tensors[name] = np.frombuffer(rng.bytes(count * np.dtype(dtype).itemsize), dtype).reshape(shape)
    os.remove(path / "model.safetensors")
    write(str(path / "model.safetensors"), tensors, {"format": "pt"})
    try:
        moe = ktcy.load_experts(path, 1, isa="ref")
    except CheckpointError:
        return
    assert np.isfinite(moe.forward(*inputs())).all()  # a well-formed replacement may load: it must run finitely


@SHORT
@given(st.sampled_from(sorted(CASES)), st.integers(0, 100), REPLACEMENTS)
def test_replaced_expert_tensors_load_or_give_checkpoint_error(tmp_path_factory, case, which, replacement):
    _replaced_tensor_property(tmp_path_factory.mktemp("r"), case, which, replacement)


@LONG
@given(st.sampled_from(sorted(CASES)), st.integers(0, 100), REPLACEMENTS)
@pytest.mark.fuzz
def test_replaced_expert_tensors_long(tmp_path_factory, case, which, replacement):
    _replaced_tensor_property(tmp_path_factory.mktemp("r"), case, which, replacement)


def test_autogptq_quantize_config_json(tmp_path):
    """AutoGPTQ's own checkpoints keep their settings in quantize_config.json, not config.json."""
    path, truth = build(tmp_path, "gptq_v1_asym_g64")
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.pop("quantization_config")
    q.pop("quant_method")
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "quantize_config.json").write_text(json.dumps(q))
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "INT4_ZP" and np.array_equal(moe.up[1].dequantize(), truth[1]["up"][1])
    from ktcy.hf_fp8 import convert_to_hf_fp8
    from ktcy.output_guard import ConvertError
    with pytest.raises(ConvertError, match="already quantized"):
        convert_to_hf_fp8(path, tmp_path / "fp8", progress=Quiet())
    (path / "quantize_config.json").write_text(json.dumps(dict(q, bits=3)))
    with pytest.raises(CheckpointError, match="quantize_config.json.*4- and 8-bit"):
        ktcy.load_experts(path, 1)


def test_compressed_tensors_actorder_g_idx(tmp_path):
    """compressed-tensors' actorder stores weight_g_idx: a permuted one is refused as stored,
    an in-order one is read as usual, one out of range is an error."""
    path, truth = build(tmp_path, "ct_asym_g64")
    name = "model.layers.1.mlp.experts.2.gate_proj.weight_g_idx"
    in_order = (np.arange(H) // 64).astype(np.int32)
    _tamper(path, lambda t: t.__setitem__(name, in_order))
    assert np.array_equal(ktcy.load_experts(path, 1).gate[2].dequantize(), truth[1]["gate"][2])
    _tamper(path, lambda t: t.__setitem__(name, in_order[::-1].copy()))
    with pytest.raises(CheckpointError, match="weight_g_idx.*desc_act"):
        ktcy.load_experts(path, 1)
    assert ktcy.load_experts(path, 1, method="INT8").format == "INT8"
    _tamper(path, lambda t: t.__setitem__(name, in_order + 5))
    with pytest.raises(CheckpointError, match="weight_g_idx.*outside"):
        ktcy.load_experts(path, 1, method="INT8")
