"""MoEModel from a GGUF model: routers and shared experts read from llama.cpp's tensors and
metadata.  Each family's tiny transformers model is written as llama.cpp's converter writes it
(its tensor names and `{arch}.*` keys, written here from the converter's description, not by
ktcy), and the blocks built from that file must equal the blocks built from the Hugging Face
folder; a float64 reference of llama.cpp's routing covers the metadata a config.json cannot say."""
import os

import numpy as np
import pytest

import gguf
import hf_checkpoints as ckpts

torch = pytest.importorskip("torch")  # CI installs the hf extra: this never skips there
pytest.importorskip("transformers")
import ktcy  # noqa: E402
from ktcy.convert import convert  # noqa: E402
from test_gguf import _close  # noqa: E402
from ktcy.model import MoEModel  # noqa: E402
from ktcy.safetensors_io import CheckpointError  # noqa: E402

T = gguf.GGMLQuantizationType

# HF model_type -> (general.architecture, the router and shared-expert keys llama.cpp's converter
# writes from its config)
FAMILIES = {
    "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "qwen3_next": "qwen3next", "olmoe": "olmoe",
    "mixtral": "llama", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe",
    "dots1": "dots1", "ernie4_5_moe": "ernie4_5-moe", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss",
    "glm4_moe_lite": "deepseek2",
}


def hf_tensors(folder):
    from safetensors import safe_open
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key).float().numpy()
    return out


def bf16_bytes(x):
    return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), T.BF16)


def add_bf16(w, name, x):
    raw = bf16_bytes(x)
    w.add_tensor(name, raw.reshape(x.shape[:-1] + (2 * x.shape[-1],)), raw_dtype=T.BF16)


