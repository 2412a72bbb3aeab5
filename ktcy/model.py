"""Whole MoE blocks of a checkpoint: router, routed experts and shared experts, with the seeds'
injection rules choosing each block's backend.

Contract (used from outside the repo): ``MoEModel.from_pretrained``, ``model.blocks``,
``model.inject_expert_backend``, ``block.route``, ``block.forward``.
"""
import logging
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from ktcy import gguf_blocks, torch_bridge
from ktcy.checkpoint import Checkpoint, config_int, layer_number
from ktcy.config import MoeConfig, QuantConfig, checked_isa
from ktcy.converted import ConvertedFolder
from ktcy.errors import naming
from ktcy.formats import DEFAULT_INT4_GROUP, canonical_format, group_sizes, has_groups
from ktcy.gguf_checkpoint import GGUFCheckpoint, is_gguf
from ktcy.gpt_oss import read_router
from ktcy.kernels import as_float32_matrix
from ktcy.loading import PathLike, experts_from_checkpoint, original_checkpoint, source_for
from ktcy.moe import MoE
from ktcy.paths import MAX_CONFIG_BYTES, read_small_text
from ktcy.ranges import ranges_text
from ktcy.routing import Router, kind_settings, router_kind
from ktcy.safetensors_io import CheckpointError

log = logging.getLogger("ktcy")


class RuleError(ValueError):
    """An injection rule that cannot be used (bad regex, unknown backend, wrong shape)."""


class Rule:
    """One optimize rule in the seeds' schema: match.name (a regex over block names, matched from
    the start as KTransformers does) -> replace.kwargs.backend.  As in KTransformers a rule with
    match.class matches only modules of that class too: ktcy's blocks are expert modules, so a
    class whose name says neither MoE nor experts (torch.nn.Linear, a rotary embedding) never
    matches one - KTransformers' own rule files put such rules, with names that would match
    `model.layers.N.mlp.experts`, before the experts rule.  The other replace keys (class,
    devices, ops) are kept for describe() and otherwise ignored: ktcy runs on the CPU."""

    def __init__(self, index, raw):
        if not isinstance(raw, dict):
            raise RuleError(f"rule {index}: expected a mapping with match/replace, got {type(raw).__name__}")
        self.index, self.raw = index, raw
        match = raw.get("match") or {}
        if not isinstance(match, dict):
            raise RuleError(f"rule {index}: 'match' must be a mapping")
        name = match.get("name")
        try:
            self.pattern = re.compile(name) if name is not None else None
        except (re.error, TypeError) as e:
            raise RuleError(f"rule {index}: match.name {name!r} is not a valid regex ({e})") from None
        cls = match.get("class")
        if cls is not None and not isinstance(cls, str):
            raise RuleError(f"rule {index}: match.class must be a class path string, got {cls!r:.80}")
        self.selects_experts = cls is None or re.search(r"moe|expert", cls.rsplit(".", 1)[-1], re.I) is not None
        replace = raw.get("replace") or {}
        if not isinstance(replace, dict):
            raise RuleError(f"rule {index}: 'replace' must be a mapping, got {type(replace).__name__}")
        kwargs = replace.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RuleError(f"rule {index}: 'replace.kwargs' must be a mapping, got {type(kwargs).__name__}")
        kwargs = dict(kwargs)
        self.backend = kwargs.pop("backend", None)
        if self.backend is not None:
            try:
                canonical_format(str(self.backend))
            except ValueError as e:
                raise RuleError(f"rule {index}: {e}") from None
        self.kept = dict(kwargs)
        if replace.get("class"):
            self.kept["class"] = replace["class"]

    def matches(self, block_name):
        # a rule without match.name selects modules by class only, which names no ktcy block
        return self.selects_experts and self.pattern is not None and self.pattern.match(block_name) is not None


def _layer_list(layers):
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be an iterable of layer numbers, got {type(layers).__name__}")
    return [layer_number(L, "each of layers") for L in layers]


