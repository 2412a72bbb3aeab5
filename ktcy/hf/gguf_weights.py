"""ktcy.hf.from_pretrained(config_folder, gguf_path=...): the torch part of a model from a GGUF
file, as KTransformers runs GGUF models (config.json and tokenizer from the Hugging Face folder,
every weight from the GGUF).  The routed experts come from the file through ktcy
(GGUFCheckpoint: Q4_0 kept as INT4, MXFP4 as MXFP4, ...); every other tensor is decoded
exactly (ktcy.gguf_quants) and copied into the model under its Hugging Face name.

Read: Qwen2-MoE and Qwen3-MoE (llama.cpp's tensors are the Hugging Face ones renamed) and Mixtral
(`llama`: its converter reorders each head's query and key rows for llama.cpp's rotary
embedding, undone here).  Others (DeepSeek's files split the latent attention's kv_b, ...) are
refused."""
import re

import numpy as np

from ktcy.checkpoint import MoEArchitecture
from ktcy.gguf_checkpoint import ARCHITECTURES, GGUFCheckpoint
from ktcy.gguf_quants import dequantize, supported
from ktcy.safetensors_io import CheckpointError

# GGUF name -> Hugging Face checkpoint name, per architecture read (the names llama.cpp's
# converter gives the Hugging Face tensors, reversed)
_COMMON = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),  # dense layers
)
NAMES = {
    "llama": _COMMON,
    "qwen2moe": _COMMON + (
        (r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight", r"model.layers.\1.mlp.shared_expert.\2_proj.weight"),
        (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
    ),
    "qwen3moe": _COMMON + (
        (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
        (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    ),
}
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight")


def open_gguf(gguf_path, config, config_file):
    """The GGUFCheckpoint of gguf_path, refused unless ktcy.hf reads its architecture and its MoE
    shape is the one config.json describes."""
    ckpt = GGUFCheckpoint(gguf_path)
    if ckpt.architecture not in NAMES:
        raise CheckpointError(f"{ckpt.path}: ktcy.hf reads the weights of {', '.join(sorted(NAMES))} GGUF models, not "
                              f"{ckpt.architecture} (ktcy.MoEModel and ktcy.load_experts read its MoE blocks)")
    theirs = MoEArchitecture.from_config(config, config_file)
    if str(config.get("model_type", "")).lower() != ARCHITECTURES[ckpt.architecture]:
        raise CheckpointError(f"{ckpt.path}: a {ckpt.architecture} model, but {config_file} describes model_type "
                              f"{config.get('model_type')!r:.40}")
    ours = ckpt.arch
    diffs = [f"{key} {getattr(ours, key)} there, {getattr(theirs, key)} in config.json"
             for key in ("num_experts", "top_k", "hidden_size", "intermediate_size", "moe_layers")
             if getattr(ours, key) != getattr(theirs, key)]
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


def values(ckpt, name, shape):
    """GGUF tensor `name` decoded to float32 of `shape` (the model's: a [1, H] gate stored [H] fits)."""
    t = ckpt.model.entry(name)
    if not supported(t.type_name):
        raise CheckpointError(f"{ckpt.path}: {name} is {t.type_name}, a ggml type ktcy does not decode")
    if int(np.prod(t.shape)) != int(np.prod(shape)) or [d for d in t.shape if d != 1] != [d for d in shape if d != 1]:
        raise CheckpointError(f"{ckpt.path}: {name} is {list(t.shape)} (outermost first), the model expects "
                              f"{list(shape)}")
    return dequantize(t.type_name, ckpt.model.raw(name), t.shape).reshape(shape)


_QK = re.compile(r"blk\.\d+\.attn_(q|k)\.weight")


def restore(architecture, gguf_name, values, config):
    """A tensor as transformers holds it, from the values a GGUF file stores: a `llama` file's
    query and key rows are reordered per head (llama.cpp's rotary embedding rotates adjacent
    pairs, transformers' the two halves of a head), so row 2i + j of a head came from row
    j * head_dim / 2 + i."""
    m = _QK.fullmatch(gguf_name) if architecture == "llama" else None
    if m is None:
        return values
    heads = config.num_attention_heads if m[1] == "q" else config.num_key_value_heads
    rows, cols = values.shape
    if rows % (2 * heads):
        raise CheckpointError(f"{gguf_name}: {rows} rows do not split into {heads} heads of rotary pairs")
    return values.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
