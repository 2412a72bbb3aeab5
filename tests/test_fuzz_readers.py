"""Property-based fuzzing of the readers (issue 16): random edits of real files written here.

safetensors headers (offsets, shapes, dtypes, keys, metadata, header length, truncation, byte
flips), config.json values and raw bytes, and index weight maps.  Property: the reader raises
CheckpointError, or returns exactly what the (edited) file declares - and for an edit that
changes nothing, exactly what the untampered file holds.  Never another exception, never a hang
(a SIGALRM limit per example).  The pure-Python readers run in-process; the load -> pack ->
forward path (C code) runs in a subprocess with a timeout so that a crash is a failure, not a
dead test run.

Default runs are short; `pytest -m fuzz test_fuzz_readers.py` runs the long ones."""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from checkpoints import make_checkpoint
from conftest import time_limit
from ktcy.checkpoint import Checkpoint
from ktcy.safetensors_io import DTYPES, CheckpointError, SafetensorsFile, write

SHORT = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=2000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
EXAMPLE_SECONDS = 20


# --- strategies -------------------------------------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-3, 20) | st.integers(-2**70, 2**70)
                | st.floats() | st.text(max_size=8) | st.sampled_from(["22", "1", "[0]", "../x", "/etc/passwd"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
DTYPE_NAMES = st.sampled_from(sorted(DTYPES) + ["F4", "f32", "", "F8_E8M0", "U128"])
SHAPES = st.lists(st.integers(-2, 12) | st.integers(2**31, 2**66) | st.sampled_from([2.0, "2", True, None]), max_size=4)
OFFSETS = (st.lists(st.integers(-8, 400), min_size=2, max_size=2) | st.lists(JSON_SCALARS, max_size=3)
           | st.tuples(st.integers(0, 2**64), st.integers(0, 2**64)).map(list))


def header_edits(names):
    name = st.sampled_from(names)
    return st.one_of(
        st.tuples(st.just("dtype"), name, DTYPE_NAMES),
        st.tuples(st.just("shape"), name, SHAPES),
        st.tuples(st.just("data_offsets"), name, OFFSETS),
        st.tuples(st.just("shift"), name, st.integers(-16, 16)),
        st.tuples(st.just("drop_field"), name, st.sampled_from(["dtype", "shape", "data_offsets"])),
        st.tuples(st.just("drop"), name, st.none()),
        st.tuples(st.just("rename"), name, st.text(max_size=10)),
        st.tuples(st.just("duplicate"), name, st.none()),
        st.tuples(st.just("entry"), name, JSON_VALUES),
        st.tuples(st.just("metadata"), st.none(), JSON_VALUES),
        st.tuples(st.just("extra_key"), st.text(max_size=8), JSON_VALUES),
    )


RAW_EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.none()),
    st.tuples(st.just("header_len"), st.integers(0, 2**64 - 1), st.none()),
    st.tuples(st.just("header_len_delta"), st.integers(-16, 16), st.none()),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16), st.none()),
)


def apply_header_edits(header, edits):
    """The header as JSON text after the edits ("duplicate" repeats an entry textually)."""
    header = json.loads(json.dumps(header))
    duplicates = []
    for op, name, value in edits:
        if op == "metadata":
            header["__metadata__"] = value
        elif op == "extra_key":
            header[name] = value
        elif name not in header or not isinstance(header[name], dict):
            continue
        elif op in ("dtype", "shape", "data_offsets"):
            header[name][op] = value
        elif op == "shift":
            offsets = header[name].get("data_offsets")
            if isinstance(offsets, list) and all(isinstance(v, int) for v in offsets):
                header[name]["data_offsets"] = [v + value for v in offsets]
        elif op == "drop_field":
            header[name].pop(value, None)
        elif op == "drop":
            del header[name]
        elif op == "rename":
            header[value] = header.pop(name)
        elif op == "duplicate":
            duplicates.append((name, header[name]))
        elif op == "entry":
            header[name] = value
    text = json.dumps(header)
    for name, entry in duplicates:
        text = text[:-1] + ("," if len(text) > 2 else "") + json.dumps(name) + ":" + json.dumps(entry) + "}"
    return text.encode()


def apply_raw_edits(blob, edits):
    blob = bytearray(blob)
    for op, a, b in edits:
        if op == "flip" and blob:
            (header_len,) = struct.unpack("<Q", bytes(blob[:8]).ljust(8, b"\0"))
            blob[a % min(len(blob), 8 + header_len)] = b  # the length field and the header
        elif op == "truncate":
            del blob[a % (len(blob) + 1):]
        elif op == "header_len" and len(blob) >= 8:
            blob[:8] = struct.pack("<Q", a)
        elif op == "header_len_delta" and len(blob) >= 8:
            # the field is a u64: a delta past either end wraps, as a corrupted field would read
            blob[:8] = struct.pack("<Q", (struct.unpack("<Q", bytes(blob[:8]))[0] + a) % 2**64)
        elif op == "append":
            blob += a
    return bytes(blob)


