"""The running machine's roofline: sustained read bandwidth and multiply-add peaks, measured
once per process and thread count."""
import functools
import os

import numpy as np

from ktcy import _native
from ktcy.formats import descriptor
from ktcy.threads import get_num_threads

# Which peak bounds each (format family, ISA): the instruction its GEMM spends its time in
# (the AVX2 INT8/INT4 kernels run vpmaddubsw chains, BF16/FP8 run ymm FMAs).
_PEAK_FOR = {
    ("int", "amx"): "amx_int8", ("int", "amx_emu"): None, ("int", "avx512"): "avx512_vnni",
    ("int", "avx2"): "avx2_int8", ("int", "ref"): None,
    ("bf16", "amx"): "amx_bf16", ("bf16", "amx_emu"): None, ("bf16", "avx512"): "avx512_bf16",
    ("bf16", "avx2"): "avx2_fma", ("bf16", "ref"): None,
}


def llc_bytes():
    """The largest cache of CPU 0 in sysfs (the last-level cache) in bytes, or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


def probe_bytes():
    """Bytes the bandwidth probe streams: 512 MiB, or 4x the last-level cache when that is larger,
    so the probe measures memory, not cache, on servers with a few hundred MB of L3."""
    return max(512 * 2**20, 4 * (llc_bytes() or 0))


def read_bandwidth(threads=None, repeats=5):
    """A fresh streaming-read figure in GB/s (not cached): the best of many short passes (16 MiB
    per thread each) over a buffer of probe_bytes(), swept `repeats` times."""
    threads = threads or get_num_threads()
    return _native.measure_read_bandwidth(threads, max(probe_bytes(), 4 * threads * 16 * 2**20), repeats) / 1e9


class ReadProbe:
    """Streaming-read passes taken one at a time, between a kernel's timed calls, so that a call's
    GB/s is set against what the memory delivered in the same seconds: on a shared machine the
    bandwidth moves by up to 2x within a minute, and a figure probed at start-up (read_bandwidth)
    is then a different moment's.  Each pass reads one window per thread (16 MiB, less on a host
    with more than 16 threads: a pass stays at 256 MiB); the windows cycle through a buffer of
    four times the last-level cache (at least four windows), so a window comes from memory, not
    from the cache its previous pass filled."""

    def __init__(self, threads=None):
        self.threads = threads or get_num_threads()
        self.window = self.window_bytes(self.threads)
        self.windows = self.buffer_bytes(self.threads) // (self.threads * self.window)
        self._buf = np.ones(self.windows * self.threads * self.window, np.uint8)
        self._next = 0

    @staticmethod
    def window_bytes(threads):
        return min(16 * 2**20, max(2**20, 256 * 2**20 // threads))

    @classmethod
    def buffer_bytes(cls, threads):
        span = threads * cls.window_bytes(threads)
        return max(4, -(-4 * (llc_bytes() or 64 * 2**20) // span)) * span

    @property
    def nbytes(self):
        return self._buf.nbytes

    def pass_gbs(self):
        """GB/s of the next window's pass."""
        start = self._next * self.threads * self.window
        self._next = (self._next + 1) % self.windows
        return _native.read_pass(self._buf, start, self.window, self.threads) / 1e9


@functools.lru_cache(maxsize=None)
def _measure(threads):
    return {
        "threads": threads,
        "read_bandwidth_gbs": read_bandwidth(threads), "probe_mib": probe_bytes() // 2**20,
        "peaks": {name: _native.measure_peak(name, threads) for name in _native.peak_names()},
    }


def roofline(threads=None):
    """{"threads", "read_bandwidth_gbs", "peaks": {name: {"instruction", "value", "unit",
    "single_thread", "reliable", "note"}}}: measured once per process and thread count."""
    return _measure(threads or get_num_threads())


def peak_for(fmt, isa, roof):
    """The peak (dict) that bounds fmt on isa, or None when no honest bound exists (emulation,
    portable C, or an instruction this CPU lacks)."""
    family = "int" if descriptor(fmt)["activations"] == "int8" else "bf16"
    name = _PEAK_FOR.get((family, isa))
    if name == "avx512_vnni" and name not in roof["peaks"]:
        name = "avx512_fma"  # the F/BW kernels without VNNI
    if name == "avx512_bf16" and name not in roof["peaks"]:
        name = "avx512_fma"
    peak = roof["peaks"].get(name) if name else None
    if not peak:
        return None
    if peak.get("reliable", True):
        return dict(peak, name=name)
    # The team figure was starved (cores shared or busy while it ran): bound by what the threads
    # can do each on its own core, which no kernel run can beat.
    return dict(peak, name=name, value=peak["single_thread"] * roof["threads"], basis="threads x one-thread")
