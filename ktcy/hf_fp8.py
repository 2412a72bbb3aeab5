"""--input-bf16-hf-path / --output-fp8-hf-path: a complete Hugging Face checkpoint whose routed
experts are FP8 E4M3 with one float32 scale per output channel, everything else unchanged.

Layout: per expert weight `X.weight` (F8_E4M3 [N, K]) and `X.weight_scale` (F32 [N, 1]), one
shard per converted layer; every other tensor of the source byte for byte in `model-rest-*`
shards; the index; the tokenizer and other small files; and config.json with a
`quantization_config` in compressed-tensors' spelling: format "float-quantized", weights 8-bit
float, strategy "channel", symmetric, static; activations dynamic per token ("FP8_DYNAMIC").
That is the scheme llm-compressor writes for per-channel FP8 and vLLM / transformers read
(transformers' own `quant_method: "fp8"` describes 128x128 block scales named weight_scale_inv,
not channels).  Its targets are regexes over exactly the converted expert modules, so the
unquantized tensors are not claimed.  ktcy_fp8_export.json lists the files this converter
created, so that a later run replaces only those (others need --overwrite)."""
import os
import re
import shutil
import stat

import ml_dtypes
import numpy as np

from ktcy.checkpoint import Checkpoint
from ktcy.convert import Progress, check_input_type, parse_layers
from ktcy.loading import original_checkpoint
from ktcy.output_guard import (ConvertError, OutputLock, publish, refuse_output_in_input, remove,
                               source_fingerprint, write_json, write_safetensors)
from ktcy.paths import MAX_INDEX_BYTES, allowed_roots, confined_file, read_json
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, open_regular_file
from ktcy.version import __version__

MARKER = "ktcy_fp8_export.json"
_OWN_SHARD = re.compile(r"model-(fp8-layer[0-9]{4,}|rest-[0-9]{5}-of-[0-9]{5})\.safetensors")
INDEX = "model.safetensors.index.json"
REST_SHARD_BYTES = 2 * 2**30
# weights in other serializations are not carried over (the safetensors ones are, as tensors)
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx", ".partial",
               ".tmp", ".lock")


def quantization_config(block_names, leaves):
    module = "(?:" + "|".join(re.escape(b) for b in block_names) + r")\.\d+\.(?:" + "|".join(leaves) + ")"
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": [f"re:^{module}$"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                        "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True, "observer": None},
            "output_activations": None}},
        "ignore": [], "kv_cache_scheme": None,
    }


class _LayerPlan:
    """One converted layer: the output name of each expert weight and the source tensors it
    replaces."""

    def __init__(self, ckpt, L, all_names):
        self.experts = ckpt.layer(L)
        kind, pattern, names = self.experts.scheme
        E = self.experts.num_experts
        self.shard = f"model-fp8-layer{L:04d}.safetensors"
        if kind == "per_expert":
            self.names = {(e, p): pattern.format(e=e, proj=names[p]) for e in range(E) for p in ("gate", "up", "down")}
            self.leaves = [names[p] + ("_proj" if pattern.endswith("_proj.weight") else "") for p in ("gate", "up", "down")]
            self.replaced = {n + s for n in self.names.values() for s in ("", "_scale", "_scale_inv")}
        else:
            block = self.experts.block_name
            self.names = {(e, p): f"{block}.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down")}
            self.leaves = ["gate_proj", "up_proj", "down_proj"]
            fused = {pattern.format(proj=p) for p in names.values()}
            self.replaced = {n + s for n in fused for s in ("", "_scale", "_scale_inv")}
        self.replaced &= all_names

    def tensor_names(self):
        return [n + s for n in self.names.values() for s in ("", "_scale")]


def _quantized_layer(plan, progress, label):
    from ktcy import _native  # the kernels' own FP8 quantizer, so both paths give the same codes
    fmt = _native.FORMATS.index("FP8_PERCHANNEL")
    tensors = {}
    E = plan.experts.num_experts
    for e in range(E):
        for proj, w in plan.experts.dequantized(e).items():
            codes, scale = _native.quantize_weights(fmt, np.ascontiguousarray(w, np.float32))
            name = plan.names[(e, proj)]
            tensors[name] = codes.view(ml_dtypes.float8_e4m3fn)
            tensors[name + "_scale"] = np.ascontiguousarray(scale[: w.shape[0]], np.float32).reshape(-1, 1)
        progress.bar(label, e + 1, E)
    return tensors


