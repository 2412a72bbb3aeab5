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

Renormalised weights are divided by their sum floored at 6.1e-5, as llama.cpp clamps it.  Expert
groups (`expert_group_count` > 1, `expert_group_used_count`) restrict a DeepSeek-like choice as
the model's own code does: a sigmoid router's group scores the sum of its best two, a softmax
one's (DeepSeek-V2's group_limited_greedy) its best.  llama.cpp scores every group by its best
two, so a DeepSeek-V2 file with expert groups is the one case whose routing differs from
llama.cpp's; groups in other architectures' files are refused.

Each architecture's table row (GRAPHS) says which other tensors its graph reads: a file holding
a shared expert, gate or bias its graph would not read is refused rather than half-run, as is
one lacking a tensor the graph requires.  Blocks are named as MoEModel names them from the
model's Hugging Face checkpoint (model.layers.L.mlp.experts; Mixtral's and MiniMax-M2's
block_sparse_moe), so that optimize rules select the same blocks from either."""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ktcy.gguf_checkpoint import KEPT, stored_form
from ktcy.gguf_quants import dequantize, require_decodable
from ktcy.gpt_oss import GptOssRouter
from ktcy.routing import Router
from ktcy.safetensors_io import CheckpointError

_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
# llama.cpp's floor under the sum a router's weights are divided by (ggml_clamp in build_moe_ffn)
SUM_FLOOR = 6.103515625e-5


@dataclass(frozen=True)
class Graph:
    """What llama.cpp's graph for an architecture reads besides the experts."""
    kind: Optional[str]             # the router kind it fixes; None: by expert_gating_func (DeepSeek-like)
    norm: bool                      # a fixed kind's weights renormalised
    bias: str                       # exp_probs_b: "no" | "optional" | "required"
    shared: str                     # shared experts: "no" | "plain" | "gated" (gate required) | "gate optional"
    gating: Optional[int] = None    # the gating function where a file leaves the key out (None: see router)


GRAPHS = {
    "llama": Graph("mixtral", True, "no", "no"),
    "qwen2moe": Graph("softmax", False, "no", "gated"),
    "olmoe": Graph("softmax", False, "no", "no"),
    "qwen3moe": Graph("softmax", True, "no", "no"),
    "qwen3vlmoe": Graph("softmax", True, "no", "no"),
    "qwen3next": Graph("softmax", True, "no", "gate optional"),
    "ernie4_5-moe": Graph("ernie4_5_moe", True, "optional", "plain"),
    "minimax-m2": Graph("minimax_m2", True, "required", "no", _SIGMOID),
    "deepseek2": Graph(None, False, "optional", "plain"),
    "glm4moe": Graph(None, False, "required", "plain", _SIGMOID),
    "dots1": Graph(None, False, "optional", "plain", _SIGMOID),
    "gpt-oss": Graph("gpt_oss", False, "no", "no"),
}
# Mixtral's and MiniMax-M2's released checkpoints name their blocks block_sparse_moe (as MoEModel
# does from them): rules written for those select the GGUF's blocks too
_SPARSE_MOE_BLOCKS = ("llama", "minimax-m2")


def block_name(ckpt, L):
    module = "block_sparse_moe" if ckpt.architecture in _SPARSE_MOE_BLOCKS else "mlp"
    return f"model.layers.{L}.{module}.experts"


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


def _meta_count(meta, key, where, default, lowest=1, highest=1 << 31):
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lowest <= v <= highest:
        raise CheckpointError(f"{where}: metadata {key} is {v!r:.40}, expected an integer in [{lowest}, {highest}]")
    return v


def float_tensor(ckpt, name, shape):
    """Tensor `name` as finite float32 of `shape` (numpy order; leading dimensions of 1 beside it
    are accepted, as llama.cpp accepts them), any type ktcy decodes."""
    model = ckpt.model
    if name not in model:
        raise CheckpointError(f"{ckpt.path}: no tensor {name}")
    t = model.entry(name)
    extra = len(t.shape) - len(shape)
    if extra < 0 or t.shape[extra:] != tuple(shape) or any(d != 1 for d in t.shape[:extra]):
        raise CheckpointError(f"{ckpt.path}: {name} is {list(t.shape)} (outermost first); expected {list(shape)}")
    require_decodable(ckpt.path, name, t.type_name)
    values = dequantize(t.type_name, model.raw(name), t.shape).reshape(shape)
    if not np.isfinite(values).all():
        raise CheckpointError(f"{ckpt.path}: {name} holds NaN or infinity")
    return np.ascontiguousarray(values, np.float32)


