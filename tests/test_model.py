"""Whole MoE blocks: routers of each family, shared experts, injection rules (issue: MoEModel)."""
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ktcy
from checkpoints import make_checkpoint
from ktcy.safetensors_io import write

SEEDS_RULES = r'''
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs:
      prefill_device: "cuda"
      prefill_op: "KExpertsTorch"
      generate_device: "cpu"
      generate_op: "KExpertsCPU"
      out_device: "cuda"
      backend: "AMXINT8"  # Use "AMXBF16" for BF16 quantization
'''

E, H, I, K = 8, 128, 64, 2
FAMILIES = {
    "qwen3": dict(style="qwen", extra_config={"model_type": "qwen3_moe", "norm_topk_prob": True}),
    "qwen2": dict(style="qwen", extra_config={"model_type": "qwen2_moe", "norm_topk_prob": False,
                                              "shared_expert_intermediate_size": 96}),
    "mixtral": dict(style="mixtral", extra_config={"model_type": "mixtral"}),
    "deepseek": dict(style="qwen", extra_config={
        "model_type": "deepseek_v3", "n_routed_experts": E, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_shared_experts": 2, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc"}),
}


def build(path, family, seed=0, bias_offset=0.0):
    """A checkpoint of the family plus its routers and shared experts (in a second shard)."""
    spec = FAMILIES[family]
    truth = make_checkpoint(path, E=E, H=H, I=I, top_k=K, num_layers=4, dense_layers=(0,), seed=seed, **spec)
    rng = np.random.default_rng(seed + 100)
    extra = {}
    prefix_of = lambda L: f"model.layers.{L}.block_sparse_moe" if family == "mixtral" else f"model.layers.{L}.mlp"
    for L in truth:
        p = prefix_of(L)
        router = (rng.standard_normal((E, H)) * 0.3).astype(np.float32)
        extra[f"{p}.gate.weight"] = router.astype(ml_dtypes.bfloat16)
        truth[L]["router"] = router.astype(ml_dtypes.bfloat16).astype(np.float64)
        if family == "deepseek":
            bias = (rng.standard_normal(E) * 0.1 + bias_offset).astype(np.float32)
            extra[f"{p}.gate.e_score_correction_bias"] = bias
            truth[L]["bias"] = bias.astype(np.float64)
        shared_i = {"qwen2": 96, "deepseek": 2 * I}.get(family)
        if shared_i:
            name = f"{p}.shared_expert" if family == "qwen2" else f"{p}.shared_experts"
            for proj, shape in (("gate", (shared_i, H)), ("up", (shared_i, H)), ("down", (H, shared_i))):
                w = (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
                extra[f"{name}.{proj}_proj.weight"] = w
                truth[L]["shared_" + proj] = w.astype(np.float64)
            if family == "qwen2":
                g = (rng.standard_normal((1, H)) * 0.1).astype(ml_dtypes.bfloat16)
                extra[f"{p}.shared_expert_gate.weight"] = g
                truth[L]["shared_gate"] = g.astype(np.float64)
    write(os.path.join(path, "extra.safetensors"), extra)
    return truth


def ref_route(family, h, t):
    """float64 routing, written from the model definitions."""
    logits = h.astype(np.float64) @ t["router"].T
    if family == "mixtral":
        ids = np.argsort(-logits, axis=1)[:, :K]
        top = np.take_along_axis(logits, ids, axis=1)
        w = np.exp(top - top.max(1, keepdims=True))
        return ids, w / w.sum(1, keepdims=True)
    if family in ("qwen3", "qwen2"):
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = np.argsort(-p, axis=1)[:, :K]
        w = np.take_along_axis(p, ids, axis=1)
        return ids, (w / w.sum(1, keepdims=True) if family == "qwen3" else w)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + t["bias"]
    groups = choice.reshape(len(h), 4, E // 4)
    gscore = np.sort(groups, axis=2)[:, :, -2:].sum(2)
    ids = np.empty((len(h), K), int)
    for r in range(len(h)):
        keep = np.argsort(-gscore[r])[:2]
        masked = np.full(E, -np.inf)  # DeepSeek's and transformers' mask: left-out groups never win
        for g in keep:
            masked[g * (E // 4):(g + 1) * (E // 4)] = choice[r, g * (E // 4):(g + 1) * (E // 4)]
        ids[r] = np.argsort(-masked)[:K]
    w = np.take_along_axis(scores, ids, axis=1)
    return ids, w / w.sum(1, keepdims=True) * 2.5


def swiglu(x, g, u, d):
    a = x @ g.T
    return (a / (1 + np.exp(-a)) * (x @ u.T)) @ d.T


def ref_block(family, block, h, t):
    ids, w = ref_route(family, h, t)
    ex = block.experts
    y = np.zeros((len(h), H))
    for r in range(len(h)):
        for j in range(K):
            e = ids[r, j]
            y[r] += w[r, j] * swiglu(h[r:r + 1].astype(np.float64), ex.gate[e].dequantize(), ex.up[e].dequantize(),
                                     ex.down[e].dequantize())[0]
    if block.shared is not None:
        s = block.shared.moe
        out = swiglu(h.astype(np.float64), s.gate[0].dequantize(), s.up[0].dequantize(), s.down[0].dequantize())
        if family == "qwen2":
            out *= 1 / (1 + np.exp(-(h.astype(np.float64) @ t["shared_gate"].T)))
        y += out
    return ids, w, y


def test_deepseek_experts_of_groups_left_out_never_win_where_scores_plus_bias_are_negative(tmp_path):
    """e_score_correction_bias below -1 makes every choice score negative: masking the groups
    left out with 0 (not -inf) chose their experts over the kept groups'."""
    truth = build(tmp_path, "deepseek", bias_offset=-1.5)
    model = ktcy.MoEModel.from_pretrained(tmp_path)
    h = np.random.default_rng(4).standard_normal((16, H)).astype(np.float32)
    for block in model.blocks.values():
        ids, _ = block.route(h)
        rids, _ = ref_route("deepseek", h, truth[block.layer])
        assert [set(r) for r in ids] == [set(r) for r in rids]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend,tol", [(None, 0.004), ("INT8", 0.03)])
def test_block_routes_and_forwards_like_the_model(tmp_path, family, backend, tol):
    truth = build(tmp_path, family)
    model = ktcy.MoEModel.from_pretrained(tmp_path, backend=backend)
    names = list(model.blocks)
    part = "block_sparse_moe" if family == "mixtral" else "mlp"
    layers = (0, 1, 2, 3) if family == "mixtral" else (1, 2, 3)   # Mixtral: every layer is MoE
    assert names == [f"model.layers.{L}.{part}.experts" for L in layers]
    rng = np.random.default_rng(3)
    for name, block in model.blocks.items():
        h = rng.standard_normal((9, H)).astype(np.float32)
        ids, w = block.route(h)
        rids, rw, ry = ref_block(family, block, h, truth[block.layer])
        assert [set(r) for r in ids] == [set(r) for r in rids]
        order = np.argsort(ids, axis=1), np.argsort(rids, axis=1)
        np.testing.assert_allclose(np.take_along_axis(w, order[0], 1), np.take_along_axis(rw, order[1], 1), rtol=2e-5, atol=1e-7)
        y = block.forward(h)
        assert np.linalg.norm(y - ry) / np.linalg.norm(ry) <= tol, (name, family)
        assert (block.shared is not None) == (family in ("qwen2", "deepseek"))


def test_seeds_rule_file_loads_unchanged_and_routes_its_backend(tmp_path):
    build(tmp_path / "qwen", "qwen3")
    rules = tmp_path / "rules.yaml"
    rules.write_text(SEEDS_RULES)
    model = ktcy.MoEModel.from_pretrained(tmp_path / "qwen", rules=str(rules))
    rows = model.describe()
    assert [r["format"] for r in rows] == ["INT8"] * 3
    assert rows[0]["rule"] == 0 and rows[0]["rule_kwargs"]["generate_device"] == "cpu"
    assert rows[0]["rule_kwargs"]["class"] == "ktransformers.operators.experts.KTransformersExperts"
    # Mixtral's blocks are named block_sparse_moe: the seeds' rule does not match them
    build(tmp_path / "mixtral", "mixtral")
    other = ktcy.MoEModel.from_pretrained(tmp_path / "mixtral", rules=SEEDS_RULES, backend="INT4")
    assert [r["format"] for r in other.describe()] == ["INT4"] * 4 and other.describe()[0]["rule"] is None


def test_first_matching_rule_wins_and_bad_rules_are_named(tmp_path):
    build(tmp_path, "qwen3")
    rules = [{"match": {"name": r"^model\.layers\.2\."}, "replace": {"kwargs": {"backend": "AMXBF16"}}},
             {"match": {"name": r"^model\.layers\..*"}, "replace": {"kwargs": {"backend": "INT4"}}},
             {"match": {"class": "torch.nn.Linear"}, "replace": {"class": "whatever"}}]
    model = ktcy.MoEModel.from_pretrained(tmp_path, rules=rules)
    assert [r["format"] for r in model.describe()] == ["INT4", "BF16", "INT4"]
    with pytest.raises(ktcy.RuleError, match=r"rule 1: match.name '\(' is not a valid regex"):
        ktcy.MoEModel.from_pretrained(tmp_path, rules=[rules[0], {"match": {"name": "("}}])
    with pytest.raises(ktcy.RuleError, match="rule 0: unknown weight format or backend 'AMXINT2'"):
        ktcy.MoEModel.from_pretrained(tmp_path, rules=[{"match": {"name": ".*"}, "replace": {"kwargs": {"backend": "AMXINT2"}}}])
    with pytest.raises(ktcy.RuleError, match="rules file 'missing/optimize.yaml' does not exist"):
        ktcy.MoEModel.from_pretrained(tmp_path, rules="missing/optimize.yaml")


def test_inject_expert_backend_changes_exactly_the_matching_blocks(tmp_path):
    build(tmp_path, "deepseek")
    model = ktcy.MoEModel.from_pretrained(tmp_path)
    before = dict(model.blocks)
    changed = model.inject_expert_backend(r"^model\.layers\.(1|3)\.mlp\.experts$", "AMXINT4")
    assert changed == ["model.layers.1.mlp.experts", "model.layers.3.mlp.experts"]
    assert model.blocks["model.layers.2.mlp.experts"] is before["model.layers.2.mlp.experts"]
    assert [r["format"] for r in model.describe()] == ["INT4", "BF16", "INT4"]
    assert model.blocks["model.layers.1.mlp.experts"].shared.moe.format == "INT4"
    with pytest.raises(ktcy.RuleError, match="not a valid regex"):
        model.inject_expert_backend("[", "INT8")
    with pytest.raises(ValueError, match="unknown"):
        model.inject_expert_backend(".*", "INT2")


def test_layers_selection_and_bad_hidden_states(tmp_path):
    build(tmp_path, "qwen2")
    model = ktcy.MoEModel.from_pretrained(tmp_path, layers=[2])
    assert list(model.blocks) == ["model.layers.2.mlp.experts"]
    block = model.blocks["model.layers.2.mlp.experts"]
    with pytest.raises(ValueError, match="hidden_size is 128"):
        block.forward(np.ones((2, 64), np.float32))
    assert block.forward(np.zeros((0, H), np.float32)).shape == (0, H)


def test_run_block_cli(tmp_path):
    build(tmp_path / "ckpt", "qwen3")
    h = np.random.default_rng(0).standard_normal((4, H)).astype(np.float32)
    np.save(tmp_path / "h.npy", h)
    r = subprocess.run([sys.executable, "-m", "ktcy", "run-block", str(tmp_path / "ckpt"), "--layer", "2",
                        "--backend", "AMXINT8", "--input", str(tmp_path / "h.npy"), "--output", str(tmp_path / "y.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    y = np.load(tmp_path / "y.npy")
    expect = ktcy.MoEModel.from_pretrained(tmp_path / "ckpt", backend="AMXINT8", layers=[2]).blocks[
        "model.layers.2.mlp.experts"].forward(h)
    assert np.array_equal(y, expect)
    assert "INT8" in r.stdout


def test_block_takes_torch_tensors_as_the_layer_does(tmp_path):
    torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
    build(tmp_path, "qwen3")
    block = next(iter(ktcy.MoEModel.from_pretrained(tmp_path).blocks.values()))
    h = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.from_numpy(h).to(dtype)
        expect = block.forward(t.float().numpy() if dtype != torch.bfloat16 else
                               t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        assert np.array_equal(block.forward(t), expect)
        ids, w = block.route(t)
        assert ids.shape == (3, block.experts.config.top_k)
