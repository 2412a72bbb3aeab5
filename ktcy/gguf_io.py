"""GGUF files (llama.cpp's model files) read by memory map: metadata and the tensor directory.

A GGUF file is a little-endian header (magic "GGUF", version 2 or 3, tensor and key-value
counts), the key-value metadata, one directory entry per tensor (name, dimensions innermost
first, ggml type, offset from the start of the data section), then the data section at the
next multiple of `general.alignment` (32 by default).  A model may be split into files named
`<name>-00001-of-0000N.gguf`, each a GGUF file with its share of the tensors.

Nothing in a file is trusted: counts, string lengths, dimensions, types, offsets and the
alignment are checked against the file's size before any tensor is read, tensors may not
overlap, and a CheckpointError names the file and the entry."""
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ktcy.safetensors_io import CheckpointError, file_state, open_regular_file

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_MAX_COUNT = 1 << 24          # tensors or metadata entries: a real model has tens of thousands
_MAX_DIMS = 4
_MAX_NAME = 1 << 16
_SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")

# ggml type id -> (name, values per block, bytes per block): ggml's own table, for every type a
# file may hold (ktcy dequantizes a subset, ktcy.gguf_quants; the others still have to be sized
# to check the file).  Q8_1 is left out: a type of llama.cpp's activations, never stored, whose
# size its tools disagree on.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
BLOCK_SIZES = {name: (values, nbytes) for name, values, nbytes in GGML_TYPES.values()}

