# Roofline probes (included by _native.pyx): streaming read bandwidth and multiply-add peaks,
# each run on `threads` OpenMP threads at once.
import time as _time

cdef extern from "ktcy/roofline.h" nogil:
    float ktcy_peak_int8_256(int64_t iters, float seed)
    int64_t ktcy_read_avx2_bytes(int64_t n)
    int64_t ktcy_read_avx512_bytes(int64_t n)

# name -> (instruction, needs bits, ops per loop step over all chains, unit)
_PEAKS = {
    "avx2_fma": ("vfmadd231ps ymm", KTCY_NEED_AVX2, 16 * 12, "GFLOP/s"),
    "avx2_int8": ("vpmaddubsw+vpmaddwd+vpaddd ymm", KTCY_NEED_AVX2, 64 * 12, "GOP/s"),
    "avx512_fma": ("vfmadd231ps zmm", KTCY_NEED_AVX512, 32 * 16, "GFLOP/s"),
    "avx512_bf16": ("vdpbf16ps zmm", KTCY_NEED_AVX512 | KTCY_NEED_BF16, 64 * 16, "GFLOP/s"),
    "avx512_vnni": ("vpdpbusd zmm", KTCY_NEED_AVX512 | KTCY_NEED_VNNI, 128 * 16, "GOP/s"),
    "amx_int8": ("tdpbssd", KTCY_NEED_AMX_INT8, 32768 * 4, "GOP/s"),
    "amx_bf16": ("tdpbf16ps", KTCY_NEED_AMX_BF16, 16384 * 4, "GFLOP/s"),
}
# A team figure below this share of threads x the one-thread figure is flagged unreliable.  Threads
# that share one core give 1/threads of it, so the bar sits well above that: at 0.5 a Zen 4 run
# whose two threads shared a core for the moment (vdpbf16ps: 1.002x the one-thread figure) passed,
# and BF16 prefill read "167% of the peak"; healthy runs there scale by 1.84-2.0x.
RELIABLE_SCALING = 0.75
# Team rounds of `repeats` runs each, taken until one reaches RELIABLE_SCALING.
TEAM_ROUNDS = 3

cdef float _run_peak(int which, int64_t iters) noexcept nogil:
    if which == 0:
        return ktcy_peak_fma256(iters, 0.001)
    if which == 1:
        return ktcy_peak_int8_256(iters, 0.0)
    if which == 2:
        return ktcy_peak_fma512(iters, 0.001)
    if which == 3:
        return ktcy_peak_dpbf16(iters, 0.001)
    if which == 4:
        return ktcy_peak_dpbusd(iters, 0.0)
    if which == 5:
        return ktcy_peak_amx(iters, 0)
    return ktcy_peak_amx(iters, 1)

def peak_names():
    """Peaks this CPU and build can measure."""
    built = {"avx512_bf16": bool(KTCY_ENABLE_AVX512_BF16), "amx_int8": bool(KTCY_ENABLE_AMX),
             "amx_bf16": bool(KTCY_ENABLE_AMX)}
    return [n for n, (_, needs, _, _) in _PEAKS.items()
            if (needs & ~_satisfied) == 0 and built.get(n, True) and (not n.startswith("amx") or _policy["amx_enabled"])]

cdef double _timed_run(int which, int64_t iters, int threads):
    """Wall seconds of every thread running `iters` loop steps at once."""
    cdef int t, team = _team(threads)
    cdef float sink = 0
    start = _time.perf_counter()
    with nogil:
        for t in prange(threads, num_threads=team, schedule="static"):
            sink += _run_peak(which, iters)
    return _time.perf_counter() - start

def measure_peak(str name, int threads, double seconds=0.03, int repeats=4):
    """Ops per second of one instruction over `threads` threads, independent chains.

    The loop length is calibrated on one thread until a run lasts `seconds`, so every team run
    lasts at least that long and a worker that starts late costs little.  Each figure is the best
    of `repeats` runs (on a shared machine: the run the neighbours left alone).  The team figure
    is checked against threads x the one-thread figure: below RELIABLE_SCALING of it (after up to
    TEAM_ROUNDS rounds) it is returned with "reliable": False and a note saying why."""
    if name not in peak_names():
        raise UnsupportedISAError(f"peak {name!r} cannot be measured here; measurable: {', '.join(peak_names())}")
    check_thread_count(threads, "threads")  # OpenMP aborts the process when asked for far too many
    cdef int which = list(_PEAKS).index(name)
    cdef int64_t iters = 256
    instruction, _, ops, unit = _PEAKS[name]
    while _timed_run(which, iters, 1) < seconds and iters < 2**40:
        iters *= 2
    single = max(ops * iters / _timed_run(which, iters, 1) for _ in range(repeats))
    best = single
    if threads > 1:
        best = 0.0
        for _ in range(TEAM_ROUNDS):  # another round while the figure looks starved
            best = max([best] + [threads * iters * ops / _timed_run(which, iters, threads) for _ in range(repeats)])
            if best >= RELIABLE_SCALING * threads * single:
                break
    reliable = best >= RELIABLE_SCALING * threads * single
    note = None if reliable else (
        f"{threads} threads reached {best / single:.2f}x the one-thread figure ({single / 1e9:.1f} {unit}), "
        f"below {RELIABLE_SCALING * threads:.1f}x: the threads share cores (SMT siblings, an oversubscribed "
        f"or busy machine); treat this figure as unreliable")
    return {"instruction": instruction, "value": best / 1e9, "unit": unit, "threads": threads,
            "single_thread": single / 1e9, "reliable": reliable, "note": note, "run_seconds": seconds}

