"""MoE expert layer at numpy level.

Contract (used from outside the repo): ``MoE.from_weights(config, gate, up, down)``,
``MoE.forward(x, topk_ids, topk_weights, out=None)``, ``MoE.kernel``.
"""
from __future__ import annotations

import logging
import os
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, overload

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ktcy import _native, kernels, torch_bridge
from ktcy import progress as _progress
from ktcy.log import warn_once
from ktcy.config import MoeConfig
from ktcy.errors import UnsupportedISAError, naming
from ktcy.formats import has_groups, keeps_codes
from ktcy.expert_arena import ExpertArena
from ktcy.safetensors_io import CheckpointError, file_state

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ktcy")

# Experts with at least this many rows in a call run the prefill (AMX) kernel; fewer rows run the
# decode kernel.  Measured on a Xeon with AMX (2 threads; bench/README.md): on one projection of
# the Qwen3 layer with its weights beyond the L3, AMX was ahead from 8 rows where the tiles need
# no per-group epilogue (bf16 activations, INT8; since 2026-12-06 BF16 and MXFP4 from 5, below).
# INT4, INT4_ZP and MXFP4_A8 store and scale
# the C tiles every 64 or 32 K.  Since the tile unit runs a group's TDPs while the core folds the
# group before (gemm_amx_tpl.h, one_step_groups), INT4 and INT4_ZP gain from 32 rows (64 experts,
# interleaved against 64: T = 384 0.84x, T = 512 0.86x the time, T = 256 and below unchanged;
# from 16 rows T = 128 took 1.12-1.14x); MXFP4_A8 from 48 or 24 rows gained nothing and stays at 64.
# MXFP4, since its B decode runs beside the TDPs, from 5 rows (128 experts, interleaved against 8:
# T = 32 0.92x, T = 64 0.79x, T = 128 0.81x, T = 16 and 256 0.97-1.0x; from 4 rows T = 32 took
# 1.02-1.11x: its 16-bit integer decode path serves up to 4 rows well).  FP8 from 4-6 rows moved
# 0.95-1.05x and stays at 8.  BF16 from 5 rows too (two runs, 7 rounds: T = 64 0.95x, T = 128
# 0.89-0.91x, T = 32 and 256 0.99-1.0x; from 6 rows 0.95-1.03x).
# INT4_MIN runs INT4_ZP's tiles with one more float add per group and takes its rows (not
# measured on AMX apart); INT8_GROUP and INT8_MIN fold a group per K step as they do, and take
# their rows too (not measured on AMX).
AMX_MIN_ROWS = {"BF16": 5, "INT8": 8, "FP8_PERCHANNEL": 8, "FP8_BLOCK": 8, "MXFP4": 5,
                "INT4": 32, "INT4_ZP": 32, "MXFP4_A8": 64, "INT4_MIN": 32, "INT8_GROUP": 32,
                "INT8_MIN": 32}

_DECODE_LADDER = ("avx512", "avx2", "ref")

# Layers at least this large (weights of all experts) show a progress bar while they are packed
# (a Qwen3-30B-A3B layer, 604M weights, takes seconds); small ones pack too fast to need one.
_PROGRESS_MIN_WEIGHTS = 1 << 26


def choose_kernels(fmt, config):
    """(prefill isa, prefill variant, decode isa, decode variant) for a format and config."""
    if config.isa is not None:
        big_isa, big = _native.resolve(fmt, config.isa)
    else:
        big_isa, big = _native.resolve(fmt)
        if config.wants_amx and big_isa != "amx":
            warn_once(f"backend {config.backend} asks for AMX, which this CPU/OS/build cannot run; "
                       f"using {big_isa} ({big}) for {fmt}")
    if big_isa not in ("amx", "amx_emu"):
        return big_isa, big, big_isa, big
    for isa in _DECODE_LADDER:
        try:
            small_isa, small = _native.resolve(fmt, isa)
            return big_isa, big, small_isa, small
        except UnsupportedISAError:
            continue
    raise UnsupportedISAError(f"no decode kernel for {fmt}")  # ref always exists; kept for clarity