def _groups(meta, arch, where, E, k):
    """(expert groups, groups kept) as llama.cpp reads them: 0 or 1 group is none; more need their
    kept count, fewer than all and enough for the k experts a token takes."""
    groups = _meta_count(meta, f"{arch}.expert_group_count", where, 1, 0, E) or 1
    if groups == 1:
        return 1, 1
    key = f"{arch}.expert_group_used_count"
    if key not in meta:
        raise CheckpointError(f"{where}: {arch}.expert_group_count is {groups}, but {key} is missing")
    used = _meta_count(meta, key, where, None, 1, groups - 1)
    if E % groups or groups >= E:
        raise CheckpointError(f"{where}: {arch}.expert_group_count {groups} does not divide {E} experts into groups")
    if used * (E // groups) < k:
        raise CheckpointError(f"{where}: {used} of {groups} expert groups hold fewer than the {k} experts a token takes")
    return groups, used


def _gating(ckpt, graph):
    """The DeepSeek-like graphs' gating function: the metadata's, else the architecture's; old
    DeepSeek-V2 files lack the key and are softmax, unless the model stores exp_probs_b (only
    sigmoid models have it), decided once for the whole model."""
    arch, meta, where = ckpt.architecture, ckpt.model.metadata, ckpt.path
    key = f"{arch}.expert_gating_func"
    gating = meta.get(key, graph.gating)
    if gating is None:
        biased = {L for L in ckpt.arch.moe_layers if f"blk.{L}.exp_probs_b.bias" in ckpt.model}
        if biased and len(biased) != len(ckpt.arch.moe_layers):
            missing = next(L for L in ckpt.arch.moe_layers if L not in biased)
            raise CheckpointError(f"{where}: no {key}, and layer {missing} lacks the exp_probs_b.bias other layers "
                                  "store: softmax or sigmoid routing cannot be told")
        gating = _SIGMOID if biased else _SOFTMAX
    if isinstance(gating, bool) or gating not in (_SOFTMAX, _SIGMOID):
        raise CheckpointError(f"{where}: metadata {key} is {gating!r:.40}; ktcy routes with 1 (softmax) or 2 (sigmoid)")
    return gating


def router(ckpt, L):
    """The router of MoE layer L, as llama.cpp's graph for the architecture computes it."""
    arch, meta, where, a = ckpt.architecture, ckpt.model.metadata, ckpt.path, ckpt.arch
    graph = GRAPHS[arch]
    E, H, k = a.num_experts, a.hidden_size, a.top_k
    weight = float_tensor(ckpt, f"blk.{L}.ffn_gate_inp.weight", (E, H))
    bias_name, router_bias = f"blk.{L}.exp_probs_b.bias", f"blk.{L}.ffn_gate_inp.bias"
    if arch != "gpt-oss" and router_bias in ckpt.model:
        raise CheckpointError(f"{where}: {router_bias}: a router bias is GPT-OSS's only; llama.cpp's {arch} graph "
                              "does not read it")
    if graph.kind is not None and _meta_count(meta, f"{arch}.expert_group_count", where, 1, 0, E) > 1:
        raise CheckpointError(f"{where}: {arch}.expert_group_count is more than 1: ktcy's {graph.kind} router "
                              f"({arch}) does not choose by expert groups")
    settings = {}
    if graph.kind is None:
        gating = _gating(ckpt, graph)
        groups, used = _groups(meta, arch, where, E, k)
        scale = _meta_number(meta, f"{arch}.expert_weights_scale", where, 0.0)
        kind = "deepseek_v3" if gating == _SIGMOID else "deepseek_v2"
        settings = {"norm_topk_prob": _meta_flag(meta, f"{arch}.expert_weights_norm", where, False),
                    "routed_scaling_factor": scale or 1.0,  # llama.cpp: 0 (the default) and 1 leave the weights
                    "n_group": groups, "topk_group": used, "renormalise_one": True}
    else:
        kind = graph.kind
        if kind == "minimax_m2":
            gating = meta.get(f"{arch}.expert_gating_func", graph.gating)
            if isinstance(gating, bool) or gating != _SIGMOID:
                raise CheckpointError(f"{where}: metadata {arch}.expert_gating_func is {gating!r:.40}; "
                                      "MiniMax-M2 routes with 2 (sigmoid)")
            settings = {"renormalise_one": True}
        if kind != "gpt_oss":
            settings["norm_topk_prob"] = graph.norm
    if kind == "ernie4_5_moe":
        settings["norm_min"] = SUM_FLOOR
    bias = None
    wanted = graph.bias if kind != "deepseek_v2" else "no"
    if bias_name in ckpt.model:
        if wanted == "no":
            raise CheckpointError(f"{where}: {bias_name} is stored, but a {kind} router ({arch}) has no use for it")
        bias = float_tensor(ckpt, bias_name, (E,))
    elif wanted == "required":
        raise CheckpointError(f"{where}: no tensor {bias_name} (llama.cpp's {arch} graph requires it)")
    if kind == "gpt_oss":
        return GptOssRouter(weight, float_tensor(ckpt, router_bias, (E,)), k)
    return Router(kind=kind, weight=weight, top_k=k, bias=bias, sum_floor=SUM_FLOOR, **settings)


@dataclass(frozen=True)
class SharedTensors:
    names: dict                     # proj -> tensor name
    width: int                      # the intermediate size of all shared experts together
    gate: Optional[str]             # the [H] gate's tensor name (Qwen), or None
    native: str                     # the ktcy format that keeps them as stored (BF16 where none does)
    native_down: str                # ...the down projection's (Q4_K_M: INT8_GROUP beside INT4_MIN)


def shared_tensors(ckpt, L):
    """Layer L's shared experts, every name, type, shape and width checked (nothing decoded),
    or None where the layer has none."""
    model, arch, meta, where = ckpt.model, ckpt.architecture, ckpt.model.metadata, ckpt.path
    H, graph = ckpt.arch.hidden_size, GRAPHS[arch]
    names = {proj: f"blk.{L}.ffn_{proj}_shexp.weight" for proj in ("gate", "up", "down")}
    gate_name = f"blk.{L}.ffn_gate_inp_shexp.weight"
    present = [n for n in names.values() if n in model]
    if present and graph.shared == "no":
        raise CheckpointError(f"{where}: {present[0]}: llama.cpp's {arch} graph has no shared experts")
    if gate_name in model and graph.shared not in ("gated", "gate optional"):
        raise CheckpointError(f"{where}: {gate_name}: llama.cpp's {arch} graph does not gate shared experts")
    if not present:
        if gate_name in model:
            raise CheckpointError(f"{where}: {gate_name} gates shared experts that layer {L} does not store")
        if graph.shared == "gated" or (f"{arch}.expert_shared_count" in meta and
                                       _meta_count(meta, f"{arch}.expert_shared_count", where, 0, 0) > 0):
            raise CheckpointError(f"{where}: no tensor {names['gate']} (layer {L}'s shared experts)")
        return None
    if len(present) < 3:
        missing = next(n for n in names.values() if n not in model)
        raise CheckpointError(f"{where}: no tensor {missing} (layer {L} stores the other shared-expert projections)")
    if graph.shared == "gated" and gate_name not in model:
        raise CheckpointError(f"{where}: no tensor {gate_name} (llama.cpp's {arch} graph gates its shared experts)")
    width = model.entry(names["gate"]).shape[0] if len(model.entry(names["gate"]).shape) == 2 else 0
    types = {}
    for proj, name in names.items():
        t = model.entry(name)
        want = (H, width) if proj == "down" else (width, H)
        if width < 1 or t.shape != want:
            raise CheckpointError(f"{where}: {name} is {list(t.shape)} (outermost first); expected {list(want)}"
                                  + ("" if width else " with a width of at least 1"))
        require_decodable(where, name, t.type_name)
        types[proj] = t.type_name
    stated = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if stated is None and f"{arch}.expert_shared_count" in meta:
        stated = _meta_count(meta, f"{arch}.expert_shared_count", where, 0, 0) * ckpt.arch.intermediate_size
    if stated is not None and stated != width:
        raise CheckpointError(f"{where}: the shared experts of layer {L} are {width} wide; the metadata says {stated!r:.40}")
    gate_up, down = {KEPT.get(types["gate"]), KEPT.get(types["up"])}, KEPT.get(types["down"])
    if len(gate_up) == 1 and None not in gate_up and down is not None:
        native, native_down = gate_up.pop(), down
    else:
        native = native_down = "BF16"
    return SharedTensors(names, width, gate_name if gate_name in model else None, native, native_down)


def shared_expert(ckpt, L, found):
    """(expert(0) as MoE.from_experts takes it, gate [H] or None) of the shared experts `found`
    (shared_tensors) of layer L."""
    model, H = ckpt.model, ckpt.arch.hidden_size
    pairs = {proj: stored_form(model.entry(name).type_name, model.raw(name), model.entry(name).shape)
             for proj, name in found.names.items()}
    return pairs, None if found.gate is None else float_tensor(ckpt, found.gate, (H,))
