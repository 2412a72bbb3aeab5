"""ExpertParallelMoE: one MoE layer whose experts are spread over the ranks of a process group.

Every rank calls forward with the same x, topk_ids and topk_weights (as after a replicated
attention).  Each computes the slots routed to its own experts with MoE.forward_slots (float32
w[t, j] * expert(x[t]), zeros elsewhere), an all_reduce(SUM) of the [T, k, H] slots gives every
rank all of them (each slot is nonzero on exactly one rank, so the sum is exact in any order),
and the k slots are added in order j = 0..k-1 in float32 from 0: the very additions of a
single-process MoE.forward, hence the same bits in every format (except that a BF16/FP8 expert
replicated on several ranks may run another kernel path for its share of the rows: ~1e-7).
reduce="sum" all-reduces each rank's partial [T, H] sum instead (k times fewer bytes; rounding
then depends on the split).

Contract (used from outside the repo): ``ExpertParallelMoE.from_weights(config, gate, up, down,
group=None, placement=None)``, ``ExpertParallelMoE.from_converted(path, layer, group=None)``,
``ExpertParallelMoE.from_moe(moe, group=None, placement=None)``,
``ExpertParallelMoE.from_checkpoint(checkpoint, layer, method=None, group=None, placement=None)``,
``.forward(x, topk_ids, topk_weights, out=None)``, ``.rank``, ``.world_size``, ``.local_experts``."""
from __future__ import annotations

import dataclasses
import os
import threading
import weakref
import zlib
from typing import Callable, Mapping, Optional

import ml_dtypes
import numpy as np

from ktcy import torch_bridge
from ktcy.checkpoint import Checkpoint, layer_number
from ktcy.config import MoeConfig
from ktcy.distributed.comm import DistributedError, Group
from ktcy.distributed.placement import Placement
from ktcy.gguf_checkpoint import GGUFCheckpoint, is_gguf
from ktcy.kernels import as_float32_matrix
from ktcy.loading import block_settings, converted_layer_file, is_converted, layer_quant_configs
from ktcy.moe import MoE, pack_experts, stacked_experts
from ktcy.packed_io import map_layer
from ktcy.paths import resolve_model_path
from ktcy.safetensors_io import CheckpointError

REDUCE_MODES = ("slots", "sum")
OPTIONS = ("reduce", "check_inputs", "spin_wait")  # what the from_* constructors pass on to __init__
_HEADER = ("rejected", "T", "k", "hidden size", "topk_ids", "topk_weights", "x", "reduce")


