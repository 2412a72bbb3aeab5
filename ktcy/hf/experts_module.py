"""The nn.Module that takes the place of a transformers experts module: same forward signature
(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], run by a ktcy.MoE."""
import time

import torch


class _InferenceOnly(torch.autograd.Function):
    """Puts the experts' output on the autograd graph with a backward that refuses: without it a
    training step's backward pass ran, silently giving the routers no gradient and the layers
    below gradients that skip the experts."""

    @staticmethod
    def forward(ctx, run, hidden_states, top_k_index, top_k_weights):
        return run(hidden_states, top_k_index, top_k_weights)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("ktcy's experts are inference-only: they have no backward pass (run the model under "
                           "torch.no_grad() or torch.inference_mode(); train with stock transformers)")


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

    @property
    def down_format(self):
        return self.moe.down_format

    def extra_repr(self):
        c = self.moe.config
        return f"{self.name}, experts={c.num_experts}, top_k={c.top_k}, kernel={self.kernel}"

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
            return _InferenceOnly.apply(self._run, hidden_states, top_k_index, top_k_weights)
        return self._run(hidden_states, top_k_index, top_k_weights)

    def _run(self, hidden_states, top_k_index, top_k_weights):
        start = time.perf_counter()
        H = hidden_states.shape[-1]
        T = hidden_states.numel() // H
        # MoE.forward takes the tensors as they are: CPU ones as zero-copy views (bf16 and fp16
        # then widened to float32), those on another device copied to host memory and back
        k = top_k_index.shape[-1]  # not reshape(T, -1): an empty batch (T = 0) has no size to infer
        y = self.moe.forward(hidden_states.reshape(T, H), top_k_index.reshape(T, k), top_k_weights.reshape(T, k))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return y.reshape(hidden_states.shape)