class MoE:
    """The routed experts of one MoE layer: y = sum_j w[t,j] * down_e(act(gate_e x, up_e x)), with
    act SwiGLU (silu(g) * u) or GPT-OSS's clamped form (MoeConfig.activation) and, where given,
    each projection's bias added to its output."""

    def __init__(self, config: MoeConfig, gate: Sequence[kernels.PackedWeight], up: Sequence[kernels.PackedWeight],
                 down: Sequence[kernels.PackedWeight], bias: Optional[Mapping[str, np.ndarray]] = None):
        """gate, up, down: lists (one per expert) of kernels.PackedWeight, already packed.
        bias: optional {"gate": [E, I], "up": [E, I], "down": [E, H]} added after each projection
        (GPT-OSS has them); any subset, float arrays."""
        if not isinstance(config, MoeConfig):
            raise TypeError("config must be a ktcy.MoeConfig")
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        fmt, down_fmt = config.weight_format, config.down_format
        groups: dict = {}
        for name, ws, shape, want in (("gate", gate, (I, H), fmt), ("up", up, (I, H), fmt), ("down", down, (H, I), down_fmt)):
            if len(ws) != E:
                raise ValueError(f"{name}: {len(ws)} experts, config says {E}")
            side = "down" if name == "down" else "gate and up"
            for e, w in enumerate(ws):
                if not isinstance(w, kernels.PackedWeight):
                    raise TypeError(f"{name}[{e}] must be a kernels.PackedWeight, got {type(w).__name__}")
                if w.format != want or tuple(w.shape) != shape:
                    raise ValueError(f"{name}[{e}] is {w.format} {tuple(w.shape)}, expected {want} {shape}")
                group = groups.setdefault(side, w.group_size)
                if w.group_size != group:  # one group size per activation: its sums depend on it
                    raise ValueError(f"{name}[{e}] has group size {w.group_size}, the layer's {side} {group}")
        if config.num_threads is not None:
            _native.check_thread_count(config.num_threads, "MoeConfig.num_threads")
        self.config = config
        self.format = fmt  # gate's and up's; the down projection's is down_format
        self.down_format = down_fmt
        self.gate, self.up, self.down = list(gate), list(up), list(down)
        self._mapped: list = []  # (fd, state, path) of files the weights are mapped from, see watch_file
        big_isa, big, small_isa, small = choose_kernels(fmt, config)
        self.isa, self.variant, self.decode_isa, self.decode_variant = big_isa, big, small_isa, small
        self.down_kernels = choose_kernels(down_fmt, config) if down_fmt != fmt else (big_isa, big, small_isa, small)
        self.bias = _checked_bias(bias, E, H, I)  # read-only: the engine reads these very arrays
        self._engine = _native.MoEEngine(fmt, [w.native() for w in self.gate], [w.native() for w in self.up],
                                         [w.native() for w in self.down], big, small, AMX_MIN_ROWS[fmt],
                                         dict(self.bias) if self.bias else None,
                                         config.activation, config.swiglu_alpha, config.swiglu_limit,
                                         down_fmt, self.down_kernels[1], self.down_kernels[3], AMX_MIN_ROWS[down_fmt])
        self._lock = threading.Lock()
        _LAYERS.add(self)
        log.info("MoE %d experts H=%d I=%d top-%d runs %s", E, H, I, config.top_k, self.kernel)

    @classmethod
    def from_weights(cls, config: MoeConfig, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                     gate_scale: Optional[np.ndarray] = None, up_scale: Optional[np.ndarray] = None,
                     down_scale: Optional[np.ndarray] = None, progress: Optional[Callable[[int, int], None]] = None,
                     bias: Optional[Mapping[str, np.ndarray]] = None) -> "MoE":
        """Quantize and pack every expert.  gate/up [E, I, H], down [E, H, I] in float32, float64
        or bfloat16; for FP8 also already-quantized float8_e4m3fn (or uint8) codes with their
        scales ([E, N] / [E, N, 1] per channel, [E, ceil(N/128), ceil(K/128)] blocks).
        progress(done, total) is called after each expert (default: a progress bar for large layers).
        Raises ValueError/TypeError for shapes, dtypes or scales that do not fit, and
        UnsupportedISAError when config.isa cannot run here."""
        return cls.from_experts(config, stacked_experts(config, gate, up, down, gate_scale, up_scale, down_scale),
                                progress, bias)

    @classmethod
    def from_experts(cls, config: MoeConfig, expert: Callable[[int], dict],
                     progress: Optional[Callable[[int, int], None]] = None,
                     bias: Optional[Mapping[str, np.ndarray]] = None) -> "MoE":
        """Pack expert by expert: expert(e) -> {"gate"|"up"|"down": (weight [N, K], scale)}.
        Only one expert's source arrays need to be in memory at a time.  scale is None for float
        weights, the scale array for FP8 codes, or for other codes as released a spec dict:
        {"format": "INT4" | "INT4_ZP" | "INT4_MIN" | "INT8_GROUP", "scale": [N, K/g], "zero_points": [N, K/g] (INT4_ZP),
        "mins": [N, K/g] (INT4_MIN), "group_size": g} or {"format": "MXFP4", "exponents": uint8 [N, ceil(K/32)]}; such codes are packed as
        stored when the layer's format is theirs (MXFP4 codes also as MXFP4_A8), else dequantized
        exactly and quantized again."""
        E = config.num_experts
        bar = None
        if progress is None and E * 3 * config.hidden_size * config.intermediate_size >= _PROGRESS_MIN_WEIGHTS:
            packing = config.weight_format + (f" (down {config.down_format})" if config.down_format != config.weight_format else "")
            bar = progress = _progress.reporter(f"packing {packing}", E, "expert")
        try:
            packed = pack_experts(config, expert, range(E), progress)
        finally:
            if bar is not None:
                bar.close()
        return cls(config, packed["gate"], packed["up"], packed["down"], bias)

    @property
    def kernel(self) -> str:
        """The format and kernels in use, e.g. 'INT8 on avx512 (int8_avx512_vnni)'; a layer whose
        down projection has its own format names both ('... gate and up; down: ...')."""
        text = f"{self.format} on {self.isa} ({self.variant})"
        if self.decode_variant != self.variant:
            text += f"; below {AMX_MIN_ROWS[self.format]} rows per expert: {self.decode_isa} ({self.decode_variant})"
        if self.down_format == self.format:
            return text
        isa, big, small_isa, small = self.down_kernels
        down = f"{self.down_format} on {isa} ({big})"
        if small != big:
            down += f"; below {AMX_MIN_ROWS[self.down_format]} rows per expert: {small_isa} ({small})"
        return f"{text} gate and up; down: {down}"

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for ws in (self.gate, self.up, self.down) for w in ws)

    @property
    def num_threads(self) -> int:
        """Threads of this layer's forward: MoeConfig.num_threads, else ktcy's current count."""
        return self.config.num_threads or _native.get_num_threads()

    def __repr__(self):
        c = self.config
        group = f" group {self.gate[0].group_size}" if self.gate[0].group_size else ""
        if self.down_format != self.format or self.down[0].group_size != self.gate[0].group_size:
            group += f", down {self.down_format}" + (f" group {self.down[0].group_size}" if self.down[0].group_size else "")
        return (f"MoE({self.format}{group}, {c.num_experts} experts, top-{c.top_k}, H={c.hidden_size}, "
                f"I={c.intermediate_size}, {self.nbytes / 2**30:.2f} GiB, kernel: {self.kernel})")

    def watch_file(self, fd, state, path):
        """The weights are memory-mapped from the open file fd, whose safetensors_io.file_state
        was `state` when it was mapped and checked: before each forward an fstat checks it is
        unchanged, since reading a mapping past a file that another program truncated kills the
        process with SIGBUS, and bytes rewritten in place were never checked (an MXFP4 exponent
        of 255 gives other numbers on each ISA)."""
        self._mapped.append((fd, state, path))

    def _check_mapped(self):
        for fd, state, path in self._mapped:
            now = file_state(os.fstat(fd))
            if now[0] != state[0]:
                raise CheckpointError(f"{path} changed size on disk ({state[0]} -> {now[0]} bytes) while mapped; "
                                      f"reload the layer")
            if now != state:
                raise CheckpointError(f"{path} was rewritten on disk while mapped (its modification time moved); "
                                      f"reload the layer")

    def __reduce_ex__(self, protocol):
        # pickle and copy.deepcopy (of a whole ktcy.hf model too) would otherwise fail inside
        # Cython's native descriptors with a message that names nothing
        raise TypeError("a ktcy.MoE cannot be pickled or copied: its experts are packed native buffers (or a mapped "
                        "file); build it again in the other process (MoE.from_weights, ktcy.load_experts)")

    @overload
    def forward(self, x: np.ndarray, topk_ids: npt.ArrayLike, topk_weights: npt.ArrayLike,
                out: Optional[np.ndarray] = None) -> np.ndarray: ...
    @overload
    def forward(self, x: torch.Tensor, topk_ids: Any, topk_weights: Any, out: Any = None) -> torch.Tensor: ...

    def forward(self, x, topk_ids, topk_weights, out=None):
        """y [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

        x [T, H] float32/float64/float16/bfloat16 (numpy, ml_dtypes) or a torch tensor (float32,
        bfloat16, float16; any device: CPU tensors are viewed in place, bfloat16/float16 widened to
        one float32 copy, others copied to the host and back); topk_ids [T, top_k] integers in
        [0, E), or -1 for a slot handled elsewhere (it adds nothing; a repeated id counts twice);
        topk_weights [T, top_k] floats.  Returns float32 numpy for numpy x, a tensor of x's dtype
        and device for torch x.  out, if given, receives the result: a writable, aligned,
        C-contiguous float32 [T, H] numpy array, or a [T, H] float tensor.
        Raises ValueError/TypeError for shapes, dtypes or ids that do not fit, CheckpointError when
        a mapped file changed on disk, TileError for an emulated AMX fault.  Threaded; the GIL is
        released."""
        return self._run(x, topk_ids, topk_weights, out, per_slot=False)

    @overload
    def forward_slots(self, x: np.ndarray, topk_ids: npt.ArrayLike, topk_weights: npt.ArrayLike,
                      out: Optional[np.ndarray] = None) -> np.ndarray: ...
    @overload
    def forward_slots(self, x: torch.Tensor, topk_ids: Any, topk_weights: Any, out: Any = None) -> torch.Tensor: ...

    def forward_slots(self, x, topk_ids, topk_weights, out=None):
        """The addends of forward one by one: s [T, k, H] float32 with s[t, j] =
        topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) rounded to float32, zeros where the id
        is -1.  forward's y[t] is exactly (((0 + s[t, 0]) + s[t, 1]) + ...) in float32, j in
        order, so partial results computed elsewhere (expert parallelism) can be summed to the
        same bits.  Inputs and out= as in forward, with out [T, k, H]."""
        return self._run(x, topk_ids, topk_weights, out, per_slot=True)

    def _run(self, x, topk_ids, topk_weights, out, per_slot):
        c = self.config
        if out is None and _engine_ready(x, topk_ids, topk_weights, c.hidden_size, c.top_k):
            result = np.empty((x.shape[0], c.top_k, c.hidden_size) if per_slot else (x.shape[0], c.hidden_size),
                              np.float32)
            if x.shape[0]:
                self._call_engine(x, topk_ids, topk_weights, result, per_slot)
            return result
        like = x if torch_bridge.is_tensor(x) else None
        if like is not None:
            x = torch_bridge.as_numpy(x, "x")
        if torch_bridge.is_tensor(topk_ids):
            topk_ids = torch_bridge.as_numpy(topk_ids, "topk_ids")
        if torch_bridge.is_tensor(topk_weights):
            topk_weights = torch_bridge.as_numpy(topk_weights, "topk_weights")
        x = _as_rows(x, "x", c.hidden_size)
        T = x.shape[0]
        ids = np.asarray(topk_ids)
        if ids.ndim != 2 or ids.shape[0] != T:
            raise ValueError(f"topk_ids must be [T={T}, k], got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"topk_ids must hold integers, got {ids.dtype}")
        # The engine checks every id as it counts them (the same message); only ids that would
        # not survive the cast to int64 are checked here, where they still have their value.
        if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and ids.size and ids.max() >= c.num_experts:
            bad = ids[ids >= c.num_experts][0]
            raise ValueError(f"topk_ids holds expert id {bad}, outside [0, {c.num_experts}) (-1 skips a slot)")
        if ids.shape[1] != c.top_k:
            raise ValueError(f"topk_ids has {ids.shape[1]} experts per token; this layer routes top_k = {c.top_k}")
        w = np.asarray(topk_weights)
        if w.shape != ids.shape:
            raise ValueError(f"topk_weights must have the shape of topk_ids {ids.shape}, got {w.shape}")
        if not (np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16):  # not the fp8 types
            raise TypeError(f"topk_weights must be floating point, got {w.dtype}")
        shape = (T, c.top_k, c.hidden_size) if per_slot else (T, c.hidden_size)
        target = None
        if out is None:
            result = np.empty(shape, np.float32)
        elif torch_bridge.is_tensor(out):
            result, target = torch_bridge.output_buffer(out, shape)
        elif not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != np.float32 \
                or not out.flags.c_contiguous or not out.flags.aligned or not out.flags.writeable:
            raise ValueError(f"out must be a writable, aligned, C-contiguous float32 array of shape {shape} or a "
                             "float tensor")
        else:
            result = out
        if T:
            ids = kernels.c_array(ids, np.int64)
            w = kernels.c_array(w, np.float32)
            # the engine writes out while it still reads the routing (x it gathers first)
            if np.may_share_memory(result, w):
                w = w.copy()
            if np.may_share_memory(result, ids):
                ids = ids.copy()
            self._call_engine(x, ids, w, result, per_slot)
        if target is not None:
            torch_bridge.copy_back(result, target)
            return out
        if out is not None:
            return out
        if like is None:
            return result
        return torch_bridge.result_like(result, like, keep_float32=per_slot)  # slots stay float32: see forward_slots

    def _call_engine(self, x, ids, w, result, per_slot):
        # One forward at a time per layer: the arena is shared, and the OpenMP team already
        # uses every configured core, so concurrent calls would not run faster.
        with self._lock:
            self._check_mapped()
            if per_slot:
                self._engine.forward(x, ids, w, np.empty((x.shape[0], self.config.hidden_size), np.float32),
                                     self.num_threads, result)
            else:
                self._engine.forward(x, ids, w, result, self.num_threads)

    __call__ = forward


# A fork copies each layer's lock in the state it had: held, where another thread of the parent
# was inside a forward, and then the child's first call waits forever.  The child renews them
# (the engine rewrites every per-call buffer when it runs, so a forward cut off by the fork
# leaves nothing the child's calls read).
_LAYERS: "weakref.WeakSet[MoE]" = weakref.WeakSet()


def _renew_locks_in_child():
    for layer in list(_LAYERS):
        layer._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks_in_child)


