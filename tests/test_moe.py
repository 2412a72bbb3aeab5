"""MoE forward at numpy level: every format x ISA against float64 references, routing edge cases,
bad input, threads and concurrency (issue: MoE forward)."""
import logging
import pickle
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import ktcy

FORMATS = ["BF16", "INT8", "INT4", "FP8_PERCHANNEL", "FP8_BLOCK"]


def isas_for(fmt):
    return [None] + [i for i in ("amx", "amx_emu", "avx512", "avx2", "ref") if i in ktcy.available_isas()]


def expert_weights(rng, E, H, I, std=0.02):
    return ((rng.standard_normal((E, I, H)) * std).astype(np.float32),
            (rng.standard_normal((E, I, H)) * std).astype(np.float32),
            (rng.standard_normal((E, H, I)) * std).astype(np.float32))


def reference(x, ids, w, gate, up, down):
    """float64 MoE: y[t] = sum_j w[t,j] * down_e(silu(gate_e x) * up_e x); id -1 skips its slot."""
    x = np.asarray(x, np.float64)
    y = np.zeros((x.shape[0], down.shape[1]))
    for e in np.unique(ids[ids >= 0]):
        rows, slots = np.nonzero(ids == e)
        xe = x[rows]
        g, u = xe @ gate[e].T, xe @ up[e].T
        h = g / (1 + np.exp(-g)) * u
        np.add.at(y, rows, w[rows, slots][:, None] * (h @ down[e].T))
    return y


def dequantized(layer):
    return tuple(np.stack([p.dequantize() for p in ps]) for ps in (layer.gate, layer.up, layer.down))


def routing(rng, T, E, k, distinct=True):
    ids = np.stack([rng.choice(E, k, replace=not distinct) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def rel_l2(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_and_isa_against_dequantized_float64(fmt):
    rng = np.random.default_rng(FORMATS.index(fmt))
    E, H, I, k = 10, 200, 144, 3   # E not a power of two; H, I not multiples of the blocks
    gate, up, down = expert_weights(rng, E, H, I)
    for isa in isas_for(fmt):
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt), isa=isa), gate, up, down)
        dq = dequantized(layer)
        for T in (1, 2, 7, 64):
            x = rng.standard_normal((T, H)).astype(np.float32)
            ids, w = routing(rng, T, E, k)
            ids[:, 0] = np.where(ids[:, 0] == E - 1, 0, ids[:, 0])  # make sure some expert may get nothing
            y = layer.forward(x, ids, w)
            assert y.dtype == np.float32 and y.shape == (T, H)
            err = rel_l2(y, reference(x, ids, w, *dq))
            # bf16 rounding of activations costs ~0.3%; int8 per-row activations ~1.5% here
            bound = 0.004 if fmt.startswith(("BF16", "FP8")) else 0.03
            assert err <= bound, (fmt, isa, T, err)


@pytest.mark.parametrize("fmt,bound", [("INT8", 0.03), ("INT4", 0.165)])
def test_quantized_formats_against_float_weights_at_qwen3_sizes(fmt, bound):
    rng = np.random.default_rng(7)
    E, H, I, k, T = 12, 2048, 768, 8, 16
    gate, up, down = expert_weights(rng, E, H, I)
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt)), gate, up, down)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = routing(rng, T, E, k)
    err = rel_l2(layer.forward(x, ids, w), reference(x, ids, w, gate, up, down))
    print(f"\n{fmt} MoE (H 2048, I 768, top 8) vs float weights: relative L2 error {err:.4f}")
    assert err <= bound


def test_int8_identical_across_isas():
    rng = np.random.default_rng(3)
    E, H, I, k = 6, 256, 160, 2
    gate, up, down = expert_weights(rng, E, H, I)
    x = rng.standard_normal((40, H)).astype(np.float32)
    ids, w = routing(rng, 40, E, k)
    outs = {}
    for isa in [i for i in ("amx", "amx_emu", "avx512", "avx2", "ref") if i in ktcy.available_isas()]:
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("INT8"), isa=isa), gate, up, down)
        outs[isa] = layer.forward(x, ids, w)
    first = next(iter(outs.values()))
    for isa, y in outs.items():
        assert np.array_equal(y, first), isa


