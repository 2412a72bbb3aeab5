"""Tiny Hugging Face-style MoE checkpoints with the real key names and dtypes, written by the
tests themselves."""
import json
import os

import ml_dtypes
import numpy as np

from ktcy import kernels
from ktcy.safetensors_io import write

NAMES = {
    "qwen": ("{root}.{L}.mlp.experts.{e}.{p}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("{root}.{L}.block_sparse_moe.experts.{e}.{p}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def expert_arrays(rng, E, H, I):
    return {"gate": (rng.standard_normal((E, I, H)) * 0.02).astype(np.float32),
            "up": (rng.standard_normal((E, I, H)) * 0.02).astype(np.float32),
            "down": (rng.standard_normal((E, H, I)) * 0.02).astype(np.float32)}


def make_checkpoint(path, *, style="qwen", dtype="bf16", E=4, H=128, I=64, top_k=2, num_layers=3,
                    dense_layers=(0,), fp8=None, shards=1, layers_root="model.layers", seed=0, extra_config=None):
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
        layer_tensors = {f"{layers_root}.{L}.self_attn.q_proj.weight": np.zeros((4, 4), ml_dtypes.bfloat16)}
        stored = {}
        if style == "fused":
            gu = np.concatenate([arrays["gate"], arrays["up"]], axis=1)
            gu_b, d_b = gu.astype(ml_dtypes.bfloat16), arrays["down"].astype(ml_dtypes.bfloat16)
            layer_tensors[f"{layers_root}.{L}.mlp.experts.gate_up_proj"] = gu_b
            layer_tensors[f"{layers_root}.{L}.mlp.experts.down_proj"] = d_b
            stored = {"gate": gu_b[:, :I].astype(np.float32), "up": gu_b[:, I:].astype(np.float32),
                      "down": d_b.astype(np.float32)}
        else:
            pattern, pnames = NAMES[style]
            for proj, a in arrays.items():
                stored[proj] = np.empty_like(a)
                for e in range(E):
                    name = pattern.format(root=layers_root, L=L, e=e, p=pnames[proj])
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


# ---- checkpoints released quantized, packed here from each format's description ----

def fields_to_int32(values, axis, bits):
    """uint values of `bits` bits -> int32 words, 32 / bits per word along `axis`, value i of a
    word at bits * i (the packing compressed-tensors and GPTQ describe); the axis is zero-padded
    to a whole word."""
    per = 32 // bits
    v = np.moveaxis(np.asarray(values, np.uint64), axis, -1)
    pad = -v.shape[-1] % per
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint64)], axis=-1)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // per,), np.uint64)
    for i in range(per):
        words |= v[..., i::per] << np.uint64(bits * i)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def nibbles_to_int32(values, axis):
    """uint 0..15 values -> int32 words, 8 per word (4-bit GPTQ and compressed-tensors)."""
    return fields_to_int32(values, axis, 4)


def bytes_to_int32(values, axis):
    """uint 0..255 values -> int32 words, 4 per word (8-bit GPTQ)."""
    return fields_to_int32(values, axis, 8)


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds channel 8c + AWQ_PACK_ORDER[i]


