"""A layer's packed expert arrays in one allocation, so that the kernels read them from huge pages.

A decode call streams every routed expert's bytes once.  From 4 KiB pages that is a TLB miss
every 4 KiB, and the hardware prefetchers stop at each page's end.  One expert's matrix (0.4-3
MiB on the Qwen3-30B shape) is below the 4 MiB from which numpy advises the kernel to back an
allocation with 2 MiB pages (Linux transparent huge pages, in the kernel's "madvise" or "always"
mode); a whole layer is far above it.  So the layers ktcy packs put each expert's arrays into
one slot of a shared, 2 MiB-aligned buffer.  Where the kernel gives no huge pages this costs
nothing but the copy.  Layers mapped from packed files keep the file's pages (no copy)."""
import dataclasses

import numpy as np

from ktcy.kernels import PackedWeight

_ALIGN = 64  # each array's start: whole cache lines for the kernels' loads
_HUGE_PAGE = 2 << 20
_ARRAYS = ("data", "scale", "colsum", "zero")


def _layout(w: PackedWeight):
    """What a slot must match: every array's presence, shape and dtype."""
    return tuple(None if getattr(w, n) is None else (getattr(w, n).shape, getattr(w, n).dtype.str) for n in _ARRAYS)


class ExpertArena:
    """Room for `count` experts laid out like `first` ({projection: PackedWeight}); place() fills
    the slots."""

    def __init__(self, first: dict, count: int):
        self._layouts = {name: _layout(w) for name, w in first.items()}
        self._offsets = {}
        at = 0
        for name, w in first.items():
            for n in _ARRAYS:
                a = getattr(w, n)
                if a is not None:
                    self._offsets[name, n] = at
                    at += -(-a.nbytes // _ALIGN) * _ALIGN
        self._stride, self._count = at, count
        raw = np.empty(count * at + _HUGE_PAGE, np.uint8)  # untouched until place() copies
        start = -raw.ctypes.data % _HUGE_PAGE
        self.buffer = raw[start:start + count * at]

    def place(self, e: int, name: str, w: PackedWeight) -> PackedWeight:
        """w with its arrays copied into expert e's slot; w itself where it does not fit the slot
        (another layout than the first expert's, or e beyond the count)."""
        if not 0 <= e < self._count or self._layouts.get(name) != _layout(w):
            return w
        arrays = {}
        for n in _ARRAYS:
            a = getattr(w, n)
            if a is not None:
                at = e * self._stride + self._offsets[name, n]
                arrays[n] = self.buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
                arrays[n][...] = a
        return dataclasses.replace(w, **arrays)  # a new descriptor over the arena's copies
