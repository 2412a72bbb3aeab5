"""The running machine's roofline: sustained read bandwidth and multiply-add peaks, measured
once per process and thread count."""
import functools

from ktcy import _native
from ktcy.threads import get_num_threads

# Which peak bounds each (format family, ISA): the instruction its GEMM spends its time in.
_PEAK_FOR = {
    ("int", "amx"): "amx_int8", ("int", "amx_emu"): None, ("int", "avx512"): "avx512_vnni",
    ("int", "avx2"): "avx2_fma", ("int", "ref"): None,
    ("bf16", "amx"): "amx_bf16", ("bf16", "amx_emu"): None, ("bf16", "avx512"): "avx512_bf16",
    ("bf16", "avx2"): "avx2_fma", ("bf16", "ref"): None,
}


@functools.lru_cache(maxsize=None)
def _measure(threads):
    return {
        "threads": threads,
        "read_bandwidth_gbs": _native.measure_read_bandwidth(threads) / 1e9,
        "peaks": {name: _native.measure_peak(name, threads) for name in _native.peak_names()},
    }


def roofline(threads=None):
    """{"threads", "read_bandwidth_gbs", "peaks": {name: {"instruction", "value", "unit"}}}."""
    return _measure(threads or get_num_threads())


def peak_for(fmt, isa, roof):
    """The peak (dict) that bounds fmt on isa, or None when no honest bound exists (emulation,
    portable C, or an instruction this CPU lacks)."""
    family = "int" if fmt in ("INT8", "INT4") else "bf16"
    name = _PEAK_FOR.get((family, isa))
    if name == "avx512_vnni" and name not in roof["peaks"]:
        name = "avx512_fma"  # the F/BW kernels without VNNI
    if name == "avx512_bf16" and name not in roof["peaks"]:
        name = "avx512_fma"
    peak = roof["peaks"].get(name) if name else None
    return dict(peak, name=name) if peak else None
