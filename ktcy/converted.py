"""A folder written by `ktcy convert`, used for the routed experts of a checkpoint's blocks
(MoEModel.from_pretrained(path, experts_path=folder), `ktcy run-block --experts folder`).

The folder is untrusted: before any block uses it, every layer file it must supply is checked
against the checkpoint's config (layer number, expert count, top_k, hidden and intermediate
sizes, activation), and the folder must not be in the middle of a conversion.  Whether it was
converted from *this* checkpoint is settled by the source fingerprint each layer file records;
when that differs (the checkpoint was copied or re-downloaded, which changes file times) two
experts of the layer are packed again from the checkpoint and must give the same bytes."""
import errno
import fcntl
import logging
import os

import numpy as np

from ktcy.formats import canonical_format
from ktcy.loading import MODEL_FILE, block_settings, is_converted
from ktcy.moe import pack_expert_weight
from ktcy.output_guard import LOCK_NAME, source_fingerprint
from ktcy.packed_io import PROJECTIONS, layer_file_name, layer_of_file_name, load_layer, read_metadata, source_fingerprint_of
from ktcy.paths import MAX_CONFIG_BYTES, allowed_roots, confined_file, read_json, require_folder, resolve_model_path
from ktcy.safetensors_io import CheckpointError

log = logging.getLogger("ktcy")

_SHAPE_KEYS = ("num_experts", "top_k", "hidden_size", "intermediate_size")


