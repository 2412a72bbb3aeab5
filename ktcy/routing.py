"""Routers of the MoE families, computed in float32 from a block's hidden states.

softmax      probabilities over all experts, top-k, renormalised when norm_topk_prob
             (Qwen3-MoE, Qwen3-Next: yes; Qwen2-MoE, OLMoE: no; Qwen3.5-MoE and Qwen3-VL-MoE
             always, their transformers modules read no such key)
mixtral      top-k of the logits, softmax over those k
deepseek_v3  sigmoid scores; choice on scores + e_score_correction_bias restricted to the
             topk_group best of n_group groups (a group scores the sum of its top 2); weights are
             the unbiased scores, normalised when norm_topk_prob and k > 1 (as DeepSeek's own code;
             transformers' module also normalises a single weight to 1, so at top_k = 1, which no
             released model uses, MoEModel and ktcy.hf differ), times routed_scaling_factor;
             GLM-4.5 (glm4_moe, glm4_moe_lite, GLM-4.5V's glm4v_moe) and dots.llm1 (dots1)
             route the same way, a single weight normalised to 1 as their transformers modules do
minimax_m2   sigmoid scores; choice on scores + e_score_correction_bias over all experts; weights
             the unbiased scores of the chosen, always normalised, a single one too (MiniMax-M2)
ernie4_5_moe softmax probabilities; choice on probabilities + e_score_correction_bias; weights the
             probabilities of the chosen over their sum, the sum at least moe_norm_min (ERNIE 4.5)
deepseek_v2  softmax probabilities; top-k of them ("greedy"), or of the topk_group best of n_group
             groups ("group_limited_greedy": a group scores its largest probability); weights the
             probabilities, not renormalised (a GGUF file may ask for it), times
             routed_scaling_factor (DeepSeek-V2)
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
    # sigmoid kinds: renormalise a single chosen weight too (to 1: GLM's and MiniMax's modules);
    # DeepSeek's own code leaves it as it is
    renormalise_one: bool = False
    norm_min: float = 0.0         # ernie4_5_moe: the least sum its weights are divided by
    sum_floor: float = 0.0        # the other kinds' (llama.cpp's clamp, for GGUF models; 0: none)

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
                w = w / np.maximum(w.sum(axis=1, keepdims=True), self.sum_floor)
            return ids, w.astype(np.float32)
        if self.kind == "ernie4_5_moe":
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = e / e.sum(axis=1, keepdims=True)
            ids = top_k_desc(probs + (self.bias if self.bias is not None else 0.0), k)
            w = np.take_along_axis(probs, ids, axis=1)
            return ids, (w / np.maximum(w.sum(axis=1, keepdims=True), self.norm_min)).astype(np.float32)
        if self.kind == "deepseek_v2":
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = e / e.sum(axis=1, keepdims=True)
            ids = top_k_desc(self._in_kept_groups(probs, lambda g: g.max(axis=2)), k)
            w = np.take_along_axis(probs, ids, axis=1)
            if self.norm_topk_prob:  # GGUF files say so (expert_weights_norm); config.json never does
                w = w / np.maximum(w.sum(axis=1, keepdims=True), self.sum_floor)
            return ids, (w * self.routed_scaling_factor).astype(np.float32)
        if self.kind in ("deepseek_v3", "minimax_m2"):
            scores = 1.0 / (1.0 + np.exp(-logits))
            choice = scores + (self.bias if self.bias is not None else 0.0)
            ids = top_k_desc(self._in_kept_groups(choice, lambda g: np.sort(g, axis=2)[:, :, -2:].sum(axis=2)), k)
            w = np.take_along_axis(scores, ids, axis=1)
            if self.norm_topk_prob and (k > 1 or self.renormalise_one):
                w = w / np.maximum(w.sum(axis=1, keepdims=True) + 1e-20, self.sum_floor)
            return ids, (w * self.routed_scaling_factor).astype(np.float32)
        raise ValueError(f"unknown router kind {self.kind!r}")

    def _in_kept_groups(self, choice, group_score):
        """choice with the experts outside the topk_group best of n_group groups (as group_score
        rates a [T, n_group, E / n_group] view) at -inf: they can never be chosen, even where
        every kept value is negative."""
        if self.n_group == 1:
            return choice
        T, E = choice.shape
        keep = np.zeros((T, self.n_group), bool)
        np.put_along_axis(keep, top_k_desc(group_score(choice.reshape(T, self.n_group, E // self.n_group)),
                                           self.topk_group), True, axis=1)
        return np.where(np.repeat(keep, E // self.n_group, axis=1), choice, -np.inf)


# The families whose routers MoEModel computes, by config.json's model_type (GPT-OSS's router is
# read apart, gpt_oss.py).  Another model_type is refused: a family with a router of its own
# (Llama 4's sigmoid of the top-1 logit, Hunyuan's) would otherwise get a softmax router and
# silently other experts and weights.
ROUTER_FAMILIES = {"qwen3_moe": "softmax", "qwen2_moe": "softmax", "qwen3_next": "softmax", "olmoe": "softmax",
                   "qwen3_5_moe": "softmax", "qwen3_5_moe_text": "softmax", "qwen3_vl_moe": "softmax",
                   "qwen3_vl_moe_text": "softmax",
                   "mixtral": "mixtral", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3",
                   "glm4_moe": "deepseek_v3", "glm4_moe_lite": "deepseek_v3", "glm4v_moe": "deepseek_v3",
                   "glm4v_moe_text": "deepseek_v3", "dots1": "deepseek_v3", "minimax_m2": "minimax_m2",
                   "deepseek_v2": "deepseek_v2", "ernie4_5_moe": "ernie4_5_moe"}
# softmax routers that renormalise the top-k weights whatever config.json says (transformers'
# Qwen3.5-MoE and Qwen3-VL-MoE modules have no norm_topk_prob), and those that do where config.json
# leaves norm_topk_prob out (Qwen3NextConfig's default; the other families' is false)
_ALWAYS_RENORMALISED = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen3_vl_moe_text"}
_RENORMALISED_BY_DEFAULT = {"qwen3_next"}
# what a deepseek_v3 router reads from config.json, without a default: transformers' defaults
# (8 groups, 4 kept, renormalised, times 2.5) are not the plain ones, so a config must say
_DEEPSEEK_KEYS = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
# each kind's scoring_func and topk_method as config.json may spell them (None: no such key)
_SCORING = {"deepseek_v3": "sigmoid", "minimax_m2": "sigmoid"}
_TOPK_METHODS = {"deepseek_v3": ("noaux_tc",), "deepseek_v2": ("greedy", "group_limited_greedy")}


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
    if config.get("scoring_func", _SCORING.get(kind, "softmax")) != _SCORING.get(kind, "softmax"):
        raise CheckpointError(f"{where}: scoring_func {config.get('scoring_func')!r:.40} does not fit a {kind} router")
    methods = _TOPK_METHODS.get(kind, (None,))
    if config.get("topk_method", methods[0]) not in methods:
        raise CheckpointError(f"{where}: topk_method {config.get('topk_method')!r:.40} is not a choice ktcy's "
                              f"{kind} router makes")
    if kind == "deepseek_v3":
        missing = [key for key in _DEEPSEEK_KEYS if key not in config]
        if missing:
            raise CheckpointError(f"{where}: a deepseek_v3 router needs {', '.join(missing)} in config.json")
    elif kind == "deepseek_v2":
        # transformers' DeepSeek-V2 router never renormalises, DeepSeek's own code does when this is
        # true: no released model sets it, and ktcy would have to pick one of the two
        if config.get("norm_topk_prob"):
            raise CheckpointError(f"{where}: norm_topk_prob true in a deepseek_v2 router (transformers ignores it, "
                                  "DeepSeek's code renormalises): ktcy does not guess which is meant")
    if kind not in ("deepseek_v3", "minimax_m2", "ernie4_5_moe") and has_bias:
        raise CheckpointError(f"{where}: {mlp_prefix} has an e_score_correction_bias, but a {kind} router has no "
                              "use for it")
    if kind not in ("deepseek_v3", "deepseek_v2") and config.get("routed_scaling_factor", 1.0) != 1.0:
        raise CheckpointError(f"{where}: routed_scaling_factor {config['routed_scaling_factor']!r:.40} does not "
                              f"fit a {kind} router (its weights are not scaled)")
    return kind


def kind_settings(kind, config, settings):
    """The router settings (checkpoint.MoEArchitecture.router_settings) as a `kind` router uses
    them: groups only where the kind chooses by groups (DeepSeek-V2's greedy choice is the
    group-limited one over a single group); MiniMax-M2, Qwen3.5-MoE and Qwen3-VL-MoE always
    renormalise, Qwen3-Next does unless config.json says otherwise."""
    grouped = kind == "deepseek_v3" or (kind == "deepseek_v2" and config.get("topk_method") == "group_limited_greedy")
    settings = settings if grouped else {**settings, "n_group": 1, "topk_group": 1}
    model_type = str(config.get("model_type", "")).lower()
    if model_type in ("glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm4v_moe_text", "dots1", "minimax_m2"):
        settings = {**settings, "renormalise_one": True}
    if kind == "minimax_m2" or model_type in _ALWAYS_RENORMALISED or \
            (model_type in _RENORMALISED_BY_DEFAULT and config.get("norm_topk_prob") is None):
        return {**settings, "norm_topk_prob": True}
    if kind == "deepseek_v2":
        return {**settings, "norm_topk_prob": False}
    return settings