def split(blob):
    """(header bytes, data bytes) of a file as laid out; None if it cannot be split."""
    if len(blob) < 8:
        return None
    (n,) = struct.unpack("<Q", blob[:8])
    return None if n > len(blob) - 8 else (blob[8:8 + n], blob[8 + n:])


# --- the safetensors reader -------------------------------------------------------------------

def base_tensors():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((3, 4)).astype(np.float32),
            "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
            "c": rng.standard_normal((2, 3)).astype(ml_dtypes.float8_e4m3fn),
            "i": np.array([7, -1], np.int64), "z": np.zeros((0, 4), np.uint8)}


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "base.safetensors"
    write(path, base_tensors(), {"format": "pt", "note": "fuzz"})
    blob = path.read_bytes()
    header, _ = split(blob)
    return blob, json.loads(header)


def contents(f):
    return {name: (f.dtype(name), f.shape(name), np.ascontiguousarray(f.get(name)).view(np.uint8).tobytes())
            for name in f.keys()}


def check_safetensors_edit(base_file, edits, raw_edits, padding):
    blob, header = base_file
    head = apply_header_edits(header, edits) + b" " * padding
    edited = apply_raw_edits(struct.pack("<Q", len(head)) + head + split(blob)[1], raw_edits)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.safetensors")
        with open(path, "wb") as out:
            out.write(edited)
        try:
            with time_limit(EXAMPLE_SECONDS):
                f = SafetensorsFile(path)
                got = contents(f)
        except CheckpointError as e:
            event("refused")
            assert path in str(e)
            parts = split(edited)
            if parts is not None and parts[1] == split(blob)[1]:
                assert strict_json(parts[0]) != header, f"a no-op edit was refused: {e}"
            return
    event("accepted")
    # accepted: what the edited header declares, read independently with plain json
    head_bytes, data = split(edited)
    declared = json.loads(head_bytes)
    assert f.metadata == (declared.pop("__metadata__", None) or {})
    assert set(got) == set(declared)
    covered = 0
    for name, entry in declared.items():
        begin, end = entry["data_offsets"]
        assert got[name][0] == DTYPES[entry["dtype"]] and got[name][1] == tuple(entry["shape"])
        assert got[name][2] == data[begin:end]
        covered += end - begin
    assert covered == len(data)


def strict_json(raw):
    """The header as the format defines it (UTF-8, unique keys), or None when it is not one."""
    def unique(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except (ValueError, RecursionError):
        return None


def read_blob(blob):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.safetensors")
        with open(path, "wb") as out:
            out.write(blob)
        return SafetensorsFile(path)


NAMES = sorted(base_tensors())
EDIT_LISTS = st.lists(header_edits(NAMES), max_size=3)
RAW_LISTS = st.lists(RAW_EDITS, max_size=2)


@SHORT
@given(edits=EDIT_LISTS, raw_edits=RAW_LISTS, padding=st.integers(0, 9))
def test_fuzz_safetensors_header(base_file, edits, raw_edits, padding):
    check_safetensors_edit(base_file, edits, raw_edits, padding)


@pytest.mark.fuzz
@LONG
@given(edits=EDIT_LISTS, raw_edits=RAW_LISTS, padding=st.integers(0, 9))
def test_fuzz_safetensors_header_long(long_run, base_file, edits, raw_edits, padding):
    check_safetensors_edit(base_file, edits, raw_edits, padding)


@SHORT
@given(order=st.permutations(NAMES), meta_first=st.booleans(), padding=st.integers(0, 9),
       whitespace=st.sampled_from([" ", "\n", "\t", "\r\n"]))
def test_fuzz_no_op_edits_give_the_untampered_result(base_file, order, meta_first, padding, whitespace):
    """Re-serialising the same header (key order, whitespace, padding) changes nothing."""
    blob, header = base_file
    items = [(n, header[n]) for n in order]
    items = ([("__metadata__", header["__metadata__"])] + items) if meta_first else (items + [("__metadata__", header["__metadata__"])])
    head = ("{" + ("," + whitespace).join(json.dumps(k) + ":" + whitespace + json.dumps(v) for k, v in items) + "}").encode()
    head += b" " * padding
    edited = struct.pack("<Q", len(head)) + head + split(blob)[1]
    with time_limit(EXAMPLE_SECONDS):
        assert contents(read_blob(edited)) == contents(read_blob(blob))


# --- config.json and the index ----------------------------------------------------------------

READER_KEYS = ["num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "hidden_size",
               "moe_intermediate_size", "intermediate_size", "num_hidden_layers", "mlp_only_layers",
               "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq", "text_config"]
NEAR_VALID = st.integers(-2, 200) | st.sampled_from([4, 64, 128, 10**8, 10**12, [0], [0, 1], [], [3], "1", 1.0, True])
CONFIG_EDITS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(READER_KEYS), NEAR_VALID | JSON_VALUES),
    st.tuples(st.just("delete"), st.sampled_from(READER_KEYS), st.none()),
    st.tuples(st.just("nest"), st.none(), st.none()),
    st.tuples(st.just("replace"), st.none(), JSON_VALUES),
)
TEXT_EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**5), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**5), st.none()),
    st.tuples(st.just("duplicate_key"), st.sampled_from(READER_KEYS), st.integers(-1, 9)),
)


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """(folder, config, {layer: [expert arrays]}) of a two-shard checkpoint with an index."""
    path = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(path, E=4, H=64, I=32, shards=2)
    with open(path / "config.json") as f:
        config = json.load(f)
    ckpt = Checkpoint(path)
    truth = {L: [expert_bytes(ckpt.layer(L).expert(e)) for e in range(4)] for L in ckpt.arch.moe_layers}
    return str(path), config, truth


