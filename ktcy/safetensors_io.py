"""safetensors files read by memory map (no copy, every dtype including F8_E4M3, which the
safetensors package's numpy backend cannot load) and written atomically (temporary name, then
rename, so an interrupted write never leaves a complete-looking file).

The reader trusts nothing in a file: it refuses what the format forbids (duplicate keys,
overlapping or uncovered byte ranges, malformed shapes, unknown dtypes, a non-UTF-8 header)
with a CheckpointError naming the file and the tensor."""
import json
import math
import mmap
import os
import stat
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the limit the safetensors package itself applies


class CheckpointError(ValueError):
    """A checkpoint or packed file that is missing, truncated, malformed or inconsistent."""


def open_regular_file(path, what=None, follow_symlinks=True):
    """A read-only descriptor of path, which must be a regular file: opened non-blocking so that a
    FIFO fails at once instead of waiting for a writer, then checked with fstat (no race).
    follow_symlinks=False refuses a path that is itself a symlink (ELOOP)."""
    what = what or path
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags if follow_symlinks else flags | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{what}: is a folder, expected a file") from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        raise CheckpointError(f"{what}: {kind}; expected a file")
    return fd


def strict_json(text, what, kind="JSON"):
    """json.loads that refuses what readers disagree on (CheckpointError naming `what`): a key
    given twice (which one wins is undefined), NaN/Infinity (not JSON), and malformed or absurdly
    nested text."""
    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError(f"{what}: {kind} lists {key!r} twice")
            out[key] = value
        return out

    def refuse(name):
        raise CheckpointError(f"{what}: {kind} holds {name}, which is not JSON")

    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=refuse)
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an int past Python's digit limit
        raise CheckpointError(f"{what}: {kind} is not valid JSON ({e})") from None


