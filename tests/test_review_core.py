"""Adversarial review of the core changes of 2026-11-30: expert id -1, MoE.forward_slots, torch
tensors in and out of MoE.forward (ktcy/moe.py, ktcy/torch_bridge.py, ktcy/_moe_engine.pxi), and
the AVX2 / AVX-512 GEMM skeleton changes (3-row x 2-panel INT8 tiles, INT4 panels unpacked once,
software prefetch), and the defects that review found (forward_slots of half-precision tensors,
out= tensors sharing memory, meta tensors, INT8 code -128 on the sign-flip kernels, INT8 column
sums that disagree with the codes)."""
import dataclasses
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import (bf16_round, int4_exact_reference, int8_exact_reference, mxfp4_a8_exact_reference,
                      i16_bound, ordered_slot_sum, quantize_rows_int8,
                      runnable_variants)
import ktcy
from ktcy import _native, kernels
from ktcy.formats import FORMATS, GROUPED_FORMATS, descriptor

E, K_TOP, H, I = 4, 3, 144, 80   # H, I not multiples of the 64-wide blocks
GROUPED = GROUPED_FORMATS
EXACT_FORMATS = ("INT8",) + GROUPED_FORMATS   # integer accumulation: every ISA gives the same bits


def vector_isas():
    """Every ISA this CPU runs for MoE (amx only where it is real) plus the AMX emulation."""
    return [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]


def make_layer(fmt, isa=None, seed=1):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    quant = ktcy.QuantConfig(fmt, group_size=32) if fmt in GROUPED else ktcy.QuantConfig(fmt)
    return ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, quant, isa=isa), gate, up, down)


def routing(T, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K_TOP] for _ in range(T)])
    w = rng.random((T, K_TOP)).astype(np.float32)
    return x, ids, w


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def threads():
    """Restores ktcy's thread count after a test that changes it."""
    old = ktcy.get_num_threads()
    yield
    ktcy.set_num_threads(old)


# ---------------------------------------------------------------------------------------------
# 1. MoE.forward / forward_slots / expert id -1 on the numpy path
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_600_rows_on_one_expert_with_skipped_slots_on_every_isa(fmt, threads):
    """A long prefill (600 rows on expert 1 reach the prefill / AMX-emulated kernel) with -1 slots
    scattered through it: forward == ordered sum of forward_slots, bit for bit; a -1 slot is the
    same as a weight-0 slot on a real expert; a token with every slot -1 gives exact zeros; the
    result does not depend on the thread count; and for integer formats the prefill kernels give
    the decode kernels' bits (rows fed two at a time) and every ISA agrees."""
    T = 600
    x, ids, w = routing(T)
    ids[:, 0] = 1
    ids[::3, 1] = -1
    ids[5, :] = -1
    ids[7, 0] = -1
    zero_ids, zero_w = np.where(ids < 0, 0, ids), np.where(ids < 0, 0, w).astype(np.float32)
    results = {}
    for isa in vector_isas():
        layer = make_layer(fmt, isa)
        ktcy.set_num_threads(1)
        y = layer.forward(x, ids, w)
        slots = layer.forward_slots(x, ids, w)
        assert slots.shape == (T, K_TOP, H) and slots.dtype == np.float32
        assert same_bits(ordered_slot_sum(slots), y), isa
        assert not slots[ids < 0].any(), isa
        assert not y[5].any(), isa
        assert same_bits(layer.forward(x, zero_ids, zero_w), y), isa
        if isa == "amx_emu" and _native.usable_cpus() >= 2:
            ktcy.set_num_threads(2)
            assert same_bits(layer.forward(x, ids, w), y)
            assert same_bits(layer.forward_slots(x, ids, w), slots)
            ktcy.set_num_threads(1)
        if fmt in EXACT_FORMATS:
            decoded = np.concatenate([layer.forward(x[i:i + 2], ids[i:i + 2], w[i:i + 2]) for i in range(0, 24, 2)])
            assert same_bits(decoded, y[:24]), isa
        results[isa] = y
    if fmt in EXACT_FORMATS:
        first = next(iter(results.values()))
        assert all(same_bits(y, first) for y in results.values()), list(results)


