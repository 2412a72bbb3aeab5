"""Untrusted packed files and hand-made weights never reach a kernel unchecked; layers keep to
their own thread count, group size and routing width; memory of one huge batch is given back."""
import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ktcy
from ktcy import _native, kernels
from ktcy.packed_io import load_layer, pack_layer, write_layer
from ktcy.safetensors_io import CheckpointError

E, K_TOP, H, I = 3, 2, 128, 64


def write_packed(path, fmt, group=64, seed=0, down=None):
    """A packed layer file; down: the down projection's (format, group) when it has its own."""
    rng = np.random.default_rng(seed)
    src = {e: {"gate": (rng.standard_normal((I, H), np.float32), None),
               "up": (rng.standard_normal((I, H), np.float32), None),
               "down": (rng.standard_normal((H, I), np.float32), None)} for e in range(E)}
    arrays = pack_layer(E, fmt, group, lambda e: src[e], down=down)
    write_layer(str(path), arrays, fmt, group, E, K_TOP, H, I, 0, down=down)
    return path


def read_header(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path, header, body):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)


def tamper_metadata(path, **changes):
    header, body = read_header(path)
    header["__metadata__"].update({k: str(v) for k, v in changes.items()})
    write_header(path, header, body)


def forward(layer, T=3):
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(E)[:K_TOP] for _ in range(T)])
    return layer.forward(rng.standard_normal((T, H), np.float32), ids, np.full((T, K_TOP), 0.5, np.float32))


@pytest.mark.parametrize("fmt,changes", [
    ("FP8_BLOCK", {"weight_format": "FP8_PERCHANNEL"}),
    ("FP8_PERCHANNEL", {"weight_format": "FP8_BLOCK"}),
    ("INT4", {"group_size": 32}),
    ("INT4", {"group_size": 128}),
    ("INT4", {"group_size": 48}),
    ("INT8", {"hidden_size": I, "intermediate_size": H}),
    # a smaller N or K that keeps every array's size (the codes past it are not padding)
    ("INT4", {"intermediate_size": I - 15}),
    ("INT4_ZP", {"intermediate_size": I - 15}),
    ("MXFP4_A8", {"intermediate_size": I - 15}),
    ("FP8_BLOCK", {"hidden_size": H - 1}),
    ("BF16", {"intermediate_size": I - 1}),
    ("INT8", {"weight_format": "INT4"}),
    ("BF16", {"weight_format": "INT8"}),
    ("INT8", {"num_experts": E + 1}),
    ("INT8", {"hidden_size": "1e3"}),
    ("INT8", {"top_k": 0}),
    ("INT8", {"scale_kind": "group"}),
])
def test_tampered_metadata_is_refused_before_any_kernel_runs(tmp_path, fmt, changes):
    path = write_packed(tmp_path / "layer.safetensors", fmt)
    tamper_metadata(path, **changes)
    with pytest.raises(CheckpointError):
        load_layer(str(path))