def _rest_shards(ckpt, replaced):
    """[[tensor name, ...], ...]: the tensors carried over unchanged, in shards of at most
    REST_SHARD_BYTES (a larger single tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for name in sorted(set(ckpt.tensor_names()) - replaced):
        n = ckpt.get(name).nbytes
        if current and size + n > REST_SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def _small_files(input_path):
    """Tokenizer, generation config and other plain files of the checkpoint folder.  The export
    is meant to be shared: a file that is a symlink out of the checkpoint is refused, as shards
    are (a Hugging Face cache snapshot's links into its blobs are allowed)."""
    out, roots = [], allowed_roots(input_path)
    for name in sorted(os.listdir(input_path)):
        path = os.path.join(input_path, name)
        if name.startswith(".") or name in ("config.json", INDEX) or name.lower().endswith(_NOT_COPIED):
            continue
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                continue
        except OSError:
            continue
        confined_file(input_path, name, roots, input_path, noun="file")
        out.append(name)
    return out


def _copy_small_file(input_path, name, final):
    """Copies a file _small_files listed, confined again at copy time: its real path is checked
    and opened without following a link, so a file swapped for a symlink meanwhile is refused."""
    real = os.path.realpath(confined_file(input_path, name, allowed_roots(input_path), input_path, noun="file"))
    with os.fdopen(open_regular_file(real, f"{input_path}: {name}", follow_symlinks=False), "rb") as src:
        def copy(tmp):
            with open(tmp, "xb") as dst:
                shutil.copyfileobj(src, dst)
        publish(final, copy)


def _shard_is_current(path, fingerprint, names):
    """A shard written by an earlier run from the same source with the same tensors."""
    try:
        f = SafetensorsFile(path)
    except CheckpointError:
        return False
    return f.metadata.get("ktcy_source_fingerprint") == fingerprint and set(f.keys()) == set(names)


def _tensor_bytes(path):
    f = SafetensorsFile(path)
    return sum(int(np.prod(f.shape(n), dtype=np.int64)) * f.dtype(n).itemsize for n in f.keys())


def _read_marker(output_path):
    path = os.path.join(output_path, MARKER)
    if not os.path.lexists(path):
        return None
    try:
        marker = read_json(path, MAX_INDEX_BYTES)
        if isinstance(marker, dict) and isinstance(marker.get("files"), list) \
                and all(isinstance(f, str) for f in marker["files"]):
            return marker
    except CheckpointError:
        pass
    raise ConvertError(f"{path} is unreadable; it lists which files ktcy wrote - remove the folder or use another")


def convert_to_hf_fp8(input_path, output_path, layers=None, resume=False, progress=None, overwrite=False,
                      input_type=None):
    """Writes the FP8 per-channel checkpoint (see the module docstring); returns the layers
    whose experts it holds in FP8."""
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    progress = progress or Progress()
    ckpt = Checkpoint(original_checkpoint(input_path, "the HF FP8 export", "its safetensors weights",
                                          "pass the checkpoint it was converted from"))
    input_path = ckpt.path  # a hub id or cache snapshot, resolved: every read below is of that folder
    refuse_output_in_input(input_path, output_path, "--output-fp8-hf-path")
    text = ckpt.config.get("text_config") if isinstance(ckpt.config.get("text_config"), dict) else {}
    if "quantization_config" in ckpt.config or "quantization_config" in text or ckpt.quant is not None:
        raise ConvertError(f"{input_path} is already quantized (a quantization_config in config.json, or "
                           "AutoGPTQ's quantize_config.json); "
                           "--input-bf16-hf-path takes an unquantized BF16/F16/F32 checkpoint")
    arch = ckpt.arch
    if arch.gpt_oss:  # its loader reads stacked, interleaved experts with biases, not per-expert FP8 linears
        raise ConvertError(f"{input_path} is a GPT-OSS checkpoint; the HF FP8 per-channel export writes per-expert "
                           "linears that GPT-OSS's loaders do not read (use ktcy convert --output for packed layers)")
    chosen = parse_layers(layers, arch.moe_layers, arch.num_layers)
    all_names = set(ckpt.tensor_names())
    plans = {L: _LayerPlan(ckpt, L, all_names) for L in chosen}
    for plan in plans.values():
        check_input_type(plan.experts, input_type)
    replaced = set().union(*(p.replaced for p in plans.values())) if plans else set()
    rest = _rest_shards(ckpt, replaced)
    rest_files = [f"model-rest-{i + 1:05d}-of-{len(rest):05d}.safetensors" for i in range(len(rest))]
    small = _small_files(input_path)
    planned = [p.shard for p in plans.values()] + rest_files + small + ["config.json", INDEX]
    fingerprint = source_fingerprint(input_path)
    with OutputLock(output_path):
        marker = _read_marker(output_path)
        ours = set(marker["files"]) if marker else set()
        foreign = [f for f in planned if os.path.lexists(os.path.join(output_path, f)) and f not in ours]
        if foreign and not overwrite:
            raise ConvertError(f"{output_path} already holds {', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}"
                               ", which this converter did not write; choose an empty folder or pass --overwrite")
        if resume and marker and marker.get("source_fingerprint") != fingerprint:
            raise ConvertError(f"--resume: {output_path} was converted from another checkpoint ({marker.get('source')}, "
                               f"fingerprint {marker.get('source_fingerprint')}; now {fingerprint})")
        record = {"format": "ktcy.hf_fp8_export", "ktcy_version": __version__, "source": os.path.abspath(input_path),
                  "source_fingerprint": fingerprint, "layers": chosen, "files": sorted(ours | set(planned))}
        write_json(os.path.join(output_path, MARKER), dict(record, complete=False))
        meta = {"format": "pt", "producer": f"ktcy {__version__}", "ktcy_source_fingerprint": fingerprint}
        weight_map, total = {}, 0
        for i, (L, plan) in enumerate(plans.items()):
            final = os.path.join(output_path, plan.shard)
            label = f"layer {L} ({i + 1}/{len(plans)}) FP8 per-channel"
            if resume and _shard_is_current(final, fingerprint, plan.tensor_names()):
                progress.line(f"{label}: already converted, kept")
            else:
                write_safetensors(final, _quantized_layer(plan, progress, label), dict(meta, ktcy_layer=L))
                progress.line(f"{label}: {os.path.getsize(final) / 2**20:.1f} MiB")
            ckpt.release_pages()
            weight_map.update({n: plan.shard for n in plan.tensor_names()})
            total += _tensor_bytes(final)
        for shard, names in zip(rest_files, rest):
            final = os.path.join(output_path, shard)
            if not (resume and _shard_is_current(final, fingerprint, names)):
                write_safetensors(final, {n: ckpt.get(n) for n in names}, meta)
                ckpt.release_pages()
            weight_map.update({n: shard for n in names})
            total += _tensor_bytes(final)
        progress.line(f"carried over {sum(map(len, rest))} other tensors unchanged in {len(rest)} shard(s)")
        for name in small:
            _copy_small_file(input_path, name, os.path.join(output_path, name))
        write_json(os.path.join(output_path, INDEX), {"metadata": {"total_size": total, "producer": f"ktcy {__version__}"},
                                                      "weight_map": dict(sorted(weight_map.items()))})
        config = dict(ckpt.config)
        if plans:
            first = next(iter(plans.values()))
            config["quantization_config"] = quantization_config([p.experts.block_name for p in plans.values()],
                                                                first.leaves)
        write_json(os.path.join(output_path, "config.json"), config)
        for name in _stale_own_shards(output_path, ours - set(planned)):
            remove(os.path.join(output_path, name))
        write_json(os.path.join(output_path, MARKER), dict(record, complete=True, files=sorted(planned)))
    return chosen


def _stale_own_shards(output_path, names):
    """Shards an earlier export here wrote that the new index no longer names (a wider --layers,
    another count of rest shards): left, they would hold gigabytes nothing reads.  Only plain
    names of this exporter's shard pattern that are regular files are taken from the marker."""
    for name in sorted(names):
        if not _OWN_SHARD.fullmatch(name):
            continue
        try:
            if stat.S_ISREG(os.lstat(os.path.join(output_path, name)).st_mode):
                yield name
        except FileNotFoundError:
            pass