def expert_stacks(t, p, E):
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of the block at prefix p."""
    if f"{p}.experts.gate_up_proj" in t:  # GPT-OSS: [E, H, 2I] with gate and up interleaved, down [E, I, H]
        gu = t[f"{p}.experts.gate_up_proj"]
        return (gu[:, :, 0::2].transpose(0, 2, 1), gu[:, :, 1::2].transpose(0, 2, 1),
                t[f"{p}.experts.down_proj"].transpose(0, 2, 1))
    names = ("gate_proj", "up_proj", "down_proj") if f"{p}.experts.0.gate_proj.weight" in t else ("w1", "w3", "w2")
    return tuple(np.stack([t[f"{p}.experts.{e}.{n}.weight"] for e in range(E)]) for n in names)


def expert_count(cfg):
    return cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg["moe_num_experts"]


def add_family_metadata(w, cfg, model_type, extra_blocks=0):
    """The `{arch}.` keys llama.cpp's converter writes for the family's MoE blocks (extra_blocks:
    multi-token-prediction blocks counted in block_count)."""
    arch = FAMILIES[model_type]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    keys = {"block_count": cfg["num_hidden_layers"] + extra_blocks, "expert_count": expert_count(cfg),
            "expert_used_count": cfg.get("num_experts_per_tok") or cfg.get("moe_k"),
            "embedding_length": cfg["hidden_size"]}
    keys["feed_forward_length" if arch == "llama" else "expert_feed_forward_length"] = inter
    if "shared_expert_intermediate_size" in cfg:
        keys["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    if arch in ("deepseek2", "glm4moe", "dots1"):
        keys["expert_shared_count"] = cfg["n_shared_experts"]
        keys["expert_group_count"] = cfg.get("n_group", 1)
        keys["expert_group_used_count"] = cfg.get("topk_group", 1)
        keys["expert_gating_func"] = 1 if model_type == "deepseek_v2" else 2
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    if arch in ("deepseek2", "glm4moe", "dots1"):
        w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])
        w.add_bool(f"{arch}.expert_weights_norm", bool(cfg.get("norm_topk_prob", False)))


def write_gguf(hf_folder, path, model_type):
    """hf_folder's MoE blocks as llama.cpp's convert_hf_to_gguf.py names them, with the metadata
    keys it writes for the family; the experts in BF16, routers and biases in F32."""
    import json
    cfg = json.load(open(os.path.join(hf_folder, "config.json")))
    cfg = cfg.get("text_config", cfg)
    arch = FAMILIES[model_type]
    t = hf_tensors(hf_folder)
    E = expert_count(cfg)
    w = gguf.GGUFWriter(path, arch)
    add_family_metadata(w, cfg, model_type)
    layers = sorted({int(k.split(".")[2]) for k in t if ".experts." in k})
    for L in layers:
        p = next(f"model.layers.{L}.{m}" for m in ("mlp", "block_sparse_moe") if f"model.layers.{L}.{m}.experts.0.w1.weight" in t
                 or f"model.layers.{L}.{m}.experts.0.gate_proj.weight" in t or f"model.layers.{L}.{m}.experts.gate_up_proj" in t)
        for proj, stack in zip(("gate", "up", "down"), expert_stacks(t, p, E)):
            add_bf16(w, f"blk.{L}.ffn_{proj}_exps.weight", stack)
        router = f"{p}.router" if model_type == "gpt_oss" else f"{p}.gate"
        w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", t[f"{router}.weight"].astype(np.float32))
        if model_type == "gpt_oss":
            w.add_tensor(f"blk.{L}.ffn_gate_inp.bias", t[f"{router}.bias"].astype(np.float32))
            gub = t[f"{p}.experts.gate_up_proj_bias"]
            for proj, b in (("gate", gub[:, 0::2]), ("up", gub[:, 1::2]), ("down", t[f"{p}.experts.down_proj_bias"])):
                w.add_tensor(f"blk.{L}.ffn_{proj}_exps.bias", np.ascontiguousarray(b, np.float32))
        for bias in (f"{p}.gate.e_score_correction_bias", f"{p}.e_score_correction_bias",
                     f"{p}.moe_statics.e_score_correction_bias"):
            if bias in t:
                w.add_tensor(f"blk.{L}.exp_probs_b.bias", t[bias].reshape(E).astype(np.float32))
        for shared in (f"{p}.shared_experts", f"{p}.shared_expert"):
            if f"{shared}.gate_proj.weight" in t:
                for proj in ("gate", "up", "down"):
                    add_bf16(w, f"blk.{L}.ffn_{proj}_shexp.weight", t[f"{shared}.{proj}_proj.weight"])
        if f"{p}.shared_expert_gate.weight" in t:
            w.add_tensor(f"blk.{L}.ffn_gate_inp_shexp.weight", t[f"{p}.shared_expert_gate.weight"].reshape(-1))
    w.add_tensor("output_norm.weight", np.ones(cfg["hidden_size"], np.float32))
    _close(w)
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """model_type -> (HF folder, GGUF file) of the same random weights."""
    made = {}

    def get(model_type):
        if model_type not in made:
            root = tmp_path_factory.mktemp(model_type)
            overrides = {"swiglu_limit": 7.0} if model_type == "gpt_oss" else {}  # llama.cpp's, not stored
            folder = ckpts.build(model_type, root / "hf", seed=5, **overrides)
            made[model_type] = (folder, write_gguf(folder, str(root / "model.gguf"), model_type))
        return made[model_type]
    return get


def hidden(T_, H, seed=0):
    return np.random.default_rng(seed).standard_normal((T_, H)).astype(np.float32)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_blocks_from_gguf_equal_the_hugging_face_blocks(pairs, model_type):
    folder, path = pairs(model_type)
    hf, gg = MoEModel.from_pretrained(folder), MoEModel.from_pretrained(path)
    assert sorted(b.layer for b in gg.blocks.values()) == sorted(b.layer for b in hf.blocks.values())
    for block in gg.blocks.values():
        twin = hf.blocks[block.name]  # the names rules select blocks by are the checkpoint's
        assert block.router.kind == twin.router.kind
        assert (block.shared is None) == (twin.shared is None)
        assert block.experts.format == twin.experts.format == "BF16"
        h = hidden(37, twin.experts.config.hidden_size, block.layer)
        ids, wts = block.route(h)
        ids_hf, wts_hf = twin.route(h)
        np.testing.assert_array_equal(ids, ids_hf)
        np.testing.assert_allclose(wts, wts_hf, rtol=1e-6, atol=0)
        np.testing.assert_allclose(block.forward(h), twin.forward(h), rtol=1e-5, atol=1e-6)


class Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


# ---- llama.cpp's routing, from the metadata alone ---------------------------------------------

E, H, I, K = 8, 64, 32, 2


def llama_route(x, weight, gating, bias, groups, used, k, norm, scale):
    """float64 routing as llama.cpp's build_moe_ffn describes it: probabilities (softmax over all
    experts, or sigmoid), the choice on probabilities + exp_probs_b, restricted to the `used`
    groups whose best two choices sum highest; weights the unbiased probabilities, divided by their
    sum when `norm`, times `scale` unless it is 0 or 1."""
    logits = x.astype(np.float64) @ weight.astype(np.float64).T
    if gating == 1:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    else:
        probs = 1 / (1 + np.exp(-logits))
    choice = probs + (0 if bias is None else bias.astype(np.float64))
    if groups > 1:
        g = choice.reshape(len(x), groups, -1)
        best = np.argsort(-np.sort(g, axis=2)[:, :, -2:].sum(axis=2), axis=1, kind="stable")[:, :used]
        keep = np.zeros((len(x), groups), bool)
        np.put_along_axis(keep, best, True, axis=1)
        choice = np.where(np.repeat(keep, E // groups, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=1)
    if norm:  # the sum clamped from below, as ggml_clamp does it
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
    if scale not in (0, 1):
        w = w * scale
    return ids, w


def bf16_round(x):
    return gguf.quants.dequantize(bf16_bytes(x), T.BF16).reshape(x.shape).astype(np.float32)


def write_block_model(path, arch, meta=None, bias=False, shared=None, shared_gate=False, layers=(1,), blocks=2,
                      seed=0, expert_type="BF16", router=None, extra=None, shared_type=None, skip=()):
    """A GGUF model of `arch` with MoE layers `layers`: BF16 (or Q4_0, Q8_0, Q5_1) experts, an F32 router,
    exp_probs_b when `bias`, `shared`-wide shared experts (and their gate); `meta` adds or (None)
    removes `{arch}.` keys; `extra` adds tensors.  Returns the values written, per layer."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    keys = {"block_count": blocks, "expert_count": E, "expert_used_count": K, "embedding_length": H,
            "expert_feed_forward_length": I}
    keys.update(meta or {})
    for key, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif value is not None:
            w.add_uint32(f"{arch}.{key}", value)
    truth = {}

    def add_weight(name, values, kind=None):
        kind = kind or expert_type
        if isinstance(kind, dict):  # a type per projection
            kind = kind[name.split("ffn_")[1].split("_")[0]]
        if values.size == 0:  # a zero-width tensor, as a hostile file may hold one
            w.add_tensor(name, values)
            return values
        if kind in ("Q4_0", "Q8_0", "Q5_1"):
            raw = gguf.quants.quantize(values.reshape(-1, values.shape[-1]), T[kind])
            w.add_tensor(name, raw.reshape(values.shape[:-1] + (-1,)), raw_dtype=T[kind])
            return gguf.quants.dequantize(raw, T[kind]).reshape(values.shape).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, values)
            return values
        add_bf16(w, name, values)
        return bf16_round(values)

    for L in layers:
        t = truth[L] = {}
        for proj in ("gate", "up", "down"):
            shape = (E, H, I) if proj == "down" else (E, I, H)
            t[proj] = add_weight(f"blk.{L}.ffn_{proj}_exps.weight", rng.standard_normal(shape).astype(np.float32) * 0.1)
        t["router"] = rng.standard_normal((E, H)).astype(np.float32) * 0.3 if router is None else router
        w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", t["router"])
        if bias and L not in skip:
            t["bias"] = rng.uniform(-0.3, 0.3, E).astype(np.float32)
            w.add_tensor(f"blk.{L}.exp_probs_b.bias", t["bias"])
        if shared is not None:
            for proj in ("gate", "up", "down"):
                shape = (H, shared) if proj == "down" else (shared, H)
                t["shexp_" + proj] = add_weight(f"blk.{L}.ffn_{proj}_shexp.weight",
                                                rng.standard_normal(shape).astype(np.float32) * 0.1, shared_type)
        if shared_gate:
            t["shexp_router"] = rng.standard_normal(H).astype(np.float32) * 0.3
            w.add_tensor(f"blk.{L}.ffn_gate_inp_shexp.weight", t["shexp_router"])
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    _close(w)
    return truth


