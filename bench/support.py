"""Helpers of the benchmark suite: which ISAs to sweep, and the extra_info every benchmark records
(GB/s, GFLOP/s and roofline fractions, so --benchmark-compare compares runs and ISAs)."""
import numpy as np

import ktcy
from ktcy.bench import draw_routing
from ktcy.roofline import llc_bytes, peak_for

# Assumed when sysfs does not say: larger than any shipping CPU's L3 (AMD 3D V-Cache parts: 1.1 GB).
_LLC_FALLBACK = 2 * 2**30


def routing_pool(rng, T, E, k, expert_bytes, min_size=8, max_size=4096):
    """Routings for a benchmark that cycles through a pool (drawing inside the timed call would
    be timed too).  The pool grows until the expert bytes its calls touch add up to 4x the
    last-level cache (read from sysfs), so between two uses of one routing the cache has been
    overwritten several times: as good as a fresh routing every call, for any layer larger than
    the cache (a smaller layer stays cached whatever the routing)."""
    llc = llc_bytes() or _LLC_FALLBACK
    pool, touched = [], 0
    while len(pool) < max_size and (len(pool) < min_size or touched < 4 * llc):
        pool.append(draw_routing(rng, T, E, k))
        touched += len(np.unique(pool[-1])) * expert_bytes
    return pool


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
