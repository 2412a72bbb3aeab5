"""The rest of a GGUF model's MoE blocks, for MoEModel: each layer's router and shared experts,
read from llama.cpp's tensors (`blk.L.ffn_gate_inp.weight` [E, H] and GPT-OSS's `.bias`,
`blk.L.exp_probs_b.bias`, `blk.L.ffn_{gate,up,down}_shexp.weight`, `blk.L.ffn_gate_inp_shexp.weight`)
and the architecture's `{arch}.expert_*` metadata.

A block routes as llama.cpp's graph for its architecture does, which for the released models is
the routing of the model's own code (ktcy.routing names the conventions):

  llama (Mixtral)                 mixtral: softmax over all experts, top-k, renormalised
  qwen2moe, olmoe                 softmax, top-k, not renormalised
  qwen3moe, qwen3vlmoe, qwen3next softmax, top-k, renormalised
  ernie4_5-moe                    ernie4_5_moe: softmax, chosen with exp_probs_b, renormalised
  minimax-m2                      minimax_m2: sigmoid, chosen with exp_probs_b, renormalised
  deepseek2, glm4moe, dots1       by {arch}.expert_gating_func: 2 = sigmoid (deepseek_v3: chosen
                                  with exp_probs_b) or 1 = softmax (deepseek_v2); renormalised
                                  when expert_weights_norm, times expert_weights_scale (0, the
                                  default, is 1 as in llama.cpp); without the key GLM-4.5 and
                                  dots.llm1 are sigmoid, and DeepSeek files softmax (old
                                  DeepSeek-V2 files) unless the layer stores exp_probs_b
  gpt-oss                         gpt_oss: top-k of the logits plus the router's bias, softmax
                                  over the k

Expert groups (`expert_group_count`, `expert_group_used_count`) restrict the choice as the
model's own code does: a sigmoid router's group scores the sum of its best two, a softmax one's
(DeepSeek-V2's group_limited_greedy) its best.  llama.cpp scores every group by its best two, so
a DeepSeek-V2 file with expert groups is the one case whose routing differs from llama.cpp's.
The blocks are named as transformers names the modules (model.layers.L.mlp.experts), so that
optimize rules written for the Hugging Face model select the same blocks."""
import math

import numpy as np

from ktcy.gguf_checkpoint import stored_form
from ktcy.gguf_quants import dequantize, supported
from ktcy.gpt_oss import GptOssRouter
from ktcy.routing import Router
from ktcy.safetensors_io import CheckpointError

_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
# architecture -> (router kind, renormalised, exp_probs_b taken) where the graph fixes them
_FIXED = {"llama": ("mixtral", True, False), "qwen2moe": ("softmax", False, False), "olmoe": ("softmax", False, False),
          "qwen3moe": ("softmax", True, False), "qwen3vlmoe": ("softmax", True, False),
          "qwen3next": ("softmax", True, False), "ernie4_5-moe": ("ernie4_5_moe", True, True)}
# the graphs that read their gating function (and the DeepSeek-like ones their normalisation,
# scale and groups) from metadata, and the function the model uses where a file leaves it out
_CONFIGURED = {"deepseek2": None, "glm4moe": _SIGMOID, "dots1": _SIGMOID, "minimax-m2": _SIGMOID}


def block_name(L):
    return f"model.layers.{L}.mlp.experts"


def _meta_number(meta, key, where, default):
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise CheckpointError(f"{where}: metadata {key} is {v!r:.40}, expected a finite number >= 0")
    return float(v)


def _meta_flag(meta, key, where, default):
    v = meta.get(key, default)
    if not isinstance(v, bool):
        raise CheckpointError(f"{where}: metadata {key} is {v!r:.40}, expected true or false")
    return v


def _meta_count(meta, key, where, default, maximum):
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= maximum:
        raise CheckpointError(f"{where}: metadata {key} is {v!r:.40}, expected an integer in [1, {maximum}]")
    return v


def float_tensor(ckpt, name, shape):
    """Tensor `name` as finite float32 of exactly `shape` (numpy order), any type ktcy decodes."""
    model = ckpt.model
    if name not in model:
        raise CheckpointError(f"{ckpt.path}: no tensor {name}")
    t = model.entry(name)
    if t.shape != tuple(shape):
        raise CheckpointError(f"{ckpt.path}: {name} is {list(t.shape)} (outermost first); expected {list(shape)}")
    if not supported(t.type_name):
        raise CheckpointError(f"{ckpt.path}: {name} is {t.type_name}, a ggml type ktcy does not decode")
    values = dequantize(t.type_name, model.raw(name), t.shape)
    if not np.isfinite(values).all():
        raise CheckpointError(f"{ckpt.path}: {name} holds NaN or infinity")
    return np.ascontiguousarray(values, np.float32)


