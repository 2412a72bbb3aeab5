"""Roofline probes on the host that runs the tests: every peak this CPU can measure (the AVX2
probes run wherever AVX2 does, so AVX-512 hosts check them too) is either within
RELIABLE_SCALING of threads x its one-thread figure or flagged unreliable with a note."""
import numpy as np
import pytest

from ktcy import _native, roofline
from ktcy.errors import UnsupportedISAError

THREADS = 2


@pytest.mark.parametrize("name", _native.peak_names())
def test_peak_is_sane_or_flagged(name):
    p = _native.measure_peak(name, THREADS, seconds=0.02, repeats=3)
    assert p["value"] > 0 and p["single_thread"] > 0 and p["threads"] == THREADS
    scaled = p["value"] >= _native.RELIABLE_SCALING * THREADS * p["single_thread"]
    assert p["reliable"] == scaled
    if not p["reliable"]:
        assert "unreliable" in p["note"]
    else:
        assert p["note"] is None


def test_one_thread_peak_is_its_own_reference():
    name = _native.peak_names()[0]
    p = _native.measure_peak(name, 1, seconds=0.02, repeats=3)
    assert p["reliable"] and p["value"] == p["single_thread"]


def test_avx2_probes_run_wherever_avx2_does():
    if not _native.cpu_features()["avx2"]:
        pytest.skip("this CPU has no AVX2")
    assert {"avx2_fma", "avx2_int8"} <= set(_native.peak_names())
    fma = _native.measure_peak("avx2_fma", 1, seconds=0.02, repeats=3)
    int8 = _native.measure_peak("avx2_int8", 1, seconds=0.02, repeats=3)
    # 64 int8 ops per ymm step against 16 flops: the int8 chain beats the FMA figure on every AVX2 CPU
    assert int8["value"] > fma["value"] > 1


def test_avx2_kernels_are_measured_against_their_own_peaks():
    roof = {"threads": 2, "peaks": {n: {"value": 1.0, "reliable": True} for n in ("avx2_fma", "avx2_int8")}}
    assert roofline.peak_for("INT8", "avx2", roof)["name"] == "avx2_int8"
    assert roofline.peak_for("INT4", "avx2", roof)["name"] == "avx2_int8"
    assert roofline.peak_for("BF16", "avx2", roof)["name"] == "avx2_fma"
    assert roofline.peak_for("FP8_BLOCK", "avx2", roof)["name"] == "avx2_fma"
    assert roofline.peak_for("INT8", "ref", roof) is None


def test_an_unreliable_peak_is_replaced_by_the_per_thread_bound():
    roof = {"threads": 2, "peaks": {"avx2_fma": {"value": 10.0, "single_thread": 8.0, "reliable": False}}}
    p = roofline.peak_for("BF16", "avx2", roof)
    assert p["value"] == 16.0 and p["basis"] == "threads x one-thread"


def test_bad_probe_arguments():
    with pytest.raises(ValueError, match="threads"):
        _native.measure_peak(_native.peak_names()[0], 0)
    with pytest.raises(UnsupportedISAError, match="measurable"):
        _native.measure_peak("avx1024_fma", 1)
    with pytest.raises(ValueError, match="threads"):
        _native.measure_read_bandwidth(0)
    buf = np.ones(4096, np.uint8)
    with pytest.raises(ValueError, match="outside"):
        _native.read_pass(buf, 1024, 2048, 2)  # the second thread's window would run past the end
    with pytest.raises(ValueError, match="outside"):
        _native.read_pass(buf, -512, 512, 1)
    wide = min(4, _native.usable_cpus())
    for start, per_thread, threads in ((0, 2**62, wide), (2**63 - 4096, 4096, 1)):  # products that wrap
        with pytest.raises(ValueError, match="outside"):
            _native.read_pass(buf, start, per_thread, threads)
    too_many = _native.usable_cpus() + 1  # OpenMP aborts the process when asked for far too many
    for probe in (lambda: _native.measure_peak(_native.peak_names()[0], 10**6),
                  lambda: _native.measure_read_bandwidth(too_many), lambda: _native.read_pass(buf, 0, 512, too_many)):
        with pytest.raises(ValueError, match="threads must be between 1 and"):
            probe()
    with pytest.raises(ValueError, match="threads"):
        _native.read_pass(buf, 0, 512, 0)
    with pytest.raises(ValueError, match="per_thread >= 512"):
        _native.read_pass(buf, 0, 256, 1)  # a pass that would read nothing


def test_read_bandwidth_and_probe_size():
    assert roofline.probe_bytes() >= 512 * 2**20
    llc = roofline.llc_bytes()
    if llc:
        assert roofline.probe_bytes() >= 4 * llc
    assert _native.measure_read_bandwidth(THREADS, 64 * 2**20, 2) > 1e8


def test_side_by_side_probe_cycles_through_a_buffer_larger_than_the_cache():
    probe = roofline.ReadProbe(THREADS)
    llc = roofline.llc_bytes()
    assert probe.windows >= 4 and probe.nbytes == probe.windows * THREADS * probe.window
    if llc:
        assert probe.nbytes >= 4 * llc  # a window's previous pass has left the cache
    assert probe.nbytes == roofline.ReadProbe.buffer_bytes(THREADS)
    figures = [probe.pass_gbs() for _ in range(probe.windows + 1)]
    assert all(0.1 < g < 1e4 for g in figures)
    assert probe._next == 1  # wrapped around
    # a pass stays at 256 MiB however many threads take part (16 MiB each up to 16 threads)
    assert [roofline.ReadProbe.window_bytes(t) for t in (1, 2, 16, 64, 1024)] == [
        16 * 2**20, 16 * 2**20, 16 * 2**20, 4 * 2**20, 2**20]
