"""Layers that ktcy packs keep their experts' arrays in one 2 MiB-aligned buffer (expert_arena):
each array in its own cache-line-aligned, non-overlapping place, holding the bytes the packer
made, and the layer computes the same bits as over the packer's own arrays."""
import numpy as np
import pytest

import ktcy
from ktcy import kernels
from ktcy.expert_arena import ExpertArena
from ktcy.moe import MoE

ARRAYS = ("data", "scale", "colsum", "zero")
E, H, I, TOP_K = 5, 96, 80, 2


def _sources(seed=0):
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((E, I, H), np.float32) * 0.1
    up = rng.standard_normal((E, I, H), np.float32) * 0.1
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    return gate, up, down


def _config(fmt):
    return ktcy.MoeConfig(E, TOP_K, H, I, ktcy.QuantConfig(fmt, group_size=32))


def _spans(layer):
    """(start, end, projection, expert, array) of every array of the layer."""
    out = []
    for name in ("gate", "up", "down"):
        for e, w in enumerate(getattr(layer, name)):
            for n in ARRAYS:
                a = getattr(w, n)
                if a is not None:
                    assert a.flags.c_contiguous
                    out.append((a.ctypes.data, a.ctypes.data + a.nbytes, name, e, n))
    return sorted(out)


def _root(a):
    """The array that owns a's memory."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize("fmt", ["BF16", "INT8", "INT4", "INT4_ZP", "INT4_MIN", "INT8_GROUP", "INT8_MIN", "FP8_PERCHANNEL", "FP8_BLOCK",
                                 "MXFP4"])
def test_from_weights_puts_every_expert_in_one_aligned_buffer(fmt):
    gate, up, down = _sources()
    layer = MoE.from_weights(_config(fmt), gate, up, down)
    spans = _spans(layer)
    bases = {id(_root(getattr(getattr(layer, s[2])[s[3]], s[4]))) for s in spans}
    assert len(bases) == 1, "the arrays live in more than one allocation"
    start = spans[0][0]
    assert start % (2 << 20) == 0, "the buffer does not start on a huge-page boundary"
    for (lo, hi, *what), (next_lo, _, *_) in zip(spans, spans[1:]):
        assert lo % 64 == 0, f"{what} does not start on a cache line"
        assert hi <= next_lo, f"{what} overlaps the next array"
    # the bytes are the packer's: pack expert 2's up projection again and compare every array
    again = kernels.pack(up[2], fmt, group_size=32)
    for n in ARRAYS:
        a, b = getattr(layer.up[2], n), getattr(again, n)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a, b), f"up[2].{n} differs from a fresh packing"


@pytest.mark.parametrize("fmt", ["INT4_ZP", "INT4_MIN", "FP8_BLOCK", "MXFP4"])
def test_arena_layer_computes_the_same_bits_as_the_packers_arrays(fmt):
    gate, up, down = _sources(1)
    config = _config(fmt)
    placed = MoE.from_weights(config, gate, up, down)
    loose = MoE(config, *([kernels.pack(w[e], fmt, group_size=32) for e in range(E)] for w in (gate, up, down)))
    rng = np.random.default_rng(2)
    for T in (1, 7):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T)]).astype(np.int64)
        w = rng.random((T, TOP_K)).astype(np.float32)
        assert np.array_equal(placed.forward(x, ids, w), loose.forward(x, ids, w)), f"{fmt} T={T}"


def test_place_keeps_a_weight_that_does_not_fit_its_slot():
    rng = np.random.default_rng(3)
    first = {"gate": kernels.pack(rng.standard_normal((32, 64)).astype(np.float32), "INT8")}
    arena = ExpertArena(first, 2)
    other_shape = kernels.pack(rng.standard_normal((48, 64)).astype(np.float32), "INT8")
    other_format = kernels.pack(rng.standard_normal((32, 64)).astype(np.float32), "BF16")
    assert arena.place(0, "gate", other_shape) is other_shape
    assert arena.place(0, "gate", other_format) is other_format
    assert arena.place(0, "down", first["gate"]) is first["gate"]  # a projection it has no room for
    assert arena.place(2, "gate", first["gate"]) is first["gate"]  # past the last slot
    assert arena.place(-1, "gate", first["gate"]) is first["gate"]
    placed = arena.place(1, "gate", first["gate"])
    assert placed is not first["gate"] and np.shares_memory(placed.data, arena.buffer)
    assert np.array_equal(placed.data, first["gate"].data) and np.array_equal(placed.scale, first["gate"].scale)


def test_pack_experts_takes_the_listed_experts_in_order_into_one_buffer():
    """The expert-parallel layer packs only its rank's experts: pack_experts(ids) gives those, in
    the order listed, in one buffer."""
    from ktcy.moe import pack_experts, stacked_experts
    gate, up, down = _sources(4)
    config = _config("INT4_ZP")
    packed = pack_experts(config, stacked_experts(config, gate, up, down), [3, 1])
    for name, src in (("gate", gate), ("up", up), ("down", down)):
        assert len(packed[name]) == 2
        for w, e in zip(packed[name], (3, 1)):
            fresh = kernels.pack(src[e], "INT4_ZP", group_size=32)
            assert all(np.array_equal(getattr(w, n), getattr(fresh, n)) for n in ("data", "scale", "zero"))
    roots = {id(_root(getattr(w, n))) for ws in packed.values() for w in ws for n in ("data", "scale", "zero")}
    assert len(roots) == 1
