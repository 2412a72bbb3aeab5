"""Helpers of the benchmark suite: which ISAs to sweep, and the extra_info every benchmark records
(GB/s, GFLOP/s and roofline fractions, so --benchmark-compare compares runs and ISAs)."""
import ktcy
from ktcy.roofline import peak_for


def isa_list():
    return [i for i in ("amx", "avx512", "avx2") if i in ktcy.available_isas()]


def record(benchmark, roof, fmt, isa, nbytes, flops):
    """Fill extra_info from the benchmark's median (nothing to fill under --benchmark-disable)."""
    if benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    gbs, gflops = nbytes / median / 1e9, flops / median / 1e9
    peak = peak_for(fmt, isa, roof)
    benchmark.extra_info.update({
        "format": fmt, "isa": isa, "weight_gbs": gbs, "gflops": gflops,
        "bandwidth_fraction": gbs / roof["read_bandwidth_gbs"],
        "peak": peak["name"] if peak else None, "peak_fraction": gflops / peak["value"] if peak else None,
        "read_bandwidth_gbs": roof["read_bandwidth_gbs"],
    })
