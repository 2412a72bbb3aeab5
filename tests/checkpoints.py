"""Tiny Hugging Face-style MoE checkpoints with the real key names and dtypes, written by the
tests themselves."""
import json
import os

import ml_dtypes
import numpy as np

from ktcy import kernels
from ktcy.safetensors_io import write

NAMES = {
    "qwen": ("model.layers.{L}.mlp.experts.{e}.{p}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("model.layers.{L}.block_sparse_moe.experts.{e}.{p}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def expert_arrays(rng, E, H, I):
    return {"gate": (rng.standard_normal((E, I, H)) * 0.02).astype(np.float32),
            "up": (rng.standard_normal((E, I, H)) * 0.02).astype(np.float32),
            "down": (rng.standard_normal((E, H, I)) * 0.02).astype(np.float32)}


def make_checkpoint(path, *, style="qwen", dtype="bf16", E=4, H=128, I=64, top_k=2, num_layers=3,
                    dense_layers=(0,), fp8=None, shards=1, prefix="", seed=0, extra_config=None):
    """Writes config.json and safetensors files; returns {layer: {"gate"|"up"|"down": float32 [E,...]}}
    holding exactly the values stored (after bf16 / fp8 rounding), and for FP8 the codes and scales."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"architectures": ["Test"], "hidden_size": H, "num_hidden_layers": num_layers,
              "num_experts_per_tok": top_k, "mlp_only_layers": list(dense_layers), "decoder_sparse_step": 1}
    if style == "mixtral":
        config.update(num_local_experts=E, intermediate_size=I)
        config.pop("mlp_only_layers")
    else:
        config.update(num_experts=E, moe_intermediate_size=I, intermediate_size=4 * I)
    config.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    moe_layers = [L for L in range(num_layers) if style == "mixtral" or L not in dense_layers]
    truth, tensors = {}, []
    for L in moe_layers:
        arrays = expert_arrays(rng, E, H, I)
        layer_tensors = {f"{prefix}model.layers.{L}.self_attn.q_proj.weight": np.zeros((4, 4), ml_dtypes.bfloat16)}
        stored = {}
        if style == "fused":
            gu = np.concatenate([arrays["gate"], arrays["up"]], axis=1)
            gu_b, d_b = gu.astype(ml_dtypes.bfloat16), arrays["down"].astype(ml_dtypes.bfloat16)
            layer_tensors[f"{prefix}model.layers.{L}.mlp.experts.gate_up_proj"] = gu_b
            layer_tensors[f"{prefix}model.layers.{L}.mlp.experts.down_proj"] = d_b
            stored = {"gate": gu_b[:, :I].astype(np.float32), "up": gu_b[:, I:].astype(np.float32),
                      "down": d_b.astype(np.float32)}
        else:
            pattern, pnames = NAMES[style]
            for proj, a in arrays.items():
                stored[proj] = np.empty_like(a)
                for e in range(E):
                    name = prefix + pattern.format(L=L, e=e, p=pnames[proj])
                    if fp8 is None:
                        t = a[e].astype({"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[dtype])
                        layer_tensors[name] = t
                        stored[proj][e] = t.astype(np.float32)
                    else:
                        p = kernels.pack(a[e], "FP8_PERCHANNEL" if fp8 == "channel" else "FP8_BLOCK")
                        codes = p.codes().view(ml_dtypes.float8_e4m3fn)
                        if fp8 == "channel":
                            scale = p.scale[: a.shape[1]].reshape(-1, 1)
                            layer_tensors[name] = codes
                            layer_tensors[name + "_scale"] = scale
                        else:
                            scale = p.scale
                            layer_tensors[name] = codes
                            layer_tensors[name + "_scale_inv"] = scale
                        stored[proj][e] = p.dequantize().astype(np.float32)
                        stored.setdefault(proj + "_codes", []).append(codes)
                        stored.setdefault(proj + "_scale", []).append(scale)
        truth[L] = stored
        tensors.append(layer_tensors)
    if shards == 1:
        merged = {k: v for t in tensors for k, v in t.items()}
        write(os.path.join(path, "model.safetensors"), merged, {"format": "pt"})
    else:
        weight_map = {}
        per_shard = -(-len(tensors) // shards)
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: v for t in tensors[s * per_shard:(s + 1) * per_shard] for k, v in t.items()}
            write(os.path.join(path, name), part, {"format": "pt"})
            weight_map.update({k: name for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return truth
