"""Hugging Face MoE checkpoints: config.json, single-file or sharded safetensors, and the usual
names of routed-expert tensors (per-expert Qwen/DeepSeek/OLMoE/Kimi, Mixtral w1/w3/w2, fused
gate_up_proj, GPT-OSS's interleaved gate_up_proj), in BF16, F16, F32 or F8_E4M3 with per-channel
or block scales, or as released already quantized (ktcy.quant_readers: compressed-tensors INT4,
GPTQ, AWQ, GPT-OSS MXFP4)."""
import numbers
import os
import re
from dataclasses import dataclass

import numpy as np

from ktcy.formats import fp8_scale_kind, keeps_codes
from ktcy.kernels import expand_block_scale
from ktcy.paths import (MAX_CONFIG_BYTES, MAX_INDEX_BYTES, allowed_roots, confined_file, read_json,
                        require_folder, resolve_model_path)
from ktcy.quant_readers import READERS, QuantScheme, mxfp4_released, read_mxfp4_stack, scheme_from_config
from ktcy.safetensors_io import CheckpointError, SafetensorsFile

# Where a checkpoint's decoder layers sit: causal LMs, LLaVA-style wrappers, and transformers'
# multimodal models (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V)
LAYER_ROOTS = ("model.layers", "language_model.model.layers", "model.language_model.layers")
# No released model comes near this; it bounds the layer loop for a config read on its own.
MAX_LAYERS = 100_000
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")
_EXPERT_INDEX = re.compile(r"^(.*\.experts)\.(\d{1,9})\.")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def layer_number(L, what="layer"):
    """L as a Python int (numpy integers welcome); TypeError for anything else."""
    if isinstance(L, bool) or not isinstance(L, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {type(L).__name__}")
    return int(L)


def _first(cfg, *names):
    """(key, value) of the first of names that cfg sets (value not None), else (names[0], None)."""
    for n in names:
        if cfg.get(n) is not None:
            return n, cfg[n]
    return names[0], None


def config_int(cfg, where, *names, minimum=1, default=None, maximum=None):
    """An integer setting (the first of its spellings that is set) checked for type and range;
    CheckpointError naming the file and the key otherwise."""
    key, value = _first(cfg, *names)
    if value is None:
        if default is not None:
            return default
        raise CheckpointError(f"{where}: {' / '.join(names)} is missing")
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise CheckpointError(f"{where}: {key} must be {bound}, got {value!r:.60}")
    return value


def config_number(cfg, where, key, default, positive=True):
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) \
            or (positive and value <= 0):
        raise CheckpointError(f"{where}: {key} must be a finite {'positive ' if positive else ''}number, got {value!r:.60}")
    return float(value)


def config_bool(cfg, where, key, default=False):
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {value!r:.60}")
    return value


# first_k_dense_replace where config.json leaves it out: transformers' config class default
# (DeepseekV3Config: 3, also for Kimi-K2, which ktcy.hf runs through it; Glm4MoeConfig and
# GLM-4.5V's Glm4vMoeTextConfig: 1), so that ktcy and transformers see the same layers as MoE
_FIRST_DENSE_DEFAULT = {"deepseek_v3": 3, "kimi_k2": 3, "glm4_moe": 1, "glm4v_moe": 1, "glm4v_moe_text": 1}


# The spellings of the routed-expert count in config.json (ERNIE 4.5: moe_num_experts)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# The config.json keys that say which layers are MoE layers, and the ones each family's
# transformers model reads (a model_type not listed: all of them).  Qwen3.5-MoE, Mixtral,
# MiniMax-M2, OLMoE and GPT-OSS make every layer an MoE layer.
_ERNIE_LAYER_KEYS = ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
_LAYER_KEYS = ("mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq",
               "mlp_layer_types") + _ERNIE_LAYER_KEYS
_QWEN_LAYER_KEYS = ("mlp_only_layers", "decoder_sparse_step")
_LAYER_KEYS_READ = {
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_vl_moe_text"), _QWEN_LAYER_KEYS),
    **dict.fromkeys(("deepseek_v3", "kimi_k2", "deepseek_v2", "glm4_moe", "glm4v_moe", "glm4v_moe_text", "dots1"),
                    ("first_k_dense_replace",)),
    "glm4_moe_lite": ("mlp_layer_types",),
    "ernie4_5_moe": _ERNIE_LAYER_KEYS,
    **dict.fromkeys(("qwen3_5_moe", "qwen3_5_moe_text", "mixtral", "minimax_m2", "olmoe", "gpt_oss"), ()),
}


