"""Offline conversion: Hugging Face MoE checkpoint or GGUF model -> a folder of packed ktcy layers (or, with
the seeds' FP8 spelling, a complete Hugging Face FP8 per-channel checkpoint: ktcy.hf_fp8).  The
same code backs `ktcy convert` and tools/convert_cpu_weights.py.

One layer is in memory at a time, packed expert by expert into buffers allocated once (peak:
about one packed layer plus one layer's source pages, which are dropped from the process's
resident set once packed; they stay in the page cache).  The output folder is locked for the
whole run; every file is written under a unique temporary name and renamed when complete.  Each
layer file records its format, group size and a fingerprint of the source checkpoint, and
--resume keeps only layers whose record matches what is asked."""
import functools
import json
import os
import re
import sys
import time

from ktcy.checkpoint import Checkpoint
from ktcy.convert_args import INPUT_TYPES, run_cli
from ktcy.errors import naming
from ktcy.formats import DEFAULT_INT4_GROUP, GROUP_SIZES, canonical_format, group_sizes, grouped_names, has_groups, weight_group
from ktcy.gguf_checkpoint import GGUFCheckpoint, is_gguf
from ktcy.loading import MODEL_FILE, block_settings, layer_group_size, layer_quant_configs, original_checkpoint
from ktcy.output_guard import (ConvertError, OutputLock, copy_file, refuse_output_in_input, remove,
                               source_fingerprint, write_json, publish)
from ktcy.packed_io import (layer_file_name, layer_of_file_name, layout_version, pack_layer, read_metadata,
                            source_fingerprint_of, write_layer)
from ktcy.safetensors_io import CheckpointError
from ktcy.version import __version__

MANIFEST_VERSION = "2"  # ktcy_model.json's; each layer file records its own layout
METHODS = ("AMXINT8", "AMXBF16", "AMXINT4", "INT8", "INT8_GROUP", "INT8_MIN", "INT4", "INT4_ZP", "INT4_MIN", "MXFP4", "MXFP4_A8", "BF16",
           "FP8", "FP8_PERCHANNEL")
_LAYER_PART = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_layers(text, available, num_layers=None):
    """'0,3,5-7' -> the listed MoE layers, sorted (all when text is None).  Every number is
    checked against the checkpoint's layer count before a range is expanded, so no input can
    make a large list."""
    available = list(available)
    if text is None:
        return available
    top = num_layers if num_layers is not None else (max(available) + 1 if available else 0)
    if not text.strip() or len(text) > 10000:
        raise ValueError(f"--layers takes layer numbers and ranges like 0,3,5-7; got {text[:40]!r}")
    chosen = set()
    for part in text.split(","):
        m = _LAYER_PART.fullmatch(part.strip())
        if m is None and part.strip().startswith("-"):
            raise ValueError(f"--layers: layer numbers start at 0; got {part.strip()[:40]!r}")
        if m is None:
            raise ValueError(f"--layers takes layer numbers and ranges like 0,3,5-7; {part.strip()[:40]!r} is neither")
        if max(len(m[1]), len(m[2] or "")) > 9:
            raise ValueError(f"--layers: {m[0][:40]} goes past the checkpoint's last layer ({top - 1})")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"--layers: the range {m[0]} runs backwards")
        if hi >= top:
            raise ValueError(f"--layers: {m[0]} goes past the checkpoint's last layer ({top - 1})")
        chosen.update(range(lo, hi + 1))
    bad = sorted(chosen - set(available))
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        raise ValueError(f"--layers: {shown} are not MoE layers of this checkpoint "
                         f"(MoE layers: {_span(available)})")
    return sorted(chosen)


def _span(layers):
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers[:16])) + (", ..." if len(layers) > 16 else "")


def _held_as(fmt, group):
    return f"{fmt} group {group}" if has_groups(fmt) else fmt


def check_group_size(group_size, fmt):
    """The group size to use for a grouped format (the default when None); refused when not one
    the format takes or given for a format without groups."""
    if group_size is None:
        return DEFAULT_INT4_GROUP
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"group size {group_size!r}: the grouped formats take {', '.join(map(str, GROUP_SIZES))}")
    if fmt is None or not has_groups(fmt):
        raise ValueError(f"a group size ({group_size}) applies to {grouped_names()} only; the target format is "
                         f"{fmt or 'the checkpoint’s own precision'}")
    if group_size not in group_sizes(fmt):
        raise ValueError(f"group size {group_size}: {fmt} takes {', '.join(map(str, group_sizes(fmt)))}")
    return group_size


