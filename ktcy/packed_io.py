"""Packed MoE layers on disk: one safetensors file per layer holding every expert's packed
blocks stacked per projection ("gate.data" [E, bytes], "gate.scale" [E, ...], "gate.colsum"
[E, N_pad] for INT8, "gate.zero" for zero-point formats, laid out like the group scales), with
metadata naming the format, layout version, shapes, group size, scale kind and ktcy version.
Layout version 1 kept group scales and zero points group-major ([E, groups, N_pad]); such files
still load (those small arrays are rearranged on load, the blocks are the same).  Layout version
3 is version 2 with the down projection in a format of its own ("down_weight_format",
"down_group_size", "down_scale_kind": a GGUF Q4_K_M layer's Q6_K down kept beside Q4_K's gate
and up); files in one format are still written as version 2, which earlier ktcy reads, while a
version it does not know stops it before it reads down's blocks in gate's format.  Loading maps
the file and wraps the stacked arrays, no copy; the layout is ISA-independent, so a file packed
on one machine runs on any other."""
import os
import re
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ktcy import _native
from ktcy.version import __version__
from ktcy.config import MoeConfig, QuantConfig
from ktcy.formats import DEFAULT_INT4_GROUP, DESCRIPTORS, FORMATS, weight_group
from ktcy.kernels import PackedWeight, panel_major
from ktcy.moe import MoE, pack_expert_weight
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, open_regular_file, strict_json, write

FILE_FORMAT = "ktcy.packed_experts"
LAYOUT_VERSION = "2"
DOWN_FORMAT_LAYOUT = "3"  # LAYOUT_VERSION plus a down projection in its own format
READABLE_LAYOUTS = ("1", "2", "3")
PROJECTIONS = ("gate", "up", "down")
# Largest dimension a metadata value may claim: far above any model, far below what could
# overflow the size arithmetic.
_MAX_DIM = 1 << 24
_WHOLE_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits only (str.isdigit accepts "²"), short enough for int()


def layer_file_name(layer):
    return f"ktcy_layer_{layer:04d}.safetensors"


_LAYER_FILE = re.compile(r"ktcy_layer_([0-9]{4,9})\.safetensors")


def layer_of_file_name(name):
    """The layer a file named as layer_file_name() names it holds, else None (any other name)."""
    m = _LAYER_FILE.fullmatch(name)
    return int(m[1]) if m else None


def layout_version(fmt, group, down=None):
    """The layout a layer file is written in: DOWN_FORMAT_LAYOUT when down (format, group size)
    differs from gate's and up's."""
    return LAYOUT_VERSION if down is None or tuple(down) == (fmt, group) else DOWN_FORMAT_LAYOUT


def pack_layer(num_experts, fmt, group, expert, progress=None, down=None):
    """Stacked arrays of a whole layer, packed expert by expert into buffers allocated once
    (the peak is one packed layer plus one expert's source); down: (format, group size) of the
    down projection when it is not (fmt, group)."""
    target = {"gate": (fmt, group), "up": (fmt, group), "down": tuple(down or (fmt, group))}
    arrays = {}
    for e in range(num_experts):
        for proj, (w, scale) in expert(e).items():
            p = pack_expert_weight(w, scale, *target[proj], f"{proj}[{e}]")
            parts = {"data": p.data, "scale": p.scale, "colsum": p.colsum, "zero": p.zero}
            for part, a in parts.items():
                if a is None:
                    continue
                key = f"{proj}.{part}"
                if key not in arrays:
                    arrays[key] = np.empty((num_experts,) + a.shape, a.dtype)
                arrays[key][e] = a
        if progress is not None:
            progress(e + 1, num_experts)
    return arrays