def _moe_layers(cfg, where, layers):
    """The MoE layers as the family's transformers model makes them, from the keys it reads.  A
    key it does not read is refused where it would say otherwise (a layer the family's rule
    makes MoE that the key would leave dense, or for mlp_layer_types any difference): which of
    the two the model's authors meant, ktcy cannot tell."""
    model_type = str(cfg.get("model_type", "")).lower()
    reads = _LAYER_KEYS_READ.get(model_type, _LAYER_KEYS)
    every = frozenset(range(layers))
    allows = {}  # key -> the layers it lets be MoE, for each key that is set (or read, with a default)
    dense = cfg.get("mlp_only_layers")
    if dense is not None:
        if not isinstance(dense, list) or not all(_is_int(L) and 0 <= L < layers for L in dense):
            raise CheckpointError(f"{where}: mlp_only_layers must be a list of layer numbers in [0, {layers}), "
                                  f"got {dense!r:.60}")
        allows["mlp_only_layers"] = every - set(dense)
    if cfg.get("decoder_sparse_step") is not None:
        step = config_int(cfg, where, "decoder_sparse_step")
        allows["decoder_sparse_step"] = frozenset(L for L in every if (L + 1) % step == 0)
    first_dense = config_int(cfg, where, "first_k_dense_replace", minimum=0,
                             default=_FIRST_DENSE_DEFAULT.get(model_type, 0))
    if cfg.get("first_k_dense_replace") is not None or "first_k_dense_replace" in reads:
        allows["first_k_dense_replace"] = frozenset(L for L in every if L >= first_dense)
    if cfg.get("moe_layer_freq") is not None:  # counted from layer 0, as DeepSeek's own code counts it
        freq = config_int(cfg, where, "moe_layer_freq")
        allows["moe_layer_freq"] = frozenset(L for L in every if L < first_dense or L % freq == 0)
    kinds = cfg.get("mlp_layer_types")
    if kinds is None and model_type == "glm4_moe_lite":
        kinds = ["dense"] + ["sparse"] * (layers - 1)  # Glm4MoeLiteConfig's default
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or not all(k in ("dense", "sparse") for k in kinds):
            raise CheckpointError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                                  f"{layers} layers, got {kinds!r:.60}")
        allows["mlp_layer_types"] = frozenset(L for L, k in enumerate(kinds) if k == "sparse")
    # ERNIE 4.5: every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index
    # (-1: the last), with Ernie4_5_MoeConfig's defaults 1, -1, 1 where it is the family
    ernie = model_type == "ernie4_5_moe"
    if ernie or any(cfg.get(key) is not None for key in _ERNIE_LAYER_KEYS):
        start = config_int(cfg, where, "moe_layer_start_index", minimum=0, default=1 if ernie else 0)
        end = cfg.get("moe_layer_end_index")
        end = layers - 1 if end is None or end == -1 else config_int(cfg, where, "moe_layer_end_index", minimum=0)
        interval = config_int(cfg, where, "moe_layer_interval", default=1)
        span = frozenset(L for L in every if start <= L <= end and (L + 1) % interval == 0)
        allows.update(dict.fromkeys((k for k in _ERNIE_LAYER_KEYS if ernie or cfg.get(k) is not None), span))
    moe = every
    for key in reads:
        moe = moe & allows.get(key, every)
    for key, allowed in allows.items():
        if key not in reads and (allowed != moe if key == "mlp_layer_types" else not moe <= allowed):
            raise CheckpointError(f"{where}: {key} {cfg[key]!r:.60} would make other layers MoE layers than "
                                  f"{model_type}'s own rule ({', '.join(reads) or 'every layer'}), which is what "
                                  "transformers follows; ktcy does not guess which is meant")
    return tuple(sorted(moe))


def released_tensor(ckpt, q, name):
    """Whether `name` is a weight stored in the checkpoint's integer scheme q: its weight suffix
    (qweight, weight_packed) or, for compressed-tensors int-quantized, int8 codes under the plain
    "weight" name (modules the scheme leaves out keep float weights there)."""
    if q is None or not q.weight_suffix or not name.endswith("." + q.weight_suffix) or name not in ckpt:
        return False
    return q.weight_suffix != "weight" or ckpt.get(name).dtype.name == "int8"


