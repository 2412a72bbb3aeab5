"""Hugging Face MoE checkpoints: config.json, single-file or sharded safetensors, and the usual
names of routed-expert tensors (per-expert Qwen/DeepSeek/OLMoE, Mixtral w1/w3/w2, fused
gate_up_proj), in BF16, F16, F32 or F8_E4M3 with per-channel or block scales."""
import json
import os
from dataclasses import dataclass

import numpy as np

from ktcy.formats import fp8_scale_kind
from ktcy.kernels import expand_block_scale
from ktcy.safetensors_io import CheckpointError, SafetensorsFile

PREFIXES = ("", "language_model.", "model.language_model.")


def _first(cfg, *names):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


@dataclass(frozen=True)
class MoEArchitecture:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    moe_layers: tuple
    raw: dict

    @classmethod
    def from_config(cls, cfg, where="config.json"):
        if isinstance(cfg.get("text_config"), dict) and _first(cfg, "hidden_size") is None:
            cfg = cfg["text_config"]  # multimodal wrappers nest the language model's config
        experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
        top_k = _first(cfg, "num_experts_per_tok")
        hidden = _first(cfg, "hidden_size")
        inter = _first(cfg, "moe_intermediate_size", "intermediate_size")
        layers = _first(cfg, "num_hidden_layers")
        for name, value in (("num_experts / num_local_experts / n_routed_experts", experts),
                            ("num_experts_per_tok", top_k), ("hidden_size", hidden),
                            ("moe_intermediate_size / intermediate_size", inter), ("num_hidden_layers", layers)):
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{where}: {name} is missing or not a positive integer ({value!r})")
        dense = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step") or 1
        first_dense = cfg.get("first_k_dense_replace") or 0
        freq = cfg.get("moe_layer_freq") or 1
        moe = tuple(L for L in range(layers)
                    if L not in dense and (L + 1) % step == 0 and L >= first_dense and (L - first_dense) % freq == 0)
        return cls(experts, top_k, hidden, inter, layers, moe, cfg)