@pytest.mark.parametrize("fmt", ["INT8", "BF16", "INT4", "MXFP4", "MXFP4_A8"])
def test_amx_emu_prefill_and_decode_branches(fmt, monkeypatch):
    """Experts with >= AMX_MIN_ROWS[fmt] rows run the AMX kernel, the others the decode kernel;
    both are exercised (and must agree with the reference) in one call."""
    rng = np.random.default_rng(4)
    min_rows = ktcy.moe.AMX_MIN_ROWS[fmt]
    T = max(48, min_rows + 2)
    per_expert = min(6, min_rows - 1)  # rows of each other expert: below the threshold
    E, H, I, k = 1 + -(-T // per_expert), 128, 96, 2
    gate, up, down = expert_weights(rng, E, H, I)
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt), isa="amx_emu"), gate, up, down)
    assert layer.variant.startswith("amx_emu") and not layer.decode_variant.startswith("amx")
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.zeros((T, k), np.int64)
    ids[:, 0] = 0                           # expert 0: every row -> AMX
    ids[:, 1] = 1 + np.arange(T) % (E - 1)  # the others: at most per_expert rows each -> decode kernel
    rows = np.bincount(ids.ravel(), minlength=E)
    assert rows[0] >= min_rows and rows[1:].max() < min_rows
    w = np.full((T, k), 0.5, np.float32)
    ref = reference(x, ids, w, *dequantized(layer))
    y = layer.forward(x, ids, w)
    assert rel_l2(y, ref) <= (0.004 if fmt in ("BF16", "MXFP4") else 0.03)
    # the same call with every expert forced onto the decode kernel gives the same integer-format
    # results (bf16 activations sum their products in another order there)
    if fmt not in ("BF16", "MXFP4"):
        layer._engine.big_min_rows = 10**9
        assert np.array_equal(layer.forward(x, ids, w), y)


@pytest.mark.parametrize("fmt", ["INT8", "INT4"])
def test_amx_work_items_of_uneven_panel_counts_give_the_portable_bits(fmt):
    """Experts on the AMX kernel take larger work items than the others (MOE_AMX_ITEM_PANELS):
    with 49 panels of I and 53 of H each projection splits into uneven items, beside an expert
    on the decode kernel and one with no tokens; the integer formats' outputs equal the portable
    kernel's bit for bit."""
    rng = np.random.default_rng(11)
    E, H, I, k, T = 3, 53 * 16, 49 * 16, 2, 40
    gate, up, down = expert_weights(rng, E, H, I)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.zeros((T, k), np.int64)
    ids[:, 1] = -1
    ids[:3, 1] = 1  # expert 1: 3 rows (decode kernel); expert 2: none
    w = np.full((T, k), 0.5, np.float32)
    outs = {}
    for isa in [i for i in ("amx", "amx_emu", "ref") if i in ktcy.available_isas()]:
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt), isa=isa), gate, up, down)
        assert T >= layer._engine.big_min_rows > 3
        outs[isa] = layer.forward(x, ids, w)
    assert rel_l2(outs["ref"], reference(x, ids, w, *dequantized(layer))) < 0.03
    for isa, y in outs.items():
        assert np.array_equal(y, outs["ref"]), isa


def test_repeated_id_counts_twice_and_empty_batch():
    rng = np.random.default_rng(5)
    E, H, I = 4, 64, 32
    gate, up, down = expert_weights(rng, E, H, I)
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("BF16")), gate, up, down)
    x = rng.standard_normal((3, H)).astype(np.float32)
    twice = layer.forward(x, np.array([[1, 1]] * 3), np.array([[0.5, 0.5]] * 3, np.float32))
    once = layer.forward(x, np.array([[1, 2]] * 3), np.array([[1.0, 0.0]] * 3, np.float32))
    np.testing.assert_allclose(twice, once, rtol=1e-6, atol=1e-9)
    empty = layer.forward(np.zeros((0, H), np.float32), np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32))
    assert empty.shape == (0, H)


def test_bfloat16_input_int32_ids_and_out_buffer():
    rng = np.random.default_rng(6)
    E, H, I = 4, 64, 48
    gate, up, down = expert_weights(rng, E, H, I)
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8")),
                                  gate.astype(ml_dtypes.bfloat16), up.astype(ml_dtypes.bfloat16),
                                  down.astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((5, H)).astype(ml_dtypes.bfloat16)
    ids, w = routing(rng, 5, E, 2)
    out = np.empty((5, H), np.float32)
    y = layer.forward(x, ids.astype(np.int32), w, out=out)
    assert y is out
    assert np.array_equal(y, layer.forward(x.astype(np.float32), ids, w))