def load_rules(rules):
    """Rules from a YAML file path, YAML text, or a list of dicts."""
    if rules is None:
        return []
    if isinstance(rules, (str, os.PathLike)):
        import yaml
        text = rules
        candidate = os.path.expanduser(os.fspath(rules))
        if "\n" not in candidate and "\0" not in candidate and os.path.lexists(candidate):
            text = read_small_text(candidate, MAX_CONFIG_BYTES)
        elif not isinstance(rules, str):
            raise RuleError(f"rules file {candidate} does not exist")
        try:
            rules = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RuleError(f"rules are not valid YAML: {e}") from None
        except RecursionError:  # nesting deeper than the parser's stack
            raise RuleError("rules are nested too deeply to be match/replace entries") from None
    if isinstance(rules, str) and "\n" not in rules.strip():
        # one line of YAML that is a bare word: a rules file name that is not there
        raise RuleError(f"rules file {rules.strip()!r} does not exist (or give the rules as a YAML list)")
    if not isinstance(rules, list):
        raise RuleError(f"rules must be a list of match/replace entries, got {type(rules).__name__}")
    return [Rule(i, r) for i, r in enumerate(rules)]


def _kept_group(pairs, fmt, projections=("gate", "up", "down")):
    """The group size that keeps a dense MLP's released codes of `projections` as stored where
    they are in fmt: the smallest of theirs (a larger one's scales split exactly), else that of
    the MLP's other projections in fmt, else the default (the packer dequantizes the rest), as
    routed experts take theirs (loading.layer_quant_configs)."""
    def kept(names):
        groups = [s["group_size"] for s in (pairs[p][1] for p in names)
                  if isinstance(s, dict) and s["format"] == fmt and has_groups(fmt) and s.get("group_size") in group_sizes(fmt)]
        return min(groups) if groups else None
    return kept(projections) or kept(("gate", "up", "down")) or DEFAULT_INT4_GROUP


class SharedExpert:
    """Dense SwiGLU shared expert(s), run as a one-expert MoE through the same kernels; Qwen2-MoE
    scales it per token by sigmoid(h . shared_expert_gate)."""

    def __init__(self, moe, gate=None):
        self.moe, self.gate = moe, None if gate is None else np.asarray(gate, np.float32).reshape(1, -1)

    def __call__(self, h):
        T = h.shape[0]
        w = np.ones((T, 1), np.float32) if self.gate is None else (1 / (1 + np.exp(-(h @ self.gate.T)))).astype(np.float32)
        return self.moe.forward(h, np.zeros((T, 1), np.int64), w)


class MoEBlock:
    """One MoE block: router -> routed experts (+ shared experts)."""

    def __init__(self, name, layer, router, experts, shared, rule, backend, experts_from=None):
        self.name, self.layer, self.router, self.experts, self.shared = name, layer, router, experts, shared
        #: where the routed experts were read: the checkpoint folder, or a converted layer file
        self.rule, self.backend, self.experts_from = rule, backend, experts_from

    def route(self, h: Any) -> Tuple[np.ndarray, np.ndarray]:
        """(topk_ids [T, k] int64, topk_weights [T, k] float32) from the router, in float32."""
        h = self._hidden(h)
        return self.router(h)

    def forward(self, h: Any) -> np.ndarray:
        """The block's output for hidden states h [T, H] (numpy or a torch tensor, float32, float64,
        float16 or bfloat16), routed experts plus shared experts, as float32 numpy: the block is
        the numpy API (ktcy.hf runs blocks inside torch models)."""
        h = self._hidden(h)
        ids, w = self.router(h)
        y = self.experts.forward(h, ids, w)
        if self.shared is not None:
            y += self.shared(h)
        return y

    __call__ = forward

    def __repr__(self):
        cfg = self.experts.config
        return (f"MoEBlock({self.name!r}, layer={self.layer}, experts={cfg.num_experts}, top_k={cfg.top_k}, "
                f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
                f"format={self.experts.format}"
                + (f", down_format={self.experts.down_format}" if self.experts.down_format != self.experts.format else "")
                + f", isa={self.experts.isa}, router={self.router.kind}, "
                f"shared_experts={self.shared is not None}, experts_from={self.experts_from!r})")

    def _hidden(self, h):
        if torch_bridge.is_tensor(h):
            h = torch_bridge.as_numpy(h, "hidden states")
        h = as_float32_matrix(h, "hidden states")
        if h.shape[1] != self.experts.config.hidden_size:
            raise ValueError(f"{self.name}: hidden states have {h.shape[1]} columns, hidden_size is "
                             f"{self.experts.config.hidden_size}")
        return h

    def describe(self) -> Dict[str, Any]:
        row = {"name": self.name, "layer": self.layer, "format": self.experts.format,
               "down_format": self.experts.down_format, "isa": self.experts.isa,
               "kernel": self.experts.kernel, "bytes": self.experts.nbytes, "router": self.router.kind,
               "shared_experts": self.shared is not None, "backend": self.backend,
               "rule": None if self.rule is None else self.rule.index, "experts_from": self.experts_from}
        if self.shared is not None:
            row["bytes"] += self.shared.moe.nbytes
        if self.rule is not None:
            row["rule_kwargs"] = self.rule.kept
        return row