class ConvertedFolder:
    """The converted experts of one checkpoint: .formats(L) is what layer L is packed in (gate's
    and up's format, down's), .serves(L, backend) whether its file is what `backend` asks for,
    .load(L, isa) its MoE (memory-mapped, no copy), .file(L) its path."""

    def __init__(self, path, ckpt):
        self.path = resolve_model_path(path, "experts_path")
        self.ckpt = ckpt
        require_folder(self.path, "converted folder")
        if os.path.realpath(self.path) == os.path.realpath(ckpt.path):
            raise CheckpointError(f"{self.path}: experts_path is the checkpoint itself; give the folder that "
                                  "`ktcy convert` wrote")
        if not is_converted(self.path):
            raise CheckpointError(f"{self.path}: no {MODEL_FILE}, so not a folder written by `ktcy convert` (or its "
                                  "conversion has not finished)")
        self._refuse_running_conversion()
        self._check_manifest()
        self._formats = {}
        self._fingerprint = None

    def __repr__(self):
        return f"ConvertedFolder({self.path!r})"

    def file(self, L):
        return confined_file(self.path, layer_file_name(L), allowed_roots(self.path), self.path)

    def require(self, layers):
        """Checks the metadata of every layer file `layers` need; a layer the folder lacks is
        refused with the full list (pass layers= to build only converted ones)."""
        missing = [L for L in layers if not os.path.lexists(self.file(L))]
        if missing:
            held = sorted(L for L in map(layer_of_file_name, os.listdir(self.path)) if L is not None)
            which = f"layer {missing[0]} was" if len(missing) == 1 else f"layers {_listed(missing)} were"
            raise CheckpointError(f"{self.path}: {which} not converted (the folder holds "
                                  f"layers {_listed(held) or 'none'}); convert them, or pass layers= / --layer to "
                                  "build only converted layers")
        for L in layers:
            self.formats(L)

    def formats(self, L):
        """(gate's and up's format, down's) in layer L's file (its metadata checked against the
        checkpoint)."""
        if L not in self._formats:
            f = self.file(L)
            if not os.path.lexists(f):
                raise CheckpointError(f"{self.path}: layer {L} was not converted (no {layer_file_name(L)})")
            _, meta, dims = read_metadata(f)
            self._check_dims(f, L, dims, meta)
            self._formats[L] = (meta["weight_format"], meta["down_weight_format"])
        return self._formats[L]

    def format(self, L):
        """Layer L's format in words: "INT4_MIN", or "INT4_MIN (down INT8_GROUP)"."""
        fmt, down = self.formats(L)
        return fmt if down == fmt else f"{fmt} (down {down})"

    def serves(self, L, backend):
        """Whether layer L's file is what `backend` asks for (None: as converted; a format: all
        three projections in it)."""
        return backend is None or set(self.formats(L)) == {canonical_format(backend)}

    def load(self, L, isa=None):
        """Layer L's experts, mapped from the file; checked again after loading (the file may
        have been replaced since format() read it) and against the checkpoint's weights when the
        recorded source fingerprint is not this checkpoint's."""
        f = self.file(L)
        try:
            moe = load_layer(f, isa=isa)
        except FileNotFoundError:
            raise CheckpointError(f"{f}: removed while loading (is a `ktcy convert` writing {self.path}?)") from None
        c = moe.config
        dims = {"layer": L, "num_experts": c.num_experts, "top_k": c.top_k, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size}
        meta = {"activation": c.activation, "swiglu_alpha": c.swiglu_alpha, "swiglu_limit": c.swiglu_limit}
        self._check_dims(f, L, dims, meta)
        if (moe.format, moe.down_format) != self.formats(L):
            now = moe.format if moe.down_format == moe.format else f"{moe.format} (down {moe.down_format})"
            raise CheckpointError(f"{f}: changed while loading ({self.format(L)} before, {now} now; is a "
                                  f"`ktcy convert` writing {self.path}?)")
        if self._recorded_fingerprint(f) != self.fingerprint:
            self._compare_with_checkpoint(f, L, moe)
        return moe

    @property
    def fingerprint(self):
        if self._fingerprint is None:
            self._fingerprint = source_fingerprint(self.ckpt.path)
        return self._fingerprint

    def _refuse_running_conversion(self):
        """A converter holds an exclusive flock on the folder's lock file while it writes; a shared
        lock taken and dropped at once tells whether one is running (the lock file is opened
        read-only: nothing in the folder is written)."""
        lock = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return  # no lock file (copied without it) or not ours to open: nothing is converting here
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise CheckpointError(f"{self.path}: a `ktcy convert` (pid {holder}) is writing this folder; wait "
                                      "for it to finish") from None
        finally:
            os.close(fd)

    def _check_manifest(self):
        """The folder-wide shape in ktcy_model.json: another model's folder is named as such
        before any layer is looked at."""
        where = os.path.join(self.path, MODEL_FILE)
        model = read_json(where, MAX_CONFIG_BYTES)
        if not isinstance(model, dict) or model.get("format") != "ktcy.packed_model":
            raise CheckpointError(f"{where}: not a ktcy packed-model manifest")
        arch = self.ckpt.arch
        diffs = [f"{key} {model.get(key)!r} there, {getattr(arch, key)} in {self.ckpt.path}"
                 for key in _SHAPE_KEYS if model.get(key) != getattr(arch, key)]
        diffs += self._config_differences()
        if diffs:
            raise CheckpointError(f"{self.path}: converted from another model ({'; '.join(diffs)})")

    def _config_differences(self):
        """The model kind in the config.json the converter copied next to the layers, against
        the checkpoint's (absent there: nothing to compare; the layers are still checked)."""
        where = os.path.join(self.path, "config.json")
        if not os.path.lexists(where):
            return []
        theirs, ours = read_json(where, MAX_CONFIG_BYTES), self.ckpt.config
        if not isinstance(theirs, dict) or not isinstance(ours, dict):
            return []
        return [f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} in {self.ckpt.path}"
                for key in ("model_type", "architectures") if theirs.get(key) != ours.get(key)]

    def _check_dims(self, f, L, dims, meta):
        arch = self.ckpt.arch
        diffs = [f"{key} {dims[key]} in the file, {getattr(arch, key)} in {self.ckpt.arch.source}"
                 for key in _SHAPE_KEYS if dims[key] != getattr(arch, key)]
        if dims["layer"] != L:
            diffs.insert(0, f"it holds layer {dims['layer']}")
        want = {"activation": "silu", **block_settings(arch)}
        for key, value in want.items():
            held = meta.get(key, "silu" if key == "activation" else None)
            if key != "activation" and held is not None:
                held = _number(held)
            if held != value:
                diffs.append(f"{key} {held!r} in the file, {value!r} for {self.ckpt.path}")
        if diffs:
            raise CheckpointError(f"{self.path}: layer {L} ({os.path.basename(f)}) does not fit the checkpoint: "
                                  + "; ".join(diffs))

    def _recorded_fingerprint(self, f):
        return source_fingerprint_of(read_metadata(f)[1])

    def _compare_with_checkpoint(self, f, L, moe):
        """The first and last expert packed again from the checkpoint in the file's format must
        give the file's bytes: otherwise the folder was converted from other weights."""
        layer = self.ckpt.layer(L)
        target = {"gate": (moe.format, moe.gate[0].group_size), "up": (moe.format, moe.up[0].group_size),
                  "down": (moe.down_format, moe.down[0].group_size)}
        try:
            source = layer.source(moe.format, strict=False, down_fmt=moe.down_format)
        except ValueError:  # down in a format of its own, which this checkpoint's layers cannot hold
            raise CheckpointError(f"{self.path}: layer {L} was converted from other weights than {self.ckpt.path} "
                                  f"(it holds down as {moe.down_format} beside {moe.format}, which this checkpoint "
                                  f"does not store; {os.path.basename(f)} records another source fingerprint)") from None
        bias = layer.bias()
        for e in sorted({0, moe.config.num_experts - 1}):
            for proj, (w, scale) in source(e).items():
                fresh = pack_expert_weight(w, scale, *target[proj], f"{proj}[{e}]")
                held = getattr(moe, proj)[e]
                if not all(_same(getattr(fresh, part), getattr(held, part)) for part in ("data", "scale", "colsum", "zero")):
                    raise CheckpointError(f"{self.path}: layer {L} was converted from other weights than "
                                          f"{self.ckpt.path} (expert {e} {proj} differs; {os.path.basename(f)} "
                                          "records another source fingerprint)")
            for proj in PROJECTIONS:
                theirs = None if moe.bias is None else moe.bias.get(proj)
                ours = None if bias is None else bias.get(proj)
                if (theirs is None) != (ours is None) or (ours is not None and not _same(ours[e], theirs[e])):
                    raise CheckpointError(f"{self.path}: layer {L} was converted from other weights than "
                                          f"{self.ckpt.path} (expert {e} {proj} bias differs)")
        log.info("%s: layer %d records another source fingerprint (checkpoint copied or re-saved?), but its "
                 "weights match %s", self.path, L, self.ckpt.path)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.size == b.size and a.tobytes() == b.tobytes()


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def _listed(layers):
    layers = list(layers)
    return ", ".join(map(str, layers[:16])) + (f", ... ({len(layers)} in all)" if len(layers) > 16 else "")
