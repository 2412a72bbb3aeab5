"""safetensors files read by memory map (no copy, every dtype including F8_E4M3, which the
safetensors package's numpy backend cannot load) and written atomically (temporary name, then
rename, so an interrupted write never leaves a complete-looking file)."""
import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint or packed file that is missing, truncated, malformed or inconsistent."""


class SafetensorsFile:
    """Tensors of one file as read-only numpy views of a memory map."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors file (truncated?)")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{self.path}: header length {header_len} does not fit a {size}-byte file "
                                      "(truncated or not a safetensors file)")
            raw = f.read(header_len)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has a malformed or unsupported entry {info!r}") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"{self.path}: tensor {name!r} claims {end - begin} bytes for shape {shape} "
                                      f"{info['dtype']} ({nbytes} bytes)")
            if end > data_len:
                raise CheckpointError(f"{self.path}: tensor {name!r} ends at byte {end} of a {data_len}-byte data "
                                      "section (file truncated)")
            self._entries[name] = (dtype, shape, begin)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._data_start else None

    def keys(self):
        return self._entries.keys()

    def __contains__(self, name):
        return name in self._entries

    def shape(self, name):
        return self._entries[name][1]

    def dtype(self, name):
        return self._entries[name][0]

    def get(self, name):
        """The tensor as a read-only view of the mapped file (no copy)."""
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        dtype, shape, begin = self._entries[name]
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.zeros(shape, dtype)
        start = self._data_start + begin
        return self._map[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def write(path, tensors, metadata=None):
    """Writes {name: array} (C order) with string metadata, via a temporary name and a rename."""
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
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
