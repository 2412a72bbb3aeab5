"""Packed MoE layers on disk: one safetensors file per layer holding every expert's packed
blocks stacked per projection ("gate.data" [E, bytes], "gate.scale" [E, ...], "gate.colsum"
[E, N_pad] for INT8), with metadata naming the format, layout version, shapes, group size,
scale kind and ktcy version.  Loading maps the file and wraps the stacked arrays, no copy; the
layout is ISA-independent, so a file packed on one machine runs on any other."""
import numpy as np

from ktcy.version import __version__
from ktcy.config import MoeConfig, QuantConfig
from ktcy.formats import FORMATS
from ktcy.kernels import PackedWeight
from ktcy.moe import MoE, pack_expert_weight
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write

FILE_FORMAT = "ktcy.packed_experts"
LAYOUT_VERSION = "1"
PROJECTIONS = ("gate", "up", "down")
SCALE_KIND = {"BF16": "none", "INT8": "per_channel", "INT4": "group", "FP8_PERCHANNEL": "per_channel",
              "FP8_BLOCK": "block_128x128"}


def layer_file_name(layer):
    return f"ktcy_layer_{layer:04d}.safetensors"


def pack_layer(num_experts, fmt, group, expert, progress=None):
    """Stacked arrays of a whole layer, packed expert by expert into buffers allocated once
    (the peak is one packed layer plus one expert's source)."""
    arrays = {}
    for e in range(num_experts):
        for proj, (w, scale) in expert(e).items():
            p = pack_expert_weight(w, scale, fmt, group, f"{proj}[{e}]")
            parts = {"data": p.data, "scale": p.scale}
            if p.colsum is not None:
                parts["colsum"] = p.colsum
            for part, a in parts.items():
                key = f"{proj}.{part}"
                if key not in arrays:
                    arrays[key] = np.empty((num_experts,) + a.shape, a.dtype)
                arrays[key][e] = a
        if progress is not None:
            progress(e + 1, num_experts)
    return arrays


def write_layer(path, arrays, fmt, group, num_experts, top_k, hidden, inter, layer, source=""):
    meta = {"format": FILE_FORMAT, "layout_version": LAYOUT_VERSION, "weight_format": fmt,
            "group_size": group if fmt == "INT4" else 0, "scale_kind": SCALE_KIND[fmt],
            "num_experts": num_experts, "top_k": top_k, "hidden_size": hidden, "intermediate_size": inter,
            "layer": layer, "ktcy_version": __version__, "source": source}
    write(path, arrays, meta)


def read_metadata(path):
    """The validated metadata of a packed layer file (CheckpointError if foreign or corrupt)."""
    f = SafetensorsFile(path)
    m = f.metadata
    if m.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path}: not a ktcy packed-experts file (format {m.get('format')!r})")
    if m.get("layout_version") != LAYOUT_VERSION:
        raise CheckpointError(f"{path}: layout version {m.get('layout_version')!r}; this ktcy "
                              f"({__version__}) reads version {LAYOUT_VERSION} - convert the checkpoint again")
    if m.get("weight_format") not in FORMATS:
        raise CheckpointError(f"{path}: unknown weight format {m.get('weight_format')!r}")
    try:
        dims = {k: int(m[k]) for k in ("num_experts", "top_k", "hidden_size", "intermediate_size", "group_size", "layer")}
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: metadata lacks or garbles {e}") from None
    return f, m, dims


def load_layer(path, isa=None, backend=None):
    """MoE over the mapped file (no copy of the packed weights)."""
    f, m, d = read_metadata(path)
    fmt = m["weight_format"]
    E, H, I, group = d["num_experts"], d["hidden_size"], d["intermediate_size"], d["group_size"]
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    experts = {}
    for proj in PROJECTIONS:
        try:
            data, scale = f.get(f"{proj}.data"), f.get(f"{proj}.scale")
            colsum = f.get(f"{proj}.colsum") if fmt == "INT8" else None
        except CheckpointError as e:
            raise CheckpointError(f"{path}: incomplete packed layer ({e})") from None
        if data.shape[0] != E or scale.shape[0] != E:
            raise CheckpointError(f"{path}: {proj} holds {data.shape[0]} experts, metadata says {E}")
        experts[proj] = []
        for e in range(E):
            w = PackedWeight(fmt, shapes[proj], data[e], scale[e], None if colsum is None else colsum[e], group)
            try:
                w.native()  # checks the byte count against the layout
            except ValueError as err:
                raise CheckpointError(f"{path}: {proj}[{e}]: {err}") from None
            experts[proj].append(w)
    quant = QuantConfig(fmt, group_size=group if fmt == "INT4" else 64)
    config = MoeConfig(E, d["top_k"], H, I, quant, isa=isa)
    return MoE(config, experts["gate"], experts["up"], experts["down"])
