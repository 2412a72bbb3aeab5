"""ktcy.load_experts: one MoE layer from a Hugging Face checkpoint folder or a folder written by
the converter.

Contract (used from outside the repo): ``load_experts(path, layer, method=None, isa=None)``.
"""
import json
import os

from ktcy.checkpoint import Checkpoint, dequantize
from ktcy.config import MoeConfig, QuantConfig
from ktcy.formats import canonical_format
from ktcy.moe import MoE
from ktcy.packed_io import layer_file_name, load_layer, read_metadata
from ktcy.safetensors_io import CheckpointError

MODEL_FILE = "ktcy_model.json"


def is_converted(path):
    return os.path.exists(os.path.join(path, MODEL_FILE))


def load_experts(path, layer, method=None, isa=None, group_size=None, progress=None):
    """The routed experts of decoder layer `layer` as a MoE.

    method=None keeps the checkpoint's precision (BF16 -> BF16, F16/F32 -> BF16, FP8 block ->
    FP8 block, FP8 per-channel -> FP8 per-channel); a format or backend name quantizes on load.
    A converted folder is mapped, not copied; it can only be loaded in the format it holds."""
    path = os.fspath(path)
    if is_converted(path):
        f = os.path.join(path, layer_file_name(layer))
        if not os.path.exists(f):
            with open(os.path.join(path, MODEL_FILE)) as fh:
                layers = json.load(fh).get("layers", [])
            raise CheckpointError(f"{path}: layer {layer} was not converted (converted layers: {layers})")
        _, meta, _ = read_metadata(f)
        if method is not None and canonical_format(method) != meta["weight_format"]:
            raise CheckpointError(f"{f}: packed as {meta['weight_format']}; converting to "
                                  f"{canonical_format(method)} needs the original checkpoint")
        return load_layer(f, isa=isa)
    return experts_from_checkpoint(Checkpoint(path), layer, method, isa, group_size, progress)


def experts_from_checkpoint(ckpt, layer, method=None, isa=None, group_size=None, progress=None):
    """Routed experts of one layer of an open Checkpoint, packed in `method` (None: as stored)."""
    experts = ckpt.layer(layer)
    a = ckpt.arch
    fmt = canonical_format(method) if method is not None else experts.native_format
    config = MoeConfig(a.num_experts, a.top_k, a.hidden_size, a.intermediate_size,
                       QuantConfig(fmt, group_size=group_size or 64), backend=method, isa=isa)
    return MoE.from_experts(config, source_for(fmt, experts.scale_kind, experts.expert), progress)


def source_for(fmt, stored_kind, expert):
    """expert() as it is when the target keeps the stored precision (float, or the same FP8
    kind), else with FP8 codes dequantized first."""
    if stored_kind is None or fmt == stored_kind:
        return expert
    return lambda e: {proj: (dequantize(w, s), None) for proj, (w, s) in expert(e).items()}