cdef int _read_kind():
    return 2 if _satisfied & KTCY_NEED_AVX512 else (1 if _satisfied & KTCY_NEED_AVX2 else 0)

cdef int64_t _read_bytes(int kind, int64_t per_thread, int threads):
    """Bytes one pass of `threads` x per_thread actually reads (the loops skip a ragged tail)."""
    return threads * (ktcy_read_avx512_bytes(per_thread) if kind == 2 else
                      ktcy_read_avx2_bytes(per_thread) if kind == 1 else per_thread // 8 * 8)

cdef double _read_pass(const uint8_t[::1] view, int64_t start_at, int64_t per_thread, int threads, int kind):
    """Wall seconds of `threads` threads each streaming per_thread bytes from start_at on."""
    cdef int t, team = _team(threads)
    cdef uint64_t sink = 0
    start = _time.perf_counter()
    with nogil:
        for t in prange(threads, num_threads=team, schedule="static"):
            if kind == 2:
                sink ^= ktcy_read_avx512(&view[start_at + t * per_thread], per_thread)
            elif kind == 1:
                sink ^= ktcy_read_avx2(&view[start_at + t * per_thread], per_thread)
            else:
                sink ^= ktcy_read_ref(&view[start_at + t * per_thread], per_thread)
    return _time.perf_counter() - start

def read_pass(const uint8_t[::1] buf, int64_t start_at, int64_t per_thread, int threads):
    """Bytes per second of one streaming pass: `threads` threads each read per_thread bytes of
    buf, side by side from start_at on (the window must lie inside buf)."""
    check_thread_count(threads, "threads")
    if per_thread < 512:  # the vector loops read whole 512-byte strides
        raise ValueError(f"need per_thread >= 512, got {per_thread}")
    if start_at < 0 or start_at > buf.shape[0] or per_thread > (buf.shape[0] - start_at) // threads:
        raise ValueError(f"a window of {threads} x {per_thread} bytes at {start_at} is outside the "
                         f"{buf.shape[0]}-byte buffer")  # compared without a product that could wrap
    cdef int kind = _read_kind()
    return _read_bytes(kind, per_thread, threads) / _read_pass(buf, start_at, per_thread, threads, kind)

def measure_read_bandwidth(int threads, int64_t nbytes=512 * 1024 * 1024, int repeats=5,
                           int64_t window=16 * 1024 * 1024):
    """Bytes per second of streaming reads by `threads` threads at once: each timed pass reads
    one window of `window` bytes per thread; passes walk through an nbytes buffer (make it far
    larger than the last-level cache: a window is read again only after the whole buffer, so it
    comes from memory), `repeats` times over, after one warm-up sweep.  The best pass counts.
    Short passes matter on a shared machine: a pass of a few milliseconds can run while no
    neighbour holds a core, which is what a kernel's call of a few milliseconds also sees; a pass
    over the whole buffer almost never does and underestimated the bandwidth by up to 2x."""
    check_thread_count(threads, "threads")  # OpenMP aborts the process when asked for far too many
    cdef int64_t per_thread = min(window, nbytes // threads) // 512 * 512  # whole strides (read_pass)
    if per_thread < 512:
        raise ValueError(f"nbytes {nbytes} is too small for {threads} threads")
    cdef int64_t span = per_thread * threads, windows = nbytes // span
    buf = np.ones(windows * span, np.uint8)
    cdef const uint8_t[::1] view = buf
    cdef int kind = _read_kind()
    read = _read_bytes(kind, per_thread, threads)
    best = 0.0
    for sweep in range(repeats + 1):
        for w in range(windows):
            seconds = _read_pass(view, w * span, per_thread, threads, kind)
            if sweep:
                best = max(best, read / seconds)
    return best