def stacked_experts(config, gate, up, down, gate_scale=None, up_scale=None, down_scale=None):
    """expert(e) -> {"gate"|"up"|"down": (weight, scale)} over whole-layer arrays (gate/up [E, I, H],
    down [E, H, I], scales [E, ...]), their shapes checked first (for MoE.from_experts)."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    arrays = {"gate": (gate, (E, I, H), gate_scale), "up": (up, (E, I, H), up_scale),
              "down": (down, (E, H, I), down_scale)}
    for name, (a, shape, _) in arrays.items():
        if not hasattr(a, "shape") or tuple(a.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} ([E, I, H] for gate/up, [E, H, I] for down), "
                             f"got {getattr(a, 'shape', type(a).__name__)}")

    def expert(e):
        return {name: (np.asarray(a[e]), None if scale is None else np.asarray(scale)[e])
                for name, (a, _, scale) in arrays.items()}
    return expert


_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


def _engine_ready(x, ids, w, width, top_k):
    """True when x, ids and w are numpy arrays exactly as the engine takes them (float32 [T, H],
    int64 and float32 [T, top_k], C-contiguous), so forward skips its conversions.  A decode call
    comes after other work has pushed the interpreter's lines and pages out of cache, and there
    the general path's checks cost 26-30 us more (3% of a 4-bit Qwen3-30B layer at T = 1); the
    engine checks the ids.  A byte-swapped dtype compares unequal: it takes the general path."""
    return (type(x) is np.ndarray and type(ids) is np.ndarray and type(w) is np.ndarray
            and x.dtype == _F32 and ids.dtype == _I64 and w.dtype == _F32 and x.ndim == 2 and x.shape[1] == width
            and ids.shape == (x.shape[0], top_k) and w.shape == ids.shape
            and x.flags.c_contiguous and ids.flags.c_contiguous and w.flags.c_contiguous
            and x.flags.aligned and ids.flags.aligned and w.flags.aligned)


def _as_rows(a, what, width):
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{what} must be [T, {width}], got shape {a.shape}")
    return kernels.as_float32_matrix(a, what)


def _checked_bias(bias, E, H, I):
    """A read-only {projection: float32 copy} of the biases (None for none), checked."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping) or set(bias) - {"gate", "up", "down"}:
        raise ValueError("bias must be a dict with keys among gate, up, down")
    out = {}
    for name, b in bias.items():
        if b is None:
            continue
        shape = (E, H) if name == "down" else (E, I)
        a = np.asarray(b)
        if a.shape != shape or not (np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16):
            raise ValueError(f"{name} bias must be a float array of shape {shape}, got {a.dtype} {a.shape}")
        a = np.array(a, np.float32, order="C")  # a copy, as the weights are: later edits of the caller's array change nothing
        if not np.isfinite(a).all():
            raise ValueError(f"{name} bias holds NaN or infinity")
        a.flags.writeable = False
        out[name] = a
    return types.MappingProxyType(out) if out else None


