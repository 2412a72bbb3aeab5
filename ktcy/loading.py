"""ktcy.load_experts: one MoE layer from a Hugging Face checkpoint folder, a GGUF model, or a
folder written by the converter.

Contract (used from outside the repo): ``load_experts(path, layer, method=None, isa=None)``.
"""
import os
from typing import Callable, Optional, Union

from ktcy.checkpoint import Checkpoint, dequantize, layer_number
from ktcy.config import MoeConfig, QuantConfig, checked_isa
from ktcy.errors import naming
from ktcy.formats import DEFAULT_INT4_GROUP, GROUP_SIZES, canonical_format, group_sizes, grouped_names, has_groups, keeps_codes
from ktcy.gguf_checkpoint import GGUFCheckpoint, is_gguf
from ktcy.log import warn_once
from ktcy.moe import MoE
from ktcy.packed_io import layer_file_name, load_layer, read_metadata
from ktcy.paths import MAX_CONFIG_BYTES, allowed_roots, confined_file, read_json, resolve_model_path
from ktcy.safetensors_io import CheckpointError

MODEL_FILE = "ktcy_model.json"

PathLike = Union[str, "os.PathLike[str]"]


def is_converted(path):
    return os.path.lexists(os.path.join(path, MODEL_FILE))


def original_checkpoint(path, who, needs, hint="pass the converted folder as experts_path"):
    """The resolved path of a whole checkpoint, or a CheckpointError when it is a folder
    written by `ktcy convert` (experts only), which `who` cannot use: it `needs` the rest."""
    path = resolve_model_path(path)
    if is_converted(path):
        raise CheckpointError(f"{path}: a converted folder holds experts only; {who} needs the original "
                              f"checkpoint ({needs}) - {hint}")
    return path


def load_experts(path: PathLike, layer: int, method: Optional[str] = None, isa: Optional[str] = None,
                 group_size: Optional[int] = None,
                 progress: Optional[Callable[[int, int], None]] = None) -> MoE:
    """The routed experts of decoder layer `layer` as a ktcy.MoE.

    Parameters
      path: a Hugging Face checkpoint folder (config.json + safetensors), a GGUF model (a .gguf
        file, any part of a split one, or a folder holding one), a folder written by `ktcy
        convert`, `~/...`, or a hub id ("Qwen/Qwen3-30B-A3B") already in the local Hugging Face
        cache (HF_HUB_CACHE / HF_HOME; nothing is downloaded).
      layer: decoder layer number (an MoE layer of the config).
      method: None keeps the checkpoint's precision (BF16 -> BF16, F16/F32 -> BF16, FP8 block ->
        FP8 block, FP8 per-channel -> FP8 per-channel) or its released codes (symmetric INT4 of
        compressed-tensors / GPTQ -> INT4, INT4 with zero points of GPTQ / AWQ / compressed-tensors
        -> INT4_ZP, GPT-OSS's MXFP4 -> MXFP4, each with its own group size; GGUF's Q4_0 -> INT4
        group 32, Q4_K and Q4_1 -> INT4_MIN group 32, Q8_0 and Q5_0 -> INT8_GROUP group 32, Q6_K ->
        INT8_GROUP group 16, Q5_K and Q5_1 -> INT8_MIN group 32, MXFP4 -> MXFP4, BF16/F16/F32 -> BF16, down in its own format where it
        differs (Q4_K_M), and its other types need a method, which keeps the tensors it holds as stored); a format or
        KTransformers backend name ("INT8", "AMXINT4", "FP8", ...) quantizes on load (released
        codes are dequantized exactly first).  A converted folder is loaded as it was packed (gate
        and up in one format, down in the same or, from a GGUF Q4_K_M, its own); a method or group
        size must be what it holds.
      isa: force one instruction set ("amx", "amx_emu", "avx512", "avx2", "ref"); None picks the
        best this CPU runs.  An ISA the CPU cannot run raises UnsupportedISAError.
      group_size: grouped formats only (INT4, INT4_ZP, INT4_MIN: 32, 64 (default; a released
        checkpoint's own) or 128 values per scale along K; INT8_GROUP also 16).  For a converted folder it must equal the group size the file was packed with.
      progress: called as progress(experts_done, num_experts) while packing.

    Returns a MoE whose forward(x, topk_ids, topk_weights) runs the layer.

    Raises CheckpointError (a ValueError) for a missing, malformed or inconsistent checkpoint or
    converted folder, naming the file; ValueError for an unknown method or a group_size that
    does not apply or an unknown ISA; TypeError for a path or layer of the wrong type."""
    isa = checked_isa(isa)
    path = resolve_model_path(path)
    layer = layer_number(layer)
    if group_size is not None:
        group_size = layer_number(group_size, "group_size")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES} ({grouped_names()} only), got {group_size!r}")
    if is_converted(path):
        return _load_converted(path, layer, method, isa, group_size)
    ckpt = GGUFCheckpoint(path) if is_gguf(path) else Checkpoint(path)
    return experts_from_checkpoint(ckpt, layer, method, isa, group_size, progress)