def test_scale_of_the_wrong_shape_is_refused(tmp_path):
    path = write_packed(tmp_path / "layer.safetensors", "INT4")
    header, body = read_header(path)
    header["gate.scale"]["shape"] = [E, int(np.prod(header["gate.scale"]["shape"][1:]))]
    write_header(path, header, body)
    load_layer(str(path))  # the same floats as one flat row per expert are fine
    header["gate.scale"]["shape"] = [E * 2, header["gate.scale"]["shape"][1] // 2]
    write_header(path, header, body)
    with pytest.raises(CheckpointError, match="gate.scale"):
        load_layer(str(path))


def test_untampered_file_loads_and_matches(tmp_path):
    for fmt in ktcy.FORMATS:
        path = write_packed(tmp_path / f"{fmt}.safetensors", fmt)
        layer = load_layer(str(path))
        assert layer.format == fmt and np.isfinite(forward(layer)).all()


@pytest.mark.parametrize("what", ["scale_short", "scale_dtype", "colsum_missing", "data_short", "group"])
def test_hand_made_packed_weight_is_checked_at_the_c_boundary(what):
    W = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    p = kernels.pack(W, "INT8")
    X = np.ones((2, 128), np.float32)
    bad = {"scale_short": dict(scale=np.ones(1, np.float32)),
           "scale_dtype": dict(scale=p.scale.astype(np.float64)),
           "colsum_missing": dict(colsum=None),
           "data_short": dict(data=p.data[:-64]),
           "group": dict(group_size=32)}[what]
    fields = dict(format=p.format, shape=p.shape, data=p.data, scale=p.scale, colsum=p.colsum, group_size=0)
    fields.update(bad)
    hand = kernels.PackedWeight(**fields)
    with pytest.raises((ValueError, TypeError)):
        kernels.linear(X, hand)


def test_truncated_mapped_file_raises_instead_of_sigbus(tmp_path):
    path = write_packed(tmp_path / "layer.safetensors", "INT8")
    code = ("import os, numpy as np\n"
            "from ktcy.packed_io import load_layer\n"
            "from ktcy.safetensors_io import CheckpointError\n"
            f"layer = load_layer({str(path)!r})\n"
            "x = np.ones((1, %d), np.float32)\n"
            "ids = np.array([[0, 1]]); w = np.ones((1, 2), np.float32)\n"
            "layer.forward(x, ids, w)\n"
            f"os.truncate({str(path)!r}, 4096)\n"
            "try:\n"
            "    layer.forward(x, ids, w)\n"
            "except CheckpointError as e:\n"
            "    print('refused:', e)\n" % H)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "changed size" in r.stdout


def test_mixed_int4_group_sizes_are_refused():
    rng = np.random.default_rng(3)
    g64 = [kernels.pack(rng.standard_normal((I, H)).astype(np.float32), "INT4", group_size=64) for _ in range(E)]
    g32 = kernels.pack(rng.standard_normal((I, H)).astype(np.float32), "INT4", group_size=32)
    down = [kernels.pack(rng.standard_normal((H, I)).astype(np.float32), "INT4", group_size=64) for _ in range(E)]
    cfg = ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("INT4"))
    with pytest.raises(ValueError, match="group size"):
        ktcy.MoE(cfg, g64[:-1] + [g32], g64, down)


def small_layer(fmt="INT8", **cfg):
    rng = np.random.default_rng(4)
    gate, up = (rng.standard_normal((E, I, H), np.float32) for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32)
    return ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig(fmt), **cfg), gate, up, down)


def test_routing_width_must_be_top_k():
    layer = small_layer()
    x = np.ones((2, H), np.float32)
    with pytest.raises(ValueError, match="top_k"):
        layer.forward(x, np.zeros((2, 1), np.int64), np.ones((2, 1), np.float32))


def test_layer_thread_count_is_its_own():
    before = ktcy.get_num_threads()
    layer = small_layer(num_threads=1)
    assert ktcy.get_num_threads() == before and layer.num_threads == 1
    with pytest.raises(ValueError, match="num_threads"):
        ktcy.MoeConfig(E, K_TOP, H, I, num_threads=0)
    with pytest.raises(ValueError, match="between 1 and"):
        small_layer(num_threads=_native.usable_cpus() + 1)


def test_large_batch_arena_is_released(monkeypatch):
    monkeypatch.setattr(_native, "ARENA_KEEP_BYTES", 1 << 20)
    layer = small_layer("BF16")
    forward(layer, 4)
    small = layer._engine.arena_bytes()
    assert 0 < small < 1 << 20
    forward(layer, 2000)  # needs several MiB of buffers: given back after the call
    assert layer._engine.arena_bytes() == 0
    forward(layer, 4)
    assert layer._engine.arena_bytes() == small


@pytest.mark.parametrize("dtype,bad", [(np.int64, E), (np.int64, -2), (np.int32, 2**31 - 1), (np.uint64, 2**64 - 1),
                                       (np.uint64, 2**63), (np.uint8, 255)])
def test_expert_ids_out_of_range_raise_before_anything_is_written(dtype, bad):
    """The engine checks each id as it counts them (no separate numpy pass per call); a uint64
    id that the cast to int64 would turn into -1 (a skipped slot) or another valid-looking
    number is refused first, with its own value."""
    layer = small_layer("INT8")
    ids = np.array([[0, 1], [2, 0], [1, 2]], dtype)
    ids[1, 1] = bad
    out = np.full((3, H), 7.0, np.float32)
    with pytest.raises(ValueError, match=f"topk_ids holds expert id {bad}, outside \\[0, {E}\\)"):
        layer.forward(np.ones((3, H), np.float32), ids, np.full((3, K_TOP), 0.5, np.float32), out=out)
    assert (out == 7.0).all()
    good = forward(layer, 3)  # the layer's kept buffers are intact after the refusal
    assert np.array_equal(good, forward(small_layer("INT8"), 3))