class Progress:
    """On a terminal a tqdm bar per layer (experts done, rate, ETA); elsewhere one line per
    layer, written when the layer is done; nothing at all when quiet."""

    def __init__(self, stream=None, quiet=False):
        self.stream, self.quiet = stream or sys.stderr, quiet
        self.tty = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar, self._label = None, None

    def bar(self, label, done, total):
        if not self.tty:
            return
        if self._bar is None or self._label != label:
            from tqdm import tqdm
            self.close()
            width = self._width()
            self._bar = tqdm(total=total, desc=label, unit="expert", file=self.stream, leave=False,
                             dynamic_ncols=width is None, ncols=width, nrows=None if width is None else 24)
            self._label = label
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def _width(self):
        """None where the terminal reports its size (tqdm follows resizes); 80 columns where it
        reports none (a bare pty: tqdm would draw nothing there, nrows being -1)."""
        try:
            return None if os.get_terminal_size(self.stream.fileno()).columns > 0 else 80
        except (OSError, ValueError, AttributeError):
            return 80

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar, self._label = None, None

    def line(self, text):
        self.close()
        if self.quiet:
            return
        self.stream.write(text + "\n")
        self.stream.flush()


def check_input_type(experts, input_type):
    if input_type and experts.dtype is None:
        raise CheckpointError(f"--input-type {input_type}, but layer {experts.layer} stores ggml types ({experts.stored}); "
                              "--input-type checks safetensors dtypes")
    if input_type and experts.dtype.name != INPUT_TYPES[input_type]:
        raise CheckpointError(f"--input-type {input_type}, but layer {experts.layer}'s experts are {experts.dtype}")


def _record(meta, dims):
    """What a packed layer file was made from: layer, formats and group sizes, source
    fingerprint, layout."""
    return {"layer": dims["layer"], "weight_format": meta["weight_format"], "group_size": dims["group_size"],
            "down_weight_format": meta["down_weight_format"], "down_group_size": dims["down_group_size"],
            "source_fingerprint": source_fingerprint_of(meta), "layout_version": meta["layout_version"]}


def _layers_on_disk(output_path):
    """{layer: record, or None for a file that is not a readable packed layer} of every
    ktcy_layer_NNNN.safetensors in the folder."""
    found = {}
    for name in os.listdir(output_path):
        layer = layer_of_file_name(name)
        if layer is None:
            continue
        try:
            _, meta, dims = read_metadata(os.path.join(output_path, name))
            found[layer] = _record(meta, dims)
        except CheckpointError:
            found[layer] = None
    return found


def _difference(record, wanted, input_path):
    if wanted is None:
        return "it is not an MoE layer of this checkpoint"
    parts = []
    if record["layer"] != wanted["layer"]:
        parts.append(f"it holds layer {record['layer']} (renamed or copied from another layer's file)")
    if record["weight_format"] != wanted["weight_format"]:
        parts.append(f"format {record['weight_format']} on disk, {wanted['weight_format']} asked")
    if record["group_size"] != wanted["group_size"]:
        parts.append(f"group size {record['group_size'] or 'none'} on disk, {wanted['group_size'] or 'none'} asked")
    down = [_held_as(r["down_weight_format"], r["down_group_size"]) for r in (record, wanted)]
    if down[0] != down[1]:
        parts.append(f"down {down[0]} on disk, {down[1]} asked")
    if record["source_fingerprint"] != wanted["source_fingerprint"]:
        parts.append(f"converted from another checkpoint (source fingerprint {record['source_fingerprint'] or 'not recorded'}"
                     f" on disk, {wanted['source_fingerprint']} for {input_path})")
    if record["layout_version"] != wanted["layout_version"] and down[0] == down[1]:
        parts.append(f"packed layout {record['layout_version']} on disk (an earlier ktcy), {wanted['layout_version']} now")
    return "; ".join(parts)


