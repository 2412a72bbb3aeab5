"""ktcy.hf.from_pretrained: a transformers causal LM (an image-text model where transformers has no
causal LM for it) built on CPU with its routed experts on ktcy.

How the experts stay out of torch: the model is built from its config with the experts modules'
parameters on the meta device (no memory), each experts module is then replaced by a KtcyExperts
whose ktcy.MoE reads the checkpoint through ktcy's memory-mapped reader (or a converted folder),
and every other tensor is copied from the checkpoint into the model one at a time.  Peak memory
is the non-expert weights plus the packed experts."""
import contextlib
import logging
import os
import re
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
import transformers

from ktcy import gguf_blocks
from ktcy.checkpoint import Checkpoint, check_fp8_tensor, dequantize, released_tensor
from ktcy.quant_readers import READERS
from ktcy.config import checked_isa
from ktcy.formats import canonical_format
from ktcy.gguf_checkpoint import GGUFCheckpoint
from ktcy.hf import gguf_weights
from ktcy.hf.architectures import ROUTED_EXPERT_TENSOR, architecture, layer_of
from ktcy.hf.experts_module import KtcyExperts
from ktcy.log import warn_once
from ktcy.converted import ConvertedFolder
from ktcy.loading import PathLike, experts_from_checkpoint, original_checkpoint
from ktcy.model import RuleError, load_rules
from ktcy.paths import MAX_CONFIG_BYTES, read_json, require_folder, resolve_model_path
from ktcy.safetensors_io import CheckpointError

log = logging.getLogger("ktcy")

_PATCH_LOCK = threading.Lock()
_SCALE_SUFFIXES = ("_scale_inv", "_scale")
_INT_PART_SUFFIXES = ("_zero_point", "_g_idx")
# keywords of transformers' from_pretrained that cannot hold here: the model runs on the CPU, with
# transformers' own implementation of the architecture (whose experts module ktcy replaces)
_NOT_APPLICABLE = ("device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "state_dict",
                   "trust_remote_code", "use_kernels")
# config attributes ktcy's experts read from config.json (their shape, which layers are MoE, GPT-OSS's
# clamped SwiGLU): overriding one for the torch part alone would leave torch and ktcy disagreeing
_EXPERT_SETTINGS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                    "experts_per_token", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace",
                    "moe_layer_freq", "mlp_layer_types", "swiglu_alpha", "swiglu_limit", "hidden_act",
                    "moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")