def test_fp8_routing_weights_and_an_engine_without_init_are_refused():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    layer = small_layer("INT8")
    ids = np.array([[0, 1]], np.int64)
    with pytest.raises(TypeError, match="topk_weights must be floating point"):
        layer.forward(np.ones((1, H), np.float32), ids, np.full((1, K_TOP), 0.5, ml_dtypes.float8_e5m2))
    engine = _native.MoEEngine.__new__(_native.MoEEngine)  # no public path does this; it must not crash
    with pytest.raises(RuntimeError, match="before __init__"):
        engine.forward(np.ones((1, H), np.float32), ids, np.ones((1, 2), np.float32), np.zeros((1, H), np.float32), 1)


def test_repr_names_format_and_shapes():
    layer = small_layer("INT4")
    text = repr(layer)
    assert "INT4" in text and "group 64" in text and f"H={H}" in text and "kernel" in text
    assert "INT4" in repr(layer.gate[0]) and "N=64" in repr(layer.gate[0])


@pytest.fixture(scope="module", params=[("INT4", None), ("INT4_MIN", ("INT8_GROUP", 16))],
                ids=["INT4", "INT4_MIN+INT8_GROUP"])  # layout 2, and 3 (down in a format of its own)
def clean_file(tmp_path_factory, request):
    fmt, down = request.param
    path = write_packed(tmp_path_factory.mktemp("fuzz") / "layer.safetensors", fmt, down=down)
    return read_header(path)


def check_mutated(tmp_path, header, body, expect):
    """Either a clear refusal, or exactly the untampered file's numbers."""
    path = tmp_path / "mutated.safetensors"
    write_header(path, header, body)
    try:
        got = forward(load_layer(str(path)))
    except (CheckpointError, ValueError):
        return
    assert np.array_equal(got, expect)


@pytest.fixture(scope="module")
def clean_output(tmp_path_factory, clean_file):
    path = tmp_path_factory.mktemp("fuzz_ref") / "layer.safetensors"
    write_header(path, *clean_file)
    return forward(load_layer(str(path)))


META_KEYS = ["weight_format", "group_size", "num_experts", "top_k", "hidden_size", "intermediate_size",
             "scale_kind", "layout_version", "format", "down_weight_format", "down_group_size", "down_scale_kind"]
META_VALUES = st.one_of(st.sampled_from(list(ktcy.FORMATS) + ["32", "64", "128", "0", "-1", "3", "2", "16", "group", "channel",
                                                                "256", "1e9", "", "x", "99999999999"]),
                        st.integers(-5, 10**6).map(str))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(META_KEYS), value=META_VALUES)
def test_fuzz_packed_metadata(tmp_path, clean_file, clean_output, key, value):
    header, body = clean_file
    header = json.loads(json.dumps(header))
    header["__metadata__"][key] = value
    check_mutated(tmp_path, header, body, clean_output)


SHAPE_EDITS = st.lists(st.integers(-2, 70000), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensor=st.sampled_from(["gate.data", "gate.scale", "up.scale", "down.data", "down.scale"]), shape=SHAPE_EDITS,
       dtype=st.sampled_from(["U8", "F32", "I32", "F16", "BF16", "I8"]))
def test_fuzz_packed_tensor_entries(tmp_path, clean_file, clean_output, tensor, shape, dtype):
    header, body = clean_file
    header = json.loads(json.dumps(header))
    entry = header[tensor]
    entry["dtype"] = dtype
    if shape:
        entry["shape"] = shape
    check_mutated(tmp_path, header, body, clean_output)


@pytest.mark.fuzz
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(META_KEYS), value=META_VALUES, tensor=st.sampled_from(["gate.data", "gate.scale", "down.scale"]),
       shape=SHAPE_EDITS, dtype=st.sampled_from(["U8", "F32", "I32", "BF16"]))
def test_fuzz_packed_file_long(tmp_path, clean_file, clean_output, key, value, tensor, shape, dtype):
    header, body = clean_file
    header = json.loads(json.dumps(header))
    header["__metadata__"][key] = value
    header[tensor]["dtype"] = dtype
    if shape:
        header[tensor]["shape"] = shape
    check_mutated(tmp_path, header, body, clean_output)