def test_a_weight_of_nan_on_a_skipped_slot_adds_nothing():
    """-1 means 'not here': its routing weight must not be read, so NaN / inf there are harmless."""
    layer = make_layer("INT8")
    x, ids, w = routing(9)
    ids[:, 1] = -1
    w[:, 1] = np.nan
    w[0, 1] = np.inf
    y = layer.forward(x, ids, w)
    slots = layer.forward_slots(x, ids, w)
    assert np.isfinite(y).all() and np.isfinite(slots).all()
    assert same_bits(ordered_slot_sum(slots), y)
    w[:, 1] = 0
    assert same_bits(layer.forward(x, np.where(ids < 0, 0, ids), w), y)


def test_out_aliasing_x_or_overlapping_it_gives_the_separate_result():
    layer = make_layer("INT8")
    x, ids, w = routing(6)
    ref = layer.forward(x, ids, w)
    same = x.copy()
    assert layer.forward(same, ids, w, out=same) is same and same_bits(same, ref)
    shifted = np.zeros((7, H), np.float32)
    shifted[:6] = x
    layer.forward(shifted[:6], ids, w, out=shifted[1:])
    assert same_bits(shifted[1:], ref)


def test_concurrent_calls_on_one_layer_give_the_serial_results():
    """forward and forward_slots from several Python threads at once (the layer's lock serialises
    them over the shared arena): each call gets exactly what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor
    layer = make_layer("INT4", "amx_emu")
    cases = []
    for T in (1, 3, 40, 2, 70, 5):
        x, ids, w = routing(T, seed=T)
        ids[::3, 0] = -1
        cases.append((x, ids, w))
    serial = [(layer.forward(*c), layer.forward_slots(*c)) for c in cases]

    def run(i):
        c = cases[i % len(cases)]
        return i % len(cases), layer.forward(*c), layer.forward_slots(*c)

    with ThreadPoolExecutor(4) as pool:
        for i, y, s in pool.map(run, range(24)):
            assert same_bits(y, serial[i][0]) and same_bits(s, serial[i][1])


@pytest.mark.parametrize("T", [0, 1, 5])
def test_bad_ids_weights_and_out_are_one_clear_error(T):
    layer = make_layer("BF16")
    x, ids, w = routing(max(T, 1))
    x, ids, w = x[:T], ids[:T], w[:T]
    cases = [
        (dict(topk_ids=ids.astype(np.float32)), TypeError, "topk_ids"),
        (dict(topk_ids=ids[:, :2]), ValueError, "topk_ids|top_k"),
        (dict(topk_weights=w.astype(np.int32)), TypeError, "topk_weights"),
        (dict(topk_weights=w[:, :2]), ValueError, "topk_weights"),
        (dict(out=np.empty((T, H), np.float64)), ValueError, "out"),
        (dict(out=np.empty((T, H + 1), np.float32)), ValueError, "out"),
        (dict(out=np.empty((T, K_TOP, H), np.float32)), ValueError, "out"),
        (dict(out=np.broadcast_to(np.zeros((1, H), np.float32), (T, H))), ValueError, "out"),
        (dict(out=[[0.0] * H] * T), ValueError, "out"),
    ]
    if T:
        cases.append((dict(topk_ids=np.where(ids == ids[0, 0], -2, ids)), ValueError, "-2"))
        cases.append((dict(topk_ids=np.where(ids == ids[0, 0], E, ids)), ValueError, str(E)))
    for change, kind, words in cases:
        args = dict(x=x, topk_ids=ids, topk_weights=w, out=None)
        args.update(change)
        with pytest.raises(kind, match=words):
            layer.forward(**args)
    for shape in [(), (H,), (1, T, H), (T, H + 1)]:
        with pytest.raises(ValueError, match="x"):
            layer.forward(np.zeros(shape, np.float32), ids, w)
        with pytest.raises(ValueError, match="x"):
            layer.forward_slots(np.zeros(shape, np.float32), ids, w)


# ---------------------------------------------------------------------------------------------
# 1b. torch tensors in and out
# ---------------------------------------------------------------------------------------------

try:  # the hf extra; without it the torch tests skip and the GEMM tests below still run
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="the hf extra (torch) is not installed")
TORCH_DTYPES = {"float32": ("float32", np.float32), "bfloat16": ("bfloat16", ml_dtypes.bfloat16),
                "float16": ("float16", np.float16)}


@pytest.fixture(scope="module")
def int8_layer():
    return make_layer("INT8")


@needs_torch
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_torch_inputs_give_the_numpy_bits(int8_layer, dtype, ids_dtype):
    """x of each float dtype (contiguous, strided, requiring grad), ids int32/int64 with -1 slots,
    weights as a strided tensor: the result is a tensor of x's dtype holding the numpy path's
    float32 result rounded once."""
    tdtype, ndtype = TORCH_DTYPES[dtype]
    tdtype = getattr(torch, tdtype)
    x, ids, w = routing(7)
    ids[::2, 2] = -1
    xn = x.astype(ndtype)
    ref = int8_layer.forward(xn, ids, w)
    wide = torch.zeros(7, 2 * H, dtype=tdtype)
    wide[:, ::2] = torch.from_numpy(x).to(tdtype)
    weights_t = torch.from_numpy(np.ascontiguousarray(w.T)).t()      # a column-major view
    for xt in (torch.from_numpy(x).to(tdtype), wide[:, ::2], torch.from_numpy(x).to(tdtype).requires_grad_(True)):
        y = int8_layer.forward(xt, torch.from_numpy(ids).to(getattr(torch, ids_dtype)), weights_t)
        assert isinstance(y, torch.Tensor) and y.dtype == tdtype and tuple(y.shape) == (7, H)
        assert not y.requires_grad
        assert torch.equal(y, torch.from_numpy(ref).to(tdtype))


@needs_torch
def test_torch_float32_slots_sum_to_forward(int8_layer):
    x, ids, w = routing(8)
    ids[3, :] = -1
    ids[::2, 0] = -1
    xt, it, wt = torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w)
    slots = int8_layer.forward_slots(xt, it, wt)
    y = int8_layer.forward(xt, it, wt)
    assert slots.dtype == torch.float32 and tuple(slots.shape) == (8, K_TOP, H)
    assert same_bits(ordered_slot_sum(slots.numpy()), y.numpy())
    assert same_bits(slots.numpy(), int8_layer.forward_slots(x, ids, w))


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_slots_of_a_half_precision_tensor_are_float32(int8_layer, dtype):
    tdtype, ndtype = TORCH_DTYPES[dtype]
    tdtype = getattr(torch, tdtype)
    x, ids, w = routing(6)
    slots = int8_layer.forward_slots(torch.from_numpy(x).to(tdtype), torch.from_numpy(ids), torch.from_numpy(w))
    numpy_slots = int8_layer.forward_slots(x.astype(ndtype), ids, w)
    assert slots.dtype == torch.float32
    assert same_bits(slots.numpy(), numpy_slots)


@needs_torch
def test_torch_zero_rows_and_wrong_ranks(int8_layer):
    for dtype in (torch.float32, torch.bfloat16):
        empty_ids = torch.zeros((0, K_TOP), dtype=torch.int64)
        y = int8_layer.forward(torch.zeros((0, H), dtype=dtype), empty_ids, torch.zeros((0, K_TOP)))
        assert isinstance(y, torch.Tensor) and y.dtype == dtype and tuple(y.shape) == (0, H)
        s = int8_layer.forward_slots(torch.zeros((0, H)), empty_ids, torch.zeros((0, K_TOP)))
        assert isinstance(s, torch.Tensor) and tuple(s.shape) == (0, K_TOP, H)
    _, ids, w = routing(1)
    for bad in (torch.tensor(1.0), torch.zeros(H), torch.zeros((1, 1, H)), torch.zeros((1, H + 1))):
        with pytest.raises(ValueError, match="x must be"):
            int8_layer.forward(bad, ids, w)
    for bad in (torch.zeros((1, H), dtype=torch.int32), torch.zeros((1, H), dtype=torch.complex64)):
        with pytest.raises(TypeError, match="x must be"):
            int8_layer.forward(bad, ids, w)
    with pytest.raises(TypeError, match="topk_ids"):
        int8_layer.forward(torch.zeros((1, H)), torch.zeros((1, K_TOP), dtype=torch.bool), w)
    with pytest.raises(ValueError, match="-2"):
        int8_layer.forward(torch.zeros((1, H)), torch.full((1, K_TOP), -2), w)


@needs_torch
def test_out_tensors_of_every_kind(int8_layer):
    x, ids, w = routing(6)
    ids[1, 1] = -1
    ref = int8_layer.forward(x, ids, w)
    xt = torch.from_numpy(x)
    # float32, contiguous: written in place and returned
    out = torch.full((6, H), 5.0)
    assert int8_layer.forward(x, ids, w, out=out) is out and same_bits(out.numpy(), ref)
    # non-contiguous float32 views: the strided and the transposed layout
    for out in (torch.full((6, 2 * H), 5.0)[:, ::2], torch.full((H, 6), 5.0).t()):
        assert int8_layer.forward(xt, ids, w, out=out) is out and same_bits(out.numpy(), ref)
    # bf16 / f16 outputs hold the float32 result rounded once
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.zeros((6, H), dtype=dtype)
        assert int8_layer.forward(xt.to(torch.bfloat16), ids, w, out=out) is out
        assert torch.equal(out, torch.from_numpy(int8_layer.forward(x.astype(ml_dtypes.bfloat16), ids, w)).to(dtype))
    # numpy out with a torch x: the numpy array is the result
    out = np.empty((6, H), np.float32)
    assert int8_layer.forward(xt, ids, w, out=out) is out and same_bits(out, ref)
    # out aliasing x (a float32 tensor written in place)
    xa = xt.clone()
    assert int8_layer.forward(xa, ids, w, out=xa) is xa and same_bits(xa.numpy(), ref)
    xb = xt.to(torch.bfloat16)
    expected = int8_layer.forward(xb, ids, w)
    assert int8_layer.forward(xb, ids, w, out=xb) is xb and torch.equal(xb, expected)
    # forward_slots into a tensor
    slots = torch.empty((6, K_TOP, H))
    assert int8_layer.forward_slots(xt, ids, w, out=slots) is slots
    assert same_bits(slots.numpy(), int8_layer.forward_slots(x, ids, w))
    # refused, naming out, before any work
    for bad in (torch.zeros((6, H + 1)), torch.zeros((6, H), dtype=torch.int32), torch.zeros((6, H), dtype=torch.float64),
                torch.zeros((6, H), requires_grad=True), torch.zeros((6, K_TOP, H)), torch.tensor(0.0)):
        with pytest.raises(ValueError, match="out"):
            int8_layer.forward(xt, ids, w, out=bad)


@needs_torch
def test_an_out_tensor_with_overlapping_elements_is_refused_as_a_value_error(int8_layer):
    x, ids, w = routing(4)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="out"):
            int8_layer.forward(x, ids, w, out=torch.zeros((1, H), dtype=dtype).expand(4, H))


@needs_torch
def test_a_tensor_without_data_is_a_clear_error(int8_layer):
    _, ids, w = routing(2)
    with pytest.raises((ValueError, TypeError), match="x"):
        int8_layer.forward(torch.zeros((2, H), device="meta"), ids, w)


# ---------------------------------------------------------------------------------------------
# 2. GEMM kernels against exact references on the edges of the new tiles
# ---------------------------------------------------------------------------------------------

EDGE_M = (5, 6, 7, 8, 9, 31, 33, 97)           # tiles of 3 (wide INT8) and 4 rows, and remainders
EDGE_N = (16, 17, 33, 48, 80, 96)              # 1, 2, 3, 3, 5, 6 panels: odd counts leave a 1-panel tail
EDGE_K = (1, 63, 65, 200, 4000)                # not multiples of 64 / 128
# every M once, N and K rotating, plus the decode rows (1, 2: the prefetching path) over the long K
EDGE_SHAPES = [(m, EDGE_N[i % len(EDGE_N)], EDGE_K[i % (len(EDGE_K) - 1)]) for i, m in enumerate(EDGE_M)] + \
              [(1, 96, 4000), (2, 80, 4000), (9, 48, 4000), (2, 17, 65), (97, 33, 200)]
FORMAT_CASES = [(f, g) for f in FORMATS for g in (descriptor(f)["group_sizes"] if f in GROUPED else (None,))]


def packed_weight(rng, fmt, group, n, k):
    W = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return kernels.pack(W, fmt, group_size=group) if group else kernels.pack(W, fmt)


def reference(X, packed):
    """(reference, bound): integer formats bit for bit from integers (bound None); float formats
    in float64, each output allowed an error of a fraction of its products' magnitude (sum of
    |x w|: a float32 sum's error scales with it, and a dot product that cancels to a small value
    keeps the error of its large terms).  The float sums stay within 1.6e-7 of it over 2200 edge
    and random cases; MXFP4's 16-bit path rounds activations to 2^-15 of their block's largest,
    which a block holding one large value and small ones turns into more than a fraction of the
    products (its own bound, i16_bound, is added)."""
    if packed.format == "INT8":
        q_x, s_x = quantize_rows_int8(X)
        return int8_exact_reference(q_x, s_x, packed.codes(), packed.scale[: packed.shape[0]]), None
    if packed.format in GROUPED:
        return int4_exact_reference(X, packed), None
    if packed.format == "MXFP4_A8":
        return mxfp4_a8_exact_reference(X, packed), None
    x, w = bf16_round(X).astype(np.float64), packed.dequantize().astype(np.float64)
    bound = 1e-6 * (np.abs(x) @ np.abs(w).T)
    return x @ w.T, bound + i16_bound(x, w) if packed.format == "MXFP4" else bound


def assert_matches(y, ref, bound, what):
    """Integer formats: the same bits; float formats: every output within its bound."""
    if bound is None:
        assert np.array_equal(y, ref), f"{what} differs from the integer reference"
    else:
        err = np.abs(y - ref)
        worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
        assert np.all(err <= bound), f"{what}: error {err[worst]} against a bound of {bound[worst]} at {worst}"


def check_every_variant(X, packed, where):
    ref, bound = reference(X, packed)
    variants = runnable_variants(packed.format)
    assert variants
    for v in variants:
        assert_matches(kernels.linear_variant(X, packed, v), ref, bound, f"{v} at {where}")


@pytest.mark.parametrize("fmt,group", FORMAT_CASES)
def test_every_variant_on_tile_and_block_edges(fmt, group):
    for m, n, k in EDGE_SHAPES:
        rng = np.random.default_rng(m * 100003 + n * 101 + k)
        X = rng.standard_normal((m, k)).astype(np.float32)
        check_every_variant(X, packed_weight(rng, fmt, group, n, k), (fmt, group, m, n, k))


def gemm_property(data):
    fmt, group = data.draw(st.sampled_from(FORMAT_CASES), label="format")
    m = data.draw(st.integers(1, 40), label="m")
    n = data.draw(st.integers(1, 100), label="n")
    k = data.draw(st.integers(1, 300), label="k")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    X = rng.standard_normal((m, k)).astype(np.float32) * np.float32(data.draw(st.sampled_from([1e-3, 1.0, 1e3])))
    check_every_variant(X, packed_weight(rng, fmt, group, n, k), (fmt, group, m, n, k))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_every_variant_matches_the_reference_on_random_shapes(data):
    gemm_property(data)


@pytest.mark.fuzz
@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_every_variant_matches_the_reference_on_random_shapes_long(data):
    gemm_property(data)


@pytest.mark.parametrize("fmt,group", [("INT8", None), ("INT4", 32), ("INT4_ZP", 128), ("BF16", None),
                                       ("MXFP4", None)])
def test_public_linear_with_one_and_two_threads(fmt, group, threads):
    """Panel ranges split unevenly between two threads (3 and 5 panels; 1, 5 and 33 rows): the
    same bits as one thread, and the reference."""
    if _native.usable_cpus() < 2:
        pytest.skip("one usable CPU: no second thread count to compare")
    for m, n, k in ((1, 80, 200), (5, 33, 65), (33, 80, 200), (5, 80, 4000)):
        rng = np.random.default_rng(m + n + k)
        X = rng.standard_normal((m, k)).astype(np.float32)
        packed = packed_weight(rng, fmt, group, n, k)
        ref, bound = reference(X, packed)
        for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
            ktcy.set_num_threads(1)
            one = kernels.linear(X, packed, isa=isa)
            ktcy.set_num_threads(2)
            two = kernels.linear(X, packed, isa=isa)
            assert same_bits(one, two), (isa, m, n, k)
            assert_matches(two, ref, bound, f"{isa} at {(fmt, m, n, k)}")


GUARD_HELPER = textwrap.dedent("""
    import ctypes, dataclasses, mmap, sys
    import numpy as np
    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    maps = []

    def at_page_end(a):
        '''A copy of a whose last byte is the last readable one: a PROT_NONE page follows.'''
        a = np.ascontiguousarray(a)
        pages = -(-a.nbytes // PAGE) + 1
        mm = mmap.mmap(-1, (pages + 1) * PAGE)
        buf = np.frombuffer(mm, np.uint8)
        base = buf.ctypes.data
        assert base % PAGE == 0
        if libc.mprotect(ctypes.c_void_p(base + pages * PAGE), PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        view = buf[pages * PAGE - a.nbytes: pages * PAGE].view(a.dtype).reshape(a.shape)
        view[...] = a
        maps.append(mm)
        return view
""")

GUARDED_GEMMS = GUARD_HELPER + textwrap.dedent("""
    sys.path.insert(0, sys.argv[1])
    from conftest import runnable_variants
    from ktcy import kernels
    from ktcy.formats import FORMATS, GROUPED_FORMATS
    done = 0
    for fmt in FORMATS:
        for m, n, k in ((1, 16, 64), (2, 48, 200), (1, 33, 4000), (2, 96, 1000), (7, 80, 200), (9, 33, 65)):
            rng = np.random.default_rng(m + n + k)
            W = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            X = rng.standard_normal((m, k)).astype(np.float32)
            group = 16 if fmt in ("INT8_GROUP", "INT8_MIN") else 32  # their 4-row groups and 16-byte AMX steps
            p = kernels.pack(W, fmt, group_size=group) if fmt in GROUPED_FORMATS else kernels.pack(W, fmt)
            moved = {f: at_page_end(getattr(p, f)) for f in ("data", "scale", "colsum", "zero")
                     if getattr(p, f) is not None}
            g = dataclasses.replace(p, **moved)
            for v in runnable_variants(fmt):
                out = at_page_end(np.zeros((m, n), np.float32))   # partial last panel: masked stores
                kernels.linear_variant(at_page_end(X), g, v, out=out)
                assert np.array_equal(out, kernels.linear_variant(X, p, v)), (fmt, v)
                done += 1
    import ktcy
    E, K_TOP, H, I = 3, 2, 144, 80
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((E, I, H), (E, I, H), (E, H, I))]
    down16 = ktcy.QuantConfig("INT8_GROUP", group_size=16)
    for fmt, down in (("INT8", None), ("INT4", None), ("MXFP4", None), ("BF16", down16)):
        for isa in [i for i in ktcy.available_isas() if i in ("avx2", "avx512")] + ["amx_emu"]:
            layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig(fmt), isa=isa,
                                                         down_quant_config=down), *weights)
            for T in (1, 40):
                x = rng.standard_normal((T, H)).astype(np.float32)
                ids = np.stack([rng.permutation(E)[:K_TOP] for _ in range(T)])
                ids[::2, 1] = -1
                w = rng.random((T, K_TOP)).astype(np.float32)
                out = at_page_end(np.zeros((T, H), np.float32))
                layer.forward(at_page_end(x), at_page_end(ids), at_page_end(w), out=out)
                assert np.array_equal(out, layer.forward(x, ids, w)), (fmt, isa, T)
                slots = at_page_end(np.zeros((T, K_TOP, H), np.float32))
                layer.forward_slots(at_page_end(x), at_page_end(ids), at_page_end(w), out=slots)
                assert np.array_equal(slots, layer.forward_slots(x, ids, w)), (fmt, isa, T)
                done += 1
    print("runs", done)
