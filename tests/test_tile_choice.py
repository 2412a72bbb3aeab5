"""The tile choices made per CPU (registry.h: ktcy_one_panel_rows and ktcy_e2m1_panel_rows, the
few-row tile width; ktcy_wide_tiles, AVX2 INT8 prefill's tile) change which tiles run, never the
numbers: each output's sums run in the same order either way.  Both sides of each choice are
reached here on any CPU, so an AMD host tests the tiles an Intel host runs and back (but AVX2
INT8's one-row calls, which take two panels on every CPU: its one-panel one-row tile runs as the
odd tail)."""
import numpy as np
import pytest

import ktcy
from conftest import I16_PATH_OFF
from ktcy import _native, kernels
from ktcy.formats import descriptor, has_groups

VECTOR_VARIANTS = [v for v in _native.variants() if v["isa"] in ("avx2", "avx512")]


@pytest.fixture
def threads(request):
    """request.param threads for the test (skipped where this process may use fewer CPUs)."""
    if request.param > _native.usable_cpus():
        pytest.skip(f"{request.param} threads: this process may use {_native.usable_cpus()} CPU(s)")
    old = ktcy.get_num_threads()
    ktcy.set_num_threads(request.param)
    yield request.param
    ktcy.set_num_threads(old)


def _cases(variant):
    for fmt in variant["formats"]:
        for group in (descriptor(fmt)["group_sizes"] if has_groups(fmt) else (None,)):
            yield fmt, group


@pytest.mark.parametrize("variant", VECTOR_VARIANTS, ids=[v["name"] for v in VECTOR_VARIANTS])
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_one_and_many_panel_tiles_give_the_same_bits(variant, threads):
    """One thread, so one call covers all 11 panels: an AVX-512 four-panel group twice, then
    one-panel tails; AVX2 two-panel tiles five times, then one (more threads would split the panels
    first)."""
    if not variant["runnable"]:
        pytest.skip(f"{variant['name']}: this CPU lacks {', '.join(variant['needs'])}")
    rng = np.random.default_rng(7)
    n, k = 16 * 10 + 5, 200  # 11 panels; K not a multiple of any block or group
    w = rng.standard_normal((n, k)).astype(np.float32)
    for fmt, group in _cases(variant):
        packed = kernels.pack(w, fmt, group_size=group) if group else kernels.pack(w, fmt)
        reference = packed.dequantize(np.float64)
        for m in (1, 2, 3, 4, 5):
            x = rng.standard_normal((m, k)).astype(np.float32)
            # the 16-bit path off: MXFP4's few-row calls keep the tiles (that path has widths of its own)
            one = kernels.linear_variant(x, packed, variant["name"], one_panel_rows=8, e2m1_panel_rows=8, **I16_PATH_OFF)
            many = kernels.linear_variant(x, packed, variant["name"], one_panel_rows=0, e2m1_panel_rows=0, **I16_PATH_OFF)
            assert one.tobytes() == many.tobytes(), f"{fmt} group {group} {variant['name']} m={m}"
            exact = x.astype(np.float64) @ reference.T
            err = np.abs(many - exact).max() / np.abs(exact).max()
            assert err < 0.03, f"{fmt} {variant['name']} m={m}: {err:.2e} from float64"  # int8 activations: ~1%


WIDE_TILE_VARIANTS = [v for v in VECTOR_VARIANTS if v["isa"] == "avx2" and "INT8" in v["formats"]]


@pytest.mark.parametrize("variant", WIDE_TILE_VARIANTS, ids=[v["name"] for v in WIDE_TILE_VARIANTS])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_wide_and_four_row_prefill_tiles_give_the_same_bits(variant, threads):
    """AVX2 INT8 prefill's two tiles (registry.h: ktcy_wide_tiles, 3 rows x 2 panels on AMD cores
    with AVX-512, or 4 rows x 1 panel) sum the same integers: the same bits, whichever this CPU
    takes, for row counts that leave every tail (a 1- or 2-row wide tile, a 1-3 row short tile)
    and an odd panel count (a one-panel tail after the two-panel tiles).  Calls of 2 or 3 rows take
    the wide tiles where one_panel_rows is below their rows (not AMD), else the 4-row ones; 1 and 4
    rows their own: the same bits as the reference."""
    if not variant["runnable"]:
        pytest.skip(f"{variant['name']}: this CPU lacks {', '.join(variant['needs'])}")
    rng = np.random.default_rng(11)
    n, k = 16 * 10 + 5, 200  # 11 panels; K not a multiple of the 64-wide block
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed = kernels.pack(w, "INT8")
    reference = packed.dequantize(np.float64)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 32, 67):
        x = rng.standard_normal((m, k)).astype(np.float32)
        wide = kernels.linear_variant(x, packed, variant["name"], wide_tiles=1, one_panel_rows=0)
        four = kernels.linear_variant(x, packed, variant["name"], wide_tiles=0, one_panel_rows=4)
        assert wide.tobytes() == four.tobytes(), f"m={m}"
        assert four.tobytes() == kernels.linear_variant(x, packed, "int8_ref").tobytes(), f"m={m}"
        exact = x.astype(np.float64) @ reference.T
        err = np.abs(four - exact).max() / np.abs(exact).max()
        assert err < 0.03, f"m={m}: {err:.2e} from float64"  # int8 activations: ~1%