def test_map_layer_validates_only_the_experts_asked_for(tmp_path):
    """An expert-parallel rank maps a converted layer and makes native (reads) only its own
    experts: a damaged expert elsewhere in the file is not its concern, but it is everyone
    else's - loading the whole layer refuses it, naming the expert."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from ktcy.convert import convert
    from ktcy.loading import converted_layer_file
    from ktcy.packed_io import map_layer
    from test_model import build
    build(str(tmp_path / "ckpt"), "qwen3")
    convert(str(tmp_path / "ckpt"), str(tmp_path / "packed"), method="INT8")
    f = converted_layer_file(str(tmp_path / "packed"), 1)
    with safe_open(f, "np") as src:
        meta, tensors = src.metadata(), {k: src.get_tensor(k) for k in src.keys()}
    tensors["up.colsum"][2, 0] += 1          # expert 2's column sum no longer matches its codes
    damaged = str(tmp_path / "damaged.safetensors")
    save_file(tensors, damaged, metadata=meta)
    mine = map_layer(damaged, experts=[0, 1])
    try:
        assert mine.weights["up"][2] is None and mine.weights["up"][1] is not None
    finally:
        os.close(mine.fd)
    with pytest.raises(ktcy.CheckpointError, match=r"up\[2\]"):
        ktcy.packed_io.load_layer(damaged)
    with pytest.raises(ktcy.CheckpointError, match="asked for"):
        map_layer(f, experts=[99])


# ---- the fiftieth stop's review ----

def _small_layer(**kw):
    rng = np.random.default_rng(3)
    gate, up = (rng.standard_normal((E, I, H)).astype(np.float32) * 0.05 for _ in range(2))
    down = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
    cfg = ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("BF16"), **kw)
    return ktcy.MoE.from_weights(cfg, gate, up, down)


_FORKED_CHILD = """
import multiprocessing as mp, sys, numpy as np, ktcy
def run(q):
    moe, x, ids, w = build()
    q.put(moe.forward(x, ids, w))
def build():
    rng = np.random.default_rng(0)
    E, H, I = 4, 128, 64
    g, u = (rng.standard_normal((E, I, H)).astype(np.float32) * 0.05 for _ in range(2))
    d = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
    moe = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8")), g, u, d)
    x = rng.standard_normal((40, H)).astype(np.float32)
    ids = np.argsort(rng.random((40, E)), axis=1)[:, :2].astype(np.int64)
    return moe, x, ids, rng.random((40, 2)).astype(np.float32)
moe, x, ids, w = build()
parent = moe.forward(x, ids, w)  # the parent's OpenMP pool now exists
q = mp.get_context("fork").Queue()
p = mp.get_context("fork").Process(target=run, args=(q,))
p.start()
child = q.get(timeout=60)
p.join(60)
print(p.exitcode == 0 and np.array_equal(parent, child))
"""


@pytest.mark.skipif(_native.usable_cpus() < 2, reason="a forked child hangs only with a team of 2 or more threads")
def test_a_forked_child_runs_on_one_thread_instead_of_hanging():
    # the default thread count (every CPU), as a plain worker pool would use it
    r = subprocess.run([sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr
    assert "ktcy runs on 1 thread in this forked process" in r.stderr


_SPAWNED_CHILD = """
import multiprocessing as mp, ktcy
def threads(q):
    q.put(ktcy.get_num_threads())
if __name__ == "__main__":
    ktcy.MoeConfig(4, 2, 128, 64, ktcy.QuantConfig("INT8"))  # the parent's state before the children start
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=threads, args=(q,))
        p.start()
        print(method, q.get(timeout=60))
        p.join(60)
