"""Routers of the MoE families, computed in float32 from a block's hidden states.

softmax      probabilities over all experts, top-k, renormalised when norm_topk_prob
             (Qwen3-MoE: yes; Qwen2-MoE, OLMoE: no)
mixtral      top-k of the logits, softmax over those k
deepseek_v3  sigmoid scores; choice on scores + e_score_correction_bias restricted to the
             topk_group best of n_group groups (a group scores the sum of its top 2); weights are
             the unbiased scores, normalised when norm_topk_prob and k > 1 (as DeepSeek's own code;
             transformers' module also normalises a single weight to 1, so at top_k = 1, which no
             released model uses, MoEModel and ktcy.hf differ), times routed_scaling_factor
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ktcy.safetensors_io import CheckpointError


def top_k_desc(values, k):
    """Indices of the k largest values per row, largest first."""
    idx = np.argpartition(-values, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(values, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1)


@dataclass
class Router:
    kind: str
    weight: np.ndarray            # [E, H] float32
    top_k: int
    norm_topk_prob: bool = False
    bias: Optional[np.ndarray] = None  # deepseek_v3: e_score_correction_bias [E]
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        self.weight = np.ascontiguousarray(self.weight, np.float32)
        if self.bias is not None:
            self.bias = np.asarray(self.bias, np.float32)

    def __call__(self, h):
        logits = np.asarray(h, np.float32) @ self.weight.T
        k = self.top_k
        if self.kind == "mixtral":
            ids = top_k_desc(logits, k)
            top = np.take_along_axis(logits, ids, axis=1)
            e = np.exp(top - top.max(axis=1, keepdims=True))
            return ids, (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        if self.kind == "softmax":
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = e / e.sum(axis=1, keepdims=True)
            ids = top_k_desc(probs, k)
            w = np.take_along_axis(probs, ids, axis=1)
            if self.norm_topk_prob:
                w = w / w.sum(axis=1, keepdims=True)
            return ids, w.astype(np.float32)
        if self.kind == "deepseek_v3":
            scores = 1.0 / (1.0 + np.exp(-logits))
            choice = scores + (self.bias if self.bias is not None else 0.0)
            T, E = choice.shape
            grouped = choice.reshape(T, self.n_group, E // self.n_group)
            group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
            keep = np.zeros((T, self.n_group), bool)
            np.put_along_axis(keep, top_k_desc(group_score, self.topk_group), True, axis=1)
            # experts of groups left out can never be chosen, even where scores + bias < 0
            masked = np.where(np.repeat(keep, E // self.n_group, axis=1), choice, -np.inf)
            ids = top_k_desc(masked, k)
            w = np.take_along_axis(scores, ids, axis=1)
            if self.norm_topk_prob and k > 1:
                w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
            return ids, (w * self.routed_scaling_factor).astype(np.float32)
        raise ValueError(f"unknown router kind {self.kind!r}")


# The families whose routers MoEModel computes, by config.json's model_type (GPT-OSS's router is
# read apart, gpt_oss.py).  Another model_type is refused: a family with a router of its own
# (GLM-4.5's sigmoid scores, DeepSeek-V2's group-limited greedy choice, MiniMax-M2's bias under
# another name) would otherwise get a softmax router and silently other experts and weights.
ROUTER_FAMILIES = {"qwen3_moe": "softmax", "qwen2_moe": "softmax", "olmoe": "softmax", "mixtral": "mixtral",
                   "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}
# what a deepseek_v3 router reads from config.json, without a default: transformers' defaults
# (8 groups, 4 kept, renormalised, times 2.5) are not the plain ones, so a config must say
_DEEPSEEK_KEYS = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


def router_kind(config, mlp_prefix, where, has_bias=False):
    """Which routing convention a model follows, from config.json (and its tensor names); a
    CheckpointError naming `where` for a family MoEModel does not know, or a config or router
    tensor that the convention would leave unused."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type and model_type not in ROUTER_FAMILIES:
        raise CheckpointError(f"{where}: model_type {model_type!r:.60} is not a family whose router ktcy computes "
                              f"(known: {', '.join(sorted(ROUTER_FAMILIES))}, gpt_oss); ktcy.load_experts loads its "
                              "experts alone")
    kind = ROUTER_FAMILIES.get(model_type)
    if kind is None:  # no model_type: the conventions the config shows
        sigmoid = config.get("scoring_func") == "sigmoid" or config.get("topk_method") == "noaux_tc"
        kind = "deepseek_v3" if sigmoid else "mixtral" if mlp_prefix.endswith("block_sparse_moe") else "softmax"
    scoring, choice = ("sigmoid", "noaux_tc") if kind == "deepseek_v3" else ("softmax", None)
    if config.get("scoring_func", scoring) != scoring:
        raise CheckpointError(f"{where}: scoring_func {config.get('scoring_func')!r:.40} does not fit a {kind} router")
    if config.get("topk_method", choice) != choice:
        raise CheckpointError(f"{where}: topk_method {config.get('topk_method')!r:.40} is not a choice ktcy's "
                              f"{kind} router makes")
    if kind == "deepseek_v3":
        missing = [key for key in _DEEPSEEK_KEYS if key not in config]
        if missing:
            raise CheckpointError(f"{where}: a deepseek_v3 router needs {', '.join(missing)} in config.json")
    else:
        if has_bias:
            raise CheckpointError(f"{where}: {mlp_prefix}.gate.e_score_correction_bias is present, but a {kind} "
                                  "router has no use for it")
        if config.get("routed_scaling_factor", 1.0) != 1.0:
            raise CheckpointError(f"{where}: routed_scaling_factor {config['routed_scaling_factor']!r:.40} does not "
                                  f"fit a {kind} router (its weights are not scaled)")
    return kind