def _pack_released(w, spec, fmt, group):
    """Codes as released (INT4 / INT4_ZP / INT4_MIN / INT8 / INT8_GROUP / INT8_MIN / MXFP4 with their spec dict): packed as
    stored when fmt is their format (in a smaller group than theirs: split exactly), else dequantized
    exactly and packed in fmt."""
    if not isinstance(spec, dict) or "format" not in spec:
        raise ValueError("a scale spec must be a dict with a 'format'")
    stored = spec["format"]
    if stored == "MXFP4":
        packed = kernels.pack_quantized(w, spec.get("exponents"), fmt if keeps_codes(stored, fmt) else stored)
    elif stored in ("INT4", "INT4_ZP", "INT4_MIN", "INT8", "INT8_GROUP", "INT8_MIN"):
        packed = kernels.pack_quantized(w, spec.get("scale"), stored, group_size=spec.get("group_size"),
                                        zero_points=spec.get("zero_points"), mins=spec.get("mins"))
    else:
        raise ValueError(f"codes as released in {stored!r} are not understood")
    if fmt == packed.format and (not has_groups(fmt) or packed.group_size == group):
        return packed
    if fmt == packed.format and has_groups(fmt) and group < packed.group_size:
        return _split_groups(packed, group)
    if stored == "INT4" and fmt == "INT4_ZP" and packed.group_size == group:  # z = 8
        scales = packed.group_scales()
        return kernels.pack_quantized(packed.codes().astype(np.int16) + 8, scales, "INT4_ZP",
                                      group_size=group, zero_points=np.full(scales.shape, 8, np.uint8))
    if stored in ("INT4", "INT4_ZP") and fmt == "INT4_MIN" and packed.group_size == group:
        # s * (q - z) = s * q + min with the codes and scales kept and min = -z * s in float32:
        # exact for INT4 (z = 8), for INT4_ZP within half a float32 ulp of z * s (quantizing the
        # values again by min and max would move them by up to half a step)
        scales = packed.group_scales()
        zero = np.full(scales.shape, 8, np.uint8) if stored == "INT4" else packed.group_zero_points()
        nibbles = packed.codes().astype(np.int16) + 8 if stored == "INT4" else packed.codes()
        return kernels.pack_quantized(nibbles, scales, "INT4_MIN", group_size=group,
                                      mins=-(zero.astype(np.float32) * scales))
    return kernels.pack(packed.dequantize(np.float32), fmt, group_size=group)


