"""ktcy.hf.from_pretrained(config_folder, gguf_path=...): the torch part of a model from a GGUF
file, as KTransformers runs GGUF models (config.json and tokenizer from the Hugging Face folder,
every weight from the GGUF).  The routed experts come from the file through ktcy
(GGUFCheckpoint: Q4_0 kept as INT4, MXFP4 as MXFP4, ...); every other tensor is decoded
exactly (ktcy.gguf_quants) and copied into the model under its Hugging Face name.

Read (NAMES): Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5, dots.llm1, ERNIE-4.5-MoE, MiniMax-M2 and
GPT-OSS, whose llama.cpp tensors are the Hugging Face ones renamed, and Mixtral (`llama`: its
converter reorders each head's query and key rows for llama.cpp's rotary embedding, undone
here), DeepSeek-V2/V3, Kimi-K2 and GLM-4.7-Flash (`deepseek2`: the latent attention's
kv_b_proj, which newer files store split per head into attn_k_b and attn_v_b, put together) and
Qwen3-Next (its zero-centred norms stored as 1 + w, A_log as -exp(A_log), the linear
attention's in_proj_qkvz split into attn_qkv and attn_gate: each undone).  Others are refused."""
import re

import numpy as np

from ktcy.checkpoint import MoEArchitecture
from ktcy.gguf_checkpoint import ARCHITECTURES, GGUFCheckpoint
from ktcy.gguf_quants import dequantize, require_decodable
from ktcy.safetensors_io import CheckpointError

# GGUF name -> Hugging Face checkpoint name, per architecture read: the names llama.cpp's
# converter gives the Hugging Face tensors (gguf-py's tensor_mapping), reversed


def _block(gguf_pattern, hf_template):
    return rf"blk\.(\d+)\.{gguf_pattern}", rf"model.layers.\1.{hf_template}"


_BASE = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    _block(r"attn_norm\.weight", "input_layernorm.weight"),
    _block(r"attn_q\.(weight|bias)", r"self_attn.q_proj.\2"),
    _block(r"attn_k\.(weight|bias)", r"self_attn.k_proj.\2"),
    _block(r"attn_v\.(weight|bias)", r"self_attn.v_proj.\2"),
    _block(r"attn_output\.(weight|bias)", r"self_attn.o_proj.\2"),
    _block(r"ffn_(gate|up|down)\.weight", r"mlp.\2_proj.weight"),  # dense layers
)
_FFN_NORM = (_block(r"ffn_norm\.weight", "post_attention_layernorm.weight"),)
_POST_ATTENTION_NORM = (_block(r"post_attention_norm\.weight", "post_attention_layernorm.weight"),)
_QK_NORM = (_block(r"attn_q_norm\.weight", "self_attn.q_norm.weight"),
            _block(r"attn_k_norm\.weight", "self_attn.k_norm.weight"))
_ROUTER = (_block(r"ffn_gate_inp\.weight", "mlp.gate.weight"),)
_SHARED = (_block(r"ffn_(gate|up|down)_shexp\.weight", r"mlp.shared_experts.\2_proj.weight"),)
# Qwen's one shared expert, scaled by a sigmoid gate
_SHARED_GATED = (_block(r"ffn_(gate|up|down)_shexp\.weight", r"mlp.shared_expert.\2_proj.weight"),
                 _block(r"ffn_gate_inp_shexp\.weight", "mlp.shared_expert_gate.weight"))


def _bias(hf_template):
    return (_block(r"exp_probs_b\.bias", hf_template),)


