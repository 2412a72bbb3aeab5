"""The nn.Module that takes the place of a transformers experts module: same forward signature
(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], run by a ktcy.MoE."""
import time

import torch



class KtcyExperts(torch.nn.Module):
    """Routed experts of one MoE block on ktcy's kernels.  Holds no torch parameters: the weights
    live in the packed (often memory-mapped) buffers of `.moe`.

    `.seconds` and `.calls` add up the time spent in forward (for `ktcy generate`'s breakdown)."""

    def __init__(self, name, layer, moe, backend=None, rule=None):
        super().__init__()
        self.name, self.layer, self.moe = name, layer, moe
        self.backend, self.rule = backend, rule
        self.seconds, self.calls = 0.0, 0

    @property
    def kernel(self):
        """The MoE's kernel string, e.g. 'BF16 on avx512 (bf16_avx512)'."""
        return self.moe.kernel

    @property
    def format(self):
        return self.moe.format

    def extra_repr(self):
        c = self.moe.config
        return f"{self.name}, experts={c.num_experts}, top_k={c.top_k}, kernel={self.kernel}"

    def forward(self, hidden_states, top_k_index, top_k_weights):
        start = time.perf_counter()
        H = hidden_states.shape[-1]
        T = hidden_states.numel() // H
        # MoE.forward takes the tensors as they are: CPU ones as zero-copy views (bf16 included),
        # those on another device copied to host memory and the result copied back there
        k = top_k_index.shape[-1]  # not reshape(T, -1): an empty batch (T = 0) has no size to infer
        y = self.moe.forward(hidden_states.reshape(T, H), top_k_index.reshape(T, k), top_k_weights.reshape(T, k))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return y.reshape(hidden_states.shape)
