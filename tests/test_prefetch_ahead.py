"""Prefill calls fetch the next panels while their row tiles compute, decode tiles' streams run
on into the panels they read next (include/ktcy/prefetch.h), and the MoE engine's threads take
work items one ahead so each GEMM knows what comes next (include/ktcy/worklist.h).  Fetching
changes no number: forward must stay bit-identical across thread counts and match float64; the
tile shares must cover every line of what they fetch, and a stream's prefetches every block of
its panel and the first blocks of the next."""
import numpy as np
import pytest

import ktcy
from ktcy import _native, kernels

FORMATS = list(ktcy.FORMATS)


@pytest.mark.parametrize("nbytes,tiles,nkb", [(1, 2, 1), (64, 3, 4), (65, 2, 64), (4 * 64 * 1024, 6, 64),
                                             (272 * 48, 7, 48), (1000, 40, 2), (5 * 512 * 24, 2, 24)])
def test_tile_shares_cover_every_line(nbytes, tiles, nkb):
    shares = _native.ahead_shares(nbytes, tiles, nkb)
    assert len(shares) == tiles
    fetched = set()
    for first, lines in shares:
        assert lines >= 0 and first % 64 == 0
        if lines:
            assert first < nbytes, "a tile with lines to fetch starts inside the range"
        fetched.update(first + (kb * lines + j) * 64 for kb in range(nkb) for j in range(lines))
    wanted = set(range(0, nbytes, 64))
    assert wanted <= fetched
    # the shares split the lines evenly: no tile fetches more than an equal share rounded up
    lines_total = -(-nbytes // 64)
    equal_share = -(-lines_total // tiles)
    assert all(lines * nkb < equal_share + nkb for _, lines in shares)


def test_nothing_to_fetch_gives_no_lines():
    assert _native.ahead_shares(0, 4, 8) == [(0, 0)] * 4
    assert _native.ahead_shares(4096, 1, 8) == [(0, 0)]  # one tile (decode) streams its own panels


@pytest.mark.parametrize("nkb,ahead,block,slots,next_slots", [(10, 8, 1024, 4, 4), (3, 8, 272, 4, 4),
                                                            (64, 8, 512, 4, 1), (24, 8, 512, 2, 2), (9, 8, 1024, 1, 0)])
def test_a_stream_runs_on_into_the_panel_its_slot_reads_next(nkb, ahead, block, slots, next_slots):
    """Over a pass through its panel, slot s fetches the blocks `ahead` on in the concatenation
    of its panel and the next group's panel s: none skipped, none twice; a slot with no next
    panel runs past its panel's end (harmless for a prefetch) as before."""
    panel_bytes = nkb * block
    here, there = 10**6, 5 * 10**6  # offsets of this group's first panel and the next group's
    for slot in range(slots):
        mine = here + slot * panel_bytes
        got = [_native.stream_ahead(there, next_slots * panel_bytes, panel_bytes, slot, mine, kb, nkb, ahead, block)
               for kb in range(nkb)]
        if slot < next_slots:
            stream = [mine + b * block for b in range(nkb)] + [there + slot * panel_bytes + b * block
                                                                for b in range(ahead)]
            assert got == stream[ahead:ahead + nkb]
        else:
            assert got == [mine + (kb + ahead) * block for kb in range(nkb)]


def _layer(fmt, isa, rng, E=7, H=200, I=136):
    gate, up = ((rng.standard_normal((E, I, H)) * 0.05).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((E, H, I)) * 0.05).astype(np.float32)
    layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, 2, H, I, ktcy.QuantConfig(fmt), isa=isa), gate, up, down)
    return layer


def _reference(layer, x, ids, w):
    deq = [np.stack([p.dequantize() for p in ps]).astype(np.float64) for ps in (layer.gate, layer.up, layer.down)]
    y = np.zeros((x.shape[0], deq[2].shape[1]))
    for e in np.unique(ids[ids >= 0]):
        rows, slots = np.nonzero(ids == e)
        g, u = x[rows] @ deq[0][e].T, x[rows] @ deq[1][e].T
        y[rows] += w[rows, slots][:, None] * ((g / (1 + np.exp(-g)) * u) @ deq[2][e].T)
    return y


def _agree_across_threads_isas_and_float64(fmt, x, ids, w, seed, **shape):
    """The layer on every runnable ISA but real AMX (untestable here): 2 threads, then 1, give the
    same bits (the 2-thread call first, into a fresh buffer arena, so an item it skipped could not
    hide behind stale rows), within the activations' error of float64, and the integer formats
    the same bits on every ISA."""
    outputs = {}
    for isa in [i for i in ("avx512", "avx2", "ref", "amx_emu") if i in ktcy.available_isas()]:
        layer = _layer(fmt, isa, np.random.default_rng(seed), **shape)
        old = ktcy.get_num_threads()
        try:
            ktcy.set_num_threads(min(2, _native.usable_cpus()))
            two = layer.forward(x, ids, w)
            ktcy.set_num_threads(1)
            one = layer.forward(x, ids, w)
        finally:
            ktcy.set_num_threads(old)
        assert np.array_equal(one, two), f"{fmt} on {isa}: thread counts disagree"
        ref = _reference(layer, x.astype(np.float64), ids, w)
        err = np.linalg.norm(one - ref) / np.linalg.norm(ref)
        # int8 rounding of x and of the intermediate: about 1.6% for INT8, INT4 and MXFP4_A8 alike
        # at this shape; MXFP4_A8's E2M1 weights reach 2.1% here
        bound = 2.5e-2 if fmt == "MXFP4_A8" else 2e-2 if kernels.descriptor(fmt)["activations"] == "int8" else 5e-3
        assert err < bound, (fmt, isa, err)
        outputs[isa] = one
    if kernels.descriptor(fmt)["activations"] == "int8":  # integer paths: the same bits on every ISA
        first = next(iter(outputs.values()))
        assert all(np.array_equal(first, o) for o in outputs.values()), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_with_lookahead_matches_threads_and_float64(fmt):
    """Experts with 45, 13, 6, 3, 3 and 0 rows: several row tiles and panel groups per call (each
    fetching the next), hints across experts and projections, the lookahead scheduler, and work
    items of two sizes in one call (the 3-row experts take decode-sized ones)."""
    rng = np.random.default_rng(3)
    T = 48
    ids = np.full((T, 2), -1, np.int64)
    ids[:45, 0] = 0
    ids[:13, 1] = 1
    ids[45:, 0] = 2
    ids[20:26, 1] = 4
    ids[30:33, 1] = 5  # expert 3 and 6 get no rows
    w = rng.random((T, 2)).astype(np.float32)
    x = rng.standard_normal((T, 200)).astype(np.float32)
    _agree_across_threads_isas_and_float64(fmt, x, ids, w, seed=5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_streams_and_lookahead_match_threads_and_float64(fmt):
    """Decode: experts with 1 or 2 rows (one tile per call, streaming; decode-sized work items,
    split so that each thread gets a few): 14 items in each phase for 2 threads, 7 for 1, so items
    are taken one ahead and each stream runs on into the next item's panels (and, inside an
    item, into the next group's)."""
    rng = np.random.default_rng(4)
    T = 5
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 0], [1, 2]], np.int64)  # every expert, 1 or 2 rows
    w = rng.random((T, 2)).astype(np.float32)
    x = rng.standard_normal((T, 264)).astype(np.float32)
    _agree_across_threads_isas_and_float64(fmt, x, ids, w, seed=6, H=264, I=520)  # 2 + 2 items per expert