# metadata value types: id -> struct format of a scalar (strings and arrays are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array: its element type and length; the values themselves only when short
    (the tokenizer's vocabulary is not what ktcy reads)."""
    item_type: int
    count: int
    values: Optional[tuple] = None

    def __len__(self):
        return self.count


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str
    dims: tuple          # ggml order: dims[0] is the innermost (contiguous) dimension
    begin: int           # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self):
        """numpy (row-major) shape of the values: the dimensions outermost first."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, path, buf, pos=0):
        self.path, self.buf, self.pos = path, buf, pos

    def take(self, n, what):
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise CheckpointError(f"{self.path}: {what} runs past the end of the file (truncated or not a GGUF file)")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def scalar(self, fmt, what):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what, limit=None):
        n = self.scalar("<Q", what)
        if limit is not None and n > limit:
            raise CheckpointError(f"{self.path}: {what} is {n} bytes long (at most {limit})")
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8") from None


def _value(cur, vtype, what, depth=0):
    if vtype in _SCALARS:
        return cur.scalar(_SCALARS[vtype], what)
    if vtype == _STRING:
        return cur.string(what)
    if vtype == _ARRAY and depth == 0:
        item = cur.scalar("<I", what)
        count = cur.scalar("<Q", what)
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            if count > (len(cur.buf) - cur.pos) // size:
                raise CheckpointError(f"{cur.path}: {what}: {count} values run past the end of the file")
            start = cur.pos
            cur.take(size * count, what)
            values = None
            if count <= 1024:
                values = tuple(struct.unpack(f"<{count}{_SCALARS[item][1]}", cur.buf[start:cur.pos]))
            return ArrayValue(item, count, values)
        if item == _STRING:
            if count > len(cur.buf) - cur.pos:
                raise CheckpointError(f"{cur.path}: {what}: {count} strings run past the end of the file")
            values = [cur.string(what) for _ in range(count)]
            return ArrayValue(item, count, tuple(values) if count <= 1024 else None)
        raise CheckpointError(f"{cur.path}: {what}: arrays of type {item} are not part of GGUF")
    raise CheckpointError(f"{cur.path}: {what}: unknown metadata value type {vtype}")


class GGUFFile:
    """One GGUF file: `metadata` {key: value}, `tensors` {name: TensorEntry}, and raw(name), the
    bytes of a tensor as a read-only view of the memory map."""

    def __init__(self, path):
        self.path = os.fspath(path)
        fd = open_regular_file(self.path)
        try:
            st = os.fstat(fd)
            self.state, self._inode = file_state(st), (st.st_dev, st.st_ino)
            if st.st_size < 24:
                raise CheckpointError(f"{self.path}: {st.st_size} bytes is too short for a GGUF file")
            try:
                self._mmap = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot map it ({e.strerror or e})") from None
        finally:
            os.close(fd)
        self._map = np.frombuffer(self._mmap, np.uint8)
        self._parse(memoryview(self._mmap))

    def _parse(self, buf):
        path = self.path
        if bytes(buf[:4]) != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
        cur = _Cursor(path, buf, 4)
        version = cur.scalar("<I", "version")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            kind = "a big-endian GGUF file, which ktcy does not read" if swapped in (2, 3) else f"GGUF version {version}"
            raise CheckpointError(f"{path}: {kind}; ktcy reads little-endian GGUF versions 2 and 3")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        for count, what in ((n_tensors, "tensors"), (n_kv, "metadata entries")):
            if count > _MAX_COUNT:
                raise CheckpointError(f"{path}: {count} {what} (at most {_MAX_COUNT}); not a model ktcy reads")
        self.metadata = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}", _MAX_NAME)
            if key in self.metadata:
                raise CheckpointError(f"{path}: metadata key {key!r} given twice")
            self.metadata[key] = _value(cur, cur.scalar("<I", f"metadata {key!r}"), f"metadata {key!r}")
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
                or alignment & (alignment - 1) or alignment > 1 << 20:
            raise CheckpointError(f"{path}: general.alignment {alignment!r:.40} is not a power of two up to 2^20")
        entries = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name {i}", _MAX_NAME)
            n_dims = cur.scalar("<I", f"tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
            dims = tuple(cur.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
            type_id = cur.scalar("<I", f"tensor {name!r}")
            offset = cur.scalar("<Q", f"tensor {name!r}")
            entries.append((name, dims, type_id, offset))
        self.data_start = data_start = -(-cur.pos // alignment) * alignment
        data_len = len(buf) - data_start
        self.tensors = {}
        spans = []
        for name, dims, type_id, offset in entries:
            if name in self.tensors:
                raise CheckpointError(f"{path}: tensor {name!r} listed twice")
            if type_id not in GGML_TYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {type_id}")
            type_name, block, block_bytes = GGML_TYPES[type_id]
            if dims[0] % block:
                raise CheckpointError(f"{path}: tensor {name!r}: {type_name} stores rows in blocks of {block} "
                                      f"values; its rows hold {dims[0]}")
            count = math.prod(dims)
            nbytes = count // block * block_bytes
            if offset % alignment:
                raise CheckpointError(f"{path}: tensor {name!r} starts at offset {offset}, not a multiple of the "
                                      f"alignment {alignment}")
            if offset > data_len or nbytes > data_len - offset:
                raise CheckpointError(f"{path}: tensor {name!r} ({type_name} {list(dims)}, {nbytes} bytes at offset "
                                      f"{offset}) runs past the end of the file (truncated?)")
            self.tensors[name] = TensorEntry(name, type_name, dims, data_start + offset, nbytes)
            spans.append((offset, offset + nbytes, name))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")

    def raw(self, name):
        """The stored bytes of tensor `name` (read-only view), once the file is checked unchanged
        since it was opened: a truncated mapping is SIGBUS, and bytes rewritten in place would
        mix two models (a file replaced by a rename leaves the mapped one intact)."""
        if self._mmap.size() != self.state[0]:
            raise CheckpointError(f"{self.path} changed size on disk since it was opened; load it again")
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == self._inode and file_state(st) != self.state:
            raise CheckpointError(f"{self.path} changed on disk since it was opened; load it again")
        t = self.tensors[name]
        return self._map[t.begin:t.begin + t.nbytes]

    def release_pages(self):
        self._mmap.madvise(mmap.MADV_DONTNEED)


def split_parts(path):
    """The files of the model that `path` names: path itself, or for a split model's file
    (`<name>-0000K-of-0000N.gguf`) every part, which must all exist."""
    folder, base = os.path.split(os.fspath(path))
    m = _SPLIT_NAME.fullmatch(base)
    if not m:
        return [os.fspath(path)]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise CheckpointError(f"{path}: part {int(m['no'])} of {count}?")
    parts = [os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.lexists(p)]
    if missing:
        raise CheckpointError(f"{path}: part of a {count}-file model, but {missing[0]} is missing")
    return parts


def _split_key(meta, key, path):
    v = meta.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise CheckpointError(f"{path}: {key} is {v!r:.40}, expected an integer")
    return v


class GGUFModel:
    """A GGUF model in one file or split into several: the first part's metadata, every part's
    tensors (a name in two parts is refused)."""

    def __init__(self, path):
        self.parts = [GGUFFile(p) for p in split_parts(path)]
        self.path = self.parts[0].path
        self.metadata = self.parts[0].metadata
        self._where = {}
        count = len(self.parts)
        stated = _split_key(self.metadata, "split.count", self.path)
        if count == 1 and stated is not None and stated > 1:
            raise CheckpointError(f"{self.path}: part of a model split into {stated} files (split.count), but not named "
                                  "<name>-0000K-of-0000N.gguf beside its other parts")
        for i, part in enumerate(self.parts):
            stated_count = _split_key(part.metadata, "split.count", part.path)
            stated_no = _split_key(part.metadata, "split.no", part.path)
            if count > 1 and (stated_count != count or stated_no != i):
                raise CheckpointError(f"{part.path}: says it is part {stated_no} of {stated_count} (split.no, "
                                      f"split.count), its name part {i} of {count} (numbered from 0)")
            for name in part.tensors:
                if name in self._where:
                    raise CheckpointError(f"{part.path}: tensor {name!r} is also in {self._where[name].path}")
                self._where[name] = part

    def __contains__(self, name):
        return name in self._where

    def tensor_names(self):
        return self._where.keys()

    def entry(self, name):
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        return self._where[name].tensors[name]

    def raw(self, name):
        self.entry(name)
        return self._where[name].raw(name)

    def release_pages(self):
        for part in self.parts:
            part.release_pages()
