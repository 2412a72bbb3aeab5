"""Offline conversion: Hugging Face MoE checkpoint -> a folder of packed ktcy layers (or, with
the seeds' FP8 spelling, a Hugging Face-style FP8 per-channel checkpoint).  The same code backs
`ktcy convert` and tools/convert_cpu_weights.py.

One layer is in memory at a time, packed expert by expert into buffers allocated once (peak:
about one packed layer plus one expert's source tensors).  Every file is written under a
temporary name and renamed when complete; --resume skips layers whose final file is valid."""
import argparse
import json
import os
import shutil
import sys
import time

import ml_dtypes
import numpy as np

from ktcy.checkpoint import Checkpoint
from ktcy.formats import canonical_format
from ktcy.loading import MODEL_FILE, source_for
from ktcy.packed_io import LAYOUT_VERSION, layer_file_name, pack_layer, read_metadata, write_layer
from ktcy.safetensors_io import CheckpointError, write
from ktcy.version import __version__

INPUT_TYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
METHODS = ("AMXINT8", "AMXBF16", "AMXINT4", "INT8", "INT4", "BF16", "FP8", "FP8_PERCHANNEL")


def parse_layers(text, available):
    """'0,3,5-7' -> the listed MoE layers (all when text is None)."""
    if not text:
        return list(available)
    chosen = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            chosen.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"--layers takes numbers and ranges like 0,3,5-7; got {text!r}") from None
    bad = [L for L in chosen if L not in available]
    if bad:
        raise ValueError(f"--layers: {bad} are not MoE layers of this checkpoint")
    return chosen


