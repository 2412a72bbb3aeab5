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

import numpy as np


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
    bias: np.ndarray = None       # deepseek_v3: e_score_correction_bias [E]
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
            masked = np.where(np.repeat(keep, E // self.n_group, axis=1), choice, 0.0)
            ids = top_k_desc(masked, k)
            w = np.take_along_axis(scores, ids, axis=1)
            if self.norm_topk_prob and k > 1:
                w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
            return ids, (w * self.routed_scaling_factor).astype(np.float32)
        raise ValueError(f"unknown router kind {self.kind!r}")


def router_kind(config, mlp_prefix):
    """Which routing convention a model follows, from config.json (and its tensor names)."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type.startswith("deepseek_v3") or config.get("scoring_func") == "sigmoid" \
            or config.get("topk_method") == "noaux_tc":
        return "deepseek_v3"
    if model_type.startswith("mixtral") or mlp_prefix.endswith("block_sparse_moe"):
        return "mixtral"
    return "softmax"