def expert_bytes(expert):
    """{proj: (dtype, shape, digest of the bytes)}: compact enough for hypothesis' reports."""
    return {p: (w.dtype, w.shape, hashlib.sha256(np.ascontiguousarray(w).view(np.uint8)).hexdigest())
            for p, (w, _) in expert.items()}


def edit_config_text(config, edits, text_edits):
    config = json.loads(json.dumps(config))
    for op, key, value in edits:
        if op in ("set", "delete") and not isinstance(config, dict):
            continue
        if op == "set":
            config[key] = value
        elif op == "delete":
            config.pop(key, None)
        elif op == "nest":
            config = {"text_config": config, "architectures": ["Wrapper"]}
        elif op == "replace":
            config = value
    text = json.dumps(config).encode()
    blob = bytearray(text)
    for op, a, b in text_edits:
        if op == "flip" and blob:
            blob[a % len(blob)] = b
        elif op == "truncate":
            del blob[a % (len(blob) + 1):]
        elif op == "duplicate_key" and blob.endswith(b"}") and len(blob) > 2:
            blob = blob[:-1] + f',"{a}":{b}}}'.encode()
    return bytes(blob)


def check_checkpoint_edit(base_checkpoint, files):
    """Writes {name: bytes} over a copy of the base checkpoint and reads every expert of every
    MoE layer: CheckpointError, or exactly the stored tensors."""
    folder, _, truth = base_checkpoint
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c")
        shutil.copytree(folder, path)
        for name, data in files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
        try:
            with time_limit(EXAMPLE_SECONDS):
                ckpt = Checkpoint(path)
                got = {L: [expert_bytes(ckpt.layer(L).expert(e)) for e in range(ckpt.arch.num_experts)]
                       for L in ckpt.arch.moe_layers}
        except CheckpointError:
            event("refused")
            return None
    event(f"accepted, {len(got)} MoE layers read")
    if got:  # a config may name no MoE layer at all (then nothing is read, nothing to compare)
        assert (ckpt.arch.hidden_size, ckpt.arch.intermediate_size, ckpt.arch.num_experts) == (64, 32, 4)
    for L, experts in got.items():
        assert experts == truth[L], f"layer {L} differs from what is stored"
    return got


CONFIG_LISTS = st.lists(CONFIG_EDITS, max_size=3)
TEXT_LISTS = st.lists(TEXT_EDITS, max_size=2)


def check_config(base_checkpoint, edits, text_edits):
    _, config, truth = base_checkpoint
    got = check_checkpoint_edit(base_checkpoint, {"config.json": edit_config_text(config, edits, text_edits)})
    if not edits and not text_edits:
        assert got == truth


@SHORT
@given(edits=CONFIG_LISTS, text_edits=TEXT_LISTS)
def test_fuzz_config_json(base_checkpoint, edits, text_edits):
    check_config(base_checkpoint, edits, text_edits)


@pytest.mark.fuzz
@LONG
@given(edits=CONFIG_LISTS, text_edits=TEXT_LISTS)
def test_fuzz_config_json_long(long_run, base_checkpoint, edits, text_edits):
    check_config(base_checkpoint, edits, text_edits)