@dataclass(frozen=True)
class MoEArchitecture:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    moe_layers: tuple
    raw: dict
    source: str = "config.json"

    @classmethod
    def from_config(cls, cfg, where="config.json", stored_layers=None):
        """The MoE shape of a config.json (already parsed), every value the readers use checked.
        stored_layers (the layer count the checkpoint's tensors show) bounds num_hidden_layers
        before anything loops over layers."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        if isinstance(cfg.get("text_config"), dict) and cfg.get("hidden_size") is None:
            cfg = cfg["text_config"]  # multimodal wrappers nest the language model's config
        experts = config_int(cfg, where, *EXPERT_COUNT_KEYS)
        top_k = config_int(cfg, where, "num_experts_per_tok", "experts_per_token", "moe_k", maximum=experts)
        hidden = config_int(cfg, where, "hidden_size")
        inter = config_int(cfg, where, "moe_intermediate_size", "intermediate_size")
        layers = config_int(cfg, where, "num_hidden_layers", maximum=MAX_LAYERS)
        if stored_layers is not None and layers > stored_layers:
            raise CheckpointError(f"{where}: num_hidden_layers is {layers}, but the checkpoint's tensors cover "
                                  f"{stored_layers} layers")
        moe = _moe_layers(cfg, where, layers)
        return cls(experts, top_k, hidden, inter, layers, moe, cfg, where)

    @property
    def gpt_oss(self):
        return str(self.raw.get("model_type", "")).lower() == "gpt_oss"

    @property
    def fused_either_way(self):
        """Fused expert stacks that may be stored [in, out] (gate_up_proj [E, H, 2I] with gate
        first, down_proj [E, I, H]): Qwen3-VL-MoE's releases, which transformers transposes on
        loading, and keeps [out, in] when it saves them again."""
        return str(self.raw.get("model_type", "")).lower() in ("qwen3_vl_moe", "qwen3_vl_moe_text")

    def activation_settings(self):
        """MoeConfig's activation keywords: GPT-OSS's clamped SwiGLU (alpha and limit from
        config.json when set, else GPT-OSS's 1.702 and 7.0), SiLU for every other family: a
        hidden_act other than silu (or its other name, swish) is refused, not run as SiLU."""
        if not self.gpt_oss:
            act = self.raw.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise CheckpointError(f"{self.source}: hidden_act {act!r:.40}: ktcy's experts are SiLU-gated "
                                      "(silu, swish), or GPT-OSS's clamped SwiGLU")
            return {"activation": "silu"}
        cfg, where = self.raw, self.source
        return {"activation": "gpt_oss", "swiglu_alpha": config_number(cfg, where, "swiglu_alpha", 1.702),
                "swiglu_limit": config_number(cfg, where, "swiglu_limit", 7.0)}

    def router_settings(self):
        """The router's config.json values, checked: norm_topk_prob, n_group, topk_group,
        routed_scaling_factor, ERNIE's moe_norm_min."""
        cfg, where = self.raw, self.source
        n_group = config_int(cfg, where, "n_group", default=1, maximum=self.num_experts)
        return {"norm_topk_prob": config_bool(cfg, where, "norm_topk_prob"), "n_group": n_group,
                "topk_group": config_int(cfg, where, "topk_group", default=1, maximum=n_group),
                "routed_scaling_factor": config_number(cfg, where, "routed_scaling_factor", 1.0),
                "norm_min": config_number(cfg, where, "moe_norm_min", 1e-12)}


class Checkpoint:
    """Tensor lookup over a checkpoint folder (model.safetensors.index.json, or every
    *.safetensors file in it).  path may start with `~`, or be a Hugging Face hub id found in the
    local cache.  Shard names are confined to the folder; without an index, a tensor stored in
    two files is refused."""

    def __init__(self, path):
        self.path = resolve_model_path(path)
        require_folder(self.path)
        self._roots = allowed_roots(self.path)
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.lexists(cfg_path):
            raise CheckpointError(f"{self.path}: no config.json")
        self.config = read_json(cfg_path, MAX_CONFIG_BYTES)
        self._files = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.lexists(index):
            self._where = self._read_index(index)
        else:
            self._where = self._scan_files()
        self.arch = MoEArchitecture.from_config(self.config, cfg_path, stored_layers=self._stored_layers())
        self.quant = scheme_from_config(self.config, cfg_path)
        legacy = os.path.join(self.path, "quantize_config.json")
        if self.quant is None and "quantization_config" not in self.config and os.path.lexists(legacy):
            # AutoGPTQ's own checkpoints describe their quantization only there
            q = read_json(legacy, MAX_CONFIG_BYTES)
            if isinstance(q, dict):
                q = dict(q, quant_method=q.get("quant_method", "gptq"))
            self.quant = scheme_from_config({"quantization_config": q}, legacy)
        self._experts_by_block = None

    def _read_index(self, index):
        doc = read_json(index, MAX_INDEX_BYTES)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (no weight_map object)")
        checked = set()
        for shard in weight_map.values():
            if not isinstance(shard, str) or shard not in checked:
                confined_file(self.path, shard, self._roots, index)  # refuses a shard name that is not a string
                checked.add(shard)
        return weight_map

    def _scan_files(self):
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise CheckpointError(f"{self.path}: no .safetensors files")
        where = {}
        for name in names:
            for key in self._file(name).keys():
                if key in where:
                    raise CheckpointError(f"{self.path}: tensor {key} is stored in both {where[key]} and {name}; "
                                          "without model.safetensors.index.json the copy to use is ambiguous")
                where[key] = name
        return where

    def _stored_layers(self):
        """1 + the largest decoder layer number among the tensor names (0 if none)."""
        top = -1
        for name in self._where:
            for m in _LAYER_INDEX.finditer(name):
                top = max(top, int(m.group(1)))
        return top + 1

    def stored_expert_indices(self, block):
        """The expert numbers stored as {block}.{e}.* (per-expert tensor names)."""
        if self._experts_by_block is None:
            found = {}
            for name in self._where:
                m = _EXPERT_INDEX.match(name)
                if m:
                    found.setdefault(m.group(1), set()).add(int(m.group(2)))
            self._experts_by_block = found
        return self._experts_by_block.get(block, set())

    def _file(self, name):
        if name not in self._files:
            full = confined_file(self.path, name, self._roots, self.path)
            if not os.path.lexists(full):
                raise CheckpointError(f"{self.path}: shard {name} named by the index is missing")
            self._files[name] = SafetensorsFile(full)
        return self._files[name]

    def __contains__(self, tensor):
        return tensor in self._where

    def release_pages(self):
        """SafetensorsFile.release_pages for every shard opened so far: called once a layer's
        tensors were packed or copied, so that going through a checkpoint keeps about one layer
        of it resident, not all of it."""
        for f in self._files.values():
            f.release_pages()

    def get(self, tensor):
        if tensor not in self._where:
            raise CheckpointError(f"{self.path}: tensor {tensor} is missing")
        f = self._file(self._where[tensor])
        if tensor not in f:
            raise CheckpointError(f"{f.path}: tensor {tensor} is listed in the index but not in the file")
        return f.get(tensor)

    def float_tensor(self, name, shape):
        """Tensor `name` as float32 of exactly `shape`, stored as a float type and finite
        (biases, router weights), else CheckpointError naming it."""
        t = self.get(name)
        if t.dtype.name not in ("bfloat16", "float16", "float32") or tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: {name} is {t.dtype} {tuple(t.shape)}; expected a float tensor of "
                                  f"shape {tuple(shape)}")
        a = np.ascontiguousarray(t, np.float32)
        if not np.isfinite(a).all():
            raise CheckpointError(f"{self.path}: {name} holds NaN or infinity")
        return a

    def tensor_names(self):
        return self._where.keys()

    def layer(self, L):
        """The routed experts of decoder layer L."""
        L = layer_number(L)
        if L not in self.arch.moe_layers:
            raise CheckpointError(f"{self.path}: layer {L} is not an MoE layer (MoE layers: "
                                  f"{list(self.arch.moe_layers)[:8]}{'...' if len(self.arch.moe_layers) > 8 else ''})")
        return LayerExperts(self, L)