"""


def test_spawned_and_forkserver_children_use_every_thread(tmp_path):
    """README: only fork() children drop to one thread; "spawn" and "forkserver" start fresh."""
    script = tmp_path / "children.py"  # spawn re-imports the main module: a file, not -c
    script.write_text(_SPAWNED_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "KTCY_NUM_THREADS"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["spawn", str(_native.usable_cpus()), "forkserver", str(_native.usable_cpus())]
    assert "forked process" not in r.stderr


def test_a_layers_thread_count_is_bounded_by_the_affinity_mask():
    g = np.zeros((4, 64, 128), np.float32)
    d = np.zeros((4, 128, 64), np.float32)
    cpus = _native.usable_cpus()
    with pytest.raises(ValueError, match=rf"MoeConfig.num_threads.*between 1 and {cpus}"):
        ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 128, 64, ktcy.QuantConfig("INT8"), num_threads=cpus + 1), g, g, d)
    moe = ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 128, 64, ktcy.QuantConfig("INT8"), num_threads=cpus), g, g, d)
    assert moe.num_threads == cpus


def test_out_that_holds_the_routing_weights_or_ids_gives_the_same_result():
    # the engine writes out while it still reads the routing: views of out's first bytes as w or ids
    moe = _small_layer()
    rng = np.random.default_rng(4)
    T = 5
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K_TOP].astype(np.int64)
    w = rng.random((T, K_TOP)).astype(np.float32)
    expect = moe.forward(x, ids, w)
    buf = np.zeros((T, H), np.float32)
    w_in_out = buf.reshape(-1)[:T * K_TOP].reshape(T, K_TOP)
    w_in_out[:] = w
    assert moe.forward(x, ids, w_in_out, out=buf) is buf and np.array_equal(buf, expect)
    buf = np.zeros((T, H), np.float32)
    ids_in_out = buf.reshape(-1)[:2 * T * K_TOP].view(np.int64).reshape(T, K_TOP)
    ids_in_out[:] = ids
    assert moe.forward(x, ids_in_out, w, out=buf) is buf and np.array_equal(buf, expect)


def test_biases_are_copied_like_the_weights():
    rng = np.random.default_rng(5)
    gate, up = (rng.standard_normal((E, I, H)).astype(np.float32) * 0.05 for _ in range(2))
    down = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
    bias = {"gate": rng.standard_normal((E, I)).astype(np.float32), "down": rng.standard_normal((E, H)).astype(np.float32)}
    moe = ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("BF16")), gate, up, down, bias=bias)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids = np.array([[0, 1], [1, 2], [2, 0]], np.int64)
    w = np.full((3, K_TOP), 0.5, np.float32)
    before = moe.forward(x, ids, w)
    bias["gate"][:] = np.nan
    bias["down"] += 100
    assert np.array_equal(moe.forward(x, ids, w), before)


@pytest.mark.parametrize("fmt,magnitude", [("INT4", 1e36), ("INT4_ZP", 1e36), ("INT8", 1e36), ("INT4", 1e37),
                                           ("INT4_ZP", 3e38), ("INT4_MIN", 1e36), ("INT4_MIN", 3e38)])
def test_weights_too_large_for_an_integer_format_are_refused(fmt, magnitude):
    W = np.random.default_rng(6).standard_normal((16, 64)).astype(np.float32) * np.float32(magnitude / 4)
    with pytest.raises(ValueError, match=f"{fmt} cannot hold weights as large as .*BF16"):
        kernels.pack(W, fmt)


def test_large_weights_within_the_bound_stay_exact_on_every_isa():
    W = np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32) * np.float32(1e27)
    p = kernels.pack(W, "INT4")
    X = np.full((2, 64), 1e-27, np.float32)
    R = X.astype(np.float64) @ p.dequantize().T
    outs = [kernels.linear(X, p, isa=isa) for isa in _native.available_isas() + ["amx_emu"] if isa != "amx"]
    for Y in outs:
        assert np.isfinite(Y).all() and np.allclose(Y, R, rtol=1e-5, atol=0)
        assert np.array_equal(Y, outs[0])


@pytest.mark.parametrize("fmt", ["INT8", "INT4", "FP8_BLOCK"])
def test_a_packed_file_with_a_nan_scale_is_refused(tmp_path, fmt):
    path = write_packed(tmp_path / "l.safetensors", fmt)
    f = ktcy.safetensors_io.SafetensorsFile(path)
    tensors, meta = {n: np.array(f.get(n)) for n in f.keys()}, dict(f.metadata)
    del f
    tensors["up.scale"].reshape(-1)[0] = np.nan
    ktcy.safetensors_io.write(path, tensors, meta)
    with pytest.raises(CheckpointError, match=r"up\[0\]: .*scale at .* is nan"):
        load_layer(str(path))


@pytest.mark.parametrize("out,needle", [([[0.0] * 3] * 2, "got list"),
                                        (np.zeros((2, 3), np.float32), "read-only")])
def test_linear_out_errors_name_what_is_wrong(out, needle):
    p = kernels.pack(np.ones((3, 32), np.float32), "BF16")
    if isinstance(out, np.ndarray):
        out.flags.writeable = False
    with pytest.raises(ValueError, match=f"out must be .*{needle}"):
        kernels.linear(np.ones((2, 32), np.float32), p, out=out)


def test_config_takes_numpy_integers_and_refuses_loose_values():
    cfg = ktcy.MoeConfig(np.int64(4), np.int32(2), np.int64(64), np.uint16(32), num_threads=np.int64(1))
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, cfg.num_threads) == (4, 2, 64, 32, 1)
    assert all(type(v) is int for v in (cfg.num_experts, cfg.hidden_size, cfg.num_threads))
    assert ktcy.QuantConfig("INT4", group_size=np.int64(32)).group_size == 32
    with pytest.raises(ValueError, match="group_size"):
        ktcy.QuantConfig("INT4", group_size=64.0)
    with pytest.raises(TypeError, match="per_channel"):
        ktcy.QuantConfig("FP8", per_channel="no")
    assert ktcy.QuantConfig("FP8", per_channel=np.bool_(True)).per_channel
    with pytest.raises(ValueError, match="K > 65536"):
        ktcy.MoeConfig(1, 1, 16, 65600, ktcy.QuantConfig("INT8"))


# ---- the sixtieth session's concurrency review ----

_IDS_CHANGED_MID_CALL = """
import sys, numpy as np, ktcy
import ktcy._native as native
E, H, I, T = 8, 256, 128, 256
rng = np.random.default_rng(0)
g, u = rng.standard_normal((2, E, I, H)).astype(np.float32) * 0.05
d = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
cfg = ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8"))
x = rng.standard_normal((T, H)).astype(np.float32)
ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(T)]).astype(np.int64)
w = rng.random((T, 2)).astype(np.float32)
expected = ktcy.MoE.from_weights(cfg, g, u, d).forward(x, ids, w)
rerouted = np.full_like(ids, 7)
rerouted[:, 1] = 6  # every slot onto two experts: past the rows the first count gave them
real_np = native.np
class AnotherThread:  # runs where numpy's allocation of the arena lets other threads run
    def __getattr__(self, name):
        return getattr(real_np, name)
    def zeros(self, *a, **kw):
        ids[...] = rerouted
        return real_np.zeros(*a, **kw)