""")


def run_guarded(code, *args):
    env = dict(os.environ, PYTHONMALLOC="malloc")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_packed_arrays_ending_at_a_guard_page_are_never_read_past():
    """Weights, scales, column sums, zero points, activations and outputs (of kernels.linear_variant
    and of MoE.forward / forward_slots) end exactly where a PROT_NONE page begins: a real load or
    store past the end (not a prefetch, which never faults) kills the child with SIGSEGV."""
    control = run_guarded(GUARD_HELPER + "a = at_page_end(np.arange(10, dtype=np.uint8))\n"
                          "print(ctypes.string_at(a.ctypes.data + a.nbytes, 1))\n")
    assert control.returncode == -11, "the guard page does not fault: the test below would prove nothing"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    r = run_guarded(GUARDED_GEMMS, tests_dir)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert int(r.stdout.split()[-1]) >= 6 * len(FORMATS) + 6




@pytest.mark.parametrize("m", [1, 5, 40])
def test_int8_code_minus_128_is_exact_and_the_same_on_every_variant(m):
    """Released symmetric INT8 reaches -128 (compressed-tensors' scale is amax / 127.5): every
    variant keeps it, the sign-flip ones (AVX2, AVX-512 BW) included, with the same bits."""
    rng = np.random.default_rng(m)
    codes = rng.integers(-128, 128, (33, 200)).astype(np.int8)
    codes[:, :8] = -128
    scale = (rng.random(33) * 0.01 + 0.001).astype(np.float32)
    X = rng.standard_normal((m, 200)).astype(np.float32)
    X[:, :8] = -np.abs(X[:, :8])
    packed = kernels.pack_quantized(codes, scale, "INT8")
    assert np.array_equal(packed.codes(), codes)
    check_every_variant(X, packed, ("INT8 codes with -128", m))
    outs = {v: kernels.linear_variant(X, packed, v) for v in runnable_variants("INT8")}
    first = next(iter(outs.values()))
    assert all(np.array_equal(y, first) for y in outs.values()), sorted(outs)


def test_int8_column_sums_that_disagree_with_the_codes_are_refused_or_unused():
    rng = np.random.default_rng(0)
    W, X = (rng.standard_normal((33, 200)) * 0.05).astype(np.float32), rng.standard_normal((5, 200)).astype(np.float32)
    good = kernels.pack(W, "INT8")
    bad = dataclasses.replace(good, colsum=good.colsum + 1000)
    try:
        bad.native()
    except ValueError as e:
        assert "colsum" in str(e) or "column sum" in str(e)
        return
    check_every_variant(X, bad, "INT8 with damaged column sums")


# ---- the fifty-ninth session's review of the native boundary ----

def _tiny_moe(bias=True):
    rng = np.random.default_rng(21)
    E, H, I = 4, 64, 32
    g, u = (rng.standard_normal((E, I, H)).astype(np.float32) * 0.1 for _ in range(2))
    d = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    b = {"gate": rng.standard_normal((E, I)).astype(np.float32), "down": rng.standard_normal((E, H)).astype(np.float32)}
    moe = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig("BF16")), g, u, d, bias=b if bias else None)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.argsort(rng.random((5, E)), axis=1)[:, :2]
    return moe, b, x, ids, np.full((5, 2), 0.5, np.float32)


def test_a_layers_biases_cannot_be_swapped_under_its_engine():
    """moe.bias was the dict the engine read raw pointers from: replacing an entry freed an array
    it still read.  It is now a read-only view of read-only arrays; the engine holds its own."""
    moe, b, x, ids, w = _tiny_moe()
    before = moe.forward(x, ids, w)
    with pytest.raises(TypeError):
        moe.bias["down"] = b["down"].copy()
    with pytest.raises(ValueError, match="read-only"):
        moe.bias["down"][0, 0] = 1.0
    b["down"][:] = 7.0  # the caller's arrays were copied
    again = ktcy.MoE(moe.config, moe.gate, moe.up, moe.down, bias=moe.bias)  # a bias mapping is taken as it is
    assert np.array_equal(moe.forward(x, ids, w), before) and np.array_equal(again.forward(x, ids, w), before)


def test_native_objects_are_made_once_and_keep_their_buffers():
    p = kernels.pack(np.ones((16, 64), np.float32), "INT8")
    act = _native.Activations(p.native().fmt, np.ones((2, 64), np.float32), p.k_pad, 0)
    for name in ("q", "scale", "bf16", "group_sum", "fmt"):
        with pytest.raises(AttributeError):
            setattr(act, name, None if name != "fmt" else 1)
    with pytest.raises(TypeError, match="made once"):
        act.__init__(p.native().fmt, np.ones((3, 64), np.float32), p.k_pad, 0)
    weight = p.native()
    with pytest.raises(TypeError, match="made once"):
        weight.__init__(weight.fmt, 0, 16, 64, p.data, None, None)
    with pytest.raises(AttributeError):
        weight.fmt = 0
    moe, *_ = _tiny_moe(bias=False)
    with pytest.raises(TypeError, match="made once"):
        moe._engine.__init__("BF16", [], [], [], "bf16_ref", "bf16_ref", 1)


def test_packed_weight_view_follows_replaced_arrays_and_shapes():
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    p, q = kernels.pack(a, "INT8"), kernels.pack(b, "INT8")
    first = kernels.linear(x, p)
    p.data, p.scale, p.colsum = q.data, q.scale, q.colsum  # the same shape, other weights
    assert np.array_equal(kernels.linear(x, p), kernels.linear(x, q))
    r = dataclasses.replace(p, data=kernels.pack(a, "INT8").data, colsum=kernels.pack(a, "INT8").colsum,
                            scale=kernels.pack(a, "INT8").scale)
    assert np.array_equal(kernels.linear(x, r), first)
    p.shape = (48, 64)  # arrays of 32 rows: refused, not 16 rows of memory past them
    with pytest.raises(ValueError):
        kernels.linear(x, p)


def test_layout_refuses_codes_of_another_width():
    with pytest.raises(ValueError, match="16-bit integers"):
        _native.layout(kernels._CODE["BF16"], np.zeros((16, 32), np.int8), 16, 32)
    with pytest.raises(ValueError, match="8-bit integers"):
        _native.layout(kernels._CODE["INT8"], np.zeros((16, 32), np.float32), 16, 32)


def test_emulated_tiles_never_move_bytes_past_the_callers_array():
    cfg = np.zeros(64, np.uint8)
    cfg[0], cfg[48] = 1, 16  # palette 1; tmm0: 16 rows
    cfg[16:18] = (64, 0)     # of 64 bytes
    _native.emu_reset()
    _native.emu_ldtilecfg(cfg)
    try:
        with pytest.raises(ValueError, match="16 x 64 bytes; the source is 1 x 1"):
            _native.emu_tileloadd(0, np.ones((1, 1), np.uint8))
        with pytest.raises(ValueError, match="the destination asked for is 1 x 1"):
            _native.emu_tilestored(0, 1, 1)
        with pytest.raises(ValueError, match="tmm9 does not exist"):
            _native.emu_tileloadd(9, np.ones((16, 64), np.uint8))
        _native.emu_tileloadd(0, np.full((16, 64), 3, np.uint8))
        assert (_native.emu_tilestored(0, 16, 64) == 3).all() and _native.emu_error() is None
        _native.emu_tileloadd(5, np.ones((16, 64), np.uint8))  # tmm5 is not configured: a fault stays set
        assert "tmm5 is not configured" in _native.emu_error()
        x, w = np.ones((2, 64), np.float32), kernels.pack(np.ones((16, 64), np.float32), "INT8")
        # a GEMM on the emulator reports its own faults only
        assert np.array_equal(kernels.linear_variant(x, w, "amx_emu_int8"), kernels.linear_variant(x, w, "int8_ref"))
    finally:
        _native.emu_reset()