class Progress:
    """A one-line progress bar on a terminal, plain lines elsewhere."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()

    def bar(self, label, done, total):
        if not self.tty:
            if done == total:
                self.line(f"{label}: {total}/{total}")
            return
        filled = int(30 * done / max(total, 1))
        self.stream.write(f"\r{label}: [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()

    def line(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()


def _check_input_type(experts, input_type):
    if input_type and experts.dtype.name != INPUT_TYPES[input_type]:
        raise CheckpointError(f"--input-type {input_type}, but layer {experts.layer}'s experts are {experts.dtype}")


def convert(input_path, output_path, method=None, input_type=None, layers=None, resume=False, group_size=64,
            progress=None):
    """Packs the chosen MoE layers of a checkpoint into output_path; returns the layers written."""
    progress = progress or Progress()
    ckpt = Checkpoint(input_path)
    arch = ckpt.arch
    chosen = parse_layers(layers, arch.moe_layers)
    os.makedirs(output_path, exist_ok=True)
    written = []
    for i, L in enumerate(chosen):
        final = os.path.join(output_path, layer_file_name(L))
        experts = ckpt.layer(L)
        _check_input_type(experts, input_type)
        fmt = canonical_format(method) if method else experts.native_format
        if resume and os.path.exists(final):
            try:
                read_metadata(final)
                progress.line(f"layer {L}: already converted, skipped")
                written.append(L)
                continue
            except CheckpointError as e:
                progress.line(f"layer {L}: existing file unusable ({e}); converting again")
        source = source_for(fmt, experts.scale_kind, experts.expert)
        t0 = time.perf_counter()
        arrays = pack_layer(arch.num_experts, fmt, group_size, source,
                            lambda done, total: progress.bar(f"layer {L} ({i + 1}/{len(chosen)}) {fmt}", done, total))
        write_layer(final, arrays, fmt, group_size, arch.num_experts, arch.top_k, arch.hidden_size,
                    arch.intermediate_size, L, source=os.path.abspath(input_path))
        del arrays
        progress.line(f"layer {L}: {os.path.getsize(final) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
        written.append(L)
    done = sorted(set(written) | _already_listed(output_path))
    model = {"format": "ktcy.packed_model", "layout_version": LAYOUT_VERSION, "ktcy_version": __version__,
             "layers": done, "num_experts": arch.num_experts, "top_k": arch.top_k,
             "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
             "source": os.path.abspath(input_path)}
    _write_json(os.path.join(output_path, MODEL_FILE), model)
    shutil.copyfile(os.path.join(input_path, "config.json"), os.path.join(output_path, "config.json"))
    return written


def _already_listed(output_path):
    try:
        with open(os.path.join(output_path, MODEL_FILE)) as f:
            return set(json.load(f).get("layers", []))
    except (OSError, json.JSONDecodeError):
        return set()


def _write_json(path, obj):
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def convert_to_hf_fp8(input_path, output_path, layers=None, resume=False, progress=None):
    """A Hugging Face-style FP8 per-channel checkpoint of the routed experts: for every expert
    weight `X.weight` an F8_E4M3 tensor plus `X.weight_scale` F32 [N, 1] (compressed-tensors'
    channel-wise convention), one shard per layer, an index, and config.json."""
    from ktcy import _native  # the kernels' own FP8 quantizer, so both paths give the same codes
    progress = progress or Progress()
    ckpt = Checkpoint(input_path)
    arch = ckpt.arch
    os.makedirs(output_path, exist_ok=True)
    weight_map = {}
    for L in parse_layers(layers, arch.moe_layers):
        experts = ckpt.layer(L)
        shard = f"model-fp8-layer{L:04d}.safetensors"
        final = os.path.join(output_path, shard)
        names = {}
        for e in range(arch.num_experts):
            kind, pattern, proj_names = experts.scheme
            for proj in ("gate", "up", "down"):
                base = (pattern.format(e=e, proj=proj_names[proj]) if kind == "per_expert"
                        else f"model.layers.{L}.mlp.experts.{e}.{proj}_proj.weight")
                names[(e, proj)] = base
        if not (resume and os.path.exists(final)):
            tensors = {}
            for e in range(arch.num_experts):
                for proj, w in experts.dequantized(e).items():
                    codes, scale = _native.quantize_weights(_native.FORMATS.index("FP8_PERCHANNEL"),
                                                            np.ascontiguousarray(w, np.float32))
                    name = names[(e, proj)]
                    tensors[name] = codes.view(ml_dtypes.float8_e4m3fn)
                    tensors[name + "_scale"] = scale.reshape(-1, 1)
                progress.bar(f"layer {L} FP8 per-channel", e + 1, arch.num_experts)
            write(final, tensors, {"format": "pt", "producer": f"ktcy {__version__}"})
        for name in names.values():
            weight_map[name] = shard
            weight_map[name + "_scale"] = shard
    _write_json(os.path.join(output_path, "model.safetensors.index.json"),
                {"metadata": {"producer": f"ktcy {__version__}"}, "weight_map": weight_map})
    config = dict(ckpt.config)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_scale_kind": "per_channel", "producer": f"ktcy {__version__}"}
    _write_json(os.path.join(output_path, "config.json"), config)


def build_parser(prog="convert_cpu_weights.py"):
    p = argparse.ArgumentParser(prog=prog, description="Hugging Face MoE checkpoint -> packed ktcy CPU weights")
    p.add_argument("--input", "--input-path", dest="input", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--output", help="output folder for packed layers")
    p.add_argument("--method", help=f"target format: {', '.join(METHODS)} (default: keep the checkpoint's)")
    p.add_argument("--quant-config", help='JSON, e.g. \'{"method": "FP8", "per_channel": true}\'')
    p.add_argument("--input-type", choices=sorted(INPUT_TYPES), help="expected input dtype (default: detected)")
    p.add_argument("--layers", help="MoE layers to convert, e.g. 0,3,5-7 (default: all)")
    p.add_argument("--group-size", type=int, default=64, help="INT4 group size: 32, 64 or 128")
    p.add_argument("--resume", action="store_true", help="skip layers whose packed file is already complete")
    p.add_argument("--input-bf16-hf-path", help="with --output-fp8-hf-path: write an HF-style FP8 checkpoint")
    p.add_argument("--output-fp8-hf-path", help="folder of the FP8 per-channel Hugging Face checkpoint")
    return p


def main(argv=None, prog="convert_cpu_weights.py"):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.input_bf16_hf_path or args.output_fp8_hf_path:
            if not (args.input_bf16_hf_path and args.output_fp8_hf_path):
                parser.error("--input-bf16-hf-path and --output-fp8-hf-path go together")
            convert_to_hf_fp8(args.input_bf16_hf_path, args.output_fp8_hf_path, args.layers, args.resume)
            return 0
        if not args.input or not args.output:
            parser.error("--input and --output are required")
        method = args.method
        if args.quant_config:
            try:
                qc = json.loads(args.quant_config)
                method = canonical_format(qc["method"], qc.get("per_channel"))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                parser.error(f"--quant-config must be JSON with a \"method\" ({e})")
            if args.method and canonical_format(args.method) != method:
                parser.error(f"--method {args.method} and --quant-config {args.quant_config} disagree")
        if method:
            canonical_format(method)  # an unknown name is a clear error before any work
        convert(args.input, args.output, method, args.input_type, args.layers, args.resume, args.group_size)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
