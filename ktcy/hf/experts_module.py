"""The nn.Module that takes the place of a transformers experts module: same forward signature
(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], run by a ktcy.MoE."""
import time

import torch

from ktcy.hf.torch_interop import moe_forward


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
        device = hidden_states.device
        on_host = device.type == "cpu"
        # hidden states on an accelerator: run on host memory, hand the result back where it came from
        x = hidden_states if on_host else hidden_states.to("cpu")
        ids = top_k_index if on_host else top_k_index.to("cpu")
        w = top_k_weights if on_host else top_k_weights.to("cpu")
        y = moe_forward(self.moe, x.reshape(-1, x.shape[-1]), ids.reshape(x.numel() // x.shape[-1], -1),
                        w.reshape(x.numel() // x.shape[-1], -1)).reshape(x.shape)
        if not on_host:
            y = y.to(device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return y