_MAX_DIMS = 32  # numpy 1.x's limit (numpy 2 allows 64); no checkpoint tensor comes close


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(path, raw, data_len):
    """(metadata {str: str}, {name: (dtype, shape, begin)}) from a header's bytes, checked
    against a data section of data_len bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: header is not UTF-8 ({e})") from None
    header = strict_json(text, path, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    entries, ranges = {}, []
    for name, info in header.items():
        dtype, shape, begin, end = _entry(path, name, info)
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} claims {end - begin} bytes for shape {shape} "
                                  f"{info['dtype']} ({nbytes} bytes)")
        if end > data_len:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {end} of a {data_len}-byte data "
                                  "section (file truncated)")
        entries[name] = (dtype, shape, begin)
        ranges.append((begin, end, name))
    _check_tiling(path, ranges, data_len)
    return metadata, entries


def _entry(path, name, info):
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: entry is not an object ({info!r:.80})")
    missing = {"dtype", "shape", "data_offsets"} - info.keys()
    if missing:
        raise CheckpointError(f"{path}: tensor {name!r}: entry lacks {', '.join(sorted(missing))}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {code!r:.40} "
                              f"(known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r:.80} is not a list of non-negative integers")
    if len(shape) > _MAX_DIMS or any(d >= 2**62 for d in shape):  # beyond what numpy can view
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r:.80} has more than {_MAX_DIMS} dimensions or "
                              "a dimension of 2^62 or more")
    if math.prod(d for d in shape if d) * np.dtype(DTYPES[code]).itemsize >= 2**62:  # numpy refuses even at size 0
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r:.80} spans 2^62 bytes or more")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(v) for v in offsets):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r:.80} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets} are not 0 <= begin <= end")
    return DTYPES[code], tuple(shape), begin, end


def _check_tiling(path, ranges, data_len):
    """The tensors must tile the data section exactly: no overlap, no gap, nothing after the last."""
    position, previous = 0, None
    for begin, end, name in sorted(ranges):
        if begin < position:
            raise CheckpointError(f"{path}: tensor {name!r} (bytes {begin}-{end}) overlaps tensor {previous!r}")
        if begin > position:
            raise CheckpointError(f"{path}: bytes {position}-{begin} before tensor {name!r} belong to no tensor")
        position, previous = end, name
    if position != data_len:
        raise CheckpointError(f"{path}: bytes {position}-{data_len} at the end of the file belong to no tensor")


def file_state(st):
    """What tells a mapped file was changed on disk since: its size (a truncated mapping is
    SIGBUS) and modification time (bytes rewritten in place would pass every load check unseen)."""
    return st.st_size, st.st_mtime_ns


class SafetensorsFile:
    """Tensors of one file as read-only numpy views of a memory map.  fd: the file already
    open (the caller's, left open: what it watches is then what is mapped), else path is opened."""

    def __init__(self, path, fd=None):
        self.path = os.fspath(path)
        own = self._checks_itself = fd is None  # else the caller watches fd (MoE.watch_file)
        fd = open_regular_file(self.path) if own else fd
        try:
            st = os.fstat(fd)
            size, self.state, self._inode = st.st_size, file_state(st), (st.st_dev, st.st_ino)
            if size < 8:
                raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors file (truncated?)")
            (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{self.path}: header length {header_len} does not fit a {size}-byte file "
                                      "(truncated or not a safetensors file)")
            raw = os.pread(fd, header_len, 8)
            if len(raw) != header_len:
                raise CheckpointError(f"{self.path}: file shrank while being read")
            self._data_start = 8 + header_len
            self.metadata, self._entries = parse_header(self.path, raw, size - self._data_start)
            # map exactly the size validated above; a file that shrinks later is the caller's risk (SIGBUS)
            try:
                self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size > self._data_start else None
            except OSError as e:  # out of descriptors or address space: name the file
                raise CheckpointError(f"{self.path}: cannot map it ({e.strerror or e})") from None
            self._map = np.frombuffer(self._mmap, np.uint8) if self._mmap is not None else None
        finally:
            if own:
                os.close(fd)

    def keys(self):
        return self._entries.keys()

    def __contains__(self, name):
        return name in self._entries

    def shape(self, name):
        return self._entries[name][1]

    def dtype(self, name):
        return self._entries[name][0]

    def get(self, name):
        """The tensor as a read-only view of the mapped file (no copy).  The file is first checked
        unchanged since it was mapped: a checkpoint kept open (MoEModel, ktcy.hf) is read again
        when a block changes backend, and a shard truncated meanwhile would be SIGBUS there."""
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        if self._checks_itself:
            self._check_unchanged()
        dtype, shape, begin = self._entries[name]
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype)
        start = self._data_start + begin
        view = self._map[start:start + count * dtype.itemsize]
        if start % dtype.alignment:  # the format allows any offset; C code reads only aligned arrays
            view = view.copy()
            view.flags.writeable = False  # as the mapped views are
        return view.view(dtype).reshape(shape)

    def release_pages(self):
        """Drops the file's pages from this process's resident set once they were read: they stay
        in the page cache (a later read maps them again, same bytes), but no longer count against
        the process (its RSS, a cgroup's limit) for the whole checkpoint it went through."""
        if self._mmap is not None:
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def _check_unchanged(self):
        """Reading a mapping past the end of a file truncated since is SIGBUS: the mapped file's
        own size is checked (mmap's descriptor, whatever the path names now), and where the path
        still names that file, its modification time (bytes rewritten in place).  A file deleted
        or replaced by a rename leaves the mapped one intact: its bytes are still what was loaded."""
        if self._mmap is not None and self._mmap.size() != self.state[0]:
            raise CheckpointError(f"{self.path} changed size on disk since it was opened ({self.state[0]} -> "
                                  f"{self._mmap.size()} bytes); load the checkpoint again")
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._inode and file_state(st) != self.state:
            raise CheckpointError(f"{self.path} changed on disk since it was opened; load the checkpoint again")


def write(path, tensors, metadata=None):
    """Writes {name: array} (C order) with string metadata, via a temporary name and a rename."""
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} cannot be stored (a str other than __metadata__)")
        a = np.ascontiguousarray(array)
        if a.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data section 8-byte aligned
    tmp = os.fspath(path) + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.view(np.uint8).data if a.nbytes else b"")  # bytes: ml_dtypes types have no buffer format
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