def _checked_options(options):
    """The from_* constructors' options, refused before any expert is read or packed (from_weights
    and from_checkpoint reach it through from_experts)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"ExpertParallelMoE got unexpected option(s) {', '.join(unknown)}; "
                        f"it takes {', '.join(OPTIONS)}")
    if options.get("reduce", "slots") not in REDUCE_MODES:
        raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {options['reduce']!r}")


class ExpertParallelMoE:
    """The routed experts of one MoE layer, each rank holding and running its own share."""

    def __init__(self, config: MoeConfig, local: Optional[MoE], placement: Placement, group=None,
                 reduce: str = "slots", check_inputs: bool = True, spin_wait: bool = True):
        """Use the from_* constructors.  local: the MoE of this rank's experts in
        placement.local_experts(rank) order (more entries may follow as padding), None if it holds none.
        Options every from_* passes on: reduce "slots" (exact) or "sum"; check_inputs (compare the
        ranks' inputs on every call; without it ranks that disagree get wrong numbers, and a T that
        differs aborts the process inside gloo); spin_wait (poll collectives, see Group)."""
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        self._group = group if isinstance(group, Group) else Group(group, spin_wait)
        _check_placement(placement, config, self._group)
        self.config, self.placement, self.reduce, self.check_inputs = config, placement, reduce, bool(check_inputs)
        self.local = local
        self.local_experts = placement.local_experts(self._group.rank)
        self._lock = threading.Lock()  # one call's collectives at a time: see forward

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_experts(cls, config: MoeConfig, expert: Callable[[int], dict], group=None,
                     placement: Optional[Placement] = None, bias: Optional[Mapping[str, np.ndarray]] = None,
                     progress: Optional[Callable[[int, int], None]] = None, **options) -> "ExpertParallelMoE":
        """Packs only this rank's experts: expert(e) (global id e) -> {"gate"|"up"|"down": (weight,
        scale)} as MoE.from_experts takes it, called for the local experts only.  bias as
        MoE.from_experts (full [E, ...] arrays; each rank keeps its rows)."""
        _checked_options(options)
        g = group if isinstance(group, Group) else Group(group, options.get("spin_wait", True))
        placement = placement or Placement.contiguous(config.num_experts, g.world_size)
        _check_placement(placement, config, g)
        local_ids = placement.local_experts(g.rank)
        packed = pack_experts(config, expert, local_ids, progress)
        local = _local_moe(config, local_ids, packed, bias)
        return cls(config, local, placement, g, **options)

    @classmethod
    def from_weights(cls, config: MoeConfig, gate, up, down, group=None, placement: Optional[Placement] = None,
                     gate_scale=None, up_scale=None, down_scale=None, bias=None, **options) -> "ExpertParallelMoE":
        """Every rank passes the whole layer (as MoE.from_weights takes it: gate/up [E, I, H],
        down [E, H, I], FP8 codes with their scales); each quantizes and packs only its experts.
        options: reduce="slots" (bit-identical to MoE.forward, default) or "sum", check_inputs=True."""
        expert = stacked_experts(config, gate, up, down, gate_scale, up_scale, down_scale)
        return cls.from_experts(config, expert, group, placement, bias=bias, **options)

    @classmethod
    def from_moe(cls, moe: MoE, group=None, placement: Optional[Placement] = None, **options) -> "ExpertParallelMoE":
        """From an already built ktcy.MoE (e.g. block.experts of a MoEModel): keeps this rank's
        packed weights (no copy) and drops its references to the rest."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a ktcy.MoE, got {type(moe).__name__}")
        _checked_options(options)
        g = group if isinstance(group, Group) else Group(group, options.get("spin_wait", True))
        config = moe.config
        placement = placement or Placement.contiguous(config.num_experts, g.world_size)
        _check_placement(placement, config, g)
        local_ids = placement.local_experts(g.rank)
        packed = {name: [getattr(moe, name)[e] for e in local_ids] for name in ("gate", "up", "down")}
        local = _local_moe(config, local_ids, packed, moe.bias)
        if local is not None:
            _keep_watching(moe, local)
        return cls(config, local, placement, g, **options)

    @classmethod
    def from_converted(cls, path, layer: int, group=None, placement: Optional[Placement] = None,
                       isa: Optional[str] = None, **options) -> "ExpertParallelMoE":
        """Layer `layer` of a folder written by `ktcy convert`, memory-mapped: every rank maps the
        layer file (its shapes checked as ktcy.load_experts checks them) and validates and keeps
        only its own experts, so it reads only their pages (under `ktcy launch --numa` they land
        in its node's memory)."""
        folder = resolve_model_path(path)
        if not is_converted(folder):
            raise CheckpointError(f"{folder}: not a folder written by ktcy convert (no ktcy_model.json)")
        _checked_options(options)
        g = group if isinstance(group, Group) else Group(group, options.get("spin_wait", True))
        mapped = map_layer(converted_layer_file(folder, layer_number(layer)), isa=isa, experts=[])
        config = mapped.config
        os.close(mapped.fd)
        placement = placement or Placement.contiguous(config.num_experts, g.world_size)
        _check_placement(placement, config, g)
        local_ids = placement.local_experts(g.rank)
        mapped = map_layer(mapped.path, isa=isa, experts=local_ids)
        packed = {name: [mapped.weights[name][e] for e in local_ids] for name in ("gate", "up", "down")}
        try:
            local = _local_moe(config, local_ids, packed, mapped.bias)
        except BaseException:
            os.close(mapped.fd)
            raise
        if local is None:
            os.close(mapped.fd)
        else:
            mapped.watched_by(local)
        return cls(config, local, placement, g, **options)

    @classmethod
    def from_checkpoint(cls, checkpoint, layer: int, method: Optional[str] = None, group=None,
                        placement: Optional[Placement] = None, isa: Optional[str] = None,
                        **options) -> "ExpertParallelMoE":
        """Layer `layer` of a Hugging Face checkpoint or a GGUF model (a folder, a .gguf file, a hub
        id in the local cache, or one opened by ktcy), each rank reading and packing only its own
        experts, so no rank ever holds the whole layer.  method as ktcy.load_experts (None keeps
        the stored precision)."""
        if isinstance(checkpoint, (Checkpoint, GGUFCheckpoint)):
            ckpt = checkpoint
        else:
            path = resolve_model_path(checkpoint)
            ckpt = GGUFCheckpoint(path) if is_gguf(path) else Checkpoint(path)
        experts = ckpt.layer(layer_number(layer))
        a = ckpt.arch
        quant, down_quant = layer_quant_configs(experts, method)  # needs_method() where no format holds them
        config = MoeConfig(a.num_experts, a.top_k, a.hidden_size, a.intermediate_size, quant, backend=method, isa=isa,
                           down_quant_config=down_quant, **block_settings(a))
        source = experts.source(quant.method, strict=method is None, down_fmt=config.down_format)
        return cls.from_experts(config, source, group, placement, bias=experts.bias(), **options)

    # ---- properties -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def format(self) -> str:
        return self.config.weight_format

    @property
    def down_format(self) -> str:
        return self.config.down_format

    @property
    def isa(self) -> Optional[str]:
        """The ISA of this rank's kernels (None when it holds no expert)."""
        return self.local.isa if self.local is not None else None

    @property
    def kernel(self) -> str:
        return self.local.kernel if self.local is not None else "no local experts"

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's packed experts."""
        if self.local is None:
            return 0
        return sum(self.local.gate[i].nbytes + self.local.up[i].nbytes + self.local.down[i].nbytes
                   for i in range(len(self.local_experts)))

    def __repr__(self):
        c = self.config
        down = f", down {self.down_format}" if self.down_format != self.format else ""
        return (f"ExpertParallelMoE({self.format}{down}, rank {self.rank} of {self.world_size}, "
                f"{len(self.local_experts)} of {c.num_experts} experts, top-{c.top_k}, H={c.hidden_size}, "
                f"I={c.intermediate_size}, reduce={self.reduce}, kernel: {self.kernel})")

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, x, topk_ids, topk_weights, out=None):
        """y [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), the same on every rank.

        Same arguments as MoE.forward (numpy arrays or CPU torch tensors; id -1 skips a slot);
        a torch x gives a torch result of x's dtype.  Every rank of the group must call it with
        the same inputs: with check_inputs (default) the ranks first compare shapes, dtypes and
        checksums of their inputs (one exchange of a few integers, gather_ints) and all raise ValueError on
        a difference.  Raises DistributedError when a peer exits or stops answering within the
        process group's timeout, or failed in its own experts.  Calls from several threads of a
        rank run one at a time: their collectives interleaved would pair one call's exchange with
        another's on the other ranks."""
        with self._lock:
            return self._forward(x, topk_ids, topk_weights, out)

    def _forward(self, x, topk_ids, topk_weights, out):
        problem, inputs = None, None
        try:
            inputs = self._checked(x, topk_ids, topk_weights, out)
        except (TypeError, ValueError) as e:
            problem = e
        # every rank learns whether all inputs agree before any slot is exchanged: an all_reduce
        # whose sizes differ between ranks aborts the process inside gloo.  (Overlapping this
        # with the compute was measured slower: gloo's thread then waits for a busy core.)
        if self.check_inputs:
            self._agree(self._group.gather_ints(self._header(inputs), "comparing the inputs across ranks"), inputs)
        if problem is not None:
            raise problem
        buffer, failure = self._compute(inputs)
        xs, ids, w, T, y, target = inputs
        k, H = self.config.top_k, self.config.hidden_size
        self._group.all_reduce_sum(buffer, f"all_reduce of the expert outputs ({self.reduce})")
        if failure is not None:
            raise failure
        if buffer[-1] != 0:
            raise DistributedError(f"rank {self.rank} of {self.world_size}: {int(buffer[-1])} peer rank(s) failed "
                                   "in their own experts (their error says why)")
        if self.reduce == "slots":
            slots = buffer[:-1].reshape(T, k, H)
            y.fill(0)  # forward's order: ((0 + s0) + s1) + ... in float32
            for j in range(k):
                np.add(y, slots[:, j], out=y)
        else:
            y[...] = buffer[:-1].reshape(T, H)
        if target is not None:
            torch_bridge.copy_back(y, target)
        if out is not None:
            return out
        return torch_bridge.result_like(y, x) if torch_bridge.is_tensor(x) else y

    __call__ = forward

    def _compute(self, inputs):
        """(buffer, exception or None): this rank's slots (or partial sum) and one more element
        that counts the ranks that failed in their own experts, so a local error stops every rank
        at the same all_reduce instead of leaving the others waiting for it."""
        xs, ids, w, T = inputs[:4]
        k, H = self.config.top_k, self.config.hidden_size
        routed = self.placement.route(ids, self.rank)
        buffer = np.zeros(T * k * H + 1 if self.reduce == "slots" else T * H + 1, np.float32)
        if self.local is None or not (routed >= 0).any():
            return buffer, None
        try:
            if self.reduce == "slots":
                self.local.forward_slots(xs, routed, w, out=buffer[:-1].reshape(T, k, H))
            else:
                self.local.forward(xs, routed, w, out=buffer[:-1].reshape(T, H))
        except Exception as e:  # re-raised after the all_reduce, once the peers know
            buffer[:] = 0
            buffer[-1] = 1
            return buffer, e
        return buffer, None

    def _checked(self, x, topk_ids, topk_weights, out):
        """(x float32 [T, H], ids int64 [T, k], weights float32 [T, k], T, float32 [T, H] to sum
        into, torch out= to copy to or None), or ValueError/TypeError."""
        c = self.config
        xs = as_float32_matrix(_numpy(x, "x"), "x")
        if xs.shape[1] != c.hidden_size:
            raise ValueError(f"x must be [T, {c.hidden_size}], got shape {xs.shape}")
        T = xs.shape[0]
        ids = _numpy(topk_ids, "topk_ids")
        if ids.ndim != 2 or ids.shape[0] != T:
            raise ValueError(f"topk_ids must be [T={T}, k], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"topk_ids must hold integers, got {ids.dtype}")
        if ids.shape[1] != c.top_k:
            raise ValueError(f"topk_ids has {ids.shape[1]} experts per token; this layer routes top_k = {c.top_k}")
        if ids.size and (ids.min() < -1 or ids.max() >= c.num_experts):
            bad = ids[(ids < -1) | (ids >= c.num_experts)][0]
            raise ValueError(f"topk_ids holds expert id {bad}, outside [0, {c.num_experts}) (-1 skips a slot)")
        w = _numpy(topk_weights, "topk_weights")
        if w.shape != ids.shape:
            raise ValueError(f"topk_weights must have the shape of topk_ids {ids.shape}, got {w.shape}")
        if not (np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16):
            raise TypeError(f"topk_weights must be floating point, got {w.dtype}")
        y, target = _output(out, T, c.hidden_size)
        return xs, np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(w, np.float32), T, y, target

    def _header(self, inputs):
        """A few integers that differ when two ranks' inputs do: shapes and checksums (or a
        'rejected' flag when this rank's inputs failed its own checks)."""
        if inputs is None:
            return [1] + [0] * (len(_HEADER) - 1)
        xs, ids, w, T = inputs[:4]
        return [0, T, ids.shape[1], xs.shape[1], zlib.crc32(ids), zlib.crc32(w), zlib.crc32(xs),
                REDUCE_MODES.index(self.reduce)]

    def _agree(self, table, inputs):
        """Raises on every rank at once when any rank rejected its inputs or two headers differ."""
        rejected = [r for r in range(self.world_size) if table[r, 0]]
        if rejected:
            if inputs is None:
                return  # this rank raises its own error
            raise ValueError(f"rank {self.rank}: rank(s) {rejected} rejected their inputs to this layer (see their error)")
        differ = [(r, [name for name, a, b in zip(_HEADER, table[r], table[0]) if a != b])
                  for r in range(1, self.world_size)]
        differ = [(r, names) for r, names in differ if names]
        if differ:
            text = "; ".join(f"rank {r} differs from rank 0 in {', '.join(names)}" for r, names in differ)
            raise ValueError(f"rank {self.rank}: the ranks called this layer with different inputs: {text}")


def _check_placement(placement, config, g):
    """A valid placement of this layer, the same on every rank (one exchange of its digest)."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a ktcy.distributed.Placement, got {type(placement).__name__}")
    if placement.num_experts != config.num_experts or placement.world_size != g.world_size:
        raise ValueError(f"the placement covers {placement.num_experts} experts over {placement.world_size} ranks; "
                         f"this layer has {config.num_experts} experts and the group {g.world_size} ranks")
    digests = g.gather_ints([placement.fingerprint()], "comparing the expert placement across ranks")[:, 0]
    if (digests != digests[0]).any():
        raise ValueError(f"rank {g.rank}: the ranks hold different expert placements "
                         f"(ranks {[r for r in range(g.world_size) if digests[r] != digests[0]]} differ from rank 0)")


def _local_moe(config, local_ids, packed, bias):
    """MoE over this rank's packed experts.  MoeConfig needs num_experts >= top_k, so a rank with
    fewer experts than top_k lists its first expert again as padding: shared packed weights
    (no memory), never routed to since route() only yields indices of real local experts."""
    n = len(local_ids)
    if n == 0:
        return None
    total = max(n, config.top_k)
    pad = [0] * (total - n)
    lists = {name: ws + [ws[i] for i in pad] for name, ws in packed.items()}
    local_bias = None
    if bias is not None:
        rows = list(local_ids) + [local_ids[i] for i in pad]
        local_bias = {name: np.asarray(b)[rows] for name, b in bias.items() if b is not None} or None
    local_config = dataclasses.replace(config, num_experts=total)
    return MoE(local_config, lists["gate"], lists["up"], lists["down"], bias=local_bias)


def _keep_watching(moe, local):
    """A memory-mapped MoE fstat-s its files before each forward (a truncated file would kill the
    process with SIGBUS); the local MoE watches its own duplicates of those descriptors, which
    stay open after the full MoE is dropped."""
    for fd, state, path in getattr(moe, "_mapped", ()):
        mine = os.dup(fd)
        local.watch_file(mine, state, path)
        weakref.finalize(local, os.close, mine)


def _numpy(a, what):
    return torch_bridge.as_numpy(a, what) if torch_bridge.is_tensor(a) else np.asarray(a)


def _output(out, T, H):
    """(float32 [T, H] numpy array to sum into, torch tensor to copy it to afterwards or None)."""
    if out is None:
        return np.empty((T, H), np.float32), None
    if torch_bridge.is_tensor(out):
        return torch_bridge.output_buffer(out, (T, H))
    if not isinstance(out, np.ndarray) or out.shape != (T, H) or out.dtype != np.float32 \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous float32 array of shape {(T, H)} or a float tensor")
    return out, None