def test_nan_routing_weight_poisons_only_its_row():
    rng = np.random.default_rng(8)
    E, H, I = 4, 64, 48
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("INT8")), *expert_weights(rng, E, H, I))
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids, w = routing(rng, 3, E, 2)
    w[1, 0] = np.nan
    y = layer.forward(x, ids, w)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_in_one_token_stays_in_that_token(fmt):
    rng = np.random.default_rng(16)
    E, H, I = 4, 64, 48
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig(fmt)), *expert_weights(rng, E, H, I))
    x = rng.standard_normal((5, H)).astype(np.float32)
    x[2, 7] = np.nan
    ids = np.array([[0, 1]] * 5)  # every token shares the same experts (and row tiles)
    y = layer.forward(x, ids, np.full((5, 2), 0.5, np.float32))
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_non_contiguous_inputs_are_accepted():
    rng = np.random.default_rng(9)
    E, H, I = 4, 64, 48
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("BF16")), *expert_weights(rng, E, H, I))
    x = rng.standard_normal((6, 2 * H)).astype(np.float32)[:, ::2]
    ids, w = routing(rng, 6, E, 2)
    ids_f, w_f = np.asfortranarray(ids), np.asfortranarray(w)
    assert np.array_equal(layer.forward(x, ids_f, w_f), layer.forward(np.ascontiguousarray(x), ids, w))


def test_plain_arrays_take_the_direct_path_with_the_general_paths_bits():
    """forward skips its conversions for float32/int64/float32 C-contiguous numpy inputs (the
    engine takes them as they are); anything else is converted first, to the same numbers."""
    from ktcy.moe import _engine_ready
    rng = np.random.default_rng(11)
    E, H, I, k = 4, 64, 48, 2
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("INT8")), *expert_weights(rng, E, H, I))
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids, w = routing(rng, 5, E, k)
    ids = ids.astype(np.int64)
    assert _engine_ready(x, ids, w, H, k)
    assert _engine_ready(pickle.loads(pickle.dumps(x)), ids, w, H, k)  # an equal dtype, not numpy's own object
    general = [(np.asfortranarray(x), ids, w), (x, ids.astype(np.int32), w), (x, ids, w.astype(np.float64)),
               (x.astype(x.dtype.newbyteorder()), ids, w), (x.view(np.memmap), ids, w), (x, ids.tolist(), w)]
    for args in general:
        assert not _engine_ready(*args, H, k)
        assert np.array_equal(layer.forward(*args), layer.forward(x, ids, w))
        assert np.array_equal(layer.forward_slots(*args), layer.forward_slots(x, ids, w))
    assert not _engine_ready(x, ids[:, :1], w[:, :1], H, k) and not _engine_ready(x[:, :32], ids, w, H, k)
    bad = ids.copy()
    bad[3, 1] = E
    with pytest.raises(ValueError, match=f"expert id {E}, outside"):
        layer.forward(x, bad, w)


@pytest.fixture(scope="module")
def small_layer():
    rng = np.random.default_rng(10)
    return ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 64, 48, ktcy.QuantConfig("INT8")), *expert_weights(rng, 4, 64, 48))


@pytest.mark.parametrize("args,err,match", [
    (dict(x=np.ones((2, 63), np.float32)), ValueError, r"\[T, 64\]"),
    (dict(x=np.ones(64, np.float32)), ValueError, r"\[T, 64\]"),
    (dict(x=np.ones((2, 64), np.int32)), TypeError, "float32"),
    (dict(ids=np.array([[0, 4], [1, 2]])), ValueError, "expert id 4"),
    (dict(ids=np.array([[0, -2], [1, 2]])), ValueError, "expert id -2"),
    (dict(ids=np.array([[0.0, 1.0], [1.0, 2.0]])), TypeError, "integers"),
    (dict(ids=np.array([[0, 1]])), ValueError, "T=2"),
    (dict(w=np.ones((2, 3), np.float32)), ValueError, "shape of topk_ids"),
    (dict(w=np.ones((2, 2), np.int64)), TypeError, "floating"),
    (dict(out=np.empty((2, 64), np.float64)), ValueError, "out must be"),
    (dict(out=np.empty((3, 64), np.float32)), ValueError, "out must be"),
])
def test_bad_input_is_a_clear_exception(small_layer, args, err, match):
    call = dict(x=np.ones((2, 64), np.float32), ids=np.array([[0, 1], [1, 2]]), w=np.ones((2, 2), np.float32))
    call.update(args)
    out = call.pop("out", None)
    with pytest.raises(err, match=match):
        small_layer.forward(call["x"], call["ids"], call["w"], out=out)