def _deepseek_settings(meta, arch, where, E, k):
    """Renormalisation, scale and expert groups of a DeepSeek-like graph (see the module's note on
    how groups are scored)."""
    groups = _meta_count(meta, f"{arch}.expert_group_count", where, 1, E)
    used = _meta_count(meta, f"{arch}.expert_group_used_count", where, groups, groups)
    if E % groups:
        raise CheckpointError(f"{where}: {arch}.expert_group_count {groups} does not divide {E} experts")
    if used * (E // groups) < k:
        raise CheckpointError(f"{where}: {used} of {groups} expert groups hold fewer than the {k} experts a token takes")
    scale = _meta_number(meta, f"{arch}.expert_weights_scale", where, 0.0)
    return {"norm_topk_prob": _meta_flag(meta, f"{arch}.expert_weights_norm", where, False),
            "routed_scaling_factor": scale or 1.0,  # llama.cpp: 0 (the default) and 1 leave the weights as they are
            "n_group": groups, "topk_group": used, "renormalise_one": True}


def router(ckpt, L):
    """The router of MoE layer L, as llama.cpp's graph for the architecture computes it."""
    arch, meta, where, a = ckpt.architecture, ckpt.model.metadata, ckpt.path, ckpt.arch
    E, H, k = a.num_experts, a.hidden_size, a.top_k
    weight = float_tensor(ckpt, f"blk.{L}.ffn_gate_inp.weight", (E, H))
    bias_name = f"blk.{L}.exp_probs_b.bias"
    if arch == "gpt-oss":
        return GptOssRouter(weight, float_tensor(ckpt, f"blk.{L}.ffn_gate_inp.bias", (E,)), k)
    if f"blk.{L}.ffn_gate_inp.bias" in ckpt.model:
        raise CheckpointError(f"{where}: blk.{L}.ffn_gate_inp.bias: a router bias is GPT-OSS's only; llama.cpp "
                              f"leaves it out for {arch}")
    if arch in _FIXED:
        kind, norm, biased = _FIXED[arch]
        settings = {"norm_topk_prob": norm}
        if kind == "ernie4_5_moe":
            settings["norm_min"] = 1e-12  # Ernie4_5_MoeConfig's moe_norm_min, not stored in GGUF
    else:
        gating = meta.get(f"{arch}.expert_gating_func", _CONFIGURED[arch])
        if gating is None:  # old DeepSeek-V2 files: softmax; a sigmoid model always stores its bias
            gating = _SIGMOID if bias_name in ckpt.model else _SOFTMAX
        if gating not in (_SOFTMAX, _SIGMOID) or (arch == "minimax-m2" and gating != _SIGMOID):
            raise CheckpointError(f"{where}: metadata {arch}.expert_gating_func is {gating!r:.40}; ktcy routes "
                                  f"{arch} with " + ("2 (sigmoid)" if arch == "minimax-m2" else "1 (softmax) or 2 (sigmoid)"))
        if arch == "minimax-m2":
            kind, biased, settings = "minimax_m2", True, {"norm_topk_prob": True, "renormalise_one": True}
        else:
            settings = _deepseek_settings(meta, arch, where, E, k)
            kind, biased = ("deepseek_v3", True) if gating == _SIGMOID else ("deepseek_v2", False)
    bias = None
    if bias_name in ckpt.model:
        if not biased:
            raise CheckpointError(f"{where}: {bias_name} is stored, but a {kind} router ({arch}) has no use for it")
        bias = float_tensor(ckpt, bias_name, (E,))
    return Router(kind=kind, weight=weight, top_k=k, bias=bias, **settings)


def shared_expert(ckpt, L):
    """(expert(0) as MoE.from_experts takes it, intermediate size, gate [H] or None) of layer L's
    shared experts (one dense SwiGLU of all of them), or None where the layer has none."""
    model, arch, meta, where = ckpt.model, ckpt.architecture, ckpt.model.metadata, ckpt.path
    H = ckpt.arch.hidden_size
    names = {proj: f"blk.{L}.ffn_{proj}_shexp.weight" for proj in ("gate", "up", "down")}
    present = [n for n in names.values() if n in model]
    if not present:
        for name in (f"blk.{L}.ffn_gate_inp_shexp.weight",):
            if name in model:
                raise CheckpointError(f"{where}: {name} gates shared experts that layer {L} does not store")
        return None
    if len(present) < 3:
        missing = next(n for n in names.values() if n not in model)
        raise CheckpointError(f"{where}: no tensor {missing} (layer {L} stores the other shared-expert projections)")
    inter = model.entry(names["gate"]).shape[0]
    for proj, name in names.items():
        t = model.entry(name)
        want = (H, inter) if proj == "down" else (inter, H)
        if not supported(t.type_name):
            raise CheckpointError(f"{where}: {name} is {t.type_name}, a ggml type ktcy does not decode")
        if t.shape != want:
            raise CheckpointError(f"{where}: {name} is {list(t.shape)} (outermost first); expected {list(want)}")
    stated = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if stated is None and f"{arch}.expert_shared_count" in meta:
        stated = _meta_count(meta, f"{arch}.expert_shared_count", where, 1, 1 << 16) * ckpt.arch.intermediate_size
    if stated is not None and stated != inter:
        raise CheckpointError(f"{where}: the shared experts of layer {L} are {inter} wide; the metadata says {stated!r:.40}")
    pairs = {proj: stored_form(model.entry(name).type_name, model.raw(name), model.entry(name).shape)
             for proj, name in names.items()}
    gate_name = f"blk.{L}.ffn_gate_inp_shexp.weight"
    gate = float_tensor(ckpt, gate_name, (H,)) if gate_name in model else None
    return pairs, inter, gate