moe = ktcy.MoE.from_weights(cfg, g, u, d)  # a fresh layer: its first call allocates the arena
native.np = AnotherThread()
try:
    y = moe.forward(x, ids, w)
finally:
    native.np = real_np
print(np.array_equal(y, expected))
"""


def test_topk_ids_changed_during_a_call_give_the_routing_that_was_checked():
    """The engine reads the caller's ids once: a change while the arena is allocated (the GIL is
    released there) took rows past an expert's segment, corrupting the heap."""
    r = subprocess.run([sys.executable, "-c", _IDS_CHANGED_MID_CALL], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", (r.returncode, r.stdout, r.stderr[-2000:])


_SMALL_INT8_LAYER = """
import numpy as np, ktcy
E, H, I = 8, 256, 128
rng = np.random.default_rng(0)
g, u = rng.standard_normal((2, E, I, H)).astype(np.float32) * 0.05
d = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
moe = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8")), g, u, d)
"""

_FORK_DURING_A_CALL = _SMALL_INT8_LAYER + """
import os, threading
x = rng.standard_normal((4, H)).astype(np.float32)
ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int64)
w = np.full((4, 2), 0.5, np.float32)
expected = moe.forward(x, ids, w)
moe._lock.acquire()  # as another thread inside a forward holds it at the fork
pid = os.fork()
if pid == 0:
    watchdog = threading.Timer(60, lambda: os._exit(3))  # a wait on the copied lock: fail, not hang
    watchdog.start()
    ok = np.array_equal(moe.forward(x, ids, w), expected)
    os._exit(0 if ok else 2)
moe._lock.release()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_a_forward_runs_in_another_thread_runs_its_own():
    r = subprocess.run([sys.executable, "-c", _FORK_DURING_A_CALL], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr[-2000:])


@pytest.mark.skipif(_native.usable_cpus() < 2, reason="needs 2 CPUs to tell 1 from all")
@pytest.mark.parametrize("env", [{"OMP_PROC_BIND": "true"}, {"OMP_PLACES": "cores"}])
def test_openmp_binding_does_not_cut_the_thread_count_to_one(env):
    """libgomp pins the main thread to one CPU when OMP_PROC_BIND/OMP_PLACES is set: the affinity
    mask seen after that is not the CPUs the process may use."""
    code = "import ktcy; ktcy.set_num_threads(2); print(ktcy.get_num_threads(), ktcy._native.usable_cpus())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KTCY_NUM_THREADS="2", **env))
    assert r.returncode == 0 and r.stdout.split() == ["2", str(_native.usable_cpus())], (r.stdout, r.stderr)
    assert "exceeds" not in r.stderr


_NATIVE_FORK = _SMALL_INT8_LAYER + """
import ctypes, os, signal
x = rng.standard_normal((6, H)).astype(np.float32)
ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 4]], np.int64)
w = np.full((6, 2), 0.5, np.float32)
expected = moe.forward(x, ids, w)  # the parent's team of threads exists now
pid = ctypes.CDLL(None).fork()  # fork() from native code: no Python at-fork hooks run
if pid == 0:
    signal.alarm(60)  # a hang in OpenMP ends as SIGALRM, not as a stuck test
    os._exit(0 if np.array_equal(moe.forward(x, ids, w), expected) else 2)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(_native.usable_cpus() < 2, reason="a forked child hangs only with a team of 2 or more threads")