def awq_pack(values):
    """[rows, N] 0..15 -> int32 [rows, N/8] in AWQ's channel order."""
    rows, n = values.shape
    reordered = values.reshape(rows, n // 8, 8)[:, :, list(AWQ_PACK_ORDER)].reshape(rows, n)
    return nibbles_to_int32(reordered, axis=1)


RELEASED_CONFIG = {
    "ct": lambda g, sym: {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": sym, "group_size": g, "strategy": "group"}}}},
    "gptq": lambda g, sym: {"quant_method": "gptq", "bits": 4, "group_size": g or -1, "sym": sym, "desc_act": False,
                            "checkpoint_format": "gptq"},
    "gptq_v2": lambda g, sym: {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": sym, "desc_act": False,
                               "checkpoint_format": "gptq_v2"},
    "awq": lambda g, sym: {"quant_method": "awq", "bits": 4, "group_size": g or -1, "zero_point": True, "version": "gemm"},
    "gptq8": lambda g, sym: {"quant_method": "gptq", "bits": 8, "group_size": g or -1, "sym": sym, "desc_act": False,
                             "checkpoint_format": "gptq"},
    "ct8": lambda g, sym: _ct8("pack-quantized", g, sym, None),  # W8A16
    "ct8_int": lambda g, sym: _ct8("int-quantized", g, sym, {   # W8A8: int8 weights, dynamic per-token activations
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
}


def _ct8(packing, g, sym, acts):
    """8-bit compressed-tensors: strategy group (g) or channel (g None)."""
    weights = {"num_bits": 8, "type": "int", "symmetric": sym, "group_size": g,
               "strategy": "group" if g else "channel"}
    return {"quant_method": "compressed-tensors", "format": packing, "config_groups": {
        "group_0": {"targets": ["Linear"], "input_activations": acts, "weights": weights}}}


def released_tensors(kind, base, q, z, s, g, rng, permute=False):
    """Tensors of one projection W[N, K] = s * (q - z) per (channel, group) in `kind`'s layout.
    q [N, K] and z [N, groups] hold 0..15 (z = 8: symmetric), s [N, groups] float32."""
    n, k = q.shape
    if kind == "ct":
        out = {f"{base}.weight_packed": nibbles_to_int32(q, axis=1),
               f"{base}.weight_shape": np.array([n, k], np.int64),
               f"{base}.weight_scale": s.astype(ml_dtypes.bfloat16)}
        if (z != 8).any():
            out[f"{base}.weight_zero_point"] = nibbles_to_int32(z, axis=0)
        return out
    if kind in ("ct8", "ct8_int"):  # stored signed: q - 128 (pack-quantized adds 128 back before packing)
        out = {f"{base}.weight_scale": s.astype(ml_dtypes.bfloat16)}
        if kind == "ct8":
            out[f"{base}.weight_packed"] = bytes_to_int32(q, axis=1)
            out[f"{base}.weight_shape"] = np.array([n, k], np.int64)
        else:
            out[f"{base}.weight"] = (q - 128).astype(np.int8)
        if (z != 128).any():
            out[f"{base}.weight_zero_point"] = bytes_to_int32(z, axis=0) if kind == "ct8" else (z - 128).astype(np.int8)
        return out
    if kind == "awq":
        return {f"{base}.qweight": awq_pack(q.T), f"{base}.qzeros": awq_pack(z.T), f"{base}.scales": s.T.astype(np.float16)}
    g_idx = np.arange(k, dtype=np.int32) // g
    if permute:  # desc_act: rows of a group scattered over K
        g_idx = rng.permutation(g_idx).astype(np.int32)
    if kind == "gptq8":  # v1: z - 1, 4 bytes per word
        return {f"{base}.qweight": bytes_to_int32(q.T, axis=0), f"{base}.qzeros": bytes_to_int32((z - 1).T, axis=1),
                f"{base}.scales": s.T.astype(np.float16), f"{base}.g_idx": g_idx}
    stored_z = (z - 1) & 0xF if kind == "gptq" else z  # GPTQ v1 stores z - 1
    return {f"{base}.qweight": nibbles_to_int32(q.T, axis=0), f"{base}.qzeros": nibbles_to_int32(stored_z.T, axis=1),
            f"{base}.scales": s.T.astype(np.float16), f"{base}.g_idx": g_idx}


def make_released_checkpoint(path, kind, *, group=32, sym=False, E=4, H=128, I=64, top_k=2, num_layers=2,
                             dense_layers=(0,), seed=0, permute=False, extra_config=None):
    """A Qwen-named checkpoint whose experts are INT4 as `kind` releases them ("ct", "gptq",
    "gptq_v2", "awq"), or 8-bit ("gptq8", compressed-tensors "ct8" pack-quantized and "ct8_int"
    int-quantized: codes 0..255, z = 128 when symmetric; group None: a scale per channel).
    Returns {layer: {proj: float64 [E, N, K] dequantized weights, proj + "_g_idx": ...}}."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"architectures": ["Test"], "model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": num_layers,
              "num_experts_per_tok": top_k, "mlp_only_layers": list(dense_layers), "num_experts": E,
              "moe_intermediate_size": I, "intermediate_size": 4 * I, "norm_topk_prob": True,
              "quantization_config": RELEASED_CONFIG[kind](group, sym)}
    config.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    truth, tensors = {}, {}
    for L in [L for L in range(num_layers) if L not in dense_layers]:
        truth[L] = {}
        for proj, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            full = np.empty((E, n, k))
            for e in range(E):
                g = group or k
                groups = -(-k // g)
                top, mid = (256, 128) if kind in ("gptq8", "ct8", "ct8_int") else (16, 8)
                q = rng.integers(0, top, (n, k))
                z = np.full((n, groups), mid) if sym else rng.integers(1 if kind.startswith("gptq") else 0, top, (n, groups))
                s = rng.uniform(0.001, 0.01, (n, groups)).astype(np.float32)
                base = f"model.layers.{L}.mlp.experts.{e}.{proj}_proj"
                t = released_tensors(kind, base, q, z, s, g, rng, permute)
                tensors.update(t)
                stored_s = (t.get(f"{base}.weight_scale", t.get(f"{base}.scales"))).astype(np.float64)
                stored_s = stored_s if kind.startswith("ct") else stored_s.T
                g_idx = t[f"{base}.g_idx"] if f"{base}.g_idx" in t else np.arange(k) // g
                full[e] = (q - z[:, g_idx]) * stored_s[:, g_idx]
            truth[L][proj] = full
        router = (rng.standard_normal((E, H)) * 0.3).astype(ml_dtypes.bfloat16)
        tensors[f"model.layers.{L}.mlp.gate.weight"] = router
        truth[L]["router"] = router.astype(np.float64)
    write(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    return truth


def e2m1_value(code):
    """E2M1 from its definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def mxfp4_blocks(codes):
    """codes [..., K] 0..15 -> GPT-OSS's blocks [..., K/32, 16]: element 2j in the low nibble of
    byte j of its block, 2j + 1 in the high nibble."""
    c = np.asarray(codes, np.uint8)
    pairs = c[..., 0::2] | (c[..., 1::2] << 4)
    return pairs.reshape(c.shape[:-1] + (c.shape[-1] // 32, 16))


def make_gpt_oss_checkpoint(path, *, E=8, H=128, I=96, top_k=4, num_layers=2, seed=0, swiglu_limit=None,
                            exponents=(119, 123)):
    """A GPT-OSS-shaped checkpoint (MXFP4 expert blocks, interleaved gate/up, biases, router with
    bias).  Returns {layer: {"gate"/"up": float64 [E, I, H], "down": [E, H, I], "gate_bias",
    "up_bias": [E, I], "down_bias": [E, H], "router", "router_bias"}}."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": num_layers, "num_local_experts": E,
              "num_experts_per_tok": top_k, "experts_per_token": top_k, "quantization_config": {"quant_method": "mxfp4"}}
    if swiglu_limit is not None:
        config["swiglu_limit"] = swiglu_limit
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    table = np.array([e2m1_value(c) for c in range(16)])
    truth, tensors = {}, {}
    for L in range(num_layers):
        p = f"model.layers.{L}.mlp"
        t = truth[L] = {}
        for stack, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            codes = rng.integers(0, 16, (E, n, k))
            exps = rng.integers(exponents[0], exponents[1] + 1, (E, n, k // 32))
            tensors[f"{p}.experts.{stack}_blocks"] = mxfp4_blocks(codes)
            tensors[f"{p}.experts.{stack}_scales"] = exps.astype(np.uint8)
            w = table[codes] * np.exp2(np.repeat(exps - 127.0, 32, axis=2))
            bias = (rng.standard_normal((E, n)) * 0.1).astype(ml_dtypes.bfloat16)
            tensors[f"{p}.experts.{stack}_bias"] = bias
            if stack == "down_proj":
                t["down"], t["down_bias"] = w, bias.astype(np.float64)
            else:  # GPT-OSS interleaves: gate = even output rows, up = odd ones
                t["gate"], t["up"] = w[:, 0::2], w[:, 1::2]
                t["gate_bias"], t["up_bias"] = bias[:, 0::2].astype(np.float64), bias[:, 1::2].astype(np.float64)
        router = (rng.standard_normal((E, H)) * 0.2).astype(ml_dtypes.bfloat16)
        router_bias = (rng.standard_normal(E) * 0.2).astype(ml_dtypes.bfloat16)
        tensors[f"{p}.router.weight"], tensors[f"{p}.router.bias"] = router, router_bias
        t["router"], t["router_bias"] = router.astype(np.float64), router_bias.astype(np.float64)
        tensors[f"model.layers.{L}.self_attn.q_proj.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
    write(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    return truth