class Checkpoint:
    """Tensor lookup over a checkpoint folder (model.safetensors.index.json, or every
    *.safetensors file in it)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a folder")
        cfg_path = os.path.join(self.path, "config.json")
        try:
            with open(cfg_path) as f:
                self.config = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        self.arch = MoEArchitecture.from_config(self.config, cfg_path)
        self._files = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                try:
                    self._where = dict(json.load(f)["weight_map"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index}: malformed index ({e})") from None
        else:
            self._where = {}
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{self.path}: no .safetensors files")
            for name in names:
                for key in self._file(name).keys():
                    self._where[key] = name

    def _file(self, name):
        if name not in self._files:
            full = os.path.join(self.path, name)
            if not os.path.exists(full):
                raise CheckpointError(f"{self.path}: shard {name} named by the index is missing")
            self._files[name] = SafetensorsFile(full)
        return self._files[name]

    def __contains__(self, tensor):
        return tensor in self._where

    def get(self, tensor):
        if tensor not in self._where:
            raise CheckpointError(f"{self.path}: tensor {tensor} is missing")
        f = self._file(self._where[tensor])
        if tensor not in f:
            raise CheckpointError(f"{f.path}: tensor {tensor} is listed in the index but not in the file")
        return f.get(tensor)

    def tensor_names(self):
        return self._where.keys()

    def layer(self, L):
        """The routed experts of decoder layer L."""
        if L not in self.arch.moe_layers:
            raise CheckpointError(f"{self.path}: layer {L} is not an MoE layer (MoE layers: "
                                  f"{list(self.arch.moe_layers)[:8]}{'...' if len(self.arch.moe_layers) > 8 else ''})")
        return LayerExperts(self, L)


class LayerExperts:
    """One layer's experts, read one at a time: expert(e) -> {proj: (weight [N, K], scale | None)}."""

    def __init__(self, ckpt, L):
        self.ckpt, self.layer = ckpt, L
        a = ckpt.arch
        self.num_experts, self.hidden, self.inter = a.num_experts, a.hidden_size, a.intermediate_size
        self.scheme = self._detect()
        w, _ = self._raw("gate", 0)
        self.dtype = w.dtype
        self.scale_kind = None
        if w.dtype.name == "float8_e4m3fn":
            _, scale_name = self._raw("gate", 0, want_scale_name=True)
            self.scale_kind = fp8_scale_kind(scale_name, self.ckpt.get(scale_name).shape, w.shape)
        elif w.dtype.name not in ("bfloat16", "float16", "float32"):
            raise CheckpointError(f"layer {L}: expert weights are {w.dtype}; expected BF16, F16, F32 or F8_E4M3")

    @property
    def native_format(self):
        """The format that keeps the checkpoint's own precision (F16/F32 have none: BF16)."""
        return self.scale_kind or "BF16"

    def _detect(self):
        """(scheme, name pattern, projection names); also sets mlp_prefix and block_name."""
        L = self.layer
        for p in PREFIXES:
            base = f"{p}model.layers.{L}"
            if f"{base}.mlp.experts.0.gate_proj.weight" in self.ckpt:
                self.mlp_prefix = f"{base}.mlp"
                scheme = ("per_expert", f"{base}.mlp.experts.{{e}}.{{proj}}_proj.weight", {"gate": "gate", "up": "up", "down": "down"})
            elif f"{base}.block_sparse_moe.experts.0.w1.weight" in self.ckpt:
                self.mlp_prefix = f"{base}.block_sparse_moe"
                scheme = ("per_expert", f"{base}.block_sparse_moe.experts.{{e}}.{{proj}}.weight", {"gate": "w1", "up": "w3", "down": "w2"})
            else:
                suffix = next((s for s in ("", ".weight") if f"{base}.mlp.experts.gate_up_proj{s}" in self.ckpt), None)
                if suffix is None:
                    continue
                self.mlp_prefix = f"{base}.mlp"
                scheme = ("fused", f"{base}.mlp.experts.{{proj}}{suffix}", {"gate_up": "gate_up_proj", "down": "down_proj"})
            self.block_name = f"{self.mlp_prefix}.experts"
            return scheme
        raise CheckpointError(f"{self.ckpt.path}: no routed-expert tensors found for layer {L} (looked for "
                              f"model.layers.{L}.mlp.experts.0.gate_proj.weight, ...block_sparse_moe.experts.0.w1.weight "
                              f"and ...mlp.experts.gate_up_proj, with prefixes {PREFIXES[1:]})")

    def _raw(self, proj, e, want_scale_name=False):
        kind, pattern, names = self.scheme
        E, H, I = self.num_experts, self.hidden, self.inter
        if kind == "fused":
            name = pattern.format(proj="gate_up_proj" if proj != "down" else "down_proj")
            t = self.ckpt.get(name)
            expect = (E, 2 * I, H) if proj != "down" else (E, H, I)
            if t.shape != expect:
                raise CheckpointError(f"{name}: shape {t.shape}, config.json implies {expect}")
            if t.dtype.name == "float8_e4m3fn":
                raise CheckpointError(f"{name}: FP8 fused experts are not supported")
            w = t[e] if proj == "down" else (t[e, :I] if proj == "gate" else t[e, I:])
            return (w, name) if want_scale_name else (w, None)
        name = pattern.format(e=e, proj=names[proj])
        w = self.ckpt.get(name)
        expect = (I, H) if proj != "down" else (H, I)
        if w.shape != expect:
            raise CheckpointError(f"{name}: shape {w.shape}, config.json implies {expect}")
        if w.dtype.name != "float8_e4m3fn":
            return (w, None)
        for scale_name in (name + "_scale_inv", name + "_scale"):
            if scale_name in self.ckpt:
                return (w, scale_name) if want_scale_name else (w, self.ckpt.get(scale_name))
        raise CheckpointError(f"{name}: FP8 weight without {name}_scale_inv or {name}_scale")

    def expert(self, e):
        """{"gate"|"up"|"down": (weight [N, K] view, scale view or None)} of expert e."""
        if not 0 <= e < self.num_experts:
            raise IndexError(f"expert {e} outside [0, {self.num_experts})")
        out = {}
        for proj in ("gate", "up", "down"):
            w, s = self._raw(proj, e)
            if w.dtype != self.dtype:
                raise CheckpointError(f"layer {self.layer} expert {e} {proj}: dtype {w.dtype} differs from {self.dtype}")
            if s is not None:
                kind = fp8_scale_kind(self._raw(proj, e, want_scale_name=True)[1], s.shape, w.shape)
                if kind != self.scale_kind:
                    raise CheckpointError(f"layer {self.layer} expert {e} {proj}: {kind} scales, the layer uses {self.scale_kind}")
            out[proj] = (w, s)
        return out

    def dense_mlp(self, name, hidden, inter):
        """A dense SwiGLU MLP stored as {name}.{gate,up,down}_proj.weight (shared experts), in the
        layout of expert(): {proj: (weight, scale | None)}."""
        out = {}
        for proj in ("gate", "up", "down"):
            tensor = f"{name}.{proj}_proj.weight"
            w = self.ckpt.get(tensor)
            expect = (inter, hidden) if proj != "down" else (hidden, inter)
            if w.shape != expect:
                raise CheckpointError(f"{tensor}: shape {w.shape}, config.json implies {expect}")
            scale = None
            if w.dtype.name == "float8_e4m3fn":
                for suffix in ("_scale_inv", "_scale"):
                    if tensor + suffix in self.ckpt:
                        scale = self.ckpt.get(tensor + suffix)
                        break
                else:
                    raise CheckpointError(f"{tensor}: FP8 weight without {tensor}_scale_inv or {tensor}_scale")
            out[proj] = (w, scale)
        return out

    def dequantized(self, e):
        """Expert e as float32 arrays (FP8 codes times their scales, on the CPU)."""
        return {proj: dequantize(w, s) for proj, (w, s) in self.expert(e).items()}


def dequantize(w, scale):
    """float32 weights from BF16/F16/F32, or from E4M3 codes with per-channel ([N] / [N, 1]) or
    128x128 block scales (multiplied, as DeepSeek-V3's weight_scale_inv)."""
    f = np.asarray(w, dtype=np.float32)
    if scale is None:
        return f
    s = np.asarray(scale, np.float32)
    n, k = f.shape
    if s.size == n:
        return f * s.reshape(-1, 1)
    return f * expand_block_scale(s, n, k)