FP8_STREAM_VARIANTS = [v for v in VECTOR_VARIANTS if v["isa"] == "avx512" and "FP8_PERCHANNEL" in v["formats"]]


@pytest.mark.parametrize("variant", FP8_STREAM_VARIANTS, ids=[v["name"] for v in FP8_STREAM_VARIANTS])
@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("fmt", ["FP8_PERCHANNEL", "FP8_BLOCK"])
def test_fp8_streams_fetched_into_l1_or_l2_give_the_same_bits(variant, threads, fmt):
    """AVX-512 FP8's decode streams prefetch into L1 or, on a Zen 4, L2 (registry.h:
    ktcy_fp8_fetch_l2).  A prefetch cannot change a value, so what this holds is the code around
    it: both levels on both paths (the float path, f32_rows, and the bf16 tiles), over the panel
    ends where the prefetch runs on into the next panel, give the same bits and float64's numbers
    (the flag is one more argument of the float path's tile)."""
    if not variant["runnable"]:
        pytest.skip(f"{variant['name']}: this CPU lacks {', '.join(variant['needs'])}")
    rng = np.random.default_rng(13)
    n, k = 16 * 10 + 5, 300  # 11 panels; K not a multiple of the 32-wide block or of 128
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed = kernels.pack(w, fmt)
    reference = packed.dequantize(np.float64)
    for m in (1, 2, 3, 4, 6):
        x = rng.standard_normal((m, k)).astype(np.float32)
        for f32_rows in (0, 4):
            l1 = kernels.linear_variant(x, packed, variant["name"], f32_rows=f32_rows, fp8_fetch_l2=0)
            l2 = kernels.linear_variant(x, packed, variant["name"], f32_rows=f32_rows, fp8_fetch_l2=1)
            assert l1.tobytes() == l2.tobytes(), f"m={m} f32_rows={f32_rows}"
            exact = x.astype(np.float64) @ reference.T
            err = np.abs(l2 - exact).max() / np.abs(exact).max()
            assert err < 0.01, f"m={m} f32_rows={f32_rows}: {err:.2e} from float64"  # bf16 activations


PLAIN_STREAM_VARIANTS = [v for v in VECTOR_VARIANTS if v["isa"] == "avx2" and {"BF16", "INT8"} & set(v["formats"])]


@pytest.mark.parametrize("variant", PLAIN_STREAM_VARIANTS, ids=[v["name"] for v in PLAIN_STREAM_VARIANTS])
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_plain_streams_fetched_into_l1_or_l2_give_the_same_bits(variant, threads):
    """AVX2 BF16's and INT8's decode tiles prefetch their streams into L2 or, on AMD cores without
    AVX-512, L1 (registry.h: ktcy_plain_fetch_l2).  A prefetch cannot change a value: what this holds is the
    code around it, for every decode tile (1-4 rows, one and two panels, an odd panel at the end)
    and the prefill tiles past it (5 and 6 rows keep L1), against the reference variant."""
    if not variant["runnable"]:
        pytest.skip(f"{variant['name']}: this CPU lacks {', '.join(variant['needs'])}")
    rng = np.random.default_rng(17)
    n, k = 16 * 10 + 5, 300  # 11 panels; K not a multiple of the 32- or 64-wide block
    w = rng.standard_normal((n, k)).astype(np.float32)
    for fmt in sorted({"BF16", "INT8"} & set(variant["formats"])):
        packed = kernels.pack(w, fmt)
        for m in (1, 2, 3, 4, 5, 6):
            x = rng.standard_normal((m, k)).astype(np.float32)
            l1 = kernels.linear_variant(x, packed, variant["name"], plain_fetch_l2=0)
            l2 = kernels.linear_variant(x, packed, variant["name"], plain_fetch_l2=1)
            assert l1.tobytes() == l2.tobytes(), f"{fmt} m={m}"
            ref = kernels.linear_variant(x, packed, fmt.lower() + "_ref")
            if fmt == "INT8":  # integer sums: the same bits
                assert l2.tobytes() == ref.tobytes(), f"{fmt} m={m}"
            else:
                assert np.abs(l2 - ref).max() <= 1e-5 * np.abs(ref).max(), f"{fmt} m={m}"


def test_tile_choices_out_of_range_are_refused():
    """FP8's float path and MXFP4's 16-bit path sweep tiles of at most 4 rows: a bound above that
    would hand 4 rows' results to more rows, so gemm() refuses it (as KTCY_TILES does)."""
    w = np.ones((16, 64), np.float32)
    x = np.ones((6, 64), np.float32)
    packed = kernels.pack(w, "MXFP4")
    with pytest.raises(ValueError, match=r"i16_rows=8.*0\.\.4"):
        kernels.linear_variant(x, packed, "mxfp4_ref", i16_rows=8)
    with pytest.raises(ValueError, match=r"plain_fetch_l2=2.*0\.\.1"):
        kernels.linear_variant(x, packed, "mxfp4_ref", plain_fetch_l2=2)
    with pytest.raises(ValueError, match=r"avx2_i16_rows=5.*0\.\.4"):
        kernels.linear_variant(x, packed, "mxfp4_ref", avx2_i16_rows=5)
    with pytest.raises(ValueError, match=r"'bogus' is not a tile choice"):
        kernels.linear_variant(x, packed, "mxfp4_ref", bogus=1)
    assert kernels.linear_variant(x, packed, "mxfp4_ref", i16_rows=4, avx2_i16_rows=4).shape == (6, 16)