NAMES = {
    "llama": _BASE + _FFN_NORM + _ROUTER,
    "qwen2moe": _BASE + _FFN_NORM + _ROUTER + _SHARED_GATED,
    "qwen3moe": _BASE + _FFN_NORM + _ROUTER + _QK_NORM,
    "olmoe": _BASE + _FFN_NORM + _ROUTER + _QK_NORM,
    "glm4moe": _BASE + _POST_ATTENTION_NORM + _ROUTER + _QK_NORM + _SHARED + _bias("mlp.gate.e_score_correction_bias"),
    "dots1": _BASE + _FFN_NORM + _ROUTER + _QK_NORM + _SHARED + _bias("mlp.gate.e_score_correction_bias"),
    "ernie4_5-moe": _BASE + _FFN_NORM + _ROUTER + _SHARED + _bias("mlp.moe_statics.e_score_correction_bias"),
    "minimax-m2": _BASE + _FFN_NORM + _QK_NORM + (_block(r"ffn_gate_inp\.weight", "block_sparse_moe.gate.weight"),)
    + _bias("block_sparse_moe.e_score_correction_bias"),
    "gpt-oss": _BASE + _POST_ATTENTION_NORM + (_block(r"ffn_gate_inp\.(weight|bias)", r"mlp.router.\2"),
                                               _block(r"attn_sinks(?:\.weight)?", "self_attn.sinks")),
    # DeepSeek's latent attention; kv_b_proj is stored whole (attn_kv_b, files from before April
    # 2025) or split per head into attn_k_b and attn_v_b (joined again: HALVES)
    "deepseek2": _BASE + _FFN_NORM + _ROUTER + _SHARED + _bias("mlp.gate.e_score_correction_bias") + (
        _block(r"attn_q_a\.weight", "self_attn.q_a_proj.weight"),
        _block(r"attn_q_a_norm\.weight", "self_attn.q_a_layernorm.weight"),
        _block(r"attn_q_b\.weight", "self_attn.q_b_proj.weight"),
        _block(r"attn_kv_a_mqa\.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        _block(r"attn_kv_a_norm\.weight", "self_attn.kv_a_layernorm.weight"),
        _block(r"attn_(kv_b|k_b)\.weight", "self_attn.kv_b_proj.weight")),
    # Qwen3-Next: zero-centred norms stored as 1 + w, A_log as -exp(A_log) (_transform), the linear
    # attention's in_proj_qkvz whole (ssm_in, older files) or split into attn_qkv + attn_gate (HALVES)
    "qwen3next": _BASE + _POST_ATTENTION_NORM + _ROUTER + _QK_NORM + _SHARED_GATED + (
        _block(r"(?:ssm_in|attn_qkv)\.weight", "linear_attn.in_proj_qkvz.weight"),
        _block(r"ssm_ba\.weight", "linear_attn.in_proj_ba.weight"),
        _block(r"ssm_conv1d\.weight", "linear_attn.conv1d.weight"),
        _block(r"ssm_dt\.bias", "linear_attn.dt_bias"),
        _block(r"ssm_a", "linear_attn.A_log"),
        _block(r"ssm_norm\.weight", "linear_attn.norm.weight"),
        _block(r"ssm_out\.weight", "linear_attn.out_proj.weight")),
}
# the Hugging Face model_types a GGUF architecture may be run as (their configs name the
# same tensors): llama.cpp writes DeepSeek-V2/V3, Kimi-K2 and GLM-4.7-Flash as deepseek2
MODEL_TYPES = {"deepseek2": ("deepseek_v3", "deepseek_v2", "kimi_k2", "glm4_moe_lite")}
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.(weight|bias)")


def open_gguf(gguf_path, config, config_file):
    """The GGUFCheckpoint of gguf_path, refused unless ktcy.hf reads its architecture and its MoE
    shape is the one config.json describes."""
    ckpt = GGUFCheckpoint(gguf_path)
    if ckpt.architecture not in NAMES:
        raise CheckpointError(f"{ckpt.path}: ktcy.hf reads the weights of {', '.join(sorted(NAMES))} GGUF models, not "
                              f"{ckpt.architecture} (ktcy.MoEModel and ktcy.load_experts read its MoE blocks)")
    theirs = MoEArchitecture.from_config(config, config_file)
    if str(config.get("model_type", "")).lower() not in MODEL_TYPES.get(ckpt.architecture,
                                                                        (ARCHITECTURES[ckpt.architecture],)):
        raise CheckpointError(f"{ckpt.path}: a {ckpt.architecture} model, but {config_file} describes model_type "
                              f"{config.get('model_type')!r:.40}")
    ours = ckpt.arch
    diffs = [f"{key} {getattr(ours, key)} there, {getattr(theirs, key)} in config.json"
             for key in ("num_experts", "top_k", "hidden_size", "intermediate_size", "moe_layers")
             if getattr(ours, key) != getattr(theirs, key)]
    # the experts' activation: GPT-OSS's clamp is not stored in GGUF (llama.cpp's is GPT-OSS's 7.0)
    diffs += [f"{key} {value} there, {theirs.activation_settings().get(key)} in config.json"
              for key, value in ours.activation_settings().items() if theirs.activation_settings().get(key) != value]
    if diffs:
        raise CheckpointError(f"{ckpt.path}: not the model {config_file} describes ({'; '.join(diffs)})")
    return ckpt


def is_expert_tensor(gguf_name):
    return _EXPERTS.fullmatch(gguf_name) is not None


def hf_name(architecture, gguf_name):
    """The Hugging Face checkpoint name of a GGUF tensor (None: an expert tensor, read by ktcy, or
    a name the architecture's table does not know)."""
    if is_expert_tensor(gguf_name):
        return None
    for pattern, template in NAMES[architecture]:
        m = re.fullmatch(pattern, gguf_name)
        if m:
            return m.expand(template)
    return None


def check(ckpt, name, shape):
    """CheckpointError unless GGUF tensor `name` decodes (a type ktcy reads) to `shape`, the
    model's (a [1, H] gate stored [H] fits); nothing is read."""
    t = ckpt.model.entry(name)
    require_decodable(ckpt.path, name, t.type_name)
    if int(np.prod(t.shape)) != int(np.prod(shape)) or [d for d in t.shape if d != 1] != [d for d in shape if d != 1]:
        raise CheckpointError(f"{ckpt.path}: {name} is {list(t.shape)} (outermost first), the model expects "
                              f"{list(shape)}")
    return t


def values(ckpt, name, shape):
    """GGUF tensor `name` decoded to float32 of `shape` (checked as check() does)."""
    t = check(ckpt, name, shape)
    return dequantize(t.type_name, ckpt.model.raw(name), t.shape).reshape(shape)


def decode_rows(ckpt, name, rows_out, chunk_bytes=16 << 20):
    """GGUF tensor `name` decoded a block of rows at a time, rows_out(start, float32 [n, K]) for
    each: a large embedding table never exists whole as float32 beside the model's copy."""
    t = ckpt.model.entry(name)
    cols = t.shape[-1]
    rows = int(np.prod(t.shape[:-1]))
    raw = ckpt.model.raw(name)
    row_bytes = raw.size // rows
    step = max(1, chunk_bytes // (4 * cols))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        rows_out(start, dequantize(t.type_name, raw[start * row_bytes:(start + n) * row_bytes], (n, cols)))


def _rope_theta(config):
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return getattr(config, "rope_theta", None)


def config_differences(ckpt, config):
    """What the GGUF file's own attention, normalisation and routing metadata says that the
    transformers config built from config.json does not (the torch part runs on the config, so
    another model's config.json of the same tensor shapes would run silently wrong)."""
    meta, a = ckpt.model.metadata, ckpt.architecture
    mla = a == "deepseek2" and f"{a}.attention.key_length_mla" in meta
    heads = config.num_attention_heads
    checks = [("attention.head_count", heads)]
    if mla:
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        checks += [("attention.key_length_mla", nope + rope), ("attention.value_length_mla", config.v_head_dim),
                   ("attention.kv_lora_rank", config.kv_lora_rank), ("rope.dimension_count", rope)]
        if getattr(config, "q_lora_rank", None):
            checks.append(("attention.q_lora_rank", config.q_lora_rank))
    elif a != "deepseek2":
        checks += [("attention.head_count_kv", getattr(config, "num_key_value_heads", heads)),
                   ("attention.key_length", getattr(config, "head_dim", None) or config.hidden_size // heads)]
    checks += [("rope.freq_base", _rope_theta(config)), ("attention.layer_norm_rms_epsilon", getattr(config, "rms_norm_eps", None))]
    if a in ("deepseek2", "glm4moe", "dots1"):
        scale = meta.get(f"{a}.expert_weights_scale", 0.0)
        checks += [("expert_weights_scale", getattr(config, "routed_scaling_factor", 1.0), scale or 1.0),
                   ("expert_weights_norm", bool(getattr(config, "norm_topk_prob", False)),
                    meta.get(f"{a}.expert_weights_norm", False)),
                   ("expert_group_count", getattr(config, "n_group", None) or 1, meta.get(f"{a}.expert_group_count", 1) or 1),
                   ("expert_group_used_count", getattr(config, "topk_group", None) or 1,
                    meta.get(f"{a}.expert_group_used_count", 1) if meta.get(f"{a}.expert_group_count", 1) not in (0, 1) else 1)]
    diffs = []
    for key, ours, *stored in checks:
        theirs = stored[0] if stored else meta.get(f"{a}.{key}")
        if theirs is None or ours is None or isinstance(theirs, (str, bytes)) or not np.isscalar(theirs):
            continue
        same = np.isclose(float(theirs), float(ours), rtol=1e-5, atol=0) if isinstance(theirs, float) else theirs == ours
        if not same:
            diffs.append(f"{key} {theirs} there, {ours} in config.json")
    if config.num_hidden_layers != ckpt.arch.num_layers:
        diffs.append(f"{ckpt.arch.num_layers} decoder blocks there, num_hidden_layers {config.num_hidden_layers} "
                     "in config.json")
    return diffs + _rope_scaling_differences(meta, a, getattr(config, "rope_parameters", None))


def _rope_scaling_differences(meta, a, params):
    """The file's rope scaling (rope.scaling.type / factor / original_context_length, where it
    states them) against config.json's rope_parameters (transformers 5)."""
    stated = meta.get(f"{a}.rope.scaling.type")
    if not isinstance(stated, str) or not isinstance(params, dict):
        return []
    ours = params.get("rope_type", "default")
    if stated in ("none", "") and ours == "default":
        return []
    if stated != ours:
        return [f"rope.scaling.type {stated} there, rope_type {ours} in config.json"]
    diffs = []
    for key, theirs in (("factor", meta.get(f"{a}.rope.scaling.factor")),
                        ("original_max_position_embeddings", meta.get(f"{a}.rope.scaling.original_context_length"))):
        if isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and key in params \
                and not np.isclose(float(theirs), float(params[key]), rtol=1e-5, atol=0):
            diffs.append(f"rope scaling {key} {theirs} there, {params[key]} in config.json")
    return diffs


_BLOCK = re.compile(r"blk\.(\d+)\.")


def beyond_layers(gguf_name, num_layers):
    """A tensor of a block past the decoder layers: GLM-4.5's multi-token-prediction layer, which
    llama.cpp counts in block_count and transformers' causal LM does not have."""
    m = _BLOCK.match(gguf_name)
    return m is not None and int(m[1]) >= num_layers


# --- tensors llama.cpp stores transformed ---------------------------------------------------

_QK = re.compile(r"blk\.\d+\.attn_(q|k)\.(weight|bias)")
_ZERO_CENTRED_NORM = re.compile(r"(?:blk\.\d+\.(?:attn_norm|post_attention_norm|attn_q_norm|attn_k_norm)|output_norm)"
                                r"\.weight")
_SSM_A = re.compile(r"blk\.\d+\.ssm_a")


def _rope_halves(values, heads):
    """A `llama` file's query / key rows (weights and biases) back in transformers' order: llama.cpp's
    rotary embedding rotates adjacent pairs, transformers' the two halves of a head, so row 2i + j
    of a head came from row j * head_dim / 2 + i."""
    rows = values.shape[0]
    if rows % (2 * heads):
        raise CheckpointError(f"{rows} query/key rows do not split into {heads} heads of rotary pairs")
    return values.reshape((heads, rows // heads // 2, 2) + values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _a_log(values):
    """Qwen3-Next's A_log from the A = -exp(A_log) llama.cpp multiplies by."""
    if not (values < 0).all():
        raise CheckpointError("ssm_a: A = -exp(A_log) must be negative")
    return np.log(-values.astype(np.float64)).astype(np.float32)


def _transform(architecture, gguf_name, config):
    """The function that turns the values llama.cpp stores for `gguf_name` into transformers'
    (None: they are transformers' own).  Qwen3-Next's zero-centred RMS norms (x * (1 + w)) are
    stored as 1 + w, its decay as A = -exp(A_log)."""
    if architecture == "llama":
        m = _QK.fullmatch(gguf_name)
        if m:
            heads = config.num_attention_heads if m[1] == "q" else config.num_key_value_heads
            return lambda v: _rope_halves(v, heads)
    elif architecture == "qwen3next":
        if _ZERO_CENTRED_NORM.fullmatch(gguf_name):
            return lambda v: v - np.float32(1)
        if _SSM_A.fullmatch(gguf_name):
            return _a_log
    return None


# model tensors llama.cpp stores split in two: architecture -> (first half, second half); the
# first one's name (NAMES) says which model tensor, the second is read with it
HALVES = {"deepseek2": ("attn_k_b", "attn_v_b"), "qwen3next": ("attn_qkv", "attn_gate")}


def _is_half(architecture, gguf_name, which):
    pair = HALVES.get(architecture)
    return pair is not None and re.fullmatch(rf"blk\.\d+\.{pair[which]}\.weight", gguf_name) is not None


def is_second_half(architecture, gguf_name):
    return _is_half(architecture, gguf_name, 1)


def _kv_b_shapes(config, shape):
    """DeepSeek's kv_b_proj [heads * (nope + v), kv_lora_rank], split per head into attn_k_b
    [heads, kv_lora_rank, nope] (each head's nope rows, transposed) and attn_v_b [heads, v,
    kv_lora_rank] (its v rows) since April 2025."""
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    return (heads * (nope + v), rank), (heads, rank, nope), (heads, v, rank)


def _join_kv_b(k_b, v_b, config, shape):
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(shape)


def _qkvz_shapes(config, shape):
    """Qwen3-Next's in_proj_qkvz [2 key + 2 value, H], per key-head group [q, k, v, z] in
    transformers, split by llama.cpp's converter into attn_qkv (all q rows, all k rows, all v
    rows, each in group order) and attn_gate (the z rows)."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    H = config.hidden_size
    return (2 * key + 2 * value, H), (2 * key + value, H), (value, H)


def _join_qkvz(qkv, z, config, shape):
    groups, key, H = config.linear_num_key_heads, config.linear_key_head_dim, config.hidden_size
    qk = groups * key
    parts = (qkv[:qk].reshape(groups, key, H), qkv[qk:2 * qk].reshape(groups, key, H),
             qkv[2 * qk:].reshape(groups, -1, H), z.reshape(groups, -1, H))
    return np.concatenate(parts, axis=1).reshape(shape)


_SPLIT = {"deepseek2": (_kv_b_shapes, _join_kv_b), "qwen3next": (_qkvz_shapes, _join_qkvz)}


def parts(ckpt, gguf_name, config, shape):
    """[(GGUF name, shape)] of what the model tensor of `shape` named by `gguf_name` is made from:
    that tensor, or it and its second half (HALVES), each checked as check() does."""
    a = ckpt.architecture
    if not _is_half(a, gguf_name, 0):
        check(ckpt, gguf_name, shape)
        return [(gguf_name, shape)]
    second = gguf_name.replace(HALVES[a][0], HALVES[a][1])
    if second not in ckpt.model:
        raise CheckpointError(f"{ckpt.path}: {gguf_name} is stored without its other half {second}")
    whole, first_shape, second_shape = _SPLIT[a][0](config, shape)
    if whole != tuple(shape):
        raise CheckpointError(f"{ckpt.path}: config.json's sizes make {gguf_name} and {second} a {list(whole)} tensor, "
                              f"the model holds {list(shape)}")
    found = [(gguf_name, first_shape), (second, second_shape)]
    for name, want in found:
        check(ckpt, name, want)
    return found


def streamed(architecture, gguf_name, config):
    """True where the model takes the stored values as they are (decode_rows may fill it)."""
    return not _is_half(architecture, gguf_name, 0) and _transform(architecture, gguf_name, config) is None


def read(ckpt, gguf_name, config, shape):
    """The model tensor of `shape` named by `gguf_name`, as transformers holds it: the stored
    values with llama.cpp's transform undone, or joined from their two halves."""
    found = parts(ckpt, gguf_name, config, shape)
    if len(found) == 2:
        (first, first_shape), (second, second_shape) = found
        return _SPLIT[ckpt.architecture][1](values(ckpt, first, first_shape), values(ckpt, second, second_shape),
                                            config, shape)
    value = values(ckpt, gguf_name, shape)
    transform = _transform(ckpt.architecture, gguf_name, config)
    return value if transform is None else np.ascontiguousarray(transform(value))