def _refuse_foreign_config(output_path, overwrite):
    """config.json in an output folder that has no ktcy_model.json belongs to someone else (a
    checkpoint?): it is never replaced without --overwrite."""
    if not overwrite and os.path.exists(os.path.join(output_path, "config.json")) \
            and not os.path.exists(os.path.join(output_path, MODEL_FILE)):
        raise ConvertError(f"{output_path} holds a config.json that ktcy convert did not write (is it a checkpoint?);"
                           " choose an empty folder, or pass --overwrite to replace it")


def convert(input_path, output_path, method=None, input_type=None, layers=None, resume=False, group_size=None,
            progress=None, overwrite=False, resume_layer=None):
    """Packs the chosen MoE layers of a checkpoint into output_path; returns the layers now in
    the output (written or, with resume / resume_layer, kept)."""
    output_path = os.fspath(output_path)
    progress = progress or Progress()
    asked = canonical_format(method) if method else None
    group = check_group_size(group_size, asked)
    if resume_layer is not None and (isinstance(resume_layer, bool) or not isinstance(resume_layer, int) or resume_layer < 0):
        raise ValueError(f"--resume-layer must be a layer number >= 0, got {resume_layer!r}")
    input_path = original_checkpoint(input_path, "ktcy convert", "its safetensors weights",
                                     "load the converted folder with load_experts instead")
    ckpt = GGUFCheckpoint(input_path) if is_gguf(input_path) else Checkpoint(input_path)
    input_path = ckpt.path  # with ~ expanded and a hub id resolved to its local snapshot
    refuse_output_in_input(input_path, output_path)
    if isinstance(ckpt, GGUFCheckpoint) and os.path.realpath(output_path) == os.path.realpath(os.path.dirname(input_path)):
        # its layer files and manifest would make the folder read as a converted one
        raise ConvertError(f"--output {output_path} is the folder holding the input {input_path}; choose another folder")
    arch = ckpt.arch
    activation = block_settings(arch)  # an activation ktcy cannot run is refused before any work
    chosen = parse_layers(layers, arch.moe_layers, arch.num_layers)
    fingerprint = source_fingerprint(input_path)
    source = json.dumps({"path": os.path.abspath(input_path), "fingerprint": fingerprint})
    moe_layers = set(arch.moe_layers)

    @functools.lru_cache(maxsize=None)
    def wanted(L):
        """The record a layer file must carry to belong to this conversion (None: not a layer)."""
        if L not in moe_layers:
            return None
        layer = ckpt.layer(L)
        fmt = asked or layer.native_format
        if fmt is None:
            raise layer.needs_method()
        if asked:
            g = layer_group_size(layer, fmt) if group_size is None else group  # released INT4 keeps its own groups
            sides = [(fmt, weight_group(fmt, g))] * 2
        else:  # each side as stored: a GGUF layer's down may be in a format of its own
            quant, down = layer_quant_configs(layer)
            sides = [(f, weight_group(f, q.group_size)) for q in (quant, down or quant)
                     for f in [canonical_format(q.method, q.per_channel)]]
        (fmt, g), (down_fmt, down_g) = sides
        return {"layer": L, "weight_format": fmt, "group_size": g, "down_weight_format": down_fmt,
                "down_group_size": down_g, "source_fingerprint": fingerprint,
                "layout_version": layout_version(fmt, g, (down_fmt, down_g))}

    for L in chosen:  # every layer's format and dtype settled (a GGUF layer may need a method) before any write
        wanted(L)
        if input_type:
            check_input_type(ckpt.layer(L), input_type)

    with OutputLock(output_path):
        _refuse_foreign_config(output_path, overwrite)
        on_disk = _layers_on_disk(output_path)
        conflicts = {L: rec for L, rec in on_disk.items() if rec is not None and rec != wanted(L)}
        if conflicts and not overwrite:
            L = min(conflicts)
            more = f" (and {len(conflicts) - 1} more layer files)" if len(conflicts) > 1 else ""
            raise ConvertError(f"{'--resume: ' if resume else ''}{os.path.join(output_path, layer_file_name(L))} differs "
                               f"from this conversion: {_difference(conflicts[L], wanted(L), input_path)}{more}; use "
                               "another output folder, or --overwrite to replace those files")
        unreadable = sorted(L for L, rec in on_disk.items() if rec is None)
        if unreadable and not overwrite:
            raise ConvertError(f"{os.path.join(output_path, layer_file_name(unreadable[0]))} is not a packed layer this "
                               "ktcy can read (another tool's, damaged, or from another ktcy version); it is not "
                               "replaced without --overwrite")
        if conflicts or unreadable:  # first a manifest of this run listing only the files that stay: an
            # interrupted run must not leave the old one vouching for layers removed or replaced
            _write_manifest(output_path, input_path, fingerprint, asked, group, arch, wanted)
        for L in list(conflicts) + unreadable:
            remove(os.path.join(output_path, layer_file_name(L)))
        if conflicts:
            progress.line(f"--overwrite: removed {len(conflicts)} layer files converted differently")
        if unreadable:
            progress.line(f"--overwrite: removed {len(unreadable)} layer files that are not readable packed layers")
        done = []
        for i, L in enumerate(chosen):
            final = os.path.join(output_path, layer_file_name(L))
            usable = on_disk.get(L) is not None and L not in conflicts
            below = resume_layer is not None and L < resume_layer
            if usable and (resume or below):
                progress.line(f"layer {L}: already converted, kept")
                done.append(L)
                continue
            if below:
                progress.line(f"layer {L}: below --resume-layer {resume_layer} but {output_path} has no usable file "
                              "for it; not converted")
                continue
            experts = ckpt.layer(L)
            want = wanted(L)
            fmt, down_fmt = want["weight_format"], want["down_weight_format"]
            label = f"layer {L} ({i + 1}/{len(chosen)}) {fmt}" + (f" (down {down_fmt})" if down_fmt != fmt else "")
            t0 = time.perf_counter()
            g = want["group_size"] or group
            down = (down_fmt, want["down_group_size"] or group)
            with naming(f"{input_path}: layer {L}", ConvertError):
                arrays = pack_layer(arch.num_experts, fmt, g, experts.source(fmt, strict=asked is None, down_fmt=down_fmt),
                                    lambda n, total: progress.bar(label, n, total), down=down)
            bias = experts.bias()  # GPT-OSS: biases and the clamped activation go into the layer file
            publish(final, lambda tmp: write_layer(tmp, arrays, fmt, g, arch.num_experts, arch.top_k,
                                                    arch.hidden_size, arch.intermediate_size, L, source=source,
                                                    bias=bias, activation=activation, down=down))
            arrays = None  # the packed layer is on disk: its buffers go before the next layer's
            seconds = time.perf_counter() - t0
            progress.line(f"{label}: {os.path.getsize(final) / 2**20:.1f} MiB in {seconds:.1f} s "
                          f"({arch.num_experts / max(seconds, 1e-9):.1f} experts/s)")
            ckpt.release_pages()  # the layer's source pages, read once: see the module docstring
            done.append(L)
        _write_manifest(output_path, input_path, fingerprint, asked, group, arch, wanted)
        if not isinstance(ckpt, GGUFCheckpoint):  # a GGUF model's settings are in the GGUF file
            copy_file(os.path.join(input_path, "config.json"), os.path.join(output_path, "config.json"))
    return done


def _write_manifest(output_path, input_path, fingerprint, asked, group, arch, wanted):
    """ktcy_model.json lists exactly the layer files on disk whose record matches this run:
    never another model's or another method's layers."""
    records = {L: rec for L, rec in _layers_on_disk(output_path).items() if rec is not None and rec == wanted(L)}
    model = {"format": "ktcy.packed_model", "layout_version": MANIFEST_VERSION, "ktcy_version": __version__,
             "layers": sorted(records), "num_experts": arch.num_experts, "top_k": arch.top_k,
             "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
             "source": os.path.abspath(input_path), "source_fingerprint": fingerprint, "method": asked,
             "group_size": group if asked and has_groups(asked) else None,
             "layer_records": {str(L): rec for L, rec in sorted(records.items())}}
    write_json(os.path.join(output_path, MODEL_FILE), model)


def convert_to_hf_fp8(*args, **kwargs):
    from ktcy.hf_fp8 import convert_to_hf_fp8 as export
    return export(*args, **kwargs)


def main(argv=None, prog="convert_cpu_weights.py"):
    """The converter's command line; returns the exit status."""
    return run_cli(argv, prog)
