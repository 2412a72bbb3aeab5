"""Torch tensors at the numpy API's edge, without importing torch unless one is handed in.

A CPU tensor becomes a numpy view of its memory (bfloat16 as ml_dtypes.bfloat16 over the same 16-bit
words); a tensor on another device (cuda, ...) is copied to host memory first and the result copied
back to that device.  Gradients are not tracked through ktcy: tensors are detached.
"""
import functools

import ml_dtypes
import numpy as np


def is_tensor(a):
    """True for a torch.Tensor, decided without importing torch."""
    if isinstance(a, np.ndarray):  # the common case, decided in a fraction of the MRO walk's time
        return False
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(a).__mro__)


def as_numpy(a, what):
    """A numpy array over a torch tensor's host memory (a view when it already lives there)."""
    import torch
    t = a.detach()
    if t.device.type == "meta":
        raise ValueError(f"{what} is a tensor on the meta device (it holds no data)")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype not in _numpy_dtypes():  # float8 kinds, complex32, quantized: numpy has no view of them
        raise TypeError(f"{what} is a {t.dtype} tensor, which ktcy does not take")
    return t.numpy()


@functools.lru_cache(maxsize=None)
def _numpy_dtypes():
    """The torch dtypes whose tensors numpy views (torch is imported on first use: it is optional)."""
    import torch
    return frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64,
                      torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
                      torch.complex128})


def result_like(y, like, keep_float32=False):
    """The float32 numpy result y as a tensor on like's device, of like's dtype unless keep_float32."""
    import torch
    t = torch.from_numpy(y)
    dtype = torch.float32 if keep_float32 else like.dtype
    if dtype != torch.float32 or like.device.type != "cpu":
        t = t.to(device=like.device, dtype=dtype)
    return t


def output_buffer(out, shape):
    """(float32 numpy array to write into, tensor to copy it to afterwards or None) for a torch out=."""
    import torch
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.requires_grad:
        raise ValueError("out must not require grad: ktcy writes into it")
    if out.device.type == "meta":
        raise ValueError("out is a tensor on the meta device (it holds no data)")
    if out.numel() and any(st == 0 for st, size in zip(out.stride(), out.shape) if size > 1):
        raise ValueError("out has elements that share memory (an expanded tensor): give a tensor of its own")
    if out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous():
        return out.numpy(), None
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out must be a float32, bfloat16 or float16 tensor, got {out.dtype}")
    return np.empty(shape, np.float32), out


def copy_back(y, target):
    import torch
    target.copy_(torch.from_numpy(y))