def test_a_child_forked_from_native_code_runs_on_one_thread_instead_of_hanging():
    r = subprocess.run([sys.executable, "-c", _NATIVE_FORK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr[-2000:])


# ---- the sixtieth session's review of resources on success and error paths ----

def test_a_mapped_file_rewritten_in_place_at_its_size_is_refused(tmp_path):
    """Bytes rewritten in place (`cp other layer` over it) keep the size: the watch compared only
    sizes, and the layer ran on bytes no load check had seen."""
    from ktcy.packed_io import load_layer
    path = write_packed(tmp_path / "layer.safetensors", "INT8")
    layer = load_layer(str(path))
    x, ids, w = np.ones((1, H), np.float32), np.array([[0, 1]]), np.ones((1, 2), np.float32)
    layer.forward(x, ids, w)
    other = write_packed(tmp_path / "other.safetensors", "INT8", seed=1)
    assert os.path.getsize(other) == os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(open(other, "rb").read())
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # not within one clock tick of the load
    with pytest.raises(CheckpointError, match="rewritten on disk while mapped"):
        layer.forward(x, ids, w)


_SWAPPED_BETWEEN_OPENS = """
import os, numpy as np
import ktcy.packed_io as packed_io
from ktcy.safetensors_io import CheckpointError
path, new = {path!r}, {new!r}
real = packed_io.SafetensorsFile
def swap_then_open(p, fd=None):  # a converter publishes the layer between the watch's open and the map's
    os.replace(new, path)
    return real(p, fd)
packed_io.SafetensorsFile = swap_then_open
layer = packed_io.load_layer(path)
packed_io.SafetensorsFile = real
x, ids, w = np.ones((1, {H}), np.float32), np.array([[0, 1]]), np.ones((1, 2), np.float32)
layer.forward(x, ids, w)
os.truncate(path, 4096)  # the file now at the path: not the one the layer opened first
layer.forward(x, ids, w)
print("ran")
fd = layer._mapped[0][0]
os.truncate("/proc/self/fd/%d" % fd, 4096)  # the file the watch holds: it must be the mapped one
try:
    layer.forward(x, ids, w)
except CheckpointError as e:
    print("refused:", e)
"""


def test_the_file_a_layer_watches_is_the_file_it_maps(tmp_path):
    """map_layer opened the file twice (the descriptor it watches, and again to map it): a rename
    in between left the watch on one file and the weights on another, and truncating the mapped
    one killed the next forward with SIGBUS."""
    path = write_packed(tmp_path / "layer.safetensors", "INT8")
    new = write_packed(tmp_path / "new.safetensors", "INT8", seed=1)
    code = _SWAPPED_BETWEEN_OPENS.format(path=str(path), new=str(new), H=H)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ran") and "refused:" in r.stdout and "changed size" in r.stdout


def test_a_checkpoint_shard_changed_after_loading_is_refused_when_read_again(tmp_path):
    """MoEModel keeps the checkpoint's shards mapped to re-pack a block for another backend: a
    shard truncated meanwhile was SIGBUS there, one rewritten at its size gave other weights."""
    import ml_dtypes
    from checkpoints import make_checkpoint
    from ktcy.safetensors_io import write
    make_checkpoint(tmp_path, num_layers=3, dense_layers=(0,))
    write(tmp_path / "routers.safetensors", {f"model.layers.{L}.mlp.gate.weight": np.ones((4, 128), ml_dtypes.bfloat16)
                                             for L in (1, 2)})
    model = ktcy.MoEModel.from_pretrained(tmp_path, layers=[1])
    shard = next(p for p in sorted(tmp_path.glob("*.safetensors")) if p.name != "routers.safetensors")
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match="changed on disk since it was opened"):
        model.inject_expert_backend(".*", "INT8")