def write_layer(path, arrays, fmt, group, num_experts, top_k, hidden, inter, layer, source="", bias=None,
                activation=None, down=None):
    """bias: optional {"gate"|"up"|"down": float32 [E, I] / [E, H]} stored as "<proj>.bias";
    activation: optional {"activation", "swiglu_alpha", "swiglu_limit"} (GPT-OSS) kept in the
    metadata, so the layer file alone says how its experts run; down: the down projection's
    (format, group size) as pack_layer took it."""
    version = layout_version(fmt, group, down)
    meta = {"format": FILE_FORMAT, "layout_version": version, "weight_format": fmt,
            "group_size": weight_group(fmt, group),
            "scale_kind": DESCRIPTORS[fmt]["scale"],
            "num_experts": num_experts, "top_k": top_k, "hidden_size": hidden, "intermediate_size": inter,
            "layer": layer, "ktcy_version": __version__, "source": source}
    if version == DOWN_FORMAT_LAYOUT:
        down_fmt, down_group = down
        meta.update(down_weight_format=down_fmt, down_group_size=weight_group(down_fmt, down_group),
                    down_scale_kind=DESCRIPTORS[down_fmt]["scale"])
    for key, value in (activation or {}).items():
        meta[key] = value
    arrays = dict(arrays)
    for proj, b in (bias or {}).items():
        arrays[f"{proj}.bias"] = np.ascontiguousarray(b, np.float32)
    if bias:
        meta["bias"] = ",".join(sorted(bias))
    write(path, arrays, meta)


def _activation_settings(path, m):
    """MoeConfig keywords from the metadata (absent: plain SiLU), validated."""
    settings = {}
    if "activation" in m:
        settings["activation"] = m["activation"]
    for key in ("swiglu_alpha", "swiglu_limit"):
        if key in m:
            try:
                settings[key] = float(m[key])
            except ValueError:
                raise CheckpointError(f"{path}: metadata {key}={m[key]!r} is not a number") from None
    return settings


_DOWN_KEYS = ("down_weight_format", "down_group_size", "down_scale_kind")


def read_metadata(path, fd=None):
    """The validated metadata of a packed layer file (CheckpointError if foreign or corrupt):
    (file, metadata, whole numbers) where the numbers include "down_group_size" and the metadata
    "down_weight_format" in every layout (gate's where down has no format of its own); fd: the
    file already open (see SafetensorsFile)."""
    f = SafetensorsFile(path, fd)
    m = f.metadata
    if m.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path}: not a ktcy packed-experts file (format {m.get('format')!r})")
    if m.get("layout_version") not in READABLE_LAYOUTS:
        raise CheckpointError(f"{path}: layout version {m.get('layout_version')!r}; this ktcy "
                              f"({__version__}) reads versions {', '.join(READABLE_LAYOUTS)} - convert the "
                              f"checkpoint again")
    own_down = m["layout_version"] == DOWN_FORMAT_LAYOUT
    listed = [key for key in _DOWN_KEYS if key in m]
    if own_down and len(listed) < len(_DOWN_KEYS):
        raise CheckpointError(f"{path}: layout version {DOWN_FORMAT_LAYOUT} without metadata "
                              f"{', '.join(k for k in _DOWN_KEYS if k not in m)}")
    if listed and not own_down:
        raise CheckpointError(f"{path}: metadata {listed[0]} in a layout {m['layout_version']} file (only layout "
                              f"{DOWN_FORMAT_LAYOUT} gives down a format of its own)")
    for key in ("weight_format",) + (("down_weight_format",) if own_down else ()):
        if m.get(key) not in FORMATS:
            raise CheckpointError(f"{path}: unknown {key.replace('_', ' ')} {m.get(key)!r}")
    dims = {}
    for key in ("num_experts", "top_k", "hidden_size", "intermediate_size", "group_size", "layer") \
            + (("down_group_size",) if own_down else ()):
        value = m.get(key)
        if not isinstance(value, str) or not _WHOLE_NUMBER.fullmatch(value) or int(value) > _MAX_DIM:
            raise CheckpointError(f"{path}: metadata {key}={value!r} is not a whole number up to {_MAX_DIM}")
        dims[key] = int(value)
    for key in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
        if dims[key] < 1:
            raise CheckpointError(f"{path}: metadata {key}={dims[key]} must be positive")
    if dims["top_k"] > dims["num_experts"]:
        raise CheckpointError(f"{path}: metadata top_k {dims['top_k']} exceeds num_experts {dims['num_experts']}")
    m = dict(m)
    if not own_down:
        m["down_weight_format"], dims["down_group_size"] = m["weight_format"], dims["group_size"]
    for prefix in ("", "down_"):
        fmt = m[f"{prefix}weight_format"]
        kind = DESCRIPTORS[fmt]["scale"]
        if m.get(f"{prefix}scale_kind", kind) != kind:
            raise CheckpointError(f"{path}: metadata {prefix}scale_kind {m.get(prefix + 'scale_kind')!r} contradicts "
                                  f"{fmt} ({kind})")
    return f, m, dims


