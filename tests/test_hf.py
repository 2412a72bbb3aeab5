"""ktcy.hf against stock transformers on tiny random checkpoints (tests/hf_checkpoints.py)."""
import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import hf_checkpoints as ckpts

torch = pytest.importorskip("torch")  # CI installs the hf extra: this never skips there
transformers = pytest.importorskip("transformers")
import ktcy  # noqa: E402
import ktcy.hf  # noqa: E402
from ktcy.checkpoint import Checkpoint  # noqa: E402
from ktcy.safetensors_io import CheckpointError  # noqa: E402
from ktcy.convert import convert  # noqa: E402
from hf_compare import assert_same_greedy, logits, rel_l2, stock  # noqa: E402

PROMPT = torch.randint(3, ckpts.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{arch: checkpoint folder}, built once per module with the arch's greedy seed."""
    root = tmp_path_factory.mktemp("hf")
    return {a: ckpts.build(a, root / a, seed=ckpts.GREEDY_SEEDS[a]) for a in ckpts.ARCHITECTURES}


@pytest.mark.parametrize("arch", ckpts.ARCHITECTURES)
def test_bf16_experts_logits_match_stock(folders, arch):
    model = ktcy.hf.from_pretrained(folders[arch], dtype=torch.float32)
    experts = model.ktcy_experts()
    assert experts and all(m.kernel.startswith("BF16 on ") for m in experts.values())
    # the experts hold no torch weights: every parameter left is a non-expert one
    assert not any(".experts." in n for n, _ in model.named_parameters())
    assert rel_l2(logits(model, PROMPT), logits(stock(folders[arch]), PROMPT)) < 0.01


@pytest.mark.parametrize("arch", ckpts.ARCHITECTURES)
def test_int8_experts_logits_within_5_percent(folders, arch):
    model = ktcy.hf.from_pretrained(folders[arch], dtype=torch.float32, backend="AMXINT8")
    assert all(m.kernel.startswith("INT8 on ") for m in model.ktcy_experts().values())
    err = rel_l2(logits(model, PROMPT), logits(stock(folders[arch]), PROMPT))
    assert 1e-4 < err < 0.05  # INT8 does change the numbers, within 5%


@pytest.mark.parametrize("arch", ckpts.ARCHITECTURES)
def test_greedy_generation_equals_stock(folders, arch):
    """Why this is deterministic: both models are evaluated teacher-forced on stock's greedy
    sequence first; at every generated position ktcy's logits differ from stock's by less than a
    third of stock's top-2 gap (the seeds in hf_checkpoints.GREEDY_SEEDS were chosen for that),
    so ktcy's argmax is stock's at every step and the two greedy runs cannot part."""
    ref, model = stock(folders[arch]), ktcy.hf.from_pretrained(folders[arch], dtype=torch.float32)
    assert_same_greedy(ref, model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("arch", ckpts.ARCHITECTURES)
@pytest.mark.parametrize("tokens", [1, 9])
def test_moe_model_blocks_equal_the_stock_blocks(folders, arch, tokens):
    """MoEModel computes the routers itself (numpy, ktcy/routing.py): each family's block (router,
    routed experts, shared experts and their gate) against transformers' own module on the same
    hidden states.  A router that chose other experts, or weighted them otherwise, would be off
    by tens of percent; the BF16 rounding of the activations leaves well under one."""
    ref = stock(folders[arch])
    model = ktcy.MoEModel.from_pretrained(folders[arch])
    assert model.blocks
    h = torch.randn(1, tokens, ref.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    for block in model.blocks.values():
        with torch.no_grad():
            want = ref.model.layers[block.layer].mlp(h)[0]
        got = torch.from_numpy(block.forward(h[0].numpy()))
        assert rel_l2(got, want) < 0.01, (block.name, rel_l2(got, want))


def test_an_architecture_the_installed_transformers_lacks_is_refused(folders, monkeypatch):
    from ktcy.hf import architectures
    gone = architectures.Architecture("mixtral", "transformers.models.no_such_model.modeling", "NoSuchExperts")
    monkeypatch.setitem(architectures._TABLE, "mixtral", gone)
    with pytest.raises(ktcy.hf.UnsupportedArchitectureError, match=r"model_type 'mixtral' needs a transformers with "
                                                                   r"transformers\.models\.no_such_model"):
        ktcy.hf.from_pretrained(folders["mixtral"])


def test_a_transformers_without_the_family_gets_the_unsupported_architecture_error(folders, monkeypatch):
    """A transformers that predates a family fails on its model_type in AutoConfig: that must not
    surface as a CheckpointError blaming config.json, but as the architecture it lacks."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    monkeypatch.delitem(CONFIG_MAPPING._mapping, "minimax_m2")
    monkeypatch.setitem(sys.modules, "transformers.models.minimax_m2.modeling_minimax_m2", None)
    with pytest.raises(ktcy.hf.UnsupportedArchitectureError, match=r"model_type 'minimax_m2' needs a transformers "
                                                                   r"with .*MiniMaxM2Experts.*upgrade transformers"):
        ktcy.hf.from_pretrained(folders["minimax_m2"])


def test_deepseek_v3_fp8_as_stored(tmp_path):
    fp8, ref = ckpts.build_fp8("deepseek_v3", str(tmp_path / "fp8"), str(tmp_path / "ref"))
    model = ktcy.hf.from_pretrained(fp8, dtype=torch.float32)
    assert [m.kernel.split(" ")[0] for m in model.ktcy_experts().values()] == ["FP8_BLOCK", "FP8_BLOCK"]
    # the non-expert FP8 weights were dequantized for torch
    q_a = model.model.layers[1].self_attn.q_a_proj.weight
    assert q_a.dtype == torch.float32 and q_a.abs().max() > 0
    # dense first layer stays a torch MLP
    assert not model.ktcy_experts().keys() & {"model.layers.0.mlp.experts"}
    assert rel_l2(logits(model, PROMPT), logits(stock(ref), PROMPT)) < 0.01
    # a config.json naming its storage type float8 as dtype: the torch part cannot hold that
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(dict(config, dtype="float8_e4m3fn")))
    model = ktcy.hf.from_pretrained(fp8)
    assert model.dtype == torch.float32
    assert rel_l2(logits(model, PROMPT), logits(stock(ref), PROMPT)) < 0.01


@pytest.mark.parametrize("arch,scales", [("glm4_moe", "block"), ("minimax_m2", "block"), ("glm4_moe", "channel"),
                                         ("qwen3_moe", "channel")])
def test_fp8_releases_as_stored(tmp_path, arch, scales):
    """GLM-4.5-FP8 and MiniMax-M2 ship DeepSeek-V3's FP8 format (128x128 block scales),
    GLM-4.5-Air-FP8 llm-compressor's (compressed-tensors, one scale per output channel): the
    routed experts run FP8 as stored, everything else is dequantized for torch."""
    fp8, ref = ckpts.build_fp8(arch, str(tmp_path / "fp8"), str(tmp_path / "ref"), scales=scales)
    fmt = {"block": "FP8_BLOCK", "channel": "FP8_PERCHANNEL"}[scales]
    model = ktcy.hf.from_pretrained(fp8, dtype=torch.float32)
    assert model.ktcy_experts() and all(m.kernel.startswith(f"{fmt} on ") for m in model.ktcy_experts().values())
    want_model = stock(ref)
    assert rel_l2(logits(model, PROMPT), logits(want_model, PROMPT)) < 0.01
    # MoEModel runs the shared experts through ktcy too, from their FP8 codes and scales
    blocks = ktcy.MoEModel.from_pretrained(fp8)
    assert blocks.blocks and all(b["format"] == fmt for b in blocks.describe())
    h = torch.randn(1, 9, want_model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    for block in blocks.blocks.values():
        with torch.no_grad():
            want = want_model.model.layers[block.layer].mlp(h)[0]
        assert rel_l2(torch.from_numpy(block.forward(h[0].numpy())), want) < 0.02, block.name


def test_kimi_k2_runs_as_the_deepseek_v3_it_is(folders, tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 (remote code that transformers does not
    register): ktcy.hf runs it through transformers' DeepSeek-V3, and so the same tensors give the
    same logits, bit for bit, as under model_type deepseek_v3."""
    kimi = ckpts.as_kimi_k2(folders["deepseek_v3"], tmp_path / "kimi")
    model = ktcy.hf.from_pretrained(kimi, dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    same = ktcy.hf.from_pretrained(folders["deepseek_v3"], dtype=torch.float32)
    assert torch.equal(logits(model, PROMPT), logits(same, PROMPT))
    blocks = ktcy.MoEModel.from_pretrained(kimi).describe()
    assert [b["layer"] for b in blocks] == [1, 2] and all(b["router"] == "deepseek_v3" for b in blocks)


def test_kimi_k2_thinking_int4_experts_as_stored(folders, tmp_path):
    """Kimi-K2-Thinking ships its routed experts as compressed-tensors INT4 (symmetric, group 32):
    they run as stored (INT4, group 32), against stock DeepSeek-V3 on exactly the values the codes
    mean (INT4's int8 activations: within the INT8 tolerance)."""
    ref = shutil.copytree(folders["deepseek_v3"], tmp_path / "ref")
    kimi = ckpts.as_kimi_k2(str(ref), tmp_path / "kimi", int4_group=32)
    model = ktcy.hf.from_pretrained(kimi, dtype=torch.float32)
    experts = model.ktcy_experts().values()
    assert experts and all(m.kernel.startswith("INT4 on ") for m in experts)
    assert all(m.moe.config.quant_config.group_size == 32 for m in experts)
    err = rel_l2(logits(model, PROMPT), logits(stock(str(ref)), PROMPT))
    assert 1e-4 < err < 0.05


def test_w8a8_int_quantized_release_as_stored(folders, tmp_path):
    """A compressed-tensors W8A8 release (int8 attention and experts, a scale per channel): the
    experts run as stored (INT8 with its scale per channel, -128 kept), the
    attention on its exactly dequantized weights, against stock on the values the codes mean."""
    ref = shutil.copytree(folders["qwen3_moe"], tmp_path / "ref")
    w8a8 = ckpts.as_w8a8(str(ref), tmp_path / "w8a8")
    model = ktcy.hf.from_pretrained(w8a8, dtype=torch.float32)
    experts = list(model.ktcy_experts().values())
    assert experts and all(m.kernel.startswith("INT8 on ") for m in experts)
    assert min(int(m.moe.gate[e].codes().min()) for m in experts for e in range(len(m.moe.gate))) == -128
    stock_model = stock(str(ref))
    attn = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[attn], stock_model.state_dict()[attn].float())
    err = rel_l2(logits(model, PROMPT), logits(stock_model, PROMPT))
    assert 1e-4 < err < 0.05  # the int8 activations' error only


def test_an_image_text_release_runs_its_language_model(folders, caplog):
    """Qwen3.5-MoE is released as an image-text model: its language model's tensors sit under
    model.language_model, and the vision tower is left out without a warning (it has no place
    in transformers' causal LM)."""
    with caplog.at_level("INFO", logger="ktcy"):
        model = ktcy.hf.from_pretrained(folders["qwen3_5_moe"], dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "not used" in r.getMessage()]
    assert any("model.visual." in r.getMessage() and "not loaded" in r.getMessage() for r in caplog.records)
    assert [b["router"] for b in ktcy.MoEModel.from_pretrained(folders["qwen3_5_moe"]).describe()] == ["softmax"] * 2


@pytest.fixture(scope="module")
def image_text_folders(tmp_path_factory):
    """Qwen3-VL-MoE (expert stacks stored [in, out] as released, or [out, in] as transformers saves
    them again) and GLM-4.5V (first layer dense, a multi-token-prediction layer after the last)."""
    root = tmp_path_factory.mktemp("image_text")
    return {"qwen3_vl_moe": ckpts.build_qwen3_vl_moe(root / "qwen3_vl_moe"),
            "qwen3_vl_moe_saved": ckpts.build_qwen3_vl_moe(root / "qwen3_vl_moe_saved", as_released=False),
            "glm4v_moe": ckpts.build_glm4v_moe(root / "glm4v_moe", mtp_layer=True)}


def image_text_stock(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_vl_moe_saved", "glm4v_moe"])
def test_an_image_text_model_runs_whole_with_its_vision_tower(image_text_folders, arch, caplog):
    """Qwen3-VL-MoE and GLM-4.5V have no causal LM in transformers: ktcy.hf builds the image-text
    model itself, vision tower and all, with its language model's experts on ktcy.  Text alone and
    text with an image give stock's logits; the image reaches them (another image moves them).
    GLM-4.5V's multi-token-prediction layer is left out without a warning."""
    folder = image_text_folders[arch]
    with caplog.at_level("WARNING", logger="ktcy"):
        model = ktcy.hf.from_pretrained(folder, dtype=torch.float32)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    ref = image_text_stock(folder)
    assert type(model).__name__ == type(ref).__name__ and type(model).__name__.endswith("ForConditionalGeneration")
    experts = model.ktcy_experts()
    assert sorted(experts) == sorted(n for n, m in ref.named_modules() if type(m).__name__.endswith("TextExperts"))
    assert all(m.kernel.startswith("BF16 on ") for m in experts.values())
    assert not any(".experts." in n for n, _ in model.named_parameters())
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    assert rel_l2(logits(model, PROMPT % ckpts.TEXT_TOKENS), logits(ref, PROMPT % ckpts.TEXT_TOKENS)) < 0.01
    image = ckpts.image_prompt(model.config)
    ids = image.pop("input_ids")
    with_image = logits(model, ids, **image)
    assert rel_l2(with_image, logits(ref, ids, **image)) < 0.01
    other = {**image, "pixel_values": torch.randn(image["pixel_values"].shape, generator=torch.Generator().manual_seed(9))}
    assert rel_l2(logits(model, ids, **other), with_image) > 0.05
    # the block names a rule or inject_expert_backend selects are the model's own
    last = max(experts)
    assert model.inject_expert_backend(re.escape(last), "INT8") == [last]
    assert model.ktcy_experts()[last].kernel.startswith("INT8 on ")
    assert 1e-5 < rel_l2(logits(model, ids, **image), logits(ref, ids, **image)) < 0.05


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "glm4v_moe"])
def test_an_image_text_models_greedy_answer_to_an_image_equals_stock(image_text_folders, arch):
    folder = image_text_folders[arch]
    image = ckpts.image_prompt(image_text_stock(folder).config, seed=ckpts.IMAGE_GREEDY_SEEDS[arch])
    ids = image.pop("input_ids")
    assert_same_greedy(image_text_stock(folder), ktcy.hf.from_pretrained(folder, dtype=torch.float32), ids,
                       NEW_TOKENS, suppress=range(ckpts.TEXT_TOKENS, ckpts.VOCAB), **image)


def test_an_image_text_model_takes_the_dtype_its_text_config_states(image_text_folders):
    """The releases state dtype in text_config only (no top-level one, as the fixtures write
    config.json): the torch part, vision tower included, is built in it, as stock builds it."""
    folder = image_text_folders["glm4v_moe"]
    ours = {n: p.dtype for n, p in ktcy.hf.from_pretrained(folder).named_parameters()}
    theirs = {n: p.dtype for n, p in transformers.AutoModelForImageTextToText.from_pretrained(folder).named_parameters()}
    assert ours and all(theirs[n] == d for n, d in ours.items())
    assert ours["model.visual.patch_embed.proj.weight"] == ours["lm_head.weight"] == torch.bfloat16


def test_an_image_text_model_from_gguf_is_refused_before_the_file_is_read(image_text_folders, tmp_path):
    with pytest.raises(CheckpointError, match="mmproj"):
        ktcy.hf.from_pretrained(image_text_folders["qwen3_vl_moe"], gguf_path=tmp_path / "absent.gguf")


def test_glm_4_5v_blocks_equal_the_stock_language_model(tmp_path):
    """GLM-4.5V (glm4v_moe): GLM-4.5's router and shared experts in an image-text release, the
    experts under model.language_model.layers, the first layer dense."""
    folder = ckpts.build_glm4v_moe(tmp_path / "m")
    language = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    language = language.model.language_model
    model = ktcy.MoEModel.from_pretrained(folder)
    assert [(b["layer"], b["router"], b["shared_experts"]) for b in model.describe()] == \
        [(1, "deepseek_v3", True), (2, "deepseek_v3", True)]
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    for block in model.blocks.values():
        with torch.no_grad():
            want = language.layers[block.layer].mlp(h[None])[0]
        assert rel_l2(torch.from_numpy(block.forward(h.numpy())), want) < 0.01, block.name


@pytest.mark.parametrize("as_released", [True, False])
def test_qwen3_vl_moe_experts_either_way_round(tmp_path, as_released):
    """Qwen3-VL-MoE's releases store the fused expert stacks [in, out]; transformers transposes
    them when it loads them and saves them [out, in]: ktcy reads both (down_proj's shape says
    which), and each block equals the stock language model's on the same hidden states."""
    folder = ckpts.build_qwen3_vl_moe(tmp_path / "m", as_released=as_released)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    language = ref.model.language_model
    model = ktcy.MoEModel.from_pretrained(folder)
    assert [b["router"] for b in model.describe()] == ["softmax"] * 2
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    for block in model.blocks.values():
        stock_experts = language.layers[block.layer].mlp.experts
        gate_up = stock_experts.gate_up_proj.detach().float().numpy()
        stored = Checkpoint(folder).layer(block.layer).expert(3)
        assert np.array_equal(stored["gate"][0].astype(np.float32), gate_up[3, :24])
        assert np.array_equal(stored["up"][0].astype(np.float32), gate_up[3, 24:])
        assert np.array_equal(stored["down"][0].astype(np.float32), stock_experts.down_proj.detach().float().numpy()[3])
        with torch.no_grad():
            want = language.layers[block.layer].mlp(h[None])[0]
        assert rel_l2(torch.from_numpy(block.forward(h.numpy())), want) < 0.01


def test_shared_experts_with_biases(tmp_path):
    """ERNIE 4.5 with use_bias: its shared experts (and dense MLPs) have biases.  ktcy.hf leaves
    them to torch; MoEModel, which runs shared experts through ktcy's bias-free kernels, refuses
    them rather than dropping the biases."""
    folder = ckpts.build("ernie4_5_moe", tmp_path / "m", seed=ckpts.GREEDY_SEEDS["ernie4_5_moe"], use_bias=True)
    model = ktcy.hf.from_pretrained(folder, dtype=torch.float32)
    assert rel_l2(logits(model, PROMPT), logits(stock(folder), PROMPT)) < 0.01
    with pytest.raises(CheckpointError, match=r"shared_experts.gate_proj.bias is stored: shared experts with biases "
                                              r"are not supported"):
        ktcy.MoEModel.from_pretrained(folder)


@pytest.mark.parametrize("bias_at", [".mlp.moe_statics.", ".mlp.gate.moe_statics."])
def test_ernie_router_bias_where_it_is_stored(folders, tmp_path, bias_at):
    """ERNIE 4.5 releases store the router's bias in mlp.moe_statics; transformers' module holds
    it in the gate (mlp.gate.moe_statics), the name a re-saved checkpoint may carry: MoEModel and
    ktcy.hf read it from either."""
    from safetensors.numpy import load_file, save_file
    folder = shutil.copytree(folders["ernie4_5_moe"], tmp_path / "ernie")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {k.replace(".mlp.moe_statics.", bias_at): v for k, v in tensors.items()}
    assert any(bias_at + "e_score_correction_bias" in k and np.abs(v.astype(np.float32)).max() > 0
               for k, v in tensors.items())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ref = stock(str(folder))
    h = torch.randn(1, 9, ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for block in ktcy.MoEModel.from_pretrained(folder).blocks.values():
        with torch.no_grad():
            want = ref.model.layers[block.layer].mlp(h)[0]
        assert rel_l2(torch.from_numpy(block.forward(h[0].numpy())), want) < 0.01, block.name
    assert rel_l2(logits(ktcy.hf.from_pretrained(folder, dtype=torch.float32), PROMPT), logits(ref, PROMPT)) < 0.01


def test_ernie_shared_expert_count_defaults_as_transformers(tmp_path):
    """Ernie4_5_MoeConfig's moe_num_shared_experts defaults to 2, where config.json leaves it out."""
    folder = ckpts.build("ernie4_5_moe", tmp_path / "e", moe_num_shared_experts=2)
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    del cfg["moe_num_shared_experts"]
    (tmp_path / "e" / "config.json").write_text(json.dumps(cfg))
    ref = stock(folder)
    h = torch.randn(1, 5, ref.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for block in ktcy.MoEModel.from_pretrained(folder).blocks.values():
        with torch.no_grad():
            want = ref.model.layers[block.layer].mlp(h)[0]
        assert rel_l2(torch.from_numpy(block.forward(h[0].numpy())), want) < 0.01, block.name


def test_bf16_model_takes_bf16_directly(folders):
    model = ktcy.hf.from_pretrained(folders["qwen3_moe"], dtype=torch.bfloat16)
    out = logits(model, PROMPT)
    assert model.dtype == torch.bfloat16
    assert rel_l2(out, logits(stock(folders["qwen3_moe"]), PROMPT)) < 0.05
    block = model.ktcy_experts()["model.layers.0.mlp.experts"]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = block(x, torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64) and y.abs().sum() > 0


def test_inject_expert_backend_switches_format_and_generates(folders):
    model = ktcy.hf.from_pretrained(folders["mixtral"], dtype=torch.float32)
    changed = model.inject_expert_backend(r"model\.layers\.1\.", "AMXINT8")
    assert changed == ["model.layers.1.mlp.experts"]
    kernels = {n: m.kernel for n, m in model.ktcy_experts().items()}
    assert kernels["model.layers.0.mlp.experts"].startswith("BF16 on ")
    assert kernels["model.layers.1.mlp.experts"].startswith("INT8 on ")
    assert model.inject_expert_backend(r"nothing\.", "INT4") == []
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, PROMPT.shape[1] + 5)
    for experts in model.ktcy_experts().values():  # docs/hf.md: time and calls of each block's forward
        assert experts.calls == 5 and experts.seconds > 0  # the prompt, then 4 one-token steps
    with pytest.raises(ktcy.RuleError):
        model.inject_expert_backend("(", "INT8")
    with pytest.raises(ValueError):
        model.inject_expert_backend(".*", "NOT_A_FORMAT")


def test_rules_select_backend_per_block(folders):
    rules = textwrap.dedent("""\
        - match: {name: "^model\\\\.layers\\\\.0\\\\.mlp\\\\.experts$"}
          replace: {class: operators.experts.KTransformersExperts, kwargs: {backend: AMXINT4}}
        """)
    model = ktcy.hf.from_pretrained(folders["olmoe"], rules=rules, backend="INT8", dtype=torch.float32)
    kernels = {n: m.kernel.split(" ")[0] for n, m in model.ktcy_experts().items()}
    assert kernels == {"model.layers.0.mlp.experts": "INT4", "model.layers.1.mlp.experts": "INT8"}


def _block_outputs(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.ktcy_experts().items():
        x = torch.randn(5, 64, generator=g)
        ids = torch.randint(0, m.moe.config.num_experts, (5, m.moe.config.top_k), generator=g)
        out[name] = m(x, ids, torch.rand(5, m.moe.config.top_k, generator=g)).numpy()
    return out


def test_experts_path_gives_the_same_blocks_as_the_checkpoint(folders, tmp_path):
    src = folders["qwen2_moe"]
    packed = tmp_path / "packed"
    convert(src, str(packed), method="INT8")
    from_folder = ktcy.hf.from_pretrained(src, experts_path=packed, dtype=torch.float32)
    from_ckpt = ktcy.hf.from_pretrained(src, backend="INT8", dtype=torch.float32)
    a, b = _block_outputs(from_folder), _block_outputs(from_ckpt)
    assert a.keys() == b.keys() and len(a) == 2
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert rel_l2(logits(from_folder, PROMPT), logits(from_ckpt, PROMPT)) == 0
    # another format than the folder's is packed from the checkpoint, as MoEModel does
    other = ktcy.hf.from_pretrained(src, experts_path=packed, backend="BF16", dtype=torch.float32)
    assert all(m.format == "BF16" for m in other.ktcy_experts().values())
    assert rel_l2(logits(other, PROMPT), logits(ktcy.hf.from_pretrained(src, backend="BF16", dtype=torch.float32),
                                                PROMPT)) == 0
    with pytest.raises(ktcy.CheckpointError, match="experts_path"):
        ktcy.hf.from_pretrained(src, experts_path=src)
    with pytest.raises(ktcy.CheckpointError, match="converted folder"):
        ktcy.hf.from_pretrained(packed)


def test_experts_path_from_another_model_is_refused(folders, tmp_path):
    packed = tmp_path / "packed"
    convert(folders["olmoe"], str(packed), method="INT8")  # 8 experts; Mixtral's layers have 4
    with pytest.raises(ktcy.CheckpointError):
        ktcy.hf.from_pretrained(folders["mixtral"], experts_path=packed)


def test_unknown_architecture_lists_supported(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ktcy.hf.UnsupportedArchitectureError) as e:
        ktcy.hf.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "'llama'" in msg and all(a in msg for a in ckpts.ARCHITECTURES)


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(ktcy.CheckpointError):
        ktcy.hf.from_pretrained(tmp_path / "nowhere")


def test_missing_torch_is_an_import_error_naming_the_extra():
    code = textwrap.dedent("""\
        import sys
        sys.modules["torch"] = None
        import ktcy  # the numpy core does not need torch
        import ktcy.hf  # importable (the CLI lists `generate`); its names need the extra
        try:
            from ktcy.hf import from_pretrained
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "IMPORT-ERROR:" in r.stdout and "pip install ktcy[hf]" in r.stdout


def test_rules_also_match_the_checkpoints_block_names(folders):
    # Mixtral's checkpoint calls the block block_sparse_moe, transformers' module mlp
    rules = [{"match": {"name": r"model\.layers\.1\.block_sparse_moe\.experts"},
              "replace": {"kwargs": {"backend": "INT8"}}}]
    model = ktcy.hf.from_pretrained(folders["mixtral"], rules=rules, dtype=torch.float32)
    kernels = {n: m.kernel.split(" ")[0] for n, m in model.ktcy_experts().items()}
    assert kernels == {"model.layers.0.mlp.experts": "BF16", "model.layers.1.mlp.experts": "INT8"}


def test_a_rule_that_matches_no_experts_module_is_named(folders, caplog):
    rules = [{"match": {"name": r"model\.language_model\.layers\.0\."}, "replace": {"kwargs": {"backend": "INT8"}}},
             {"match": {"name": r"model\.layers\.1\."}, "replace": {"kwargs": {"backend": "INT8"}}},
             {"match": {"name": r"model\.layers\.0\.", "class": "torch.nn.Linear"}, "replace": {"class": "x"}}]
    with caplog.at_level("WARNING", logger="ktcy"):
        model = ktcy.hf.from_pretrained(folders["olmoe"], rules=rules, dtype=torch.float32)
    said = [r.getMessage() for r in caplog.records if "matches no experts module" in r.getMessage()]
    # the first only: the second selects layer 1, the third selects no experts by its class
    assert len(said) == 1 and said[0].startswith("rule 0:") and "model.layers.0.mlp.experts" in said[0], said
    kernels = {n: m.kernel.split(" ")[0] for n, m in model.ktcy_experts().items()}
    assert kernels == {"model.layers.0.mlp.experts": "BF16", "model.layers.1.mlp.experts": "INT8"}


def test_arguments_that_do_not_apply_are_refused(folders):
    with pytest.raises(ValueError, match="device_map"):
        ktcy.hf.from_pretrained(folders["olmoe"], device_map="auto")
    with pytest.raises(ValueError, match="hidden_act= cannot override config.json"):
        ktcy.hf.from_pretrained(folders["olmoe"], hidden_act="gelu")  # the torch part alone would change
    for switch in ("load_in_8bit", "load_in_4bit"):  # bitsandbytes would quantize the experts ktcy runs
        with pytest.raises(ValueError, match=switch):
            ktcy.hf.from_pretrained(folders["olmoe"], **{switch: True})
    with pytest.raises(ValueError, match="trust_remote_code"):
        ktcy.hf.from_pretrained(folders["olmoe"], trust_remote_code=True)
    with pytest.raises(ValueError, match="dtype"):
        ktcy.hf.from_pretrained(folders["olmoe"], dtype="int8")
    with pytest.raises(ValueError, match=r"got 'bf16'"):  # the name given, not what it failed to become
        ktcy.hf.from_pretrained(folders["olmoe"], dtype="bf16")
    with pytest.raises(TypeError, match="attn_implementaton"):  # misspelt: stock refuses it too
        ktcy.hf.from_pretrained(folders["olmoe"], attn_implementaton="eager")
    with pytest.raises(ktcy.RuleError):
        ktcy.hf.from_pretrained(folders["olmoe"], rules="- match: {name: '('}\n")


def test_dense_layers_between_moe_layers_stay_torch(tmp_path):
    folder = ckpts.build("qwen2_moe", tmp_path / "m", seed=ckpts.GREEDY_SEEDS["qwen2_moe"], mlp_only_layers=[0])
    model = ktcy.hf.from_pretrained(folder, dtype=torch.float32)
    assert list(model.ktcy_experts()) == ["model.layers.1.mlp.experts"]
    assert rel_l2(logits(model, PROMPT), logits(stock(folder), PROMPT)) < 0.01


def test_hub_id_is_found_in_the_local_cache(folders, tmp_path, monkeypatch):
    import shutil
    snapshot = tmp_path / "hub" / "models--tiny--olmoe" / "snapshots" / "rev1"
    shutil.copytree(folders["olmoe"], snapshot)
    (tmp_path / "hub" / "models--tiny--olmoe" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--olmoe" / "refs" / "main").write_text("rev1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = ktcy.hf.from_pretrained("tiny/olmoe", dtype=torch.float32)
    assert rel_l2(logits(model, PROMPT), logits(stock(folders["olmoe"]), PROMPT)) < 0.01
    with pytest.raises(ktcy.CheckpointError, match="huggingface-cli download"):
        ktcy.hf.from_pretrained("tiny/absent")


# ---- the fiftieth stop's review ----

def test_kt_rule_files_linear_rules_do_not_take_the_experts(folders):
    # KTransformers' rule files (optimize_rules/DeepSeek-V3-Chat-amx.yaml) put a torch.nn.Linear rule
    # whose name matches every module under model.layers before the experts rule
    rules = textwrap.dedent("""\
        - match: {class: some.RotaryEmbedding}
          replace: {class: some.Rope}
        - match: {name: "^model\\\\.layers\\\\.(?!.*self_attn\\\\.kv_b_proj).*$", class: torch.nn.Linear}
          replace: {class: ktransformers.operators.linear.KTransformersLinear, kwargs: {generate_op: KLinearMarlin}}
        - match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
          replace: {class: ktransformers.operators.experts.KTransformersExperts, kwargs: {backend: AMXInt4}}
        """)
    model = ktcy.hf.from_pretrained(folders["olmoe"], rules=rules, dtype=torch.float32)
    assert {m.kernel.split(" ")[0] for m in model.ktcy_experts().values()} == {"INT4"}
    blocks = ktcy.MoEModel.from_pretrained(folders["olmoe"], rules=rules).describe()
    assert [(r["format"], r["rule"]) for r in blocks] == [("INT4", 2)] * len(blocks)
    with pytest.raises(ktcy.RuleError, match="rule 0: 'replace' must be a mapping"):
        ktcy.hf.from_pretrained(folders["olmoe"], rules=[{"match": {"name": ".*"}, "replace": [1]}])


def test_empty_batch_and_save_pretrained_and_copies(folders, tmp_path):
    model = ktcy.hf.from_pretrained(folders["qwen3_moe"], dtype=torch.float32)
    block = model.model.layers[0].mlp
    assert tuple(block(torch.zeros(1, 0, 64)).shape) == (1, 0, 64)  # as stock's sparse block
    experts = next(iter(model.ktcy_experts().values()))
    assert tuple(experts(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)).shape) == (0, 64)
    with pytest.raises(NotImplementedError, match="no routed experts"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    import copy
    import pickle
    for attempt in (lambda: copy.deepcopy(model), lambda: pickle.dumps(experts.moe)):
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            attempt()
    with pytest.raises(ValueError, match="dtype must be torch.float32"):
        ktcy.hf.from_pretrained(folders["qwen3_moe"], dtype=torch.float8_e4m3fn)


def test_a_config_transformers_refuses_is_one_checkpoint_error(folders, tmp_path):
    """transformers' own refusal of a config.json (here a KeyError for an unknown rope type, deep in
    its modeling code) comes out as a CheckpointError naming the file."""
    bad = tmp_path / "bad"
    shutil.copytree(folders["olmoe"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["rope_scaling"] = config["rope_parameters"] = {"rope_type": "nonsense", "rope_theta": 10000.0}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ktcy.CheckpointError, match=r"config.json: transformers could not make .* from it"):
        ktcy.hf.from_pretrained(bad)


def test_a_backward_pass_through_the_experts_raises(folders):
    """Training through ktcy's experts ran a backward pass that gave the routers no gradient."""
    model = ktcy.hf.from_pretrained(folders["qwen3_moe"], dtype=torch.float32)
    model.train()
    loss = model(PROMPT, labels=PROMPT).loss  # the forward still runs with gradients enabled
    assert torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="inference-only"):
        loss.backward()
    with torch.no_grad():
        assert torch.equal(logits(model, PROMPT), logits(model, PROMPT))


def test_a_stock_model_built_in_another_thread_during_a_load_gets_real_experts(folders):
    """The experts class is patched to build on meta while ktcy loads: only for the loading thread."""
    experts_type = type(stock(folders["qwen3_moe"]).model.layers[1].mlp.experts)
    config = transformers.AutoConfig.from_pretrained(folders["qwen3_moe"])
    built, stop = [], threading.Event()

    def build():
        while not stop.is_set():
            built.append(next(experts_type(config).parameters()).device.type)

    other = threading.Thread(target=build)
    other.start()
    try:
        for _ in range(3):
            ktcy.hf.from_pretrained(folders["qwen3_moe"], dtype=torch.float32)
    finally:
        stop.set()
        other.join()
    assert built and set(built) == {"cpu"}


def test_loading_skips_random_initialisation_and_keeps_every_buffer(folders, monkeypatch):
    """Every tensor of the torch part comes from the checkpoint: drawing random weights first
    cost seconds per billion of them.  Buffers built in __init__ (rotary) stay as stock's."""
    calls = []
    real = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = ktcy.hf.from_pretrained(folders["deepseek_v3"], dtype=torch.float32)
    assert calls == []
    ref = stock(folders["deepseek_v3"])
    mine = dict(model.named_buffers())
    for name, buffer in ref.named_buffers():
        if ".experts." not in name:
            assert torch.equal(mine[name], buffer), name