class MoEModel:
    """Every MoE block of a Hugging Face checkpoint folder, by the names the checkpoint uses
    (model.layers.3.mlp.experts, Mixtral's model.layers.3.block_sparse_moe.experts, ...), or of a
    GGUF model (named as the model's Hugging Face checkpoint names them: ktcy.gguf_blocks)."""

    def __init__(self, ckpt, blocks, rules, default_backend, isa, converted=None, group=None):
        self.checkpoint, self.blocks, self.rules = ckpt, blocks, rules
        self.default_backend, self.isa, self.group = default_backend, isa, group
        #: the ConvertedFolder routed experts come from (None: everything from the checkpoint)
        self.converted = converted

    @classmethod
    def from_pretrained(cls, path: PathLike, rules: Union[PathLike, List[Dict[str, Any]], None] = None,
                        backend: Optional[str] = None, layers: Optional[Iterable[int]] = None,
                        isa: Optional[str] = None, experts_path: Optional[PathLike] = None,
                        group: Any = None) -> "MoEModel":
        """Every MoE block of a Hugging Face checkpoint or a GGUF model.

        Parameters
          path: checkpoint folder (config.json + safetensors), a GGUF model (a .gguf file, any
            part of a split one, or a folder holding one: routers and shared experts read as
            llama.cpp reads them, ktcy.gguf_blocks), `~/...`, or a hub id already in the local
            Hugging Face cache (nothing is downloaded).  A folder written by `ktcy convert`
            holds experts only and is refused.
          rules: optimize rules (YAML file path, YAML text or list of dicts, first match wins)
            choosing each block's backend by block name.
          backend: format/backend for blocks no rule names (None keeps the stored precision).
          layers: which MoE layers to build (default: all of them).
          isa: force one instruction set for every block (None: the best this CPU runs).
          experts_path: a folder written by `ktcy convert` from this checkpoint: routed experts
            are mapped from its layer files (routers and shared experts still come from `path`).
            It must hold every layer built (a missing one is refused with the list; pass layers=
            to build fewer) and fit the checkpoint (see ktcy.converted).  A block whose backend
            is None or the file's format uses the file (INT4 with the group size it was
            converted with); another format is packed from `path`, the source of truth (one
            log line), never from the already-quantized file.
          group: a torch.distributed process group (e.g. torch.distributed.group.WORLD, ranks
            started by torchrun or `ktcy launch`) to run the routed experts expert-parallel: each
            rank packs or maps only its share (ktcy.distributed.ExpertParallelMoE) and every rank
            gets the whole block output; routers and shared experts run on every rank.  Needs the
            hf extra.  None: one process.

        Returns a MoEModel whose .blocks maps block names to MoEBlock.

        Raises CheckpointError for a missing/malformed checkpoint, a layer that is not an MoE
        layer, or a converted folder that lacks a layer or does not fit the checkpoint (naming
        the folder, the layer and what differs); RuleError for unusable rules; ValueError for an
        unknown backend or ISA; UnsupportedISAError for an ISA this CPU cannot run; TypeError for
        a path or layers of the wrong type."""
        isa = checked_isa(isa)
        path = original_checkpoint(path, "MoEModel", "routers, shared experts")
        if backend is not None:
            canonical_format(backend)
        ckpt = GGUFCheckpoint(path) if is_gguf(path) else Checkpoint(path)
        if not isinstance(ckpt, GGUFCheckpoint):
            ckpt.arch.router_settings()  # refuses bad router values before any expert is packed
        ckpt.arch.activation_settings()
        parsed = load_rules(rules)
        chosen = list(ckpt.arch.moe_layers) if layers is None else _layer_list(layers)
        if isinstance(ckpt, GGUFCheckpoint):  # each layer's router metadata and tensors, likewise
            for L in chosen:
                if L in ckpt.arch.moe_layers:
                    gguf_blocks.router(ckpt, L)
                    gguf_blocks.shared_tensors(ckpt, L)
        converted = None
        if experts_path is not None:
            converted = ConvertedFolder(experts_path, ckpt)
            converted.require([L for L in chosen if L in ckpt.arch.moe_layers])  # others fail in _build, as without it
        model = cls(ckpt, {}, parsed, backend, isa, converted, group)
        repacked: List[tuple] = []
        for L in chosen:
            block = model._build(L, None, repacked)
            model.blocks[block.name] = block
            ckpt.release_pages()  # the checkpoint stays open for inject_expert_backend, not resident
        model._say_repacked(repacked, "the rules / backend ask")
        return model

    def __repr__(self):
        arch = self.checkpoint.arch
        names = self.checkpoint.config.get("architectures") if isinstance(self.checkpoint.config, dict) else None
        kind = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else "unknown"
        layers = [b.layer for b in self.blocks.values()]
        formats = sorted({f for b in self.blocks.values() for f in (b.experts.format, b.experts.down_format)})
        isas = sorted({b.experts.isa for b in self.blocks.values()})
        return (f"MoEModel(architecture={kind}, path={self.checkpoint.path!r}, blocks={len(layers)}, "
                f"layers={ranges_text(layers) or 'none'}, experts={arch.num_experts}, top_k={arch.top_k}, "
                f"hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size}, "
                f"formats={'/'.join(formats) or '-'}, isa={'/'.join(isas) or '-'}"
                + (f", experts_path={self.converted.path!r})" if self.converted is not None else ")"))

    def _rule_for(self, name):
        return next((r for r in self.rules if r.matches(name)), None)

    def _rule_and_backend(self, name, forced_backend):
        """The rule that names block `name` and the backend it gets: forced, the rule's, else the default."""
        rule = self._rule_for(name)
        return rule, forced_backend or (rule.backend if rule is not None and rule.backend else None) or self.default_backend

    def _shared_expert(self, pairs, fmt, width, backend, gate, down_fmt=None):
        """A SharedExpert of one dense MLP (pairs as MoE.from_experts takes expert 0) packed in fmt
        (its down projection in down_fmt, default fmt)."""
        H = self.checkpoint.arch.hidden_size
        if (down_fmt or fmt) == fmt:  # one format, one group (as routed experts)
            quant, down = QuantConfig(fmt, group_size=_kept_group(pairs, fmt)), None
        else:
            quant = QuantConfig(fmt, group_size=_kept_group(pairs, fmt, ("gate", "up")))
            down = QuantConfig(down_fmt, group_size=_kept_group(pairs, down_fmt, ("down",)))
        config = MoeConfig(1, 1, H, width, quant, backend=backend, isa=self.isa, down_quant_config=down)
        return SharedExpert(MoE.from_experts(config, lambda e: pairs), gate)

    def _experts(self, L, backend, repacked):
        """(routed experts of layer L in `backend`, where they came from).  With a converted
        folder: its file when the backend keeps its format, else packed from the checkpoint
        (noted in `repacked`) - converted weights are already quantized, and quantizing them
        again would lose accuracy the checkpoint still has."""
        if self.converted is not None:
            held = self.converted.format(L)
            if self.converted.serves(L, backend):
                moe = self.converted.load(L, self.isa)
                if self.group is not None:  # each rank keeps (and so reads) only its experts' pages
                    from ktcy.distributed import ExpertParallelMoE
                    moe = ExpertParallelMoE.from_moe(moe, self.group)
                return moe, self.converted.file(L)
            repacked.append((L, held, canonical_format(backend)))
        if self.group is not None:  # each rank reads and packs only its experts
            from ktcy.distributed import ExpertParallelMoE
            return (ExpertParallelMoE.from_checkpoint(self.checkpoint, L, backend, group=self.group, isa=self.isa),
                    self.checkpoint.path)
        return experts_from_checkpoint(self.checkpoint, L, backend, self.isa), self.checkpoint.path

    def _say_repacked(self, repacked, why):
        if repacked:
            pairs = sorted({(held, fmt) for _, held, fmt in repacked})
            log.warning("layers %s: %s %s, but %s holds %s; packed from the checkpoint %s instead",
                        ranges_text(L for L, _, _ in repacked) or "none", why, "/".join(fmt for _, fmt in pairs),
                        self.converted.path, "/".join(held for held, _ in pairs), self.checkpoint.path)

    def _build(self, L, forced_backend, repacked):
        ckpt, arch = self.checkpoint, self.checkpoint.arch
        if isinstance(ckpt, GGUFCheckpoint):
            return self._build_gguf(L, forced_backend, repacked)
        layer = ckpt.layer(L)
        name = layer.block_name
        rule, backend = self._rule_and_backend(name, forced_backend)
        experts, origin = self._experts(L, backend, repacked)
        if arch.gpt_oss:
            router = read_router(ckpt, layer.mlp_prefix, arch.num_experts, arch.hidden_size, arch.top_k)
            return MoEBlock(name, L, router, experts, None, rule, backend, origin)
        # DeepSeek and GLM keep the bias in the router (gate), MiniMax-M2 beside it, ERNIE 4.5 in
        # moe_statics ([1, E]: beside the gate as released, in it as transformers names it)
        p = layer.mlp_prefix
        bias_name = next((name for name in (f"{p}.gate.e_score_correction_bias", f"{p}.e_score_correction_bias",
                                            f"{p}.moe_statics.e_score_correction_bias",
                                            f"{p}.gate.moe_statics.e_score_correction_bias") if name in ckpt), None)
        kind = router_kind(arch.raw, layer.mlp_prefix, arch.source, bias_name is not None)
        settings = kind_settings(kind, arch.raw, arch.router_settings())  # each value type- and range-checked first
        router = Router(  # float_tensor: the shape config.json implies, a float dtype, finite
            kind=kind, weight=ckpt.float_tensor(f"{layer.mlp_prefix}.gate.weight", (arch.num_experts, arch.hidden_size)),
            top_k=arch.top_k, bias=self._bias(bias_name) if bias_name else None,
            **settings)
        if arch.num_experts % router.n_group:
            raise CheckpointError(f"{arch.source}: n_group {router.n_group} does not divide {arch.num_experts} experts")
        if router.topk_group * (arch.num_experts // router.n_group) < arch.top_k:
            raise CheckpointError(f"{arch.source}: {router.topk_group} of {router.n_group} groups hold fewer than the "
                                  f"{arch.top_k} experts a token takes")
        shared = self._shared(layer, experts.format, backend)
        return MoEBlock(name, L, router, experts, shared, rule, backend, origin)

    def _build_gguf(self, L, forced_backend, repacked):
        ckpt = self.checkpoint
        ckpt.layer(L)  # refuses a layer that is not an MoE layer first
        name = gguf_blocks.block_name(ckpt, L)
        rule, backend = self._rule_and_backend(name, forced_backend)
        router = gguf_blocks.router(ckpt, L)
        found = gguf_blocks.shared_tensors(ckpt, L)
        experts, origin = self._experts(L, backend, repacked)
        shared = None
        if found is not None:
            # kept in their own precision unless a backend is asked for (as llama.cpp runs them;
            # a type no ktcy format holds as stored, Q8_0 say, becomes BF16)
            fmt = experts.format if backend is not None else found.native
            down_fmt = fmt if backend is not None else found.native_down
            pairs, gate = gguf_blocks.shared_expert(ckpt, L, found)
            with naming(f"{ckpt.path}: layer {L} shared experts", CheckpointError):
                shared = self._shared_expert(pairs, fmt, found.width, backend, gate, down_fmt)
        return MoEBlock(name, L, router, experts, shared, rule, backend, origin)

    def _bias(self, name):
        """A router's e_score_correction_bias, [E] (or [1, E] as ERNIE stores it), as float32 [E]."""
        E = self.checkpoint.arch.num_experts
        return self.checkpoint.float_tensor(name, (1, E) if self.checkpoint.get(name).ndim == 2 else (E,)).reshape(E)

    def _shared(self, layer, fmt, backend):
        ckpt, cfg, H = self.checkpoint, self.checkpoint.arch.raw, self.checkpoint.arch.hidden_size
        p = layer.mlp_prefix
        where = self.checkpoint.arch.source
        q = ckpt.quant
        suffixes = ("weight",) + ((q.weight_suffix,) if q is not None and q.weight_suffix else ())
        stored = lambda name: any(f"{name}.gate_proj.{s}" in ckpt for s in suffixes)  # noqa: E731
        if stored(f"{p}.shared_experts"):       # DeepSeek, Kimi, GLM, ERNIE
            name, gate = f"{p}.shared_experts", None
            ernie = str(cfg.get("model_type", "")).lower() == "ernie4_5_moe"  # Ernie4_5_MoeConfig's default: 2
            inter = ckpt.arch.intermediate_size * config_int(cfg, where, "n_shared_experts", "moe_num_shared_experts",
                                                             default=2 if ernie else 1)
        elif stored(f"{p}.shared_expert"):      # Qwen2-MoE
            inter = config_int(cfg, where, "shared_expert_intermediate_size")
            gate_name = f"{p}.shared_expert_gate.weight"  # Linear(H, 1): [1, H], or [H] as some exports keep it
            name, gate = f"{p}.shared_expert", ckpt.float_tensor(gate_name, (1, H) if ckpt.get(gate_name).ndim == 2 else (H,))
        else:
            return None
        biased = [f"{name}.{proj}_proj.bias" for proj in ("gate", "up", "down") if f"{name}.{proj}_proj.bias" in ckpt]
        if biased:  # ERNIE's use_bias: ktcy's experts have no biases but GPT-OSS's
            raise CheckpointError(f"{where}: {biased[0]} is stored: shared experts with biases are not supported")
        pairs, kind = layer.dense_mlp(name, H, inter)
        return self._shared_expert(source_for(fmt, kind, lambda e: pairs)(0), fmt, inter, backend, gate)

    def inject_expert_backend(self, layer_regex: str, backend: str) -> List[str]:
        """Re-packs the routed experts of every block whose name matches layer_regex (re.match,
        from the start of the name, e.g. r"model\\.layers\\.[0-9]\\.") in `backend` (a format or
        KTransformers backend name such as "AMXINT8"); routers and shared experts stay as they are.
        With experts_path, a backend in a converted file's format maps that file again; any other
        format is packed from the checkpoint (one log line), as in from_pretrained.

        Returns the names of the blocks changed (empty when none matched).

        Raises RuleError for an invalid regex; ValueError for an unknown backend; CheckpointError
        if the checkpoint cannot be read again."""
        try:
            pattern = re.compile(layer_regex)
        except re.error as e:
            raise RuleError(f"layer_regex {layer_regex!r} is not a valid regex ({e})") from None
        canonical_format(backend)
        changed: List[str] = []
        repacked: List[tuple] = []
        for name, block in list(self.blocks.items()):
            if pattern.match(name):
                self.blocks[name] = self._build(block.layer, backend, repacked)
                self.checkpoint.release_pages()
                changed.append(name)
        self._say_repacked(repacked, "inject_expert_backend asks")
        log.info("%s -> %s for %d blocks", layer_regex, backend, len(changed))
        return changed

    def describe(self) -> List[Dict[str, Any]]:
        return [b.describe() for b in self.blocks.values()]
