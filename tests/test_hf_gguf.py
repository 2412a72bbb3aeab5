"""ktcy.hf.from_pretrained(config_folder, gguf_path=...): a whole model from a GGUF file, as
KTransformers runs GGUF models.  The tiny transformers models are written to GGUF with the
`gguf` package's own name table (llama.cpp's converter's; not ktcy's) and must give the logits
of the same model loaded from its Hugging Face checkpoint."""
import json
import os
import shutil

import numpy as np
import pytest

import gguf
import hf_checkpoints as ckpts

torch = pytest.importorskip("torch")  # CI installs the hf extra: this never skips there
pytest.importorskip("transformers")
import ktcy.hf  # noqa: E402
from ktcy.convert import convert  # noqa: E402
from ktcy.safetensors_io import CheckpointError  # noqa: E402
from hf_compare import assert_same_greedy, logits, stock  # noqa: E402
from test_hf import NEW_TOKENS, PROMPT as GREEDY_PROMPT  # noqa: E402  (the prompt the greedy seeds were chosen for)
from test_gguf import _close  # noqa: E402
from test_gguf_model import FAMILIES, add_family_metadata, expert_count, hf_tensors  # noqa: E402

T = gguf.GGMLQuantizationType
ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
PROMPT = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])


def add_attention_metadata(w, cfg, name, **changed):
    """The attention keys llama.cpp's converter writes (`changed` replaces some: another model's)."""
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    ints = {"attention.head_count": heads}
    if name == "deepseek2":  # latent attention written as MQA over the compressed kv, as since April 2025
        nope, rot = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        ints.update({"attention.head_count_kv": 1, "attention.key_length": cfg["kv_lora_rank"] + rot,
                     "attention.value_length": cfg["kv_lora_rank"], "attention.key_length_mla": nope + rot,
                     "attention.value_length_mla": cfg["v_head_dim"], "attention.kv_lora_rank": cfg["kv_lora_rank"],
                     "rope.dimension_count": rot})
        if cfg.get("q_lora_rank"):
            ints["attention.q_lora_rank"] = cfg["q_lora_rank"]
    else:
        ints.update({"attention.head_count_kv": cfg.get("num_key_value_heads", heads),
                     "attention.key_length": cfg.get("head_dim") or cfg["hidden_size"] // heads})
    floats = {"rope.freq_base": rope, "attention.layer_norm_rms_epsilon": cfg.get("rms_norm_eps")}
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    strings = {"rope.scaling.type": scaling.get("rope_type", scaling.get("type"))} if scaling.get("factor") else {}
    if strings:
        floats["rope.scaling.factor"] = scaling["factor"]
        ints["rope.scaling.original_context_length"] = scaling.get("original_max_position_embeddings")
    for key, value in {**ints, **floats, **strings, **changed}.items():
        if value is None:
            continue
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"{name}.{key}", value)


def write_gguf(folder, path, model_type, expert_type="BF16", drop=(), split=True, mtp=False, meta=None,
               extra=None, dense_type="BF16"):
    """Every tensor of the checkpoint in `folder` under the name llama.cpp's converter gives it
    (gguf.get_tensor_name_map, after the converter's own e_score_correction_bias rename), 2-D
    ones in BF16 and 1-D ones in F32 as the converter keeps them, the experts stacked per
    projection [E, N, K] in expert_type (GPT-OSS's interleaved gate_up split, biases F32); the
    family's metadata (test_gguf_model.add_family_metadata)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    name = FAMILIES[model_type]
    t = hf_tensors(folder)
    names = gguf.get_tensor_name_map(ARCHS[name], cfg["num_hidden_layers"])
    E = expert_count(cfg)
    w = gguf.GGUFWriter(path, name)
    add_family_metadata(w, cfg, model_type, extra_blocks=int(mtp))
    add_attention_metadata(w, cfg, name, **(meta or {}))
    if mtp:
        w.add_uint32(f"{name}.nextn_predict_layers", 1)
    experts = {}
    for key in sorted(t):
        value = t[key]
        if ".experts." in key:
            layer, rest = key.split(".")[2], key.split(".experts.")[1]
            if rest.startswith(("gate_up_proj", "down_proj")):  # GPT-OSS: [E, in, out] stacks and their biases
                if rest == "gate_up_proj":
                    experts[layer, "gate"], experts[layer, "up"] = (value[:, :, 0::2].transpose(0, 2, 1),
                                                                   value[:, :, 1::2].transpose(0, 2, 1))
                elif rest == "gate_up_proj_bias":
                    experts[layer, "gate_bias"], experts[layer, "up_bias"] = value[:, 0::2], value[:, 1::2]
                elif rest == "down_proj":
                    experts[layer, "down"] = value.transpose(0, 2, 1)
                else:
                    experts[layer, "down_bias"] = value
                continue
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            proj = {"w1": "gate", "w3": "up", "w2": "down"}.get(proj, proj.split("_")[0])  # Mixtral's names
            experts.setdefault((layer, proj), {})[e] = value
            continue
        key = key.replace("e_score_correction_bias", "e_score_correction.bias")  # the converter's renames
        key = key + ".weight" if key.endswith(".sinks") else key
        if model_type == "qwen3_next":  # its converter's transforms (written from their description)
            key = key.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")
            if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
                value = value.astype(np.float32) + np.float32(1)  # zero-centred norms stored as 1 + w
            elif key.endswith(".A_log"):
                value = -np.exp(value.astype(np.float32))
            elif key.endswith("conv1d.weight"):
                value = value.squeeze(1)
            elif key.endswith("in_proj_qkvz.weight") and split:  # per key-head group [q k v z] -> all q, k, v | z
                groups, k_dim = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
                vz = cfg["linear_num_value_heads"] // groups * cfg["linear_value_head_dim"]
                per = value.reshape(groups, 2 * k_dim + 2 * vz, -1)
                layer = key.split(".")[2]
                for half, part in (("attn_qkv", np.concatenate([per[:, :k_dim].reshape(-1, per.shape[-1]),
                                                                per[:, k_dim:2 * k_dim].reshape(-1, per.shape[-1]),
                                                                per[:, 2 * k_dim:2 * k_dim + vz].reshape(-1, per.shape[-1])])),
                                   ("attn_gate", per[:, 2 * k_dim + vz:].reshape(-1, per.shape[-1]))):
                    raw = gguf.quants.quantize(np.ascontiguousarray(part, np.float32), T.BF16)
                    w.add_tensor(f"blk.{layer}.{half}.weight", raw, raw_dtype=T.BF16)
                continue
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert target is not None, key
        if target in drop:
            continue
        if target.endswith("attn_kv_b.weight") and split:  # llama.cpp since April 2025: per head, k half transposed
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = value.reshape(heads, nope + v, -1)
            for half, part in (("attn_k_b", kv_b[:, :nope].transpose(0, 2, 1)), ("attn_v_b", kv_b[:, nope:])):
                raw = gguf.quants.quantize(np.ascontiguousarray(part, np.float32), T.BF16)
                w.add_tensor(target.replace("attn_kv_b", half), raw, raw_dtype=T.BF16)
            continue
        if model_type == "mixtral" and target.endswith(("attn_q.weight", "attn_k.weight")):
            value = llama_cpp_rope_order(value, cfg["num_attention_heads"] if "attn_q" in target
                                         else cfg["num_key_value_heads"])
        if value.ndim == 2 and value.shape[0] == 1 and "e_score_correction" in key:
            value = value.reshape(-1)  # ERNIE's [1, E] statics
        if value.ndim == 1:
            w.add_tensor(target, value.astype(np.float32))
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(value, np.float32), T[dense_type])
            w.add_tensor(target, raw, raw_dtype=T[dense_type])
    for (layer, proj), stack in experts.items():
        if proj.endswith("_bias"):
            w.add_tensor(f"blk.{layer}.ffn_{proj[:-5]}_exps.bias", np.ascontiguousarray(stack, np.float32))
            continue
        if isinstance(stack, dict):
            stack = np.stack([stack[e] for e in range(E)])
        type_name = expert_type[proj] if isinstance(expert_type, dict) else expert_type  # or one per projection
        kind = T[type_name]
        stack = np.ascontiguousarray(stack, np.float32)
        raw = quantize_q4_k(stack) if type_name == "Q4_K" else gguf.quants.quantize(stack, kind)
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", raw, raw_dtype=kind)
    for target, value in (extra or {}).items():
        w.add_tensor(target, value)
    if mtp:  # GLM-4.5's multi-token-prediction block after the decoder layers, as llama.cpp writes it
        L = cfg["num_hidden_layers"]
        for name, value in (("attn_norm.weight", np.ones(cfg["hidden_size"], np.float32)),
                            ("nextn.eh_proj.weight", np.zeros((cfg["hidden_size"], 2 * cfg["hidden_size"]), np.float32)),
                            ("ffn_gate_exps.weight", np.zeros((E, cfg["moe_intermediate_size"], cfg["hidden_size"]), np.float32))):
            w.add_tensor(f"blk.{L}.{name}", value)
    _close(w)
    return path


def quantize_q4_k(x):
    """float32 [..., K] (K a multiple of 256) as ggml's block_q4_K bytes [..., K / 256 * 144], by a
    plain rule written here (the gguf package quantizes no K-quant): per 32 values the offset
    -min(0, lo) and the step (hi - lo) / 15 as 6-bit multiples of the super-block's f16 dmin and d;
    codes q = rint((w + dmin * m) / (d * sc)) in 0..15.  Block layout: f16 d, f16 dmin, the 6-bit
    scales and mins (sub-blocks 0-3 in the low six bits of bytes 0-3 and 4-7, 4-7 in the nibbles
    of bytes 8-11 with their top two bits in bits 6-7 of bytes 0-7), then 64 values per 32 bytes,
    low nibbles first."""
    lead, k = x.shape[:-1], x.shape[-1]
    v = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(v.min(axis=2), 0), v.max(axis=2)
    step, off = (hi - lo) / 15, -lo
    d = (step.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (off.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(off / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    scale, mn = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint((v + mn[:, :, None]) / np.where(scale > 0, scale, 1)[:, :, None]), 0, 15).astype(np.uint8)
    out = np.zeros((v.shape[0], 144), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    codes = q.reshape(-1, 4, 2, 32)
    out[:, 16:] = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(*lead, k // 256 * 144)


def stock_with_file_experts(folder, path):
    """Stock transformers' model of `folder` with its experts replaced by the GGUF file's, as
    the gguf package decodes them (GPT-OSS's [E, in, out] stacks with gate and up interleaved)."""
    model = stock(folder)
    reader = gguf.GGUFReader(path)
    stacks = {t.name: torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
              for t in reader.tensors if "_exps.weight" in t.name}
    for L, layer in enumerate(model.model.layers):
        e = layer.mlp.experts
        gate, up, down = (stacks[f"blk.{L}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        with torch.no_grad():
            if model.config.model_type != "gpt_oss":  # [E, 2I, H], gate first
                e.gate_up_proj.copy_(torch.cat([gate, up], 1))
                e.down_proj.copy_(down)
            else:
                e.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2)
                e.gate_up_proj[:, :, 1::2] = up.transpose(1, 2)
                e.down_proj.copy_(down.transpose(1, 2))
    return model


def llama_cpp_rope_order(w, heads):
    """The row order llama.cpp's converter writes a `llama` model's query / key weights in: each
    head's rows [first half | second half] interleaved as pairs (half[0][0], half[1][0], ...)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def config_only(folder, dest):
    """The checkpoint folder without its weights: config.json and the generation config."""
    os.makedirs(dest)
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(folder, name)):
            shutil.copy(os.path.join(folder, name), dest)
    return str(dest)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "dots1",
                                        "ernie4_5_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "deepseek_v2",
                                        "glm4_moe_lite", "qwen3_next"])
def test_gguf_model_equals_the_checkpoint_model(tmp_path, model_type, caplog):
    if model_type == "gpt_oss":  # llama.cpp's clamp (GGUF stores none); its seeds were chosen for another
        folder = ckpts.build(model_type, tmp_path / "hf", seed=0, swiglu_limit=7.0)
    else:
        folder = ckpts.build(model_type, tmp_path / "hf", seed=ckpts.GREEDY_SEEDS[model_type])
    path = write_gguf(folder, str(tmp_path / "model.gguf"), model_type, mtp=model_type == "glm4_moe")
    if model_type in ("deepseek_v3", "qwen3_next"):  # a file from before llama.cpp split kv_b / in_proj_qkvz
        old = ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cfg_old"), dtype=torch.float32,
                                      gguf_path=write_gguf(folder, str(tmp_path / "old.gguf"), model_type, split=False))
    cfg = config_only(folder, tmp_path / "cfg")
    with caplog.at_level("INFO", logger="ktcy"):
        from_gguf = ktcy.hf.from_pretrained(cfg, gguf_path=path, dtype=torch.float32)
    assert "not used by the model" not in caplog.text  # every tensor has its place (or is an MTP block's)
    assert ("multi-token-prediction" in caplog.text) == (model_type == "glm4_moe")
    from_checkpoint = ktcy.hf.from_pretrained(folder, dtype=torch.float32)
    assert {m.moe.format for m in from_gguf.ktcy_experts().values()} == {"BF16"}
    assert torch.equal(logits(from_gguf, PROMPT), logits(from_checkpoint, PROMPT))
    if model_type in ("deepseek_v3", "qwen3_next"):
        assert torch.equal(logits(old, PROMPT), logits(from_checkpoint, PROMPT))
    if model_type != "gpt_oss":
        assert_same_greedy(stock(folder), from_gguf, GREEDY_PROMPT, NEW_TOKENS)


def test_quantize_q4_k_writes_what_llama_cpp_decodes():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32) * 0.05
    x[1] += 0.2  # a row whose sub-blocks have no negative value: offset 0
    back = np.asarray(gguf.quants.dequantize(quantize_q4_k(x), T.Q4_K), np.float32).reshape(x.shape)
    step = (x.reshape(3, -1, 32).max(axis=2) - np.minimum(x.reshape(3, -1, 32).min(axis=2), 0)) / 15
    assert (np.abs(back - x).reshape(3, -1, 32).max(axis=2) <= step * 0.5 + step.max() * 0.05).all()


@pytest.mark.parametrize("expert_type,fmt", [("Q4_0", "INT4"), ("Q4_K", "INT4_MIN"), ("Q4_1", "INT4_MIN"),
                                             ("Q8_0", "INT8_GROUP"), ("Q5_0", "INT8_GROUP"), ("Q5_1", "INT8_MIN"),
                                             ({"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0"}, ("INT4_MIN", "INT8_GROUP"))],
                         ids=["Q4_0", "Q4_K", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K+Q8_0"])
def test_quantized_experts_run_as_stored(tmp_path, expert_type, fmt):
    # K-quants store rows in blocks of 256 values: every type at that width
    folder = ckpts.build("qwen3_moe", tmp_path / "hf", seed=0, hidden_size=256, moe_intermediate_size=256)
    path = write_gguf(folder, str(tmp_path / "model.gguf"), "qwen3_moe", expert_type=expert_type)
    model = ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cfg"), gguf_path=path, dtype=torch.float32)
    experts = list(model.ktcy_experts().values())
    gate_up, down = fmt if isinstance(fmt, tuple) else (fmt, fmt)  # down may have its own format
    assert {(m.moe.format, m.moe.gate[0].group_size, m.moe.down_format) for m in experts} == {(gate_up, 32, down)}
    stock_model = stock_with_file_experts(folder, path)
    for L, m in enumerate(experts):  # the file's values, bit for bit
        for proj in ("gate", "up", "down"):
            file_values = getattr(stock_model.model.layers[L].mlp.experts, "down_proj" if proj == "down" else "gate_up_proj")
            I_ = m.moe.gate[0].shape[0]
            for e in range(len(m.moe.gate)):
                want = file_values[e] if proj == "down" else file_values[e][:I_] if proj == "gate" else file_values[e][I_:]
                assert np.array_equal(getattr(m.moe, proj)[e].dequantize(np.float32), want.detach().numpy()), (L, proj, e)
    ref = logits(stock_model, PROMPT)
    # int8 activations' error only, over two 256-wide layers: 2.7-3.2% for the 4-bit types, 3.5%
    # for Q5_0; the model with Q8_0's experts is more sensitive to it: 8.9% (per-channel INT8 gives
    # 10.1% there, bf16 activations 1.2%)
    bound = {"Q8_0": 0.1, "Q5_0": 0.045}.get(expert_type, 0.04) if isinstance(expert_type, str) else 0.04
    assert float((logits(model, PROMPT) - ref).norm() / ref.norm()) < bound
    if isinstance(fmt, tuple):  # converted as stored, each side in its format: the same model from the folder
        convert(path, str(tmp_path / "packed"), progress=None)
        folder_model = ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cfg2"), gguf_path=path, dtype=torch.float32,
                                               experts_path=str(tmp_path / "packed"))
        assert {(m.moe.format, m.moe.down_format) for m in folder_model.ktcy_experts().values()} == {fmt}
        assert torch.equal(logits(folder_model, PROMPT), logits(model, PROMPT))
    changed = model.inject_expert_backend(r"model\.layers\.0\.", "BF16")
    assert changed == ["model.layers.0.mlp.experts"] and model.ktcy_experts()[changed[0]].moe.format == "BF16"


def test_gguf_files_ktcy_hf_does_not_read_are_refused(tmp_path):
    folder = ckpts.build("qwen3_moe", tmp_path / "hf", seed=0)
    cfg = config_only(folder, tmp_path / "cfg")
    other = ckpts.build("qwen2_moe", tmp_path / "hf2", seed=0)
    with pytest.raises(CheckpointError, match="a qwen2moe model, but .*config.json describes model_type 'qwen3_moe'"):
        ktcy.hf.from_pretrained(cfg, gguf_path=write_gguf(other, str(tmp_path / "q2.gguf"), "qwen2_moe"))
    fewer = ckpts.build("qwen3_moe", tmp_path / "hf3", seed=0, num_experts=4)
    with pytest.raises(CheckpointError, match="not the model .* describes .num_experts 4 there, 8 in config.json"):
        ktcy.hf.from_pretrained(cfg, gguf_path=write_gguf(fewer, str(tmp_path / "e4.gguf"), "qwen3_moe"))
    with pytest.raises(CheckpointError, match="1 tensors the model needs are missing from the GGUF model "
                                              r"\(first: model.layers.1.self_attn.q_proj.weight\)"):
        ktcy.hf.from_pretrained(cfg, gguf_path=write_gguf(folder, str(tmp_path / "d.gguf"), "qwen3_moe",
                                                          drop=("blk.1.attn_q.weight",)))
    mixtral = ckpts.build("mixtral", tmp_path / "hf4", seed=0)
    with pytest.raises(CheckpointError, match="a llama model, but .*config.json describes model_type 'qwen3_moe'"):
        ktcy.hf.from_pretrained(cfg, gguf_path=write_gguf(mixtral, str(tmp_path / "m.gguf"), "mixtral"))


def test_ktcy_generate_reads_a_gguf_model(tmp_path):
    import io
    from ktcy.cli import build_parser
    from ktcy.hf import generate_cli
    folder = ckpts.build("qwen3_moe", tmp_path / "hf", seed=ckpts.GREEDY_SEEDS["qwen3_moe"])
    path = write_gguf(folder, str(tmp_path / "model.gguf"), "qwen3_moe")
    cfg = config_only(folder, tmp_path / "cfg")
    out = io.StringIO()
    args = build_parser().parse_args(["generate", "--model", cfg, "--gguf", path, "--input-ids", "3,4,5,6",
                                      "--max-new-tokens", "5", "--threads", "1", "--dtype", "float32"])
    assert generate_cli.run(args, out) == 0
    tokens = [int(t) for t in out.getvalue().splitlines()[0].split()]
    with torch.no_grad():
        ref = stock(folder).generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert tokens == ref[0, 4:].tolist()


def test_gpt_oss_mxfp4_experts_stay_mxfp4_and_its_clamp_must_agree(tmp_path):
    folder = ckpts.build("gpt_oss", tmp_path / "hf", seed=0, swiglu_limit=7.0)
    path = write_gguf(folder, str(tmp_path / "model.gguf"), "gpt_oss", expert_type="MXFP4")
    model = ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cfg"), gguf_path=path, dtype=torch.float32)
    assert {m.moe.format for m in model.ktcy_experts().values()} == {"MXFP4"}
    ref = logits(stock_with_file_experts(folder, path), PROMPT)
    assert float((logits(model, PROMPT) - ref).norm() / ref.norm()) < 0.01  # bf16 activations' error only
    other = ckpts.build("gpt_oss", tmp_path / "hf3", seed=0)  # the tests' GPT-OSS clamps at 3.0
    with pytest.raises(CheckpointError, match="swiglu_limit 7.0 there, 3.0 in config.json"):
        ktcy.hf.from_pretrained(config_only(other, tmp_path / "cfg3"), gguf_path=path)


def _edited_config(folder, dest, **changes):
    cfg = config_only(folder, dest)
    doc = json.load(open(os.path.join(cfg, "config.json")))
    doc.update(changes)
    json.dump(doc, open(os.path.join(cfg, "config.json"), "w"))
    return cfg


def test_a_config_of_another_model_with_the_same_shapes_is_refused(tmp_path):
    """The torch part runs on config.json: a file whose own attention, rope, norm or routing
    metadata says otherwise would run silently wrong (every tensor shape still fits)."""
    folder = ckpts.build("qwen3_moe", tmp_path / "hf", seed=0)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "qwen3_moe")
    cases = [({"rope_theta": 12345.0, "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}},
              r"rope.freq_base 10000.0 there, 12345.0 in config.json"),
             ({"rms_norm_eps": 1e-3}, r"attention.layer_norm_rms_epsilon .* there, 0.001 in config.json")]
    for i, (changes, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            ktcy.hf.from_pretrained(_edited_config(folder, tmp_path / f"c{i}", **changes), gguf_path=path)
    scaled = write_gguf(folder, str(tmp_path / "y.gguf"), "qwen3_moe",
                        meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match="rope.scaling.type yarn there, rope_type default in config.json"):
        ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cy"), gguf_path=scaled)
    gpt_oss = ckpts.build("gpt_oss", tmp_path / "go", seed=0, swiglu_limit=7.0)  # YaRN, factor 32 over 4 positions
    with pytest.raises(CheckpointError, match="rope scaling factor 32.0 there, 8.0 in config.json"):
        doc_rope = json.load(open(os.path.join(gpt_oss, "config.json")))["rope_parameters"]
        ktcy.hf.from_pretrained(_edited_config(gpt_oss, tmp_path / "cg", rope_parameters={**doc_rope, "factor": 8.0}),
                                gguf_path=write_gguf(gpt_oss, str(tmp_path / "go.gguf"), "gpt_oss"))
    mixtral = ckpts.build("mixtral", tmp_path / "mx", seed=0)  # 4 heads of 16 there, 8 of 8 here: the same shapes
    with pytest.raises(CheckpointError, match=r"attention.head_count 4 there, 8 in config.json"):
        ktcy.hf.from_pretrained(_edited_config(mixtral, tmp_path / "cm", num_attention_heads=8, head_dim=8),
                                gguf_path=write_gguf(mixtral, str(tmp_path / "mx.gguf"), "mixtral"))
    deepseek = ckpts.build("deepseek_v3", tmp_path / "ds", seed=0)
    with pytest.raises(CheckpointError, match=r"expert_weights_scale 2.5 there, 1.0 in config.json"):
        ktcy.hf.from_pretrained(_edited_config(deepseek, tmp_path / "cd", routed_scaling_factor=1.0),
                                gguf_path=write_gguf(deepseek, str(tmp_path / "ds.gguf"), "deepseek_v3"))


def test_tied_embeddings_load_from_the_checkpoint_and_from_gguf(tmp_path):
    """ERNIE-4.5-21B-A3B ties lm_head to the embeddings; transformers ties them in init_weights,
    which ktcy.hf skips, so both paths used to refuse the model for a missing lm_head."""
    folder = ckpts.build("ernie4_5_moe", tmp_path / "hf", seed=0, tie_word_embeddings=True)
    ref = logits(stock(folder), PROMPT)
    from_checkpoint = ktcy.hf.from_pretrained(folder, dtype=torch.float32)
    path = write_gguf(folder, str(tmp_path / "m.gguf"), "ernie4_5_moe")
    from_gguf = ktcy.hf.from_pretrained(config_only(folder, tmp_path / "cfg"), gguf_path=path, dtype=torch.float32)
    assert from_gguf.lm_head.weight.data_ptr() == from_gguf.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(from_gguf, PROMPT), logits(from_checkpoint, PROMPT))
    assert float((logits(from_checkpoint, PROMPT) - ref).norm() / ref.norm()) < 0.01  # BF16 experts
    untied = ckpts.build("ernie4_5_moe", tmp_path / "hf2", seed=0)
    with pytest.raises(CheckpointError, match="ties lm_head to the embeddings, but the file stores its own output.weight"):
        ktcy.hf.from_pretrained(_edited_config(untied, tmp_path / "c2", tie_word_embeddings=True),
                                gguf_path=write_gguf(untied, str(tmp_path / "u.gguf"), "ernie4_5_moe"))


def test_tensors_llama_cpp_applies_without_a_place_or_twice_are_refused_before_packing(tmp_path, monkeypatch):
    import ktcy.hf.loader
    packed = []
    monkeypatch.setattr(ktcy.hf.loader, "experts_from_checkpoint", lambda *a, **k: packed.append(a) or 1 / 0)
    mixtral = ckpts.build("mixtral", tmp_path / "mx", seed=0)  # transformers' Mixtral has no attention bias
    path = write_gguf(mixtral, str(tmp_path / "b.gguf"), "mixtral", extra={"blk.0.attn_q.bias": np.ones(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"blk.0.attn_q.bias \(model.layers.0.self_attn.q_proj.bias\) has no place"):
        ktcy.hf.from_pretrained(config_only(mixtral, tmp_path / "c1"), gguf_path=path)
    deepseek = ckpts.build("deepseek_v3", tmp_path / "ds", seed=0)
    whole = np.zeros((4 * (16 + 16), 16), np.float32)  # an old file's kv_b beside the split halves
    path = write_gguf(deepseek, str(tmp_path / "d.gguf"), "deepseek_v3", extra={"blk.1.attn_kv_b.weight": whole})
    with pytest.raises(CheckpointError, match="both hold model.layers.1.self_attn.kv_b_proj.weight"):
        ktcy.hf.from_pretrained(config_only(deepseek, tmp_path / "c2"), gguf_path=path)
    qwen = ckpts.build("qwen3_moe", tmp_path / "q", seed=0)
    path = write_gguf(qwen, str(tmp_path / "q.gguf"), "qwen3_moe", drop=("token_embd.weight",),
                      extra={"token_embd.weight": np.zeros((32, 64), np.int32)})
    with pytest.raises(CheckpointError, match="token_embd.weight is I32, a ggml type ktcy does not decode"):
        ktcy.hf.from_pretrained(config_only(qwen, tmp_path / "c3"), gguf_path=path)
    assert not packed


def test_dense_tensors_decode_a_block_of_rows_at_a_time(tmp_path):
    from ktcy.gguf_checkpoint import GGUFCheckpoint
    from ktcy.gguf_quants import dequantize
    from ktcy.hf import gguf_weights
    qwen = ckpts.build("qwen3_moe", tmp_path / "q", seed=0)
    path = write_gguf(qwen, str(tmp_path / "q.gguf"), "qwen3_moe", dense_type="Q4_0")
    ckpt = GGUFCheckpoint(path)
    t = ckpt.model.entry("token_embd.weight")
    whole = dequantize(t.type_name, ckpt.model.raw("token_embd.weight"), t.shape)
    pieces = np.full(t.shape, np.nan, np.float32)
    sizes = []

    def put(start, v):
        pieces[start:start + len(v)] = v
        sizes.append(len(v))
    gguf_weights.decode_rows(ckpt, "token_embd.weight", put, chunk_bytes=5 * 4 * t.shape[1])  # 5 rows a block
    assert np.array_equal(pieces, whole) and sizes == [5] * 6 + [2]