def _load_converted(path, layer, method, isa, group_size):
    return load_layer(converted_layer_file(path, layer, method, group_size), isa=isa)


def converted_layer_file(path, layer, method=None, group_size=None):
    """The file of layer `layer` in a folder written by `ktcy convert` (confined to the folder),
    or a CheckpointError when the layer was not converted or not in `method` / `group_size`."""
    model_file = os.path.join(path, MODEL_FILE)
    model = read_json(model_file, MAX_CONFIG_BYTES)
    if not isinstance(model, dict):
        raise CheckpointError(f"{model_file}: expected a JSON object")
    if layer < 0:
        raise CheckpointError(f"{path}: layer {layer} was not converted (layer numbers start at 0)")
    f = confined_file(path, layer_file_name(layer), allowed_roots(path), path)
    if not os.path.lexists(f):
        layers = model.get("layers", [])
        raise CheckpointError(f"{path}: layer {layer} was not converted (converted layers: {layers!r:.200})")
    _, meta, dims = read_metadata(f)
    if dims["layer"] != layer:
        raise CheckpointError(f"{f}: holds layer {dims['layer']}, not layer {layer} (a file renamed or copied from "
                              "another layer); convert the checkpoint again")
    gate = (meta["weight_format"], dims["group_size"])
    down = (meta["down_weight_format"], dims["down_group_size"])
    sides = [gate] if down == gate else [gate, down]
    if method is not None and {fmt for fmt, _ in sides} != {canonical_format(method)}:
        formats = gate[0] if down[0] == gate[0] else f"{gate[0]} (down {down[0]})"
        raise CheckpointError(f"{f}: packed as {formats}; converting to "
                              f"{canonical_format(method)} needs the original checkpoint")
    if group_size is not None and any(not has_groups(fmt) or group_size != group for fmt, group in sides):
        held = " and down as ".join(f"{fmt} with group size {group}" if has_groups(fmt) else f"{fmt} (no group size)"
                                    for fmt, group in sides)
        raise CheckpointError(f"{f}: packed as {held}; group_size={group_size} needs converting the original "
                              "checkpoint again")
    return f


def experts_from_checkpoint(ckpt, layer, method=None, isa=None, group_size=None, progress=None):
    """Routed experts of one layer of an open Checkpoint, packed in `method` (None: as stored)."""
    experts = ckpt.layer(layer)
    a = ckpt.arch
    quant, down_quant = layer_quant_configs(experts, method, group_size)
    fmt = quant.method
    config = MoeConfig(a.num_experts, a.top_k, a.hidden_size, a.intermediate_size, quant, backend=method, isa=isa,
                       down_quant_config=down_quant, **block_settings(a))
    _warn_if_requantized(ckpt, experts, quant, down_quant)
    bias = experts.bias()
    source = experts.source(fmt, strict=method is None, down_fmt=config.down_format)
    with naming(f"{ckpt.path}: layer {layer}", CheckpointError):
        if bias is None:
            return MoE.from_experts(config, source, progress)
        return MoE.from_experts(config, source, progress, bias=bias)