def _resident_kib_of(path):
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip("\n").endswith(" " + str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_a_model_keeps_its_checkpoint_mapped_but_not_resident(tmp_path):
    """The checkpoint stays open for inject_expert_backend; the pages its blocks were packed from
    are dropped from the resident set (RSS and cgroup limits counted the whole checkpoint)."""
    import ml_dtypes
    from checkpoints import make_checkpoint
    from ktcy.safetensors_io import write
    make_checkpoint(tmp_path, num_layers=3, dense_layers=(0,), E=8, H=256, I=128)
    write(tmp_path / "routers.safetensors", {f"model.layers.{L}.mlp.gate.weight": np.ones((8, 256), ml_dtypes.bfloat16)
                                             for L in (1, 2)})
    shard = next(p for p in sorted(tmp_path.glob("*.safetensors")) if p.name != "routers.safetensors")
    model = ktcy.MoEModel.from_pretrained(tmp_path, backend="INT8")
    assert any(line.rstrip().endswith(str(shard)) for line in open("/proc/self/maps"))  # still mapped
    assert _resident_kib_of(shard) == 0
    model.inject_expert_backend(".*", "BF16")
    assert _resident_kib_of(shard) == 0
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    for block in model.blocks.values():
        assert block.experts.format == "BF16" and np.isfinite(block.forward(x)).all()


def test_a_checkpoint_shard_truncated_after_loading_is_refused_not_sigbus(tmp_path):
    code = """
import os, sys, numpy as np, ml_dtypes
sys.path.insert(0, {tests!r})
import ktcy
from checkpoints import make_checkpoint
from ktcy.safetensors_io import CheckpointError, write
path = {path!r}
make_checkpoint(path, num_layers=3, dense_layers=(0,))
write(os.path.join(path, "routers.safetensors"),
      {{f"model.layers.{{L}}.mlp.gate.weight": np.ones((4, 128), ml_dtypes.bfloat16) for L in (1, 2)}})
model = ktcy.MoEModel.from_pretrained(path, layers=[1])
shard = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and n != "routers.safetensors")[0]
os.truncate(os.path.join(path, shard), 4096)
try:
    model.inject_expert_backend(".*", "INT8")
except CheckpointError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code.format(tests=os.path.dirname(__file__), path=str(tmp_path))],
                       capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "changed size" in r.stdout


# ---- the sixtieth session's sanitizer run: arrays C reads through typed pointers are aligned ----

def _unaligned(a):
    """a's bytes at an odd address: C-contiguous, same dtype and values, flags.aligned False."""
    raw = np.empty(a.nbytes + 1, np.uint8)
    out = raw[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.flags.c_contiguous and not out.flags.aligned
    return out


@pytest.mark.parametrize("fmt", ["INT8", "BF16", "INT4", "MXFP4"])
def test_unaligned_inputs_give_the_aligned_results(fmt):
    """numpy keeps an array at an odd offset as it is (ascontiguousarray does not copy it); C
    reading it through typed pointers is undefined behaviour (UBSan: misaligned load)."""
    moe = small_layer(fmt)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.array([[(e + j) % E for j in range(K_TOP)] for e in range(5)], np.int64)
    w = rng.random((5, K_TOP)).astype(np.float32)
    want = moe.forward(x, ids, w)
    assert np.array_equal(moe.forward(_unaligned(x), _unaligned(ids), _unaligned(w)), want)
    with pytest.raises(ValueError, match="aligned"):
        moe.forward(x, ids, w, out=_unaligned(np.empty((5, H), np.float32)))
    p = kernels.pack(rng.standard_normal((24, 40)).astype(np.float32), fmt)
    assert np.array_equal(kernels.linear(_unaligned(x[:, :40]), p), kernels.linear(x[:, :40].copy(), p))


def test_packed_arrays_that_are_not_aligned_are_refused_and_codes_are_copied():
    rng = np.random.default_rng(2)
    codes = rng.integers(-127, 128, (16, 64)).astype(np.int8)
    scale = (rng.random(16) + 0.5).astype(np.float32)
    p = kernels.pack_quantized(codes, _unaligned(scale), "INT8")
    assert np.array_equal(p.dequantize(), kernels.pack_quantized(codes, scale, "INT8").dequantize())
    bits = _unaligned(rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(kernels.pack_quantized(bits, None, "BF16").codes(), bits)
    with pytest.raises(ValueError, match="must be aligned"):
        kernels.PackedWeight(p.format, p.shape, p.data, _unaligned(p.scale), p.colsum, 0, None).native()


def test_a_safetensors_tensor_at_an_odd_offset_is_read_aligned(tmp_path):
    """The format allows any data offset; such a tensor is copied (read-only, as the mapped ones)."""
    from ktcy.safetensors_io import SafetensorsFile
    header = json.dumps({"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}}).encode()
    values = np.arange(6, dtype=np.float32)
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\x07" + values.tobytes())
    t = SafetensorsFile(str(tmp_path / "odd.safetensors")).get("w")
    assert t.flags.aligned and not t.flags.writeable and np.array_equal(t, values.reshape(2, 3))