def test_bad_construction():
    with pytest.raises(ValueError, match="top_k"):
        ktcy.MoeConfig(4, 5, 64, 48)
    with pytest.raises(ValueError, match="unknown"):
        ktcy.MoeConfig(4, 2, 64, 48, backend="AMXINT3")
    rng = np.random.default_rng(11)
    gate, up, down = expert_weights(rng, 4, 64, 48)
    with pytest.raises(ValueError, match=r"\[E, I, H\]"):
        ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 64, 48), gate[:, :, :10], up, down)
    with pytest.raises(ktcy.UnsupportedISAError):
        missing = [i for i in ("amx", "avx512", "avx2") if i not in ktcy.available_isas()]
        if not missing:
            pytest.skip("every ISA runs here")
        ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 64, 48, isa=missing[0]), gate, up, down)


def test_amx_backend_falls_back_with_one_warning(caplog, monkeypatch):
    rng = np.random.default_rng(12)
    gate, up, down = expert_weights(rng, 4, 64, 48)
    monkeypatch.setattr(ktcy.log, "_warned", set())
    with caplog.at_level(logging.INFO, logger="ktcy"):
        layers = [ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 64, 48, backend="AMXINT8"), gate, up, down)
                  for _ in range(3)]
    layer = layers[0]
    assert layer.format == "INT8"
    if "amx" in ktcy.available_isas():
        assert layer.isa == "amx"
    else:
        assert layer.isa != "amx"
        said = [r for r in caplog.records if "asks for AMX" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING  # once per process, not per layer
        assert not said[0].getMessage().startswith("ktcy:")
    assert "INT8 on" in layer.kernel and layer.nbytes > 0


def test_fp8_from_quantized_codes_matches_from_float():
    rng = np.random.default_rng(13)
    E, H, I = 3, 256, 128
    gate, up, down = expert_weights(rng, E, H, I)
    cfg = ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("FP8", per_channel=True))
    from_float = ktcy.MoE.from_weights(cfg, gate, up, down)
    codes = {n: np.stack([p.codes() for p in getattr(from_float, n)]).view(ml_dtypes.float8_e4m3fn)
             for n in ("gate", "up", "down")}
    scales = {n: np.stack([p.scale[: p.shape[0]][:, None] for p in getattr(from_float, n)]) for n in ("gate", "up", "down")}
    from_codes = ktcy.MoE.from_weights(cfg, codes["gate"], codes["up"], codes["down"], gate_scale=scales["gate"],
                                       up_scale=scales["up"], down_scale=scales["down"])
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids, w = routing(rng, 4, E, 2)
    assert np.array_equal(from_codes.forward(x, ids, w), from_float.forward(x, ids, w))


def test_progress_callback():
    rng = np.random.default_rng(14)
    seen = []
    ktcy.MoE.from_weights(ktcy.MoeConfig(5, 2, 64, 48), *expert_weights(rng, 5, 64, 48),
                          progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 5) for i in range(1, 6)]


def test_threads_and_concurrent_callers_agree():
    rng = np.random.default_rng(15)
    E, H, I, k = 8, 256, 192, 2
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig("INT8")), *expert_weights(rng, E, H, I))
    inputs = [(rng.standard_normal((T, H)).astype(np.float32),) + routing(rng, T, E, k) for T in (1, 9, 33, 4)]
    old = ktcy.get_num_threads()
    try:
        ktcy.set_num_threads(1)
        serial = [layer.forward(*a) for a in inputs]
        ktcy.set_num_threads(2)
        results = [None] * 8

        def worker(i):
            results[i] = layer.forward(*inputs[i % 4])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ktcy.set_num_threads(old)
    for i, y in enumerate(results):
        assert np.array_equal(y, serial[i % 4])


