# Roofline probes (included by _native.pyx): streaming read bandwidth and multiply-add peaks,
# each run on `threads` OpenMP threads at once.
import time as _time

# name -> (instruction, needs bits, ops per instruction x chains, unit)
_PEAKS = {
    "avx2_fma": ("vfmadd231ps ymm", KTCY_NEED_AVX2, 16 * 12, "GFLOP/s"),
    "avx512_fma": ("vfmadd231ps zmm", KTCY_NEED_AVX512, 32 * 16, "GFLOP/s"),
    "avx512_bf16": ("vdpbf16ps zmm", KTCY_NEED_AVX512 | KTCY_NEED_BF16, 64 * 16, "GFLOP/s"),
    "avx512_vnni": ("vpdpbusd zmm", KTCY_NEED_AVX512 | KTCY_NEED_VNNI, 128 * 16, "GOP/s"),
    "amx_int8": ("tdpbssd", KTCY_NEED_AMX_INT8, 32768 * 4, "GOP/s"),
    "amx_bf16": ("tdpbf16ps", KTCY_NEED_AMX_BF16, 16384 * 4, "GFLOP/s"),
}

cdef float _run_peak(int which, int64_t iters) noexcept nogil:
    if which == 0:
        return ktcy_peak_fma256(iters, 0.001)
    if which == 1:
        return ktcy_peak_fma512(iters, 0.001)
    if which == 2:
        return ktcy_peak_dpbf16(iters, 0.001)
    if which == 3:
        return ktcy_peak_dpbusd(iters, 0.0)
    if which == 4:
        return ktcy_peak_amx(iters, 0)
    return ktcy_peak_amx(iters, 1)

def peak_names():
    """Peaks this CPU and build can measure."""
    built = {"avx512_bf16": bool(KTCY_ENABLE_AVX512_BF16), "amx_int8": bool(KTCY_ENABLE_AMX),
             "amx_bf16": bool(KTCY_ENABLE_AMX)}
    return [n for n, (_, needs, _, _) in _PEAKS.items()
            if (needs & ~_satisfied) == 0 and built.get(n, True) and (not n.startswith("amx") or _policy["amx_enabled"])]

def measure_peak(str name, int threads, double seconds=0.05, int repeats=9):
    """Ops per second of one instruction over `threads` threads, independent chains.  The best of
    several short runs: on a shared machine that is the run the neighbours left alone."""
    if name not in peak_names():
        raise UnsupportedISAError(f"peak {name!r} cannot be measured here; measurable: {', '.join(peak_names())}")
    cdef int which = list(_PEAKS).index(name), t
    cdef int64_t iters = 1000
    cdef float sink = 0
    instruction, _, ops, unit = _PEAKS[name]
    best = 0.0
    while True:  # calibrate to about `seconds` per run
        start = _time.perf_counter()
        with nogil:
            for t in prange(threads, num_threads=threads, schedule="static"):
                sink += _run_peak(which, iters)
        elapsed = _time.perf_counter() - start
        if elapsed > seconds / 4 or iters > 10**9:
            break
        iters *= 4
    for _ in range(repeats):
        start = _time.perf_counter()
        with nogil:
            for t in prange(threads, num_threads=threads, schedule="static"):
                sink += _run_peak(which, iters)
        best = max(best, threads * iters * ops / (_time.perf_counter() - start))
    return {"instruction": instruction, "value": best / 1e9, "unit": unit, "threads": threads}

def measure_read_bandwidth(int threads, int64_t nbytes=512 * 1024 * 1024, int repeats=9):
    """Bytes per second of a streaming read over nbytes (far larger than any last-level cache),
    split over `threads` threads; best of `repeats` passes after one warm-up pass."""
    buf = np.ones(nbytes, np.uint8)
    cdef const uint8_t[::1] view = buf
    cdef int64_t chunk = (nbytes // threads) // 256 * 256
    cdef int t, kind = 2 if _satisfied & KTCY_NEED_AVX512 else (1 if _satisfied & KTCY_NEED_AVX2 else 0)
    cdef uint64_t sink = 0
    best = 0.0
    for rep in range(repeats + 1):
        start = _time.perf_counter()
        with nogil:
            for t in prange(threads, num_threads=threads, schedule="static"):
                if kind == 2:
                    sink ^= ktcy_read_avx512(&view[t * chunk], chunk)  # reads 4 * (chunk / 4 // 128 * 128)
                elif kind == 1:
                    sink ^= ktcy_read_avx2(&view[t * chunk], chunk)
                else:
                    sink ^= ktcy_read_ref(&view[t * chunk], chunk)
        if rep:
            best = max(best, (chunk // 4 // 128 * 128 * 4 if kind == 2 else chunk) * threads / (_time.perf_counter() - start))
    return best