def source_fingerprint_of(meta):
    """The source checkpoint's fingerprint recorded in a packed file's metadata (the "source"
    JSON that `ktcy convert` writes), or None when absent or not readable."""
    try:
        source = strict_json(meta.get("source") or "null", "source", "metadata")
    except CheckpointError:
        return None
    fingerprint = source.get("fingerprint") if isinstance(source, dict) else None
    return fingerprint if isinstance(fingerprint, str) else None


def _stacked(f, path, name, dtype, experts, shape, flat_ok=True, source="the metadata implies"):
    """Tensor `name` as [experts, *shape] (or, with flat_ok, [experts, prod(shape)]) of dtype,
    returned as [experts, prod(shape)], else CheckpointError naming what `source` expects: the
    check that comes before any kernel reads the mapped bytes."""
    if name not in f:
        raise CheckpointError(f"{path}: incomplete packed layer (no tensor {name!r})")
    a = f.get(name)
    flat = (experts, int(np.prod(shape)))
    if a.dtype != dtype or a.shape not in ((experts,) + tuple(shape), flat if flat_ok else None):
        raise CheckpointError(f"{path}: {name} is {a.dtype} {a.shape}; {source} {np.dtype(dtype)} "
                              f"{(experts,) + tuple(shape)}")
    return a.reshape(flat)


def _group_array(f, path, name, dtype, experts, shape, layout_1, wanted, flat_ok=True):
    """A stacked scale or zero-point array (None when the format has none); from a layout-1 file,
    whose group arrays are [E, groups, N_pad] (that shape exactly, never flat: the element count
    cannot tell the layouts apart), the experts in `wanted` rearranged panel-major as the kernels
    read them, {expert: copy} (a few experts copy only theirs).  flat_ok: a layout-2 group array
    may be one flat row per expert; layout 3's (panels, groups, 16 or 32) are exactly as written
    (flat, INT8_MIN group 32 and INT8_GROUP group 16 hold as many floats, so a relabelled down
    would pass).  Per-channel scales are flat in every layout."""
    if not shape:
        return None
    if not layout_1:
        return _stacked(f, path, name, dtype, experts, shape, flat_ok=flat_ok or len(shape) != 3)
    panels, groups, _ = shape
    old = _stacked(f, path, name, dtype, experts, (groups, panels * 16), flat_ok=False, source="a layout-1 file holds")
    return {int(e): panel_major(old[e].reshape(groups, -1)).reshape(-1) for e in wanted}


@dataclass
class MappedLayer:
    """A packed layer file mapped and checked: the layer's config, its packed weights per
    projection (None for experts not asked for) and biases ([E, ...]), and the open file `fd`
    the weights are mapped from, in `state` (safetensors_io.file_state) when it was mapped (the
    caller keeps it open for the weights' life and watches it: see MoE.watch_file)."""
    path: str
    fd: int
    state: tuple
    config: MoeConfig
    weights: dict
    bias: Optional[dict]

    def watched_by(self, moe):
        """Hands the open file to `moe`: fstat before each forward, closed with it."""
        moe.watch_file(self.fd, self.state, self.path)
        weakref.finalize(moe, os.close, self.fd)
        return moe