@pytest.mark.parametrize("fmt", ["INT4", "BF16", "MXFP4"])
def test_down_items_wait_for_their_experts_rows_only(fmt):
    """The down projection of an expert starts when the thread finishing its last gate and up item
    has readied its rows, not at a barrier (worklist.h): two threads give one thread's bits, call
    after call, for decode-sized and prefill-sized items (several gate/up items per expert), idle
    experts, -1 slots, biases and GPT-OSS's activation."""
    if ktcy._native.usable_cpus() < 2:
        pytest.skip("one CPU: no second thread to hand rows over to")
    rng = np.random.default_rng(31)
    E, H, I, k = 12, 256, 512, 4
    gate, up, down = expert_weights(rng, E, H, I)
    bias = {"gate": rng.standard_normal((E, I)).astype(np.float32) * 0.1,
            "up": rng.standard_normal((E, I)).astype(np.float32) * 0.1,
            "down": rng.standard_normal((E, H)).astype(np.float32) * 0.1}
    calls = []
    for T in (1, 2, 5, 40, 1, 96):
        ids, w = routing(rng, T, E, k)
        ids[ids == 3] = 7  # expert 3 idle (a repeated id counts twice)
        ids[0, -1] = -1
        calls.append((rng.standard_normal((T, H)).astype(np.float32), ids, w))
    for isa in [None] + [i for i in ("amx_emu", "avx2") if i in ktcy.available_isas()]:
        for activation, b in (("silu", None), ("gpt_oss", bias)):
            cfg = ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt), isa=isa, activation=activation)
            layer = ktcy.MoE.from_weights(cfg, gate, up, down, bias=b)
            old = ktcy.get_num_threads()
            try:
                ktcy.set_num_threads(1)
                serial = [layer.forward(*c) for c in calls]
                ktcy.set_num_threads(ktcy._native.usable_cpus())
                for _ in range(5):
                    for c, want in zip(calls, serial):
                        assert np.array_equal(layer.forward(*c), want), (isa, activation, c[0].shape[0])
            finally:
                ktcy.set_num_threads(old)
            assert np.all(np.isfinite(serial[3])) and np.abs(serial[3]).max() > 0


def slow_layer(seed):
    """A BF16 layer on the portable kernels and one thread (about 0.1 s a call of its 128
    tokens), with those tokens' inputs in the engine's own form (C-contiguous int64 ids)."""
    rng = np.random.default_rng(seed)
    E, H, I = 8, 512, 256
    g, u = (rng.standard_normal((E, I, H)).astype(np.float32) * 0.05 for _ in range(2))
    d = rng.standard_normal((E, H, I)).astype(np.float32) * 0.05
    moe = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("BF16"), isa="ref", num_threads=1),
                                g, u, d)
    x = rng.standard_normal((128, H)).astype(np.float32)
    ids = np.ascontiguousarray(np.argsort(rng.random((128, E)), axis=1)[:, :2])
    return moe, x, ids, np.full((128, 2), 0.5, np.float32)


def test_forward_releases_the_gil():
    """README: forward runs with the GIL released.  A second Python thread counts while forward
    computes on one thread: every count it makes strictly inside a call proves the call did not
    hold the GIL (one that held it would leave no Python bytecode running until it returned)."""
    moe, x, ids, w = slow_layer(0)
    calls, done = [], threading.Event()

    def compute():
        for _ in range(4):
            start = time.perf_counter()
            moe.forward(x, ids, w)
            calls.append((start, time.perf_counter()))
        done.set()

    worker = threading.Thread(target=compute)
    worker.start()
    counts = []
    while not done.is_set():
        counts.append(time.perf_counter())
    worker.join()
    # the call's own Python before and after its C code, and the switch interval the counting
    # thread may keep the GIL for once it has it (a GIL-holding builtin of 80 ms, sum(range()),
    # lets no count through past this margin)
    margin = 2 * sys.getswitchinterval() + 0.002
    inside = sum(1 for t in counts for a, b in calls if a + margin < t < b - margin)
    assert all(b - a > 4 * margin for a, b in calls), calls
    assert inside > 100, f"{inside} counts during {len(calls)} calls of {[round(b - a, 3) for a, b in calls]} s"


def test_an_engine_refuses_a_second_caller_while_it_runs():
    """The engine reuses its buffers and may replace its arena on every call while its threads run
    without the GIL: a second call from another thread (past MoE's lock: the engine used
    directly) must be refused, not free or rewrite memory under the first."""
    moe, x, ids, w = slow_layer(1)
    H = x.shape[1]
    want = moe.forward(x, ids, w)
    outs, started, done = [], threading.Event(), threading.Event()

    def compute():
        started.set()
        try:
            for _ in range(3):
                out = np.empty_like(want)
                try:
                    moe._engine.forward(x, ids, w, out, 1)
                    outs.append(out)
                except RuntimeError:
                    pass  # the other thread got in first
        finally:
            done.set()

    worker = threading.Thread(target=compute)
    worker.start()
    started.wait()
    refused, small, give_up = 0, np.empty((1, H), np.float32), time.monotonic() + 60
    while not done.is_set() and time.monotonic() < give_up:
        try:
            moe._engine.forward(x[:1], ids[:1], w[:1], small, 1)
            assert np.array_equal(small, want[:1])
        except RuntimeError as e:
            assert "already running" in str(e)
            refused += 1
    worker.join()
    assert refused > 0 and outs
    assert all(np.array_equal(o, want) for o in outs)
    assert np.array_equal(moe.forward(x, ids, w), want)  # the engine is free again