def layer_quant_configs(experts, method=None, group_size=None):
    """(QuantConfig of gate and up, QuantConfig of down or None when it is the same) that load a
    layer's experts: method None keeps every projection as stored (a GGUF layer's down may have
    its own format: Q4_K_M's Q6_K down as INT8_GROUP group 16 beside Q4_K's INT4_MIN group 32);
    a method packs all three in it.  One format takes one group for the layer, the smallest its
    kept codes have (a larger one's scales split exactly; what convert writes), two formats each
    their own; group_size, when given, applies to all.  Raises needs_method() where nothing is
    stored in a ktcy format, ValueError for a group_size that does not apply."""
    fmt = canonical_format(method) if method is not None else experts.native_format
    if fmt is None:
        raise experts.needs_method()
    down_fmt = fmt if method is not None else experts.native_down_format
    for f in {fmt, down_fmt} if group_size is not None else ():
        if not has_groups(f):
            raise ValueError(f"group_size applies to grouped formats ({grouped_names()}) only; the experts are loaded as {f}")
        if group_size not in group_sizes(f):
            raise ValueError(f"group_size {group_size}: {f} takes {', '.join(map(str, group_sizes(f)))}")

    def group_of(f, projections):
        return group_size or layer_group_size(experts, f, projections)

    if down_fmt == fmt:
        return QuantConfig(fmt, group_size=group_of(fmt, ("gate", "up", "down"))), None
    return (QuantConfig(fmt, group_size=group_of(fmt, ("gate", "up"))),
            QuantConfig(down_fmt, group_size=group_of(down_fmt, ("down",))))


def _warn_if_requantized(ckpt, experts, quant, down_quant):
    """One WARNING when a load dequantizes weights the checkpoint already stores quantized and
    quantizes them again (FP8 per-channel loaded as FP8 = 128x128 blocks, INT4 with another
    group size, ...): an accuracy loss nobody asked for by name.  Float targets (BF16) are exact,
    and so is a group that divides the stored one (each scale repeated).  A GGUF layer whose
    projections are stored in two formats is warned about by its source (per ggml type) where a
    format changes; here where a group does."""
    stored_gu, stored_down = experts.native_format, experts.native_down_format
    sides = [("it", ("gate", "up", "down"), stored_gu, quant)] if stored_gu == stored_down and down_quant is None else \
        [("gate and up", ("gate", "up"), stored_gu, quant), ("down", ("down",), stored_down, down_quant or quant)]
    for what, projections, stored, q in sides:
        fmt, group = canonical_format(q.method, q.per_channel), q.group_size
        if stored in (None, "BF16") or fmt == "BF16":
            continue
        stored_group = experts.kept_group(stored, projections)
        if keeps_codes(stored, fmt):
            if not has_groups(fmt) or not stored_group or stored_group % group == 0:
                continue
        elif len(sides) == 2:
            continue
        held = f"{stored}" + (f" group {stored_group}" if has_groups(stored) and stored_group else "")
        warn_once(f"{ckpt.path}: the checkpoint stores {held}; loading {what} as {fmt}"
                  + (f" group {group}" if has_groups(fmt) else "")
                  + " dequantizes and quantizes it again, which costs accuracy (method=None keeps it as stored)")


def layer_group_size(experts, fmt, projections=("gate", "up", "down")):
    """The group size that keeps released grouped codes as stored: the smallest of those of
    `projections` in fmt (else of the layer's other projections in fmt) when ktcy's layout takes
    it, else the default."""
    stored = experts.kept_group(fmt, projections) or experts.kept_group(fmt)  # GGUF keeps formats per tensor
    if has_groups(fmt) and stored in group_sizes(fmt):
        return stored
    return DEFAULT_INT4_GROUP


def block_settings(arch):
    """MoeConfig keywords for the block's activation (GPT-OSS's clamped SwiGLU), {} for SiLU."""
    settings = arch.activation_settings()
    return {} if settings["activation"] == "silu" else settings


def source_for(fmt, stored_kind, expert):
    """expert() as it is when the target keeps the stored precision (float, or the same FP8
    kind), else with FP8 codes dequantized first."""
    if stored_kind is None or fmt == stored_kind:
        return expert
    return lambda e: {proj: (dequantize(w, s), None) for proj, (w, s) in expert(e).items()}
