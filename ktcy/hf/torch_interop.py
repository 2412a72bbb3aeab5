"""Torch tensors across the ktcy.MoE boundary as zero-copy numpy views (bf16 as raw 16-bit words).
One function, so it can give way to MoE.forward's own torch support."""
import ml_dtypes
import torch


def as_numpy(t):
    """A numpy view of a CPU tensor (bfloat16 as ml_dtypes.bfloat16, no copy)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def moe_forward(moe, x, topk_ids, topk_weights):
    """moe.forward on CPU tensors: x [T, H] float32/bfloat16 (other floats go through float32),
    ids [T, k], weights [T, k]; the result has x's dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32)
    out = torch.empty((x.shape[0], x.shape[1]), dtype=torch.float32)
    moe.forward(as_numpy(x), as_numpy(topk_ids.to(torch.int64)), as_numpy(topk_weights.to(torch.float32)),
                out=out.numpy())
    return out if x.dtype == torch.float32 else out.to(x.dtype)