SHARD_NAMES = st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "../model-00001-of-00002.safetensors", "/etc/passwd", "", ".", "config.json",
                               "./model-00001-of-00002.safetensors", "x/../model-00002-of-00002.safetensors"])
INDEX_EDITS = st.one_of(
    st.tuples(st.just("point"), st.integers(0, 10**4), SHARD_NAMES | JSON_SCALARS),
    st.tuples(st.just("drop"), st.integers(0, 10**4), st.none()),
    st.tuples(st.just("add"), st.text(max_size=12), SHARD_NAMES),
    st.tuples(st.just("weight_map"), st.none(), JSON_VALUES),
    st.tuples(st.just("document"), st.none(), JSON_VALUES),
)


def edit_index(folder, edits):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        doc = json.load(f)
    keys = sorted(doc["weight_map"])
    for op, a, b in edits:
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if op == "point" and isinstance(wm, dict):
            wm[keys[a % len(keys)]] = b
        elif op == "drop" and isinstance(wm, dict):
            wm.pop(keys[a % len(keys)], None)
        elif op == "add" and isinstance(wm, dict):
            wm[a] = b
        elif op == "weight_map" and isinstance(doc, dict):
            doc["weight_map"] = b
        elif op == "document":
            doc = b
    return json.dumps(doc).encode()


def check_index(base_checkpoint, edits):
    folder, _, truth = base_checkpoint
    got = check_checkpoint_edit(base_checkpoint, {"model.safetensors.index.json": edit_index(folder, edits)})
    if not edits:
        assert got == truth


@SHORT
@given(edits=st.lists(INDEX_EDITS, max_size=3))
def test_fuzz_index(base_checkpoint, edits):
    check_index(base_checkpoint, edits)


@pytest.mark.fuzz
@LONG
@given(edits=st.lists(INDEX_EDITS, max_size=3))
def test_fuzz_index_long(long_run, base_checkpoint, edits):
    check_index(base_checkpoint, edits)


# --- through the C code: load, pack, forward in a subprocess ----------------------------------

def run_c_path_fuzz(folder, examples):
    """Called in a child process: random config / shard-header edits, then load_experts (BF16 and
    INT8 packing) and a forward.  Exits non-zero on any exception other than CheckpointError /
    ValueError; a crash shows as a signal in the parent."""
    import ktcy
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    shard = os.path.join(folder, "model-00001-of-00002.safetensors")
    with open(shard, "rb") as f:
        blob = f.read()
    header = json.loads(split(blob)[0])
    names = sorted(k for k in header if k != "__metadata__")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 3]], np.int64)
    w = np.full((3, 2), 0.5, np.float32)

    def reference(method):
        return ktcy.load_experts(folder, 1, method=method).forward(x, ids, w)

    expected = {m: reference(m) for m in (None, "INT8")}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(edits=st.lists(CONFIG_EDITS, max_size=2), shard_edits=st.lists(header_edits(names), max_size=2),
           method=st.sampled_from([None, "INT8"]))
    def one(edits, shard_edits, method):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "c")
            shutil.copytree(folder, path)
            with open(os.path.join(path, "config.json"), "wb") as f:
                f.write(edit_config_text(config, edits, []))
            head = apply_header_edits(header, shard_edits)
            with open(os.path.join(path, os.path.basename(shard)), "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head + split(blob)[1])
            try:
                y = ktcy.load_experts(path, 1, method=method).forward(x, ids, w)
            except ValueError:  # CheckpointError is one
                tally["refused"] += 1
                return
            tally["accepted"] += 1
            if not edits and not shard_edits:
                assert np.array_equal(y, expected[method])
            assert y.shape == (3, 64)

    tally = {"accepted": 0, "refused": 0}
    one()
    print(json.dumps(tally))


def c_path_fuzz(base_checkpoint, examples, timeout):
    folder = base_checkpoint[0]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests_dir!r}); import test_fuzz_readers as t; " \
           f"t.run_c_path_fuzz({folder!r}, {examples})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    tally = json.loads(r.stdout.strip().splitlines()[-1])
    assert tally["accepted"] > 0 and tally["refused"] > 0, tally  # both outcomes were exercised


def test_fuzz_load_and_forward_in_a_subprocess(base_checkpoint):
    c_path_fuzz(base_checkpoint, 40, timeout=300)


@pytest.mark.fuzz
def test_fuzz_load_and_forward_in_a_subprocess_long(long_run, base_checkpoint):
    c_path_fuzz(base_checkpoint, 1000, timeout=3000)