def check_expert_index(e, num_experts):
    """IndexError unless e is an integer expert number in [0, num_experts)."""
    if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < num_experts:
        raise IndexError(f"expert {e!r} outside [0, {num_experts})")


class LayerExperts:
    """One layer's experts, read one at a time: expert(e) -> {proj: (weight [N, K], scale | None)},
    or for weights released quantized {proj: (codes [N, K], spec dict)} (see ktcy.quant_readers)."""

    def __init__(self, ckpt, L):
        self.ckpt, self.layer = ckpt, L
        a = ckpt.arch
        self.num_experts, self.hidden, self.inter = a.num_experts, a.hidden_size, a.intermediate_size
        self.quant = None
        self.scheme = self._detect()
        self._check_expert_count()
        self.scale_kind = None
        if self.quant is not None:
            # the stored container dtype (int32 words, uint8 blocks), for --input-type's check
            self.dtype = np.dtype(np.uint8 if self.quant.method == "mxfp4" else np.int32)
            self._released("gate", 0)  # every tensor of one projection checked before anything is packed
            return
        w, _ = self._raw("gate", 0)
        self.dtype = w.dtype
        if w.dtype.name == "float8_e4m3fn":
            _, scale_name = self._raw("gate", 0, want_scale_name=True)
            self.scale_kind = fp8_scale_kind(scale_name, self.ckpt.get(scale_name).shape, w.shape)
        elif w.dtype.name not in ("bfloat16", "float16", "float32"):
            raise CheckpointError(f"layer {L}: expert weights are {w.dtype}; expected BF16, F16, F32 or F8_E4M3")

    def _check_expert_count(self):
        """config.json's expert count must be what the layer stores: fewer would silently load a
        subset, more fails later on a missing tensor."""
        kind, pattern, names = self.scheme
        if kind != "per_expert":
            return  # fused tensors: their leading dimension is checked against the count in _raw
        stored = self.ckpt.stored_expert_indices(self.block_name)
        E, key = self.num_experts, _first(self.ckpt.arch.raw, *EXPERT_COUNT_KEYS)[0]
        where = self.ckpt.arch.source
        missing = next((e for e in range(E) if e not in stored), None)
        if missing is not None:
            raise CheckpointError(f"{where}: {key} is {E}, but layer {self.layer} stores {len(stored)} experts "
                                  f"({pattern.format(e=missing, proj=names['gate'])} is missing)")
        if len(stored) > E:
            extra = sorted(stored - set(range(E)))
            raise CheckpointError(f"{where}: {key} is {E}, but layer {self.layer} stores {len(stored)} experts "
                                  f"(also {self.block_name}.{extra[0]}); refusing to load a subset")

    @property
    def native_format(self):
        """The format that keeps the checkpoint's own precision (F16/F32 have none: BF16)."""
        if self.quant is not None:
            return self.quant.native_format
        return self.scale_kind or "BF16"

    @property
    def native_down_format(self):
        """The down projection's stored format: the layer's one (GGUF layers may differ)."""
        return self.native_format

    @property
    def kept_formats(self):
        """The formats that keep some of the layer's tensors as stored: its one native format."""
        return frozenset({self.native_format})

    @property
    def group_size(self):
        """The group size the released codes are kept in (None: no released integer codes, MXFP4,
        per-channel INT8)."""
        return self.quant.kept_group_size if self.quant is not None else None

    def kept_group(self, fmt, projections=None):
        """The group size of the tensors kept as stored in fmt (None when fmt keeps none, or has
        no groups); every projection of the layer has the same."""
        del projections
        return self.group_size if fmt in self.kept_formats else None

    def _detect(self):
        """(scheme, name pattern, projection names); also sets mlp_prefix, block_name and quant."""
        L, q = self.layer, self.ckpt.quant
        suffixes = ((q.weight_suffix,) if q is not None and q.weight_suffix else ()) + ("weight",)
        for root in LAYER_ROOTS:
            base = f"{root}.{L}"
            experts = f"{base}.mlp.experts"
            scheme = None
            for suffix in suffixes:
                if f"{experts}.0.gate_proj.{suffix}" in self.ckpt:
                    self.mlp_prefix = f"{base}.mlp"
                    scheme = ("per_expert", f"{experts}.{{e}}.{{proj}}_proj.{suffix}", {"gate": "gate", "up": "up", "down": "down"})
                elif f"{base}.block_sparse_moe.experts.0.w1.{suffix}" in self.ckpt:
                    self.mlp_prefix = f"{base}.block_sparse_moe"
                    scheme = ("per_expert", f"{base}.block_sparse_moe.experts.{{e}}.{{proj}}.{suffix}", {"gate": "w1", "up": "w3", "down": "w2"})
                if scheme is not None:  # experts left out of quantization read as floats
                    first = scheme[1].format(e=0, proj=scheme[2]["gate"])
                    self.quant = q if released_tensor(self.ckpt, q, first) else None
                    break
            if scheme is None and f"{experts}.gate_up_proj_blocks" in self.ckpt:
                self.mlp_prefix = f"{base}.mlp"
                self.quant = q if q is not None and q.method == "mxfp4" else QuantScheme("mxfp4", None)
                scheme = ("mxfp4_fused", f"{experts}.{{proj}}", {"gate_up": "gate_up_proj", "down": "down_proj"})
            if scheme is None:
                suffix = next((s for s in ("", ".weight") if f"{experts}.gate_up_proj{s}" in self.ckpt), None)
                if suffix is None:
                    continue
                self.mlp_prefix = f"{base}.mlp"
                # GPT-OSS stores [E, H, 2I] with gate and up interleaved, Qwen3-VL-MoE [E, H, 2I] with
                # gate first; the others [E, 2I, H], gate first
                arch = self.ckpt.arch
                kind = "gpt_oss_fused" if arch.gpt_oss else "fused"
                if arch.fused_either_way:  # down_proj's shape says which (a file holds one convention)
                    if self.hidden in (self.inter, 2 * self.inter):  # transformers decides per stack, by shape
                        raise CheckpointError(f"{experts}: hidden_size {self.hidden} with an expert width of "
                                              f"{self.inter}: whether the stacks are stored [in, out] is ambiguous")
                    down = self.ckpt.get(f"{experts}.down_proj{suffix}")
                    kind = "fused_in_out" if down.shape == (self.num_experts, self.inter, self.hidden) else "fused"
                scheme = (kind, f"{experts}.{{proj}}{suffix}", {"gate_up": "gate_up_proj", "down": "down_proj"})
            if self.quant is not None and self.quant.method == "mxfp4" and scheme[0] != "mxfp4_fused":
                self.quant = None  # quant_method mxfp4 with float experts: read them as floats
            self.block_name = f"{self.mlp_prefix}.experts"
            return scheme
        raise CheckpointError(f"{self.ckpt.path}: no routed-expert tensors found for layer {L} (looked for "
                              f"model.layers.{L}.mlp.experts.0.gate_proj.{suffixes[0]}, "
                              f"...block_sparse_moe.experts.0.w1.{suffixes[0]}, ...mlp.experts.gate_up_proj and "
                              f"...mlp.experts.gate_up_proj_blocks, also under {' and '.join(LAYER_ROOTS[1:])})")

    def _shape(self, proj):
        return (self.inter, self.hidden) if proj != "down" else (self.hidden, self.inter)

    def _released(self, proj, e):
        """Projection `proj` of expert e as stored, a quant_readers.Released."""
        kind, pattern, names = self.scheme
        n, k = self._shape(proj)
        if kind == "mxfp4_fused":
            stack = "down_proj" if proj == "down" else "gate_up_proj"
            blocks, scales = read_mxfp4_stack(self.ckpt, self.block_name, stack, self.num_experts,
                                              n if proj == "down" else 2 * n, k)
            rows = slice(None) if proj == "down" else slice(0 if proj == "gate" else 1, None, 2)  # interleaved
            return mxfp4_released(self.ckpt, f"{self.block_name}.{stack}", blocks[e][rows], scales[e][rows])
        name = pattern.format(e=e, proj=names[proj])
        base = name[: -len(self.quant.weight_suffix) - 1]
        return READERS[self.quant.method](self.ckpt, base, n, k, self.quant)

    def _raw(self, proj, e, want_scale_name=False):
        kind, pattern, names = self.scheme
        E, H, I = self.num_experts, self.hidden, self.inter
        if kind == "gpt_oss_fused":
            name = pattern.format(proj="gate_up_proj" if proj != "down" else "down_proj")
            t = self.ckpt.get(name)
            expect = (E, H, 2 * I) if proj != "down" else (E, I, H)
            if t.shape != expect:
                raise CheckpointError(f"{name}: shape {t.shape}, config.json implies {expect} (GPT-OSS stores [in, out])")
            if t.dtype.name not in ("bfloat16", "float16", "float32"):
                raise CheckpointError(f"{name}: {t.dtype} GPT-OSS experts; expected BF16, F16, F32 or the MXFP4 blocks")
            w = t[e].T if proj == "down" else t[e][:, (0 if proj == "gate" else 1)::2].T
            return (w, name) if want_scale_name else (w, None)
        if kind in ("fused", "fused_in_out"):
            name = pattern.format(proj="gate_up_proj" if proj != "down" else "down_proj")
            t = self.ckpt.get(name)
            expect = (E, 2 * I, H) if proj != "down" else (E, H, I)
            if kind == "fused_in_out":
                expect = (expect[0], expect[2], expect[1])
            if t.shape != expect:
                raise CheckpointError(f"{name}: shape {t.shape}, config.json implies {expect}"
                                      + (" (stored [in, out])" if kind == "fused_in_out" else ""))
            if t.dtype.name == "float8_e4m3fn":
                raise CheckpointError(f"{name}: FP8 fused experts are not supported")
            w = t[e] if kind == "fused" else t[e].T
            w = w if proj == "down" else (w[:I] if proj == "gate" else w[I:])
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
                if want_scale_name:
                    return (w, scale_name)
                scale = self.ckpt.get(scale_name)
                check_fp8_tensor(name, w, scale_name, scale)
                return (w, scale)
        raise CheckpointError(f"{name}: FP8 weight without {name}_scale_inv or {name}_scale")

    def expert(self, e):
        """{"gate"|"up"|"down": (weight [N, K] view, scale view or None)} of expert e; for weights
        released quantized (codes [N, K], spec), refused (CheckpointError) where the stored
        layout cannot be kept (then dequantized() / source(another format) still work)."""
        check_expert_index(e, self.num_experts)
        if self.quant is not None:
            out = {}
            for proj in ("gate", "up", "down"):
                r = self._released(proj, e)
                if r.problem:
                    raise CheckpointError(f"{self.ckpt.path}: layer {self.layer} expert {e} {proj}: {r.problem}; ktcy "
                                          f"cannot keep it as stored ({self.native_format}) - load or convert it with "
                                          f"a method (e.g. method='{self.native_format}', 'INT8' or 'BF16'), which "
                                          "dequantizes it exactly and quantizes it again")
                out[proj] = (r.codes, r.spec)
            return out
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

    def source(self, fmt, strict=True, down_fmt=None):
        """expert() as MoE.from_experts should see it for target format fmt: as stored when fmt
        keeps the stored precision (float, the same FP8 kind, the released format), else with
        the stored codes dequantized exactly first.  strict=False (a method the caller asked
        for): released codes that cannot keep their layout are dequantized instead of refused.
        down_fmt: the down projection's, always fmt here (one format per layer)."""
        if down_fmt not in (None, fmt):
            raise ValueError("a Hugging Face checkpoint's layer has one format for all its projections")
        if self.quant is not None and keeps_codes(self.native_format, fmt) and not strict:
            return self._kept_or_dequantized
        if keeps_codes(self.native_format, fmt) or (self.quant is None and self.scale_kind is None):
            return self.expert
        return lambda e: {proj: (w, None) for proj, w in self.dequantized(e).items()}

    def _kept_or_dequantized(self, e):
        check_expert_index(e, self.num_experts)
        out = {}
        for proj in ("gate", "up", "down"):
            r = self._released(proj, e)
            out[proj] = (r.dequantize(), None) if r.problem else (r.codes, r.spec)
        return out

    def bias(self):
        """GPT-OSS's expert biases {"gate": [E, I], "up": [E, I], "down": [E, H]} as float32,
        else None."""
        if self.scheme[0] not in ("mxfp4_fused", "gpt_oss_fused"):
            return None
        E, H, I = self.num_experts, self.hidden, self.inter
        out = {}
        for stack, shape in (("gate_up_proj", (E, 2 * I)), ("down_proj", (E, H))):
            b = self.ckpt.float_tensor(f"{self.block_name}.{stack}_bias", shape)
            if stack == "down_proj":
                out["down"] = b
            else:
                out["gate"], out["up"] = np.ascontiguousarray(b[:, 0::2]), np.ascontiguousarray(b[:, 1::2])
        return out

    def dense_mlp(self, name, hidden, inter):
        """A dense SwiGLU MLP stored as {name}.{gate,up,down}_proj.weight (shared experts), in the
        layout of expert(): {proj: (weight, scale | None)}, or (codes, spec) when released
        quantized like the routed experts; and the FP8 scale kind all three share (None when
        not FP8)."""
        out, kinds = {}, set()
        q = self.ckpt.quant
        for proj in ("gate", "up", "down"):
            tensor = f"{name}.{proj}_proj.weight"
            expect = (inter, hidden) if proj != "down" else (hidden, inter)
            if q is not None and q.weight_suffix and released_tensor(self.ckpt, q, f"{name}.{proj}_proj.{q.weight_suffix}"):
                r = READERS[q.method](self.ckpt, f"{name}.{proj}_proj", *expect, q)
                out[proj] = (r.dequantize(), None) if r.problem else (r.codes, r.spec)
                continue
            w = self.ckpt.get(tensor)
            if w.shape != expect:
                raise CheckpointError(f"{tensor}: shape {w.shape}, config.json implies {expect}")
            scale = None
            if w.dtype.name == "float8_e4m3fn":
                for suffix in ("_scale_inv", "_scale"):
                    if tensor + suffix in self.ckpt:
                        scale = self.ckpt.get(tensor + suffix)
                        kinds.add(check_fp8_tensor(tensor, w, tensor + suffix, scale))
                        break
                else:
                    raise CheckpointError(f"{tensor}: FP8 weight without {tensor}_scale_inv or {tensor}_scale")
            out[proj] = (w, scale)
        if len(kinds) > 1:
            raise CheckpointError(f"{name}: gate, up and down projections mix FP8 scale kinds ({', '.join(sorted(kinds))}); "
                                  "ktcy packs the three in one format")
        return out, next(iter(kinds), None)

    def dequantized(self, e):
        """Expert e as float32 arrays: FP8 codes times their scales, released INT4 / MXFP4 codes
        dequantized exactly (on the CPU)."""
        check_expert_index(e, self.num_experts)
        if self.quant is not None:
            return {proj: self._released(proj, e).dequantize() for proj in ("gate", "up", "down")}
        return {proj: dequantize(w, s) for proj, (w, s) in self.expert(e).items()}


