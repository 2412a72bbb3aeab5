"""GPT-OSS's router: a linear layer with bias over the hidden states, the top-k of those logits,
and a softmax over the k chosen (weights sum to one per token).  The experts' side of GPT-OSS
(interleaved gate/up, biases, the clamped SwiGLU) is in checkpoint.LayerExperts and the engine."""
from dataclasses import dataclass

import numpy as np

from ktcy.routing import top_k_desc


@dataclass
class GptOssRouter:
    weight: np.ndarray   # [E, H] float32
    bias: np.ndarray     # [E] float32
    top_k: int
    kind: str = "gpt_oss"

    def __call__(self, h):
        logits = np.asarray(h, np.float32) @ self.weight.T + self.bias
        ids = top_k_desc(logits, self.top_k)
        top = np.take_along_axis(logits, ids, axis=1)
        e = np.exp(top - top.max(axis=1, keepdims=True))
        return ids, (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def read_router(ckpt, mlp_prefix, num_experts, hidden, top_k):
    """The router of a GPT-OSS block ({mlp_prefix}.router.weight [E, H], .bias [E]), checked."""
    weight = ckpt.float_tensor(f"{mlp_prefix}.router.weight", (num_experts, hidden))
    bias = ckpt.float_tensor(f"{mlp_prefix}.router.bias", (num_experts,))
    return GptOssRouter(weight, bias, top_k)
