"""Which rank runs which expert: contiguous ranges, or balanced from a routing trace with hot
experts optionally replicated.  Plain numpy (no torch): a placement is built and checked the
same way on every rank, and `route` decides, for each (token, slot), the one rank that computes it."""
from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np


def _count(value, what, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class Placement:
    """owners[e] = the ranks holding expert e (one rank, or several for a replicated expert).

    A slot (t, j) routed to an expert with n replicas is computed by exactly one of them, the
    replica at position (t * k + j) mod n: every rank derives the same answer from the same ids,
    so each slot's contribution is nonzero on one rank only."""

    def __init__(self, owners: Sequence[Union[int, Sequence[int]]], world_size: int):
        self.world_size = _count(world_size, "world_size")
        if isinstance(owners, (str, bytes)) or not hasattr(owners, "__len__") or len(owners) == 0:
            raise ValueError("owners must list, for every expert, the ranks that hold it")
        clean: List[Tuple[int, ...]] = []
        for e, given in enumerate(owners):
            listed = (given,) if isinstance(given, (int, np.integer)) else given
            try:
                ranks = tuple(sorted({_rank(r, self.world_size, e) for r in listed}))
            except TypeError:
                raise ValueError(f"owners[{e}] must be a rank or a list of ranks, got {given!r}") from None
            if not ranks:
                raise ValueError(f"expert {e} is owned by no rank")
            clean.append(ranks)
        self.owners = tuple(clean)
        self.num_experts = len(clean)
        E = self.num_experts
        self._replicas = np.array([len(r) for r in clean], np.int64)
        # position of each rank among an expert's owners (-1: not an owner), one row per rank
        self._position = np.full((self.world_size, E), -1, np.int64)
        for e, ranks in enumerate(clean):
            for i, r in enumerate(ranks):
                self._position[r, e] = i

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> "Placement":
        """Rank r holds experts [r*E/W, (r+1)*E/W): equal counts up to one (none when E < W)."""
        E, W = _count(num_experts, "num_experts"), _count(world_size, "world_size")
        return cls([(e * W // E,) for e in range(E)], W)

    @classmethod
    def balanced(cls, frequencies, world_size: int, replicate: int = 0) -> "Placement":
        """From expert frequencies (how often each expert was routed in a trace): the `replicate`
        hottest experts go to every rank (their load then splits evenly), the others are packed
        greedily, hottest first, onto the rank with the least load among those still holding
        fewer than ceil(E_rest / W) experts, so memory stays balanced too.  Ties go to the lower
        rank, so every rank computes the same placement."""
        W = _count(world_size, "world_size")
        f = np.asarray(frequencies)
        if f.ndim != 1 or f.size == 0 or not (np.issubdtype(f.dtype, np.integer) or np.issubdtype(f.dtype, np.floating)):
            raise ValueError(f"frequencies must be a 1-D array of numbers, one per expert, got {f.dtype} {f.shape}")
        f = f.astype(np.float64)
        if not np.isfinite(f).all() or (f < 0).any():
            raise ValueError("frequencies must be finite and non-negative")
        E = f.size
        replicate = _count(replicate, "replicate", minimum=0)
        if replicate > E:
            raise ValueError(f"replicate={replicate} exceeds the {E} experts")
        order = sorted(range(E), key=lambda e: (-f[e], e))
        hot, rest = order[:replicate], order[replicate:]
        owners: List[Tuple[int, ...]] = [()] * E  # every expert is hot or in rest: all filled below
        load = np.full(W, f[hot].sum() / W if hot else 0.0)
        held = np.zeros(W, np.int64)
        capacity = -(-len(rest) // W)
        for e in hot:
            owners[e] = tuple(range(W))
        for e in rest:
            open_ranks = [r for r in range(W) if held[r] < capacity]
            r = min(open_ranks, key=lambda r: (load[r], r))
            owners[e] = (r,)
            load[r] += f[e]
            held[r] += 1
        return cls(owners, W)

    @classmethod
    def from_trace(cls, topk_ids, num_experts: int, world_size: int, replicate: int = 0) -> "Placement":
        """balanced() from a routing trace: topk_ids [N, k] of past tokens (ids in [0, E); -1 ignored)."""
        E = _count(num_experts, "num_experts")
        ids = np.asarray(topk_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"a routing trace must hold integer expert ids, got {ids.dtype}")
        ids = ids[ids != -1]
        if ids.size and (ids.min() < 0 or ids.max() >= E):
            raise ValueError(f"the routing trace holds expert ids outside [0, {E})")
        return cls.balanced(np.bincount(ids.ravel(), minlength=E), world_size, replicate)

    def local_experts(self, rank: int) -> tuple:
        """Global ids of the experts rank holds, ascending."""
        rank = _rank(rank, self.world_size)
        return tuple(int(e) for e in np.flatnonzero(self._position[rank] >= 0))

    def route(self, topk_ids: np.ndarray, rank: int) -> np.ndarray:
        """topk_ids [T, k] (global ids, -1 = skipped slot, already checked to lie in [-1, E)) ->
        [T, k] int64 local expert indices of `rank` for the slots it computes, -1 elsewhere."""
        rank = _rank(rank, self.world_size)
        ids = np.asarray(topk_ids, np.int64)
        T, k = ids.shape
        skipped = ids < 0
        safe = np.where(skipped, 0, ids)
        position = self._position[rank][safe]
        slot = np.arange(T * k, dtype=np.int64).reshape(T, k)
        mine = ~skipped & (position >= 0) & (slot % self._replicas[safe] == position)
        lookup = np.cumsum(self._position[rank] >= 0) - 1  # global id -> local index where held
        return np.where(mine, lookup[safe], -1)

    def fingerprint(self) -> int:
        """A 63-bit digest of (world size, owners): ranks compare it to agree on one placement."""
        text = repr((self.world_size, self.owners)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

    def __eq__(self, other):
        return isinstance(other, Placement) and (self.world_size, self.owners) == (other.world_size, other.owners)

    def __hash__(self):
        return hash((self.world_size, self.owners))

    def __repr__(self):
        counts = [len(self.local_experts(r)) for r in range(self.world_size)]
        replicated = int((self._replicas > 1).sum())
        return (f"Placement({self.num_experts} experts over {self.world_size} ranks, experts per rank {counts}"
                + (f", {replicated} replicated" if replicated else "") + ")")


def _rank(r, world_size, expert: Optional[int] = None):
    where = "" if expert is None else f" (owners of expert {expert})"
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
        raise TypeError(f"rank must be an integer{where}, got {r!r}")
    if not 0 <= r < world_size:
        raise ValueError(f"rank {r}{where} is outside [0, {world_size})")
    return int(r)