def from_pretrained(path: PathLike, rules: Union[PathLike, List[Dict[str, Any]], None] = None,
                    backend: Optional[str] = None, experts_path: Optional[PathLike] = None,
                    gguf_path: Optional[PathLike] = None,
                    **hf_kwargs: Any) -> Any:  # a transformers model class with ktcy's methods added
    """A transformers causal LM (eval mode, CPU) whose MoE experts modules run on ktcy; for
    Qwen3-VL-MoE and GLM-4.5V, which have none, the image-text model with its vision tower.

    Parameters
      path: the original Hugging Face checkpoint folder (config.json + safetensors), `~/...`, or a
        hub id already in the local cache (nothing is downloaded).  A folder written by
        `ktcy convert` holds experts only and is refused here: pass it as experts_path.
      rules: optimize rules (YAML file, YAML text or list of dicts; ktcy.model.load_rules); the
        first rule whose match.name regex matches an experts module name (as in
        model.named_modules(), e.g. "model.layers.3.mlp.experts") or the checkpoint's name for
        the block (as MoEModel uses them: Mixtral's "model.layers.3.block_sparse_moe.experts")
        gives its backend.
      backend: format / KTransformers backend for modules no rule names (None keeps the
        checkpoint's precision: BF16 stays BF16, FP8 block checkpoints stay FP8).
      experts_path: a folder written by `ktcy convert` for this checkpoint, checked as MoEModel
        checks it: routed experts in its format are mapped from it, another format is packed
        from the checkpoint (one warning).
      gguf_path: every weight from this GGUF model instead (a .gguf file, any part of a split
        one, or a folder holding one), as KTransformers runs GGUF models: `path` then needs only
        config.json (and the tokenizer, for generating).  The routed experts stay as the file
        stores them where a ktcy format holds them (Q4_0 -> INT4, BF16), else need a backend;
        the rest is decoded exactly.  The architectures of ktcy.hf.gguf_weights.NAMES.
      hf_kwargs: `dtype` (or `torch_dtype`; default the config's dtype, else float32) for the
        torch part of the model, `attn_implementation`, `isa` (force ktcy's instruction set),
        `group` (a torch.distributed process group: the routed experts run expert-parallel,
        each rank holding its share, as in MoEModel.from_pretrained); anything else overrides
        config attributes as in transformers' from_pretrained, except those the experts read
        from config.json (expert counts and sizes, layer count and MoE layers, GPT-OSS's
        swiglu_alpha / swiglu_limit): those are refused (ValueError), as are device_map,
        quantization_config, the bitsandbytes switches, state_dict, trust_remote_code and
        use_kernels (hub kernels would replace the MoE blocks ktcy runs).

    Returns the model, with `inject_expert_backend(layer_regex, backend)` and
    `ktcy_experts()` (name -> KtcyExperts); its save_pretrained raises NotImplementedError (the
    state dict holds no routed experts).

    Raises UnsupportedArchitectureError (a ValueError) for a model_type ktcy.hf does not serve;
    CheckpointError for a missing, malformed or converted checkpoint; RuleError / ValueError for
    unusable rules or backends."""
    path = original_checkpoint(path, "from_pretrained", "attention, embeddings, routers")
    if backend is not None:
        canonical_format(backend)
    if "gguf_file" in hf_kwargs:  # transformers' spelling, which would parse the file for its own loader
        raise ValueError("from_pretrained: gguf_file= is transformers' keyword; ktcy.hf takes gguf_path= (the .gguf "
                         "file), with path the folder holding its config.json")
    for key in _NOT_APPLICABLE:
        if key in hf_kwargs:
            raise ValueError(f"from_pretrained: {key}= does not apply to ktcy.hf (the model runs on the CPU with "
                             "transformers' own implementation, its experts quantized by ktcy: use backend= or rules=)")
    for key in _EXPERT_SETTINGS:
        if key in hf_kwargs:
            raise ValueError(f"from_pretrained: {key}= cannot override config.json here: ktcy's experts read it from "
                             "the checkpoint's config.json, and the torch part must agree with them")
    parsed = load_rules(rules)
    require_folder(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.lexists(config_file):
        raise CheckpointError(f"{path}: no config.json")
    config_json = read_json(config_file, MAX_CONFIG_BYTES)
    arch = architecture(config_json, config_file)  # before any MoE-specific check
    # a transformers that predates the family is named as such, before its AutoConfig fails on the model_type
    experts_type, config_type = arch.experts_type(), arch.config_type() or transformers.AutoConfig
    if gguf_path is not None and arch.image_text:
        raise CheckpointError(f"{gguf_path}: {arch.model_type} is an image-text model, and a GGUF file holds only its "
                              "language model (llama.cpp keeps the vision tower in a separate mmproj file, which "
                              "ktcy.hf does not read); load it from its Hugging Face checkpoint")
    if gguf_path is None:
        ckpt = Checkpoint(path)
    else:
        ckpt = gguf_weights.open_gguf(resolve_model_path(gguf_path, "gguf_path"), config_json, config_file)
    # the same checks and format rule as MoEModel: the folder must come from this checkpoint
    converted = ConvertedFolder(experts_path, ckpt) if experts_path is not None else None
    if converted is not None:
        converted.require(ckpt.arch.moe_layers)
    isa = checked_isa(hf_kwargs.pop("isa", None))
    group = hf_kwargs.pop("group", None)
    dtype = _dtype(hf_kwargs)
    attn = hf_kwargs.pop("attn_implementation", None)
    hf_kwargs.setdefault("local_files_only", True)
    with _transformers_errors(config_file, "its configuration"), _quiet_type_mismatch(arch):
        config, unused = config_type.from_pretrained(path, return_unused_kwargs=True, **hf_kwargs)
    if unused:  # a misspelt keyword would otherwise be dropped without a word (stock raises too)
        raise TypeError(f"ktcy.hf.from_pretrained got keyword arguments it does not use: {', '.join(sorted(unused))}")
    if dtype is None:  # the config's, where the torch part can hold it (not float8 kinds)
        # an image-text release states it in its text config only (Qwen3-VL, GLM-4.5V)
        stated = config.dtype or config.get_text_config().dtype
        dtype = stated if stated in _DTYPES else torch.float32
    # the torch part holds dequantized weights (the experts, GPT-OSS's MXFP4 included, are ktcy's):
    # transformers must not quantize it again, nor fetch hub kernels for a quantization method
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    # every tensor of the torch part is then loaded from the checkpoint (_load_dense_weights
    # refuses a missing one): random initialisation first cost seconds per billion weights
    with _experts_on_meta(experts_type), _no_init_weights(), _transformers_errors(config_file, "the model"):
        extra = {"attn_implementation": attn} if attn is not None else {}
        model = arch.model_class().from_config(config, dtype=dtype, **extra)
    # transformers ties lm_head to the embeddings in init_weights, which no_init_weights skips
    # (ERNIE-4.5-21B-A3B ties them): without this lm_head stays an unloaded tensor of its own
    model.tie_weights()
    model.eval()
    # a GGUF file's dense tensors are checked (names, places, shapes, types) before any expert
    # is packed: a refusal after minutes of packing would waste them
    plan = _gguf_dense_plan(model, ckpt, arch) if gguf_path is not None else None
    state = _KtcyState(ckpt, arch, parsed, backend, converted, isa, group)
    replaced = [name for name, module in list(model.named_modules()) if isinstance(module, experts_type)]
    if len(replaced) != len(ckpt.arch.moe_layers):
        raise CheckpointError(f"{path}: the model has {len(replaced)} {arch.experts_class} modules, config.json "
                              f"describes {len(ckpt.arch.moe_layers)} MoE layers")
    state.warn_unmatched_rules(replaced)  # before minutes of packing
    for name in replaced:
        _replace(model, name, state.build(name))
        ckpt.release_pages()  # the checkpoint stays open for inject_expert_backend, not resident
    if gguf_path is None:
        _load_dense_weights(model, ckpt, arch, model.config)  # an image-text config: its language model's
    else:
        _load_gguf_dense_weights(model, ckpt, plan)
    ckpt.release_pages()
    _attach_generation_config(model, path)
    model._ktcy = state
    _warn_if_threads_spin()
    model.inject_expert_backend = types.MethodType(inject_expert_backend, model)
    model.ktcy_experts = types.MethodType(ktcy_experts, model)
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    return model


@contextlib.contextmanager
def _transformers_errors(config_file, what):
    """transformers' own refusals of a config.json (a KeyError for an unknown rope type, ...) as
    one CheckpointError naming the file, instead of a traceback from deep inside it."""
    try:
        yield
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{config_file}: transformers could not make {what} from it "
                              f"({type(e).__name__}: {e})") from e