def swiglu(x, gate, up, down):
    g, u = gate.astype(np.float64) @ x, up.astype(np.float64) @ x
    return down.astype(np.float64) @ (g / (1 + np.exp(-g)) * u)


def block_reference(x, t, ids, wts):
    """float64 block output: the chosen experts, plus the shared experts (times sigmoid(gate . x))."""
    out = np.zeros((len(x), H))
    for i, xt in enumerate(x.astype(np.float64)):
        for e, wt in zip(ids[i], wts[i]):
            out[i] += wt * swiglu(xt, t["gate"][e], t["up"][e], t["down"][e])
        if "shexp_gate" in t:
            s = swiglu(xt, t["shexp_gate"], t["shexp_up"], t["shexp_down"])
            if "shexp_router" in t:
                s = s / (1 + np.exp(-(t["shexp_router"].astype(np.float64) @ xt)))
            out[i] += s
    return out


# (architecture, metadata, exp_probs_b, shared width, shared gate) -> llama.cpp's (gating, groups,
# used, norm, scale) for it
ROUTING_CASES = {
    "deepseek2 sigmoid, groups, renormalised, scaled": (
        "deepseek2", {"expert_gating_func": 2, "expert_group_count": 4, "expert_group_used_count": 2,
                      "expert_weights_norm": True, "expert_weights_scale": 2.5, "expert_shared_count": 1},
        True, I, False, (2, 4, 2, True, 2.5)),
    "deepseek2 without a gating key: softmax (DeepSeek-V2), renormalised": (
        "deepseek2", {"expert_weights_norm": True, "expert_weights_scale": 1.5}, False, None, False,
        (1, 1, 1, True, 1.5)),
    "deepseek2 without a gating key but with exp_probs_b: sigmoid": (
        "deepseek2", {"expert_group_count": 2, "expert_group_used_count": 1}, True, None, False, (2, 2, 1, False, 0)),
    "glm4moe: sigmoid by default, scale 0 leaves the weights": (
        "glm4moe", {"expert_weights_norm": True, "expert_weights_scale": 0.0}, True, 2 * I, False, (2, 1, 1, True, 0)),
    "dots1": ("dots1", {"expert_gating_func": 2, "expert_weights_norm": True, "expert_weights_scale": 2.0},
              True, None, False, (2, 1, 1, True, 2.0)),
    "ernie4_5-moe: softmax, chosen with its bias": ("ernie4_5-moe", {}, True, I, False, (1, 1, 1, True, 0)),
    "minimax-m2": ("minimax-m2", {"expert_gating_func": 2}, True, None, False, (2, 1, 1, True, 0)),
    "qwen2moe: gated shared expert": (
        "qwen2moe", {"expert_shared_feed_forward_length": 48}, False, 48, True, (1, 1, 1, False, 0)),
    "qwen3moe": ("qwen3moe", {}, False, None, False, (1, 1, 1, True, 0)),
    "olmoe": ("olmoe", {}, False, None, False, (1, 1, 1, False, 0)),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_routing_follows_llama_cpp_from_the_metadata(tmp_path, case):
    arch, meta, bias, shared, gated, (gating, groups, used, norm, scale) = ROUTING_CASES[case]
    path = str(tmp_path / "m.gguf")
    truth = write_block_model(path, arch, meta, bias=bias, shared=shared, shared_gate=gated)[1]
    model = MoEModel.from_pretrained(path)
    module = "block_sparse_moe" if arch == "minimax-m2" else "mlp"  # as MiniMax-M2's checkpoints name it
    block = model.blocks[f"model.layers.1.{module}.experts"]
    assert (block.shared is not None) == bool(shared)
    x = hidden(41, H, 7)
    ids, wts = block.route(x)
    ref_ids, ref_wts = llama_route(x, truth["router"], gating, truth.get("bias"), groups, used, K, norm, scale)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(wts, ref_wts, rtol=2e-6, atol=1e-7)
    y = block.forward(x)
    ref = block_reference(x, truth, ref_ids, ref_wts)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 5e-3  # BF16 activations


def test_q4_0_routed_and_shared_experts_stay_int4_group_32(tmp_path):
    path = str(tmp_path / "m.gguf")
    truth = write_block_model(path, "qwen2moe", {"expert_shared_feed_forward_length": 64}, shared=64,
                              shared_gate=True, expert_type="Q4_0")[1]
    block = MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"]
    shared = block.shared.moe
    assert block.experts.format == shared.format == "INT4" and shared.gate[0].group_size == 32
    for proj in ("gate", "up", "down"):  # the stored codes and scales, not quantized again
        assert np.array_equal(getattr(shared, proj)[0].dequantize(np.float32), truth["shexp_" + proj]), proj
    x = hidden(9, H, 2)
    ids, wts = block.route(x)
    assert np.linalg.norm(block.forward(x) - block_reference(x, truth, ids, wts)) < \
        0.03 * np.linalg.norm(block_reference(x, truth, ids, wts))  # the int8 activations' error only


def test_routed_and_shared_experts_keep_a_down_projection_of_another_type(tmp_path, caplog):
    """Q4_0 gate and up with a Q8_0 down (as Q4_K_M pairs Q4_K with Q6_K): each projection as
    stored, routed (INT4 gate and up, INT8_GROUP down) and shared experts alike."""
    path = str(tmp_path / "m.gguf")
    types = {"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"}
    truth = write_block_model(path, "qwen2moe", {"expert_shared_feed_forward_length": 64}, shared=64,
                              shared_gate=True, expert_type=types, shared_type=types)[1]
    model = MoEModel.from_pretrained(path)
    block = model.blocks["model.layers.1.mlp.experts"]
    for moe in (block.experts, block.shared.moe):
        assert (moe.format, moe.gate[0].group_size, moe.down_format, moe.down[0].group_size) == ("INT4", 32, "INT8_GROUP", 32)
    for proj in ("gate", "up", "down"):  # the stored codes and scales, not quantized again
        assert np.array_equal(getattr(block.shared.moe, proj)[0].dequantize(np.float32), truth["shexp_" + proj]), proj
        for e in range(E):
            assert np.array_equal(getattr(block.experts, proj)[e].dequantize(np.float32), truth[proj][e]), (proj, e)
    row = model.describe()[0]
    assert (row["format"], row["down_format"]) == ("INT4", "INT8_GROUP") and "INT4/INT8_GROUP" in repr(model)
    assert "down_format=INT8_GROUP" in repr(block) and "down INT8_GROUP group 32" in repr(block.experts)
    asked = MoEModel.from_pretrained(path, backend="INT4").blocks["model.layers.1.mlp.experts"]
    for moe in (asked.experts, asked.shared.moe):  # one format asked for: one group, the kept codes' (32)
        assert {(w.format, w.group_size) for w in moe.gate + moe.up + moe.down} == {("INT4", 32)}
    x = hidden(9, H, 2)
    ids, wts = block.route(x)
    assert np.linalg.norm(block.forward(x) - block_reference(x, truth, ids, wts)) < \
        0.03 * np.linalg.norm(block_reference(x, truth, ids, wts))  # the int8 activations' error only
    out = str(tmp_path / "packed")  # converted as stored: the folder serves the block in both formats
    convert(path, out, progress=Quiet())
    from_folder = MoEModel.from_pretrained(path, experts_path=out).blocks["model.layers.1.mlp.experts"]
    assert from_folder.experts_from.startswith(out)
    assert (from_folder.experts.format, from_folder.experts.down_format) == ("INT4", "INT8_GROUP")
    np.testing.assert_array_equal(from_folder.forward(x), block.forward(x))
    with caplog.at_level("WARNING", logger="ktcy"):  # one format asked for: not what the folder holds
        repacked = MoEModel.from_pretrained(path, experts_path=out, backend="INT4").blocks["model.layers.1.mlp.experts"]
    assert repacked.experts_from == path and "holds INT4 (down INT8_GROUP); packed from the checkpoint" in caplog.text


def test_multi_token_prediction_layers_are_not_decoder_layers(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_block_model(path, "glm4moe", {"nextn_predict_layers": 1}, bias=True, layers=(1, 2), blocks=3)
    model = MoEModel.from_pretrained(path)
    assert [b.layer for b in model.blocks.values()] == [1]  # GLM-4.5's config.json counts 2 layers
    with pytest.raises(CheckpointError, match="layer 2 is not an MoE layer"):
        ktcy.load_experts(path, 2)


def test_inject_and_experts_path_work_from_gguf(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_block_model(path, "qwen3moe", layers=(0, 1))
    out = tmp_path / "int8"
    convert(path, str(out), "INT8", progress=Quiet())
    model = MoEModel.from_pretrained(path, experts_path=str(out))
    assert {b.experts.format for b in model.blocks.values()} == {"INT8"}
    assert all(b.experts_from.startswith(str(out)) for b in model.blocks.values())
    changed = model.inject_expert_backend(r"model\.layers\.1\.", "BF16")
    assert changed == ["model.layers.1.mlp.experts"] and model.blocks[changed[0]].experts.format == "BF16"
    x = hidden(5, H)
    direct = MoEModel.from_pretrained(path, layers=[1]).blocks[changed[0]]
    np.testing.assert_array_equal(model.blocks[changed[0]].forward(x), direct.forward(x))
    rules = [{"match": {"name": r"^model\.layers\.0\.mlp\.experts$"}, "replace": {"kwargs": {"backend": "AMXINT8"}}}]
    assert MoEModel.from_pretrained(path, rules=rules).blocks["model.layers.0.mlp.experts"].experts.format == "INT8"


REFUSALS = {
    "gating function 3": (dict(arch="deepseek2", meta={"expert_gating_func": 3}), "expert_gating_func is 3"),
    "softmax minimax-m2": (dict(arch="minimax-m2", meta={"expert_gating_func": 1}, bias=True),
                           "MiniMax-M2 routes with 2"),
    "gating function true": (dict(arch="glm4moe", meta={"expert_gating_func": True}, bias=True),
                             "expert_gating_func is True"),
    "groups that do not divide the experts": (dict(arch="deepseek2", meta={"expert_group_count": 3,
                                                                           "expert_group_used_count": 1}),
                                              "expert_group_count 3 does not divide 8"),
    "a group per expert": (dict(arch="deepseek2", meta={"expert_group_count": 8, "expert_group_used_count": 1}),
                           "expert_group_count 8 does not divide 8 experts into groups"),
    "groups that hold too few experts": (dict(arch="deepseek2", meta={"expert_group_count": 4, "expert_group_used_count": 1,
                                                                      "expert_used_count": 3}),
                                         "1 of 4 expert groups hold fewer than the 3"),
    "groups without their kept count": (dict(arch="deepseek2", meta={"expert_group_count": 4}),
                                        "expert_group_used_count is missing"),
    "groups all kept": (dict(arch="deepseek2", meta={"expert_group_count": 4, "expert_group_used_count": 4}),
                        r"expert_group_used_count is 4, expected an integer in \[1, 3\]"),
    "groups where the graph has none": (dict(arch="qwen3moe", meta={"expert_group_count": 4, "expert_group_used_count": 2}),
                                        "does not choose by expert groups"),
    "shared experts where the graph has none": (dict(arch="qwen3moe", shared=I), "qwen3moe graph has no shared experts"),
    "a shared gate where the graph has none": (
        dict(arch="deepseek2", shared=I, extra={"blk.1.ffn_gate_inp_shexp.weight": np.zeros(H, np.float32)}),
        "deepseek2 graph does not gate shared experts"),
    "qwen2moe shared experts without their gate": (dict(arch="qwen2moe", shared=48), "gates its shared experts"),
    "qwen2moe without shared experts": (dict(arch="qwen2moe"), "no tensor blk.1.ffn_gate_shexp.weight"),
    "shared experts the metadata counts but the layer lacks": (dict(arch="deepseek2", meta={"expert_shared_count": 1}),
                                                               "no tensor blk.1.ffn_gate_shexp.weight"),
    "a GLM-4.5 router without exp_probs_b": (dict(arch="glm4moe"), "no tensor blk.1.exp_probs_b.bias"),
    "a MiniMax-M2 router without exp_probs_b": (dict(arch="minimax-m2"), "no tensor blk.1.exp_probs_b.bias"),
    "zero-width shared experts": (dict(arch="deepseek2", shared=0), "width of at least 1"),
    "a bias a softmax router does not use": (dict(arch="qwen3moe", bias=True), "exp_probs_b.bias is stored"),
    "a router bias outside GPT-OSS": (dict(arch="qwen3moe", extra={"blk.1.ffn_gate_inp.bias": np.zeros(E, np.float32)}),
                                      "ffn_gate_inp.bias: a router bias is GPT-OSS's only"),
    "a shared gate without shared experts": (
        dict(arch="qwen2moe", extra={"blk.1.ffn_gate_inp_shexp.weight": np.zeros(H, np.float32)}),
        "gates shared experts that layer 1 does not store"),
    "part of a shared expert": (dict(arch="deepseek2", extra={"blk.1.ffn_gate_shexp.weight": np.zeros((I, H), np.float32)}),
                                "no tensor blk.1.ffn_up_shexp.weight"),
    "a shared expert of another width than stated": (
        dict(arch="qwen2moe", meta={"expert_shared_feed_forward_length": 40}, shared=48, shared_gate=True),
        "shared experts of layer 1 are 48 wide; the metadata says 40"),
    "a router holding NaN": (dict(arch="qwen3moe", router=np.full((E, H), np.nan, np.float32)), "NaN or infinity"),
    "a router of the wrong shape": (dict(arch="qwen3moe", router=np.zeros((E, H // 2), np.float32)),
                                    r"ffn_gate_inp.weight is \[8, 32\].*expected \[8, 64\]"),
    "a flag that is a number": (dict(arch="deepseek2", meta={"expert_weights_norm": 1}), "expected true or false"),
    "a negative scale": (dict(arch="glm4moe", meta={"expert_weights_scale": -2.0}, bias=True), "expected a finite number"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_router_metadata_and_tensors_are_refused_before_packing(tmp_path, case):
    kwargs, message = REFUSALS[case]
    path = str(tmp_path / "m.gguf")
    write_block_model(path, **kwargs)
    with pytest.raises(CheckpointError, match=message):
        MoEModel.from_pretrained(path)


def test_run_block_reads_a_gguf_model(tmp_path):
    import subprocess
    import sys
    path = str(tmp_path / "m.gguf")
    write_block_model(path, "qwen2moe", {"expert_shared_feed_forward_length": 48}, shared=48, shared_gate=True)
    x = hidden(6, H, 3)
    np.save(tmp_path / "h.npy", x)
    r = subprocess.run([sys.executable, "-m", "ktcy", "run-block", path, "--layer", "1", "--input", str(tmp_path / "h.npy"),
                        "--output", str(tmp_path / "y.npy"), "--backend", "INT8"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    block = MoEModel.from_pretrained(path, backend="INT8").blocks["model.layers.1.mlp.experts"]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), block.forward(x))
    r = subprocess.run([sys.executable, "-m", "ktcy", "run-block", path, "--layer", "0", "--input", str(tmp_path / "h.npy"),
                        "--output", str(tmp_path / "z.npy")], capture_output=True, text=True)
    assert r.returncode != 0 and "layer 0 is not an MoE layer" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("routed, shared, kept", [("Q4_0", "BF16", "BF16"), ("Q4_0", "Q8_0", "INT8_GROUP"),
                                                  ("BF16", "Q4_0", "INT4"), ("BF16", "F32", "BF16"),
                                                  ("Q4_0", "Q5_1", "INT8_MIN")])
def test_shared_experts_keep_their_own_precision_without_a_backend(tmp_path, routed, shared, kept):
    path = str(tmp_path / "m.gguf")
    truth = write_block_model(path, "deepseek2", {"expert_gating_func": 2}, bias=True, shared=64,
                              expert_type=routed, shared_type=shared)[1]
    block = MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"]
    moe = block.shared.moe
    assert moe.format == kept and block.experts.format == ("INT4" if routed == "Q4_0" else "BF16")
    for proj in ("gate", "up", "down"):  # as stored (F32's values rounded to BF16, 2^-9 at most)
        got = getattr(moe, proj)[0].dequantize(np.float32)
        np.testing.assert_allclose(got, truth["shexp_" + proj], rtol=2 ** -8, atol=0)
        if kept != "BF16" or shared == "BF16":
            assert np.array_equal(got, truth["shexp_" + proj]), proj
    asked = MoEModel.from_pretrained(path, backend="INT8").blocks["model.layers.1.mlp.experts"]
    assert asked.shared.moe.format == asked.experts.format == "INT8"  # a backend asked for applies to both


def test_size_one_leading_dimensions_are_accepted(tmp_path):
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(1)
    bias, gate = rng.uniform(-0.3, 0.3, (1, E)).astype(np.float32), rng.standard_normal((1, H)).astype(np.float32)
    write_block_model(path, "ernie4_5-moe", shared=I, extra={"blk.1.exp_probs_b.bias": bias})
    block = MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"]
    np.testing.assert_array_equal(block.router.bias, bias.reshape(E))
    path2 = str(tmp_path / "q.gguf")
    write_block_model(path2, "qwen2moe", shared=48, extra={"blk.1.ffn_gate_inp_shexp.weight": gate})
    shared = MoEModel.from_pretrained(path2).blocks["model.layers.1.mlp.experts"].shared
    np.testing.assert_array_equal(shared.gate, gate)


def test_metadata_llama_cpp_reads_as_none(tmp_path):
    path = str(tmp_path / "m.gguf")  # 0 groups is llama.cpp's default (none); qwen3moe has no MTP layers to drop
    write_block_model(path, "qwen3moe", {"expert_group_count": 0, "nextn_predict_layers": 1}, layers=(0, 1))
    assert [b.layer for b in MoEModel.from_pretrained(path).blocks.values()] == [0, 1]
    path = str(tmp_path / "d.gguf")
    write_block_model(path, "deepseek2", {"expert_gating_func": 2, "expert_group_count": 0}, bias=True)
    assert MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"].router.n_group == 1


def test_deepseek2_without_a_gating_key_decides_once_for_the_model(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_block_model(path, "deepseek2", bias=True, layers=(1, 2), blocks=3, skip=(2,))
    with pytest.raises(CheckpointError, match="layer 2 lacks the exp_probs_b.bias other layers store"):
        MoEModel.from_pretrained(path, layers=[1])


def test_bad_shared_experts_of_the_last_layer_are_refused_before_any_packing(tmp_path, monkeypatch):
    import ktcy.model
    path = str(tmp_path / "m.gguf")
    bad = {"blk.2.ffn_gate_shexp.weight": np.zeros((I, H), np.float32), "blk.2.ffn_up_shexp.weight": np.zeros((I, H), np.float32),
           "blk.2.ffn_down_shexp.weight": np.zeros((H, I + 8), np.float32)}
    write_block_model(path, "deepseek2", {"expert_gating_func": 2}, bias=True, layers=(1, 2), blocks=3, extra=bad)
    packed = []
    monkeypatch.setattr(ktcy.model, "experts_from_checkpoint", lambda *a, **k: packed.append(a) or 1 / 0)
    with pytest.raises(CheckpointError, match=r"blk.2.ffn_down_shexp.weight is \[64, 40\]"):
        MoEModel.from_pretrained(path)
    assert not packed


def test_a_shared_expert_the_packer_refuses_is_named(tmp_path):
    path = str(tmp_path / "m.gguf")
    inf = np.zeros((I, H), np.float32)
    inf[3, 5] = np.inf
    write_block_model(path, "deepseek2", {"expert_gating_func": 2}, bias=True, shared=None,
                      extra={"blk.1.ffn_gate_shexp.weight": inf, "blk.1.ffn_up_shexp.weight": np.zeros((I, H), np.float32),
                             "blk.1.ffn_down_shexp.weight": np.zeros((H, I), np.float32)})
    with pytest.raises(CheckpointError, match="m.gguf: layer 1 shared experts: "):
        MoEModel.from_pretrained(path)


def test_the_weight_sum_is_floored_as_llama_cpp_floors_it(tmp_path):
    """Sigmoid scores of about 1e-11 (every logit near -25): the chosen weights' sum is far below
    llama.cpp's 6.1e-5 floor, so renormalising leaves them tiny instead of summing to one."""
    path = str(tmp_path / "m.gguf")
    router = np.full((E, H), -0.5, np.float32) + np.random.default_rng(4).uniform(-0.05, 0.05, (E, H)).astype(np.float32)
    truth = write_block_model(path, "deepseek2", {"expert_gating_func": 2, "expert_weights_norm": True}, bias=True,
                              router=router)[1]
    block = MoEModel.from_pretrained(path).blocks["model.layers.1.mlp.experts"]
    x = np.abs(hidden(8, H, 5)) + 0.5
    ids, wts = block.route(x)
    ref_ids, ref_wts = llama_route(x, truth["router"], 2, truth["bias"], 1, 1, K, True, 0)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(wts, ref_wts, rtol=1e-5)
    assert wts.sum(axis=1).max() < 1e-3