def _split_groups(packed, group):
    """A grouped weight in a smaller group (a divisor of its own): each scale, zero point and min
    repeated, the codes as they are.  Exact: the same values, in more groups (a GGUF layer mixing
    Q8_0's group 32 with Q6_K's 16)."""
    n, k = packed.shape
    ratio, groups = packed.group_size // group, -(-k // group)

    def split(a):
        return None if a is None else np.repeat(a[:, :n].T, ratio, axis=1)[:, :groups]

    return kernels.pack_quantized(packed.codes(), split(packed.group_scales()), packed.format, group_size=group,
                                  zero_points=split(packed.group_zero_points()), mins=split(packed.group_mins()))


def pack_experts(config, expert, ids, progress=None):
    """{"gate"|"up"|"down": [PackedWeight]} of experts `ids` in that order (expert(e) as
    MoE.from_experts takes it), all in one ExpertArena: the kernels then stream them from huge
    pages.  progress(done, len(ids)) after each expert."""
    target = {"gate": (config.weight_format, config.quant_config.group_size),
              "up": (config.weight_format, config.quant_config.group_size),
              "down": (config.down_format, config.down_group_size)}
    packed = {"gate": [], "up": [], "down": []}
    arena = None
    for i, e in enumerate(ids):
        parts = {name: pack_expert_weight(w, scale, *target[name], f"{name}[{e}]") for name, (w, scale) in expert(e).items()}
        if arena is None:
            arena = ExpertArena(parts, len(ids))
        for name, w in parts.items():
            packed[name].append(arena.place(i, name, w))
        if progress is not None:
            progress(i + 1, len(ids))
    return packed


def pack_expert_weight(w, scale, fmt, group, what):
    """One expert projection: float weights are quantized; FP8 codes (with scales) are packed as
    they are when the format is FP8 and the scale kinds agree, else dequantized first; codes as
    released with a spec dict (see MoE.from_experts) likewise.  A packer's error names `what`."""
    if isinstance(scale, dict):
        with naming(what):
            return _pack_released(np.asarray(w), scale, fmt, group)
    if w.dtype == ml_dtypes.float8_e4m3fn and scale is not None and not fmt.startswith("FP8"):
        raise ValueError(f"{what}: FP8 codes must be dequantized before packing as {fmt}")
    if fmt.startswith("FP8") and (w.dtype == ml_dtypes.float8_e4m3fn or w.dtype == np.uint8):
        if scale is None:
            raise ValueError(f"{what}: FP8 codes need their scales")
        with naming(what):
            return kernels.pack_quantized(w, scale, fmt)
    if scale is not None:
        raise ValueError(f"{what}: scales are only taken with already-quantized FP8 weights")
    with naming(what):
        return kernels.pack(w, fmt, group_size=group)
