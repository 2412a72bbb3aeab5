"""The routed experts of a GGUF model (llama.cpp's files), in the form ktcy.load_experts reads a
Hugging Face checkpoint: GGUFCheckpoint(path).arch and .layer(L).

Experts are stored as `blk.L.ffn_{gate,up,down}_exps.weight` (ggml dims [K, N, E]: numpy
[E, N, K]) or, in files from before llama.cpp merged them, one `blk.L.ffn_{gate,up,down}.e.weight`
per expert; GPT-OSS adds `blk.L.ffn_{gate,up,down}_exps.bias`.  The shape comes from the tensors
and must agree with the metadata (`{arch}.expert_count`, `.expert_used_count`,
`.embedding_length`, `.expert_feed_forward_length`).

Codes a ktcy format holds exactly are kept: Q4_0 (d * (q - 8) over 32 values) is INT4 with group
32, Q4_K (d * sc * q - dmin * m per 32 values) and Q4_1 (d * q + m) are INT4_MIN with group 32,
Q8_0 (d * q) and Q5_0 (d * (q - 16)) are INT8_GROUP with group 32, Q6_K (d * sc * (q - 32) per
16 values) INT8_GROUP with group 16, Q5_K (d * sc * q - dmin * m) and Q5_1 (d * q + m) INT8_MIN
with group 32, MXFP4 is MXFP4, BF16 is BF16 (F16 and F32 round to BF16, as from safetensors).  A
layer stored in these loads with method=None: one format takes the smallest group of its tensors
(Q8_0 beside Q6_K: 16), and down may have a format of its own (Q4_K_M: Q4_K gate and up as
INT4_MIN, Q6_K down as INT8_GROUP; Q5_K_M: Q5_K as INT8_MIN, Q6_K as INT8_GROUP).  Every other
ggml type (Q2_K, Q3_K, ...) has no ktcy twin, and neither have gate and up of two formats:
loading needs a method.
With a method, each tensor a kept type holds in that very format stays as stored (Q4_K_M's
gate and up with INT4_MIN); the others are dequantized exactly (ktcy.gguf_quants) and quantized.
Routers and shared experts (MoEModel) are read by ktcy.gguf_blocks."""
import os
import re

import numpy as np

from ktcy.checkpoint import MAX_LAYERS, MoEArchitecture, check_expert_index, layer_number
from ktcy.gguf_io import ArrayValue, GGUFModel
from ktcy.formats import keeps_codes
from ktcy.gguf_quants import dequantize, int8_group_parts, int8_min_parts, q4_01_parts, q4_k_parts, require_decodable
from ktcy.log import warn_once
from ktcy.safetensors_io import CheckpointError

# general.architecture -> the Hugging Face model_type whose experts it stores (the activation:
# SiLU-gated for all but GPT-OSS's clamped SwiGLU).  Other architectures are refused: their
# experts may compute something else (GELU, input-scaled routing).
ARCHITECTURES = {
    "llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next",
    "qwen3vlmoe": "qwen3_vl_moe", "deepseek2": "deepseek_v3", "olmoe": "olmoe", "glm4moe": "glm4_moe",
    "dots1": "dots1", "ernie4_5-moe": "ernie4_5_moe", "minimax-m2": "minimax_m2", "gpt-oss": "gpt_oss",
}
PROJECTIONS = ("gate", "up", "down")
KEPT = {"Q4_0": "INT4", "Q4_K": "INT4_MIN", "Q4_1": "INT4_MIN", "Q8_0": "INT8_GROUP", "Q5_0": "INT8_GROUP",
        "Q6_K": "INT8_GROUP", "Q5_K": "INT8_MIN", "Q5_1": "INT8_MIN", "MXFP4": "MXFP4", "BF16": "BF16", "F16": "BF16",
        "F32": "BF16"}
# the group each kept grouped type has (INT8_GROUP takes both: a layer mixing them uses 16, each
# group-32 scale twice, which is exact)
KEPT_GROUP = {"Q4_0": 32, "Q4_K": 32, "Q4_1": 32, "Q8_0": 32, "Q5_0": 32, "Q6_K": 16, "Q5_K": 32, "Q5_1": 32}
_LAYER = re.compile(r"blk\.(\d+)\.ffn_gate(?:_exps|_up_exps|\.\d+)\.weight")
# a layer's expert tensors: blk.L.ffn_<proj>_exps.<kind> or blk.L.ffn_<proj>.<e>.<kind>
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)(?:_exps|\.(\d+))\.(\w+)")


