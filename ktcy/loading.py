"""ktcy.load_experts: one MoE layer from a Hugging Face checkpoint folder or a folder written by
the converter.

Contract (used from outside the repo): ``load_experts(path, layer, method=None, isa=None)``.
"""
import json
import os

from ktcy.checkpoint import Checkpoint
from ktcy.config import MoeConfig, QuantConfig
from ktcy.formats import canonical_format
from ktcy.moe import MoE
from ktcy.packed_io import layer_file_name, load_layer, read_metadata
from ktcy.safetensors_io import CheckpointError

MODEL_FILE = "ktcy_model.json"


def is_converted(path):
    return os.path.exists(os.path.join(path, MODEL_FILE))


def quant_config_for(method, group_size=None):
    """QuantConfig for a method/backend name (None: keep the checkpoint's precision)."""
    fmt = canonical_format(method)
    return QuantConfig(fmt, group_size=group_size or 64)


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
    ckpt = Checkpoint(path)
    experts = ckpt.layer(layer)
    a = ckpt.arch
    if method is None:
        fmt = experts.native_format
        expert = experts.expert
    else:
        fmt = canonical_format(method)
        same_fp8 = fmt == experts.scale_kind
        expert = experts.expert if same_fp8 or experts.scale_kind is None else _dequantized(experts)
    config = MoeConfig(a.num_experts, a.top_k, a.hidden_size, a.intermediate_size,
                       QuantConfig(fmt, group_size=group_size or 64), isa=isa)
    return MoE.from_experts(config, expert, progress)


def _dequantized(experts):
    def expert(e):
        return {proj: (w, None) for proj, w in experts.dequantized(e).items()}
    return expert