@contextlib.contextmanager
def _quiet_type_mismatch(arch):
    """transformers warns when a config class reads a config.json of another model_type; for an
    architecture run through another's config class (Kimi-K2 as DeepSeek-V3) that is the point."""
    if not arch.config_class:
        yield
        return
    logger = logging.getLogger("transformers.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _save_pretrained(model, *args, **kwargs):
    """The routed experts live in ktcy's packed buffers, not in the state dict: transformers'
    save_pretrained would write a checkpoint without them, which stock transformers loads with
    random experts.  Refused with the way to a file that has them."""
    raise NotImplementedError("save_pretrained of a ktcy.hf model would write no routed experts (they are ktcy's "
                              "packed buffers, not torch parameters); keep the original checkpoint, and use "
                              "`ktcy convert` to save the packed experts (load them back with experts_path=)")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float8 kinds have no storage


def _dtype(kwargs):
    given = kwargs.pop("dtype", None)
    legacy = kwargs.pop("torch_dtype", None)
    given = given if given is not None else legacy
    if given is None or given == "auto":
        return None
    dtype = getattr(torch, given, None) if isinstance(given, str) else given
    if dtype not in _DTYPES:
        raise ValueError("dtype must be torch.float32, torch.bfloat16, torch.float16 or torch.float64 (or their "
                         f"names: 'float32', ...), got {given!r}")
    return dtype


def _no_init_weights():
    """transformers' switch that skips the random initialisation of a model about to be loaded."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # where it lived before
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@contextlib.contextmanager
def _experts_on_meta(experts_type):
    """Builds experts modules with their parameters on the meta device: their weights come from
    ktcy, so torch never allocates them.  Only in the loading thread: the class is patched for
    the whole process while the model is built, and another thread building that class (a stock
    model from a config) must get real parameters."""
    original, loader = experts_type.__init__, threading.get_ident()

    def init(self, *args, **kwargs):
        if threading.get_ident() != loader:
            return original(self, *args, **kwargs)
        with torch.device("meta"):
            original(self, *args, **kwargs)

    with _PATCH_LOCK:
        experts_type.__init__ = init
        try:
            yield
        finally:
            experts_type.__init__ = original


def _replace(model, name, module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class _KtcyState:
    """What a model needs to build and rebuild its experts modules."""

    def __init__(self, ckpt, arch, rules, backend, converted, isa, group=None):
        self.checkpoint, self.arch, self.rules = ckpt, arch, rules
        self.default_backend, self.converted, self.isa, self.group = backend, converted, isa, group
        self._names = {}  # module name -> names(): a layer's block name is found once

    def names(self, name):
        """(module name, the block's name in the checkpoint): rules match either."""
        if name not in self._names:
            L = layer_of(name)
            if isinstance(self.checkpoint, GGUFCheckpoint):
                stored = gguf_blocks.block_name(self.checkpoint, L)
            else:
                stored = self.checkpoint.layer(L).block_name  # Mixtral's checkpoint says block_sparse_moe
            self._names[name] = (name, stored)
        return self._names[name]

    def warn_unmatched_rules(self, module_names):
        """A WARNING per rule whose match.name selects no experts module: a rule written for
        another layout (model.layers.N. where an image-text model's are
        model.language_model.layers.N.) would otherwise leave its layers in the default backend
        without a word."""
        naming = [r for r in self.rules if r.selects_experts and r.pattern is not None]
        names = [n for m in module_names for n in self.names(m)] if naming else []
        for rule in naming:
            if not any(rule.matches(n) for n in names):
                log.warning("rule %d: match.name %r matches no experts module (they are named like %r)",
                            rule.index, rule.pattern.pattern, module_names[0] if module_names else "")

    def build(self, name, forced_backend=None):
        L = layer_of(name)
        rule = next((r for r in self.rules if any(r.matches(n) for n in self.names(name))), None) if self.rules \
            else None
        backend = forced_backend or (rule.backend if rule is not None else None) or self.default_backend
        return KtcyExperts(name, L, self._experts(L, backend), backend, rule)

    def _experts(self, L, backend):
        """From the converted folder when it holds the format asked for; else packed from the
        checkpoint (converted weights are quantized already: packing them again would lose what
        the checkpoint still has)."""
        if self.converted is not None:
            held = self.converted.format(L)
            if self.converted.serves(L, backend):
                moe = self.converted.load(L, self.isa)
                if self.group is not None:  # each rank keeps only its experts
                    from ktcy.distributed import ExpertParallelMoE
                    moe = ExpertParallelMoE.from_moe(moe, self.group)
                return moe
            log.warning("layer %d: %s asked for, %s holds %s; packed from the checkpoint %s instead", L,
                        canonical_format(backend), self.converted.path, held, self.checkpoint.path)
        if self.group is not None:  # each rank reads and packs only its experts
            from ktcy.distributed import ExpertParallelMoE
            return ExpertParallelMoE.from_checkpoint(self.checkpoint, L, backend, group=self.group, isa=self.isa)
        return experts_from_checkpoint(self.checkpoint, L, backend, self.isa)


def inject_expert_backend(model, layer_regex, backend):
    """Re-packs the experts of every ktcy experts module whose name matches layer_regex (re.match,
    from the start, e.g. r"model\\.layers\\.[0-9]\\.") in `backend`, from the original checkpoint.
    Returns the names of the modules changed (empty when none matched)."""
    try:
        pattern = re.compile(layer_regex)
    except (re.error, TypeError) as e:
        raise RuleError(f"layer_regex {layer_regex!r} is not a valid regex ({e})") from None
    canonical_format(backend)
    changed = []
    for name, module in list(ktcy_experts(model).items()):
        if pattern.match(name):
            _replace(model, name, model._ktcy.build(name, backend))
            model._ktcy.checkpoint.release_pages()
            changed.append(name)
    log.info("%s -> %s for %d experts modules", layer_regex, backend, len(changed))
    return changed


def ktcy_experts(model):
    """{module name: KtcyExperts} of the model, in layer order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, KtcyExperts)}


def _to_torch(a):
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        a = a.view(np.int16)
        with warnings.catch_warnings():  # read-only mapped file: copy_ below only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a).view(torch.bfloat16)
    if a.dtype not in (np.float16, np.float32, np.float64):
        a = a.astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _stored_weight(ckpt, name):
    """Tensor `name` as stored, FP8 codes multiplied by their scales and compressed-tensors'
    int-quantized int8 codes dequantized exactly (torch runs them as floats)."""
    t = ckpt.get(name)
    if t.dtype.name == "int8":
        if not released_tensor(ckpt, ckpt.quant, name) or t.ndim != 2:
            raise CheckpointError(f"{ckpt.path}: {name} holds int8 values, but config.json's quantization_config "
                                  "does not say how to dequantize them (compressed-tensors int-quantized does)")
        q = ckpt.quant
        return READERS[q.method](ckpt, name[: -len(".weight")], *t.shape, q).dequantize()
    if t.dtype.name != "float8_e4m3fn":
        return t
    for suffix in _SCALE_SUFFIXES:
        if name + suffix in ckpt:
            scale = ckpt.get(name + suffix)
            check_fp8_tensor(name, t, name + suffix, scale)
            return dequantize(t, scale)
    raise CheckpointError(f"{ckpt.path}: {name} is FP8 without {name}_scale_inv or {name}_scale")


def _is_scale_of_stored_weight(ckpt, name):
    """A weight's scale (FP8, integer) or compressed-tensors' zero points / group index of it."""
    return any(name.endswith(s) and name[: -len(s)] in ckpt for s in _SCALE_SUFFIXES + _INT_PART_SUFFIXES)


def _beyond_layers(name, num_layers):
    """DeepSeek-V3's multi-token-prediction layers are stored after the decoder layers (GLM-4.5V's
    after its language model's); the model does not use them."""
    m = re.match(r"model\.(?:language_model\.)?layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_layers


def _load_dense_weights(model, ckpt, arch, config):
    """Copies every non-expert tensor of the checkpoint into the model, one tensor at a time."""
    targets = model.state_dict()
    loaded, unexpected, left_out = set(), [], 0
    for name in ckpt.tensor_names():
        if ROUTED_EXPERT_TENSOR.search(name) or _is_scale_of_stored_weight(ckpt, name) \
                or _beyond_layers(name, config.get_text_config().num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
            continue
        if arch.unused_prefixes and name.startswith(arch.unused_prefixes):
            left_out += 1
            continue
        target = arch.model_name(name)
        if target not in targets:
            unexpected.append(name)
            continue
        dest = targets[target]
        value = _stored_weight(ckpt, name)
        if tuple(value.shape) != tuple(dest.shape):
            raise CheckpointError(f"{ckpt.path}: {name} has shape {tuple(value.shape)}, the model expects "
                                  f"{tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(_to_torch(value))
        loaded.add(dest.data_ptr())
    missing = [n for n, t in targets.items() if t.data_ptr() not in loaded]
    if missing:
        raise CheckpointError(f"{ckpt.path}: {len(missing)} tensors the model needs are missing from the checkpoint "
                              f"(first: {', '.join(missing[:3])})")
    if left_out:
        log.info("%s: %d tensors under %s not loaded (parts transformers' causal LM does not have: a vision "
                 "tower, a multi-token-prediction head)", ckpt.path, left_out, " / ".join(arch.unused_prefixes))
    if unexpected:
        log.warning("%s: %d checkpoint tensors are not used by the model (first: %s)", ckpt.path, len(unexpected),
                    unexpected[0])


def _gguf_dense_plan(model, ckpt, arch):
    """[(GGUF name, model tensor)] for every non-expert tensor of a GGUF model, after checking
    that the file is the model config.json describes and that each tensor has one place in the
    model, of its shape, in a type ktcy decodes (nothing decoded yet).  A tensor the
    architecture's table names but the model has no place for is refused (llama.cpp applies it:
    leaving it out would run another model); an unknown one gets a warning, as unknown
    checkpoint tensors do."""
    config = model.config.get_text_config()
    diffs = gguf_weights.config_differences(ckpt, config)
    if diffs:
        raise CheckpointError(f"{ckpt.path}: not the model config.json describes ({'; '.join(diffs)})")
    targets = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan, placed, unexpected, left_out = [], {}, [], 0
    for name in ckpt.model.tensor_names():
        if gguf_weights.beyond_layers(name, config.num_hidden_layers):
            left_out += 1
            continue
        if gguf_weights.is_expert_tensor(name) or gguf_weights.is_second_half(ckpt.architecture, name):
            continue  # ktcy's experts; read with the first half
        hf = gguf_weights.hf_name(ckpt.architecture, name)
        if hf is None:
            unexpected.append(name)
            continue
        target = arch.model_name(hf)
        if target not in targets:
            raise CheckpointError(f"{ckpt.path}: {name} ({hf}) has no place in the model transformers builds from "
                                  "config.json; llama.cpp applies it, so leaving it out would run another model")
        if tied and name == "output.weight":
            raise CheckpointError(f"{ckpt.path}: config.json ties lm_head to the embeddings, but the file stores its own "
                                  "output.weight: not the model config.json describes")
        dest = targets[target]
        if dest.data_ptr() in placed:
            raise CheckpointError(f"{ckpt.path}: {name} and {placed[dest.data_ptr()]} both hold {target}")
        placed[dest.data_ptr()] = name
        gguf_weights.parts(ckpt, name, config, tuple(dest.shape))
        plan.append((name, dest))
    missing = [n for n, t in targets.items() if not t.is_meta and t.data_ptr() not in placed]  # meta: ktcy's experts
    if missing:
        raise CheckpointError(f"{ckpt.path}: {len(missing)} tensors the model needs are missing from the GGUF model "
                              f"(first: {', '.join(missing[:3])})")
    if left_out:
        log.info("%s: %d tensors of blocks past the %d decoder layers not loaded (a multi-token-prediction layer)",
                 ckpt.path, left_out, config.num_hidden_layers)
    if unexpected:
        log.warning("%s: %d tensors are not used by the model (first: %s)", ckpt.path, len(unexpected), unexpected[0])
    return plan


def _load_gguf_dense_weights(model, ckpt, plan):
    """Copies the planned tensors into the model, decoded exactly: a block of rows at a time
    where the values are used as stored, whole where llama.cpp stored them transformed."""
    config = model.config.get_text_config()
    for name, dest in plan:
        with torch.no_grad():
            if gguf_weights.streamed(ckpt.architecture, name, config):
                cols = ckpt.model.entry(name).shape[-1]
                rows = dest.view(-1, cols)
                gguf_weights.decode_rows(ckpt, name, lambda start, v: rows[start:start + len(v)].copy_(torch.from_numpy(v)))
            else:
                dest.copy_(torch.from_numpy(gguf_weights.read(ckpt, name, config, tuple(dest.shape))))
        ckpt.release_pages()


def _warn_if_threads_spin():
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        warn_once("torch and ktcy each keep an OpenMP thread team, and with the default wait policy the idle team "
                  "spins on the cores the other one needs; set OMP_WAIT_POLICY=PASSIVE in the environment before "
                  "Python starts (decode ran 4x faster so on 2 shared cores, bench/bench_hf.py)")


def _attach_generation_config(model, path):
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            log.warning("%s: generation_config.json not used (%s)", path, e)