def map_layer(path, isa=None, experts=None) -> MappedLayer:
    """Maps a packed layer file (no copy).  Every array is checked against the shapes the
    metadata implies by the format descriptor; the experts in `experts` (default: all) are also
    made native, which reads their codes once where the format checks them (INT8 column sums) -
    so a rank that keeps a few experts reads only those pages."""
    fd = open_regular_file(path)
    try:
        f, m, d = read_metadata(path, fd)  # the very file watched is the one mapped
        E, H, I = d["num_experts"], d["hidden_size"], d["intermediate_size"]
        held = {"gate": (m["weight_format"], d["group_size"]), "up": (m["weight_format"], d["group_size"]),
                "down": (m["down_weight_format"], d["down_group_size"])}
        wanted = range(E) if experts is None else experts
        if any(not 0 <= int(e) < E for e in wanted):
            raise CheckpointError(f"{path}: holds experts 0..{E - 1}; asked for {sorted(wanted)}")
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        weights: Dict[str, List[Optional[PackedWeight]]] = {}  # None: an expert not asked for
        for proj in PROJECTIONS:
            fmt, group = held[proj]
            try:
                want = _native.packed_shapes(FORMATS.index(fmt), *shapes[proj], group)
            except ValueError as err:
                raise CheckpointError(f"{path}: {proj}: {err}") from None
            data = _stacked(f, path, f"{proj}.data", np.uint8, E, want["data"])
            layout_1 = m["layout_version"] == "1" and DESCRIPTORS[fmt]["scale"] == "group"
            if layout_1 and DESCRIPTORS[fmt]["mins"]:
                raise CheckpointError(f"{path}: layout version 1 predates {fmt}; no ktcy wrote such a file")
            exact = m["layout_version"] == DOWN_FORMAT_LAYOUT
            scale = _group_array(f, path, f"{proj}.scale", np.float32, E, want["scale"], layout_1, wanted, not exact)
            colsum = _stacked(f, path, f"{proj}.colsum", np.int32, E, want["colsum"]) if want["colsum"] else None
            zero = _group_array(f, path, f"{proj}.zero", np.uint8, E, want["zero"], layout_1, wanted, not exact)
            weights[proj] = [None] * E
            for e in map(int, wanted):
                w = PackedWeight(fmt, shapes[proj], data[e], None if scale is None else scale[e],
                                 None if colsum is None else colsum[e], group, None if zero is None else zero[e])
                try:
                    w.native()
                except (TypeError, ValueError) as err:
                    raise CheckpointError(f"{path}: {proj}[{e}]: {err}") from None
                if not w.padding_is_clear():
                    raise CheckpointError(f"{path}: {proj}[{e}]: codes past its {shapes[proj][0]} x "
                                          f"{shapes[proj][1]} are not zero: hidden_size / intermediate_size in the "
                                          f"metadata are smaller than the weights the file holds")
                weights[proj][e] = w
        listed = [p for p in m.get("bias", "").split(",") if p]
        if set(listed) - set(PROJECTIONS):
            raise CheckpointError(f"{path}: metadata bias={m['bias']!r} names no projection")
        bias = {proj: _stacked(f, path, f"{proj}.bias", np.float32, E, ((H,) if proj == "down" else (I,)))
                for proj in listed} or None
        quant, down_quant = (QuantConfig(f, group_size=g or DEFAULT_INT4_GROUP) for f, g in (held["gate"], held["down"]))
        try:
            config = MoeConfig(E, d["top_k"], H, I, quant, isa=isa, **_activation_settings(path, m),
                               down_quant_config=None if held["down"] == held["gate"] else down_quant)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None
        return MappedLayer(path, fd, f.state, config, weights, bias)
    except BaseException:
        os.close(fd)
        raise


def load_layer(path, isa=None, backend=None):
    """MoE over the mapped file (no copy of the packed weights), see map_layer."""
    layer = map_layer(path, isa)
    try:
        moe = MoE(layer.config, layer.weights["gate"], layer.weights["up"], layer.weights["down"], bias=layer.bias)
    except BaseException as e:
        os.close(layer.fd)
        if isinstance(e, (TypeError, ValueError)) and not isinstance(e, CheckpointError):
            raise CheckpointError(f"{path}: {e}") from None
        raise
    return layer.watched_by(moe)