def check_fp8_tensor(name, codes, scale_name, scale):
    """The scale kind (formats.fp8_scale_kind: the scale's name against its shape) of an FP8
    weight read from a checkpoint, after checking that it holds no NaN: a NaN or infinite scale,
    or an E4M3 NaN code (0x7F, 0xFF), makes every output of its channel NaN.  (The kernels
    themselves propagate NaN codes as IEEE does; a released model holding one is corrupt, so it
    is refused where it is read.)  CheckpointError naming the tensor otherwise."""
    try:
        kind = fp8_scale_kind(scale_name, scale.shape, codes.shape)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    s = np.asarray(scale, np.float32)
    if not np.isfinite(s).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(s))[0])
        raise CheckpointError(f"{scale_name}: scale at {where} is {s[where]}; FP8 scales must be finite")
    nan = (np.asarray(codes).view(np.uint8) & 0x7F) == 0x7F
    if nan.any():
        where = tuple(int(i) for i in np.argwhere(nan)[0])
        raise CheckpointError(f"{name}: the E4M3 code at {where} is NaN; a checkpoint's FP8 weights must be finite")
    return kind


def dequantize(w, scale):
    """float32 weights from BF16/F16/F32, or from E4M3 codes with per-channel ([N] / [N, 1]) or
    128x128 block scales (multiplied, as DeepSeek-V3's weight_scale_inv).  The convention is read
    from the scale's shape, never its size: a block grid can hold N values.  The two shapes agree
    only for a single row of at most 128 columns, where both conventions give the same product.
    Callers check the scale tensor's name against its shape first (formats.fp8_scale_kind)."""
    f = np.asarray(w, dtype=np.float32)
    if scale is None:
        return f
    s = np.asarray(scale, np.float32)
    n, k = f.shape
    if s.shape in ((n,), (n, 1)):
        return f * s.reshape(n, 1)
    grid = (-(-n // 128), -(-k // 128))
    if s.shape != grid:
        raise CheckpointError(f"FP8 scales of shape {s.shape} fit neither per-channel ({n},) / ({n}, 1) nor "
                              f"128x128 blocks {grid} of a {n}x{k} weight")
    return f * expand_block_scale(s, n, k)