def is_gguf(path):
    """True for a .gguf file, or a folder holding .gguf files and no config.json."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path.endswith(".gguf")
    if not os.path.isdir(path) or os.path.lexists(os.path.join(path, "config.json")):
        return False
    return any(name.endswith(".gguf") for name in os.listdir(path))


def model_file(path):
    """The file to open for `path`: itself, or the one model in a folder (a single .gguf, or the
    first part of one split set)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path
    names = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    firsts = [n for n in names if not re.fullmatch(r".+-\d{5}-of-\d{5}\.gguf", n) or "-00001-of-" in n]
    if not firsts:
        raise CheckpointError(f"{path}: no GGUF model starts here (a .gguf file, or the -00001-of-N part of a split one)")
    if len(firsts) > 1:
        raise CheckpointError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(firsts[:4])}); pass one file")
    return os.path.join(path, firsts[0])


def _meta_int(meta, key, where, required=True):
    v = meta.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 31:
        raise CheckpointError(f"{where}: metadata {key} is {v!r:.40}, expected a positive integer")
    return v


def stored_form(type_name, raw, shape):
    """One [N, K] tensor as ktcy keeps it: Q4_0 as INT4 codes with their group-32 scales, Q4_K and
    Q4_1 as INT4_MIN codes with scales and mins (w = s * q + min), Q8_0 and Q5_0 (group 32) and
    Q6_K (group 16) as INT8_GROUP codes with their scales, Q5_K and Q5_1 as INT8_MIN codes 0..31
    with scales and mins (group 32), MXFP4 as its nibbles and
    exponents (each with the spec dict MoE.from_experts reads), any other type as the float32
    values llama.cpp decodes (spec None)."""
    n, k = shape
    if type_name == "Q4_K":
        codes, scale, mins = q4_k_parts(raw, n, k)
        return codes, {"format": "INT4_MIN", "scale": scale, "mins": mins, "group_size": 32}
    if type_name in ("Q4_0", "Q4_1"):
        nibbles, scale, mins = q4_01_parts(type_name, raw, n, k)
        if mins is not None:
            return nibbles, {"format": "INT4_MIN", "scale": scale, "mins": mins, "group_size": 32}
        return (nibbles.astype(np.int16) - 8).astype(np.int8), {"format": "INT4", "scale": scale, "group_size": 32}
    if KEPT.get(type_name) == "INT8_GROUP":
        codes, scale, group = int8_group_parts(type_name, raw, n, k)
        return codes, {"format": "INT8_GROUP", "scale": scale, "group_size": group}
    if KEPT.get(type_name) == "INT8_MIN":
        codes, scale, mins = int8_min_parts(type_name, raw, n, k)
        return codes, {"format": "INT8_MIN", "scale": scale, "mins": mins, "group_size": 32}
    if type_name != "MXFP4":
        return dequantize(type_name, raw, shape), None
    blocks = raw.reshape(n * k // 32, -1)
    nibbles = np.concatenate([blocks[:, -16:] & 0x0F, blocks[:, -16:] >> 4], axis=1).reshape(n, k)
    return nibbles, {"format": "MXFP4", "exponents": np.ascontiguousarray(blocks[:, 0]).reshape(n, k // 32)}


class GGUFCheckpoint:
    def __init__(self, path):
        self.model = GGUFModel(model_file(path))
        self.path = self.model.path
        meta, where = self.model.metadata, self.model.path
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise CheckpointError(f"{where}: general.architecture {arch!r:.40} is not an MoE architecture ktcy "
                                  f"reads from GGUF (known: {known})")
        clamps = meta.get(f"{arch}.swiglu_clamp_exp")
        if clamps is not None and not (isinstance(clamps, ArrayValue) and clamps.values is not None
                                       and not any(clamps.values)):  # per layer, 0 = no clamp
            raise CheckpointError(f"{where}: {arch}.swiglu_clamp_exp: clamped expert activations other than "
                                  "GPT-OSS's are not implemented")
        layers = sorted({int(m[1]) for m in map(_LAYER.fullmatch, self.model.tensor_names()) if m})
        if not layers:
            raise CheckpointError(f"{where}: no expert tensors (blk.N.ffn_gate_exps.weight); not an MoE model")
        blocks = _meta_int(meta, f"{arch}.block_count", where)
        if blocks > MAX_LAYERS or layers[-1] >= blocks:
            raise CheckpointError(f"{where}: {arch}.block_count is {blocks}, but the file stores experts of "
                                  f"layer {layers[-1]}")
        experts = _meta_int(meta, f"{arch}.expert_count", where)
        top_k = _meta_int(meta, f"{arch}.expert_used_count", where)
        if top_k > experts:
            raise CheckpointError(f"{where}: {arch}.expert_used_count {top_k} exceeds {arch}.expert_count {experts}")
        hidden = _meta_int(meta, f"{arch}.embedding_length", where)
        inter = _meta_int(meta, f"{arch}.expert_feed_forward_length", where, required=False)
        if inter is None:  # Mixtral's files state the expert width as the model's
            inter = _meta_int(meta, f"{arch}.feed_forward_length", where)
        # multi-token-prediction layers (GLM-4.5's last) are stored as decoder blocks, but their
        # config.json counterparts are not decoder layers (llama.cpp reads the key for these two)
        nextn = meta.get(f"{arch}.nextn_predict_layers", 0) if arch in ("glm4moe", "deepseek2") else 0
        if isinstance(nextn, bool) or not isinstance(nextn, int) or not 0 <= nextn < blocks:
            raise CheckpointError(f"{where}: {arch}.nextn_predict_layers is {nextn!r:.40}, expected an integer in "
                                  f"[0, {blocks})")
        layers = [L for L in layers if L < blocks - nextn]
        if not layers:
            raise CheckpointError(f"{where}: experts only in the {nextn} multi-token-prediction layers")
        self.architecture = arch
        self.config = {"model_type": ARCHITECTURES[arch], "architectures": [f"{arch} (GGUF)"]}
        self.arch = MoEArchitecture(experts, top_k, hidden, inter, blocks - nextn, tuple(layers),
                                    self.config, f"{where} (metadata)")

    def release_pages(self):
        self.model.release_pages()

    def layer(self, L):
        L = layer_number(L)
        if L not in self.arch.moe_layers:
            shown = list(self.arch.moe_layers)
            raise CheckpointError(f"{self.path}: layer {L} is not an MoE layer (MoE layers: {shown[:8]}"
                                  f"{'...' if len(shown) > 8 else ''})")
        return GGUFLayerExperts(self, L)


class GGUFLayerExperts:
    """One layer's experts; expert(e) -> {proj: (weight or codes [N, K], None | spec)} as
    LayerExperts gives them (ktcy.checkpoint)."""

    def __init__(self, ckpt, L):
        self.ckpt, self.layer = ckpt, L
        a = ckpt.arch
        self.num_experts, self.hidden, self.inter = a.num_experts, a.hidden_size, a.intermediate_size
        model = ckpt.model
        self.fused = f"blk.{L}.ffn_gate_exps.weight" in model
        self._check_companions()
        self.types = {}  # proj -> the set of its tensors' ggml types
        for proj in PROJECTIONS:
            n, k = (a.hidden_size, a.intermediate_size) if proj == "down" else (a.intermediate_size, a.hidden_size)
            names = [self._name(proj)] if self.fused else [self._name(proj, e) for e in range(self.num_experts)]
            want = (self.num_experts, n, k) if self.fused else (n, k)
            for name in names:
                if name not in model:
                    raise CheckpointError(f"{ckpt.path}: no tensor {name} (layer {L} stores "
                                          f"{'fused' if self.fused else 'per-expert'} experts)")
                t = model.entry(name)
                if t.shape != want:
                    raise CheckpointError(f"{ckpt.path}: {name} is {list(t.shape)} (outermost first); the metadata "
                                          f"implies {list(want)}")
                require_decodable(ckpt.path, name, t.type_name)
                self.types.setdefault(proj, set()).add(t.type_name)
        kept = {KEPT.get(t) for types in self.types.values() for t in types}
        gate_up = {KEPT.get(t) for p in ("gate", "up") for t in self.types[p]}
        down = {KEPT.get(t) for t in self.types["down"]}
        # kept as stored only when every tensor of the layer has a ktcy twin, gate and up the same
        # one; down may have another (Q4_K_M: INT4_MIN gate and up, INT8_GROUP down)
        whole = len(gate_up) == 1 and len(down) == 1 and None not in gate_up | down
        self.native_format = next(iter(gate_up)) if whole else None
        self.native_down_format = next(iter(down)) if whole else None
        # the formats some of its tensors are kept in, with a method naming one
        self.kept_formats = frozenset(f for f in kept if f is not None)

    def _check_companions(self):
        """The layer's expert tensors are weights only (and GPT-OSS's biases), stored one way:
        llama.cpp also applies per-expert scales or biases where a file has them, which ktcy
        would leave out; and per-expert tensors must number exactly expert_count (counted before
        any name is made from that count)."""
        L, where, E = self.layer, self.ckpt.path, self.num_experts
        gpt_oss = self.ckpt.arch.raw["model_type"] == "gpt_oss"
        numbered = {proj: set() for proj in PROJECTIONS}
        for name in self.ckpt.model.tensor_names():
            m = _EXPERT_TENSOR.fullmatch(name)
            if not m or int(m[1]) != L:
                continue
            proj, e, kind = m[2], m[3], m[4]
            if proj == "gate_up":
                raise CheckpointError(f"{where}: {name}: merged gate_up expert tensors are not read by ktcy")
            if (e is None) != self.fused:
                raise CheckpointError(f"{where}: layer {L} mixes fused (ffn_*_exps) and per-expert tensors ({name})")
            if kind != "weight" and not (kind == "bias" and gpt_oss and e is None):
                raise CheckpointError(f"{where}: {name}: ktcy's experts have no per-expert {kind} (llama.cpp applies it; "
                                      "leaving it out would give other numbers)")
            if e is not None:
                numbered[proj].add(int(e))
        for proj, ids in numbered.items():  # E may be huge: no range(E) is built
            if not self.fused and not (len(ids) == E and max(ids) == E - 1):
                beyond = sorted(e for e in ids if e >= E)
                missing = next(e for e in range(len(ids) + 1) if e not in ids)
                what = f"also expert {beyond[0]}" if beyond else f"expert {missing} is missing"
                raise CheckpointError(f"{where}: expert_count is {E}, but layer {L} stores {len(ids)} {proj} experts "
                                      f"({what})")

    dtype = None  # safetensors checkpoints' element type (convert's --input-type); GGUF has ggml types

    def _name(self, proj, e=None, kind="weight"):
        return f"blk.{self.layer}.ffn_{proj}_exps.{kind}" if e is None else f"blk.{self.layer}.ffn_{proj}.{e}.{kind}"

    @property
    def stored(self):
        """The ggml types, e.g. 'Q4_K' or 'Q4_K (gate, up), Q6_K (down)'."""
        kinds = {}
        for proj, types in self.types.items():
            for t in sorted(types):
                kinds.setdefault(t, []).append(proj)
        if len(kinds) == 1:
            return next(iter(kinds))
        return ", ".join(f"{t} ({', '.join(ps)})" for t, ps in kinds.items())

    def kept_group(self, fmt, projections=PROJECTIONS):
        """The smallest group of the tensors of `projections` kept as stored in fmt, or None."""
        groups = [KEPT_GROUP[t] for p in projections for t in self.types[p] if t in KEPT_GROUP and KEPT[t] == fmt]
        return min(groups) if groups else None

    def _requantized(self, fmt, down_fmt=None):
        """{ggml type: [projections]} of the tensors that loading as fmt (down as down_fmt, default
        fmt) dequantizes and quantizes again."""
        out = {}
        for proj, types in self.types.items():
            target = down_fmt or fmt if proj == "down" else fmt
            for t in sorted(types):
                if not keeps_codes(KEPT.get(t), target) and KEPT.get(t) != "BF16":
                    out.setdefault(t, []).append(proj)
        return out

    def needs_method(self):
        """The CheckpointError for method=None when no ktcy format holds the stored codes."""
        partly = ""
        for fmt in sorted(self.kept_formats - {"BF16"}):
            again = self._requantized(fmt)
            kept = sorted({p for p, ts in self.types.items() for t in ts if KEPT.get(t) == fmt})
            partly += (f"; method='{fmt}' keeps {', '.join(kept)} as stored and quantizes "
                       f"{', '.join(p for ps in again.values() for p in ps)} ({', '.join(again)}) again")
        return CheckpointError(f"{self.ckpt.path}: layer {self.layer} stores {self.stored}, which no ktcy format "
                               "holds as stored; pass a method (backend= in MoEModel and ktcy.hf): the values are "
                               "dequantized exactly and quantized again (on bench/gguf_requant.py's weight BF16 adds "
                               f"0.2% error, INT8 about 2%, INT4 about 8-9%){partly}")

    def _raw(self, proj, e):
        """(type name, bytes of expert e's [N, K] values, [N, K])."""
        model = self.ckpt.model
        if not self.fused:
            name = self._name(proj, e)
            t = model.entry(name)
            return t.type_name, model.raw(name), t.shape
        name = self._name(proj)
        t = model.entry(name)
        per = t.nbytes // self.num_experts
        return t.type_name, model.raw(name)[e * per:(e + 1) * per], t.shape[1:]

    def _values(self, proj, e):
        return dequantize(*self._raw(proj, e))

    def dequantized(self, e):
        """Expert e as float32 [N, K] arrays, the values llama.cpp decodes."""
        check_expert_index(e, self.num_experts)
        return {proj: self._values(proj, e) for proj in PROJECTIONS}

    def expert(self, e):
        """Expert e as stored, in the native format (BF16 sources as float32 values)."""
        if self.native_format is None:
            raise self.needs_method()
        return self._stored_or_values(e)

    def _stored_or_values(self, e):
        check_expert_index(e, self.num_experts)
        return {proj: stored_form(*self._raw(proj, e)) for proj in PROJECTIONS}

    def source(self, fmt, strict=True, down_fmt=None):
        """Expert e as ktcy keeps each tensor (stored_form: MoE.from_experts packs kept codes as
        stored when fmt, or down_fmt for the down projection, is theirs, else dequantizes them
        exactly), the others as the dequantized values; one warning when a mixed layer's tensors
        are quantized again."""
        del strict  # the GGUF codes ktcy keeps always fit its layout
        again = self._requantized(fmt, down_fmt)
        # a layer stored in one ktcy format loaded in another: the loader's warning says so
        one_format = self.native_format is not None and self.native_format == self.native_down_format
        if again and fmt != "BF16" and not one_format:
            kept = "" if not self.kept_formats & {fmt} else " (the rest stays as stored)"
            which = "; ".join(f"{t} ({', '.join(ps)})" for t, ps in again.items())
            warn_once(f"{self.ckpt.path}: the model stores {self.stored}; loading it as {fmt} dequantizes {which} "
                      f"and quantizes it again, which costs accuracy{kept}")
        return self._stored_or_values

    def bias(self):
        """GPT-OSS's expert biases {"gate": [E, I], "up": [E, I], "down": [E, H]} as float32, else None."""
        if self.ckpt.arch.raw["model_type"] != "gpt_oss":
            return None
        model, E = self.ckpt.model, self.num_experts
        out = {}
        for proj in PROJECTIONS:
            name = self._name(proj, kind="bias")
            width = self.hidden if proj == "down" else self.inter
            if name not in model:
                raise CheckpointError(f"{self.ckpt.path}: no tensor {name} (GPT-OSS's experts have biases)")
            t = model.entry(name)
            if t.shape != (E, width) or t.type_name not in ("F32", "F16", "BF16"):
                raise CheckpointError(f"{self.ckpt.path}: {name} is {t.type_name} {list(t.shape)}; expected a float "
                                      f"[{E}, {width}]")
            out[proj] = np.ascontiguousarray(dequantize(t.type_name, model.raw(name), t.shape))
        return out
