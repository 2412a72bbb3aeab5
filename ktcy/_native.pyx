# cython: language_level=3
"""ktcy._native: CPU probe, kernel dispatch table, packing and the threaded GEMM driver.

Everything here is thin: the numbers are computed by the C headers in include/ktcy/.  The only
mutable module state is the dispatch table (set at import from the probe and the environment)
and the thread count.
"""
import logging
import os

import numpy as np

from cython.parallel cimport prange
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset, strncpy
cimport openmp

from ktcy.errors import TileError, UnsupportedISAError

_log = logging.getLogger("ktcy")

FORMATS = tuple(KTCY_FORMAT_DESCS[i].name.decode() for i in range(KTCY_NUM_FORMATS))
ISAS = ("ref", "avx2", "avx512", "amx", "amx_emu")
_AUTO_ORDER = (KTCY_AMX, KTCY_AVX512, KTCY_AVX2, KTCY_REF)  # amx_emu: only when forced
_NEED_NAMES = {KTCY_NEED_AVX2: "avx2+fma+f16c", KTCY_NEED_AVX512: "avx512f/bw/vl/dq",
               KTCY_NEED_VNNI: "avx512_vnni", KTCY_NEED_BF16: "avx512_bf16", KTCY_NEED_VBMI: "avx512_vbmi",
               KTCY_NEED_AMX_INT8: "amx_tile+amx_int8 (with OS permission)",
               KTCY_NEED_AMX_BF16: "amx_tile+amx_bf16 (with OS permission)"}

_CODE_NAMES = {KTCY_CODE_S8: "s8", KTCY_CODE_U4: "u4", KTCY_CODE_BF16: "bf16", KTCY_CODE_E4M3: "e4m3",
               KTCY_CODE_E2M1: "e2m1"}
_SCALE_NAMES = {KTCY_SCALE_NONE: "none", KTCY_SCALE_CHANNEL: "per_channel", KTCY_SCALE_GROUP: "group",
                KTCY_SCALE_BLOCK128: "block_128x128", KTCY_SCALE_IN_BLOCK: "e8m0_in_block"}
E8M0_RANGE = (KTCY_E8M0_MIN, KTCY_E8M0_MAX)  # exponents MXFP4 decodes exactly (include/ktcy/numeric.h)

def format_descriptors():
    """The C descriptor table (include/ktcy/formats.h), one dict per format in enum order."""
    out = []
    for i in range(KTCY_NUM_FORMATS):
        d = KTCY_FORMAT_DESCS[i]
        out.append({"name": d.name.decode(), "code": _CODE_NAMES[d.code], "block_k": d.block_k,
                    "block_bytes": d.block_bytes, "activations": "int8" if d.act == KTCY_ACT_INT8 else "bf16",
                    "scale": _SCALE_NAMES[d.scale], "group_sizes": [g for g in (16, 32, 64, 128) if d.groups & g],
                    "zero_points": bool(d.zero_points), "colsum": bool(d.colsum), "mins": bool(d.mins)})
    return out

cdef int _format_index(str name) except -1:
    try:
        return FORMATS.index(name)
    except ValueError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}") from None

cdef int _check_format_code(int fmt) except -1:
    if fmt < 0 or fmt >= KTCY_NUM_FORMATS:
        raise ValueError(f"format code {fmt} is not one of 0..{KTCY_NUM_FORMATS - 1}")
    return fmt

# ---------------------------------------------------------------- probe

cdef ktcy_cpu _cpu
ktcy_cpu_probe(&_cpu)
cdef int _satisfied = ktcy_satisfied_needs(&_cpu)
cdef ktcy_tiles _tiles = ktcy_cpu_tiles(&_cpu)  # every ktcy_act built here carries them

# The largest value each tile choice may take: FP8's float path and MXFP4's 16-bit path sweep
# tiles of at most 4 rows (KT_FEW_ROWS_SWEEP: a larger bound would give 4 rows' results to more);
# the panel-width bounds only compare with a call's rows; the rest are on/off.
TILE_CHOICE_LIMITS = {"one_panel_rows": 1 << 20, "e2m1_panel_rows": 1 << 20, "f32_rows": 4, "i16_rows": 4,
                      "avx2_i16_rows": 4, "fp8_fetch_l2": 1, "wide_tiles": 1, "fp8_normal_panels": 1,
                      "plain_fetch_l2": 1}

def _check_tile_choice(name, value):
    """value as an int if it is one tile choice's allowed value, else ValueError naming both."""
    if name not in TILE_CHOICE_LIMITS:
        raise ValueError(f"{name!r} is not a tile choice; choose one of {', '.join(TILE_CHOICE_LIMITS)}")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= TILE_CHOICE_LIMITS[name]:
        raise ValueError(f"tile choice {name}={value!r}: must be an integer in 0..{TILE_CHOICE_LIMITS[name]}")
    return value

def _parse_tile_choices(spec):
    """({name: value}, problem or None) for a KTCY_TILES value "name=int[,name=int...]".  Any
    problem drops the whole value (half a measurement's settings would mislead more than none)."""
    choices = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, eq, text = (part.strip() for part in item.partition("="))
        try:
            if not eq:
                raise ValueError(f"{item.strip()!r} is not name=value")
            try:
                value = int(text)
            except ValueError:
                value = text  # refused below, by name
            choices[name] = _check_tile_choice(name, value)
        except ValueError as e:
            return {}, f"KTCY_TILES={spec!r} ignored: {e}; this CPU's tile choices stay"
    return choices, None

cdef dict _tile_values(ktcy_tiles tiles):
    return tiles  # Cython makes a struct a dict of its fields

cdef ktcy_tiles _with_choices(ktcy_tiles tiles, dict choices) except *:
    """tiles with the named choices (checked names and values) replaced: through a dict of the
    struct's fields, which Cython turns back into the struct."""
    cdef ktcy_tiles out = dict(_tile_values(tiles), **choices)
    return out

if set(TILE_CHOICE_LIMITS) != set(_tile_values(_tiles)):
    raise ImportError("ktcy._native: TILE_CHOICE_LIMITS must name every field of ktcy_tiles (types.h)")

TILES_OVERRIDDEN, TILES_PROBLEM = _parse_tile_choices(os.environ.get("KTCY_TILES"))
if TILES_PROBLEM:
    _log.warning(TILES_PROBLEM)
_tiles = _with_choices(_tiles, TILES_OVERRIDDEN)  # once, at import: a choice measured without a rebuild

cdef inline void _set_tile_choices(ktcy_act *act) noexcept nogil:
    """This CPU's tile choices (registry.h), into every ktcy_act built here."""
    act.tiles = _tiles

def cpu_features():
    """Feature flags from cpuid/xgetbv (and the Linux AMX permission), as Python bools."""
    c = _cpu
    names = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_vbmi", "amx_tile", "amx_int8", "amx_bf16", "os_avx", "os_avx512",
             "os_amx", "amx_permitted")
    values = (c.avx2, c.fma, c.f16c, c.avx512f, c.avx512bw, c.avx512vl, c.avx512dq, c.avx512_vnni,
              c.avx512_bf16, c.avx512_vbmi, c.amx_tile, c.amx_int8, c.amx_bf16, c.os_avx, c.os_avx512,
              c.os_amx, c.amx_permitted)
    return {n: bool(v) for n, v in zip(names, values)}

def cpu_model_name():
    return (<bytes>_cpu.model_name).decode("ascii", "replace").strip()

def build_info():
    """What this binary was compiled with (the CPUINFER_ENABLE_* switches of setup.py)."""
    return {"amx": bool(KTCY_ENABLE_AMX), "avx512_vbmi": bool(KTCY_ENABLE_AVX512_VBMI),
            "avx512_bf16": bool(KTCY_ENABLE_AVX512_BF16),
            "variants": [v["name"] for v in variants()]}

def tile_choice():
    """The tile choices made for this CPU (registry.h, by vendor, family and features): the few-row
    tile width (ktcy_one_panel_rows; AVX-512 MXFP4 and MXFP4_A8: ktcy_e2m1_panel_rows), the rows that
    take AVX-512 FP8's float path (ktcy_f32_rows) and MXFP4's 16-bit integer path (AVX-512:
    ktcy_i16_rows, AVX2: ktcy_avx2_i16_rows),
    where AVX-512 FP8's decode streams prefetch to (ktcy_fp8_fetch_l2), AVX2 INT8 prefill's tile
    (ktcy_wide_tiles), whether AVX2 FP8 prefill decodes its panels to normal floats
    (ktcy_fp8_normal_panels) and where AVX2 BF16's and INT8's decode streams prefetch to
    (ktcy_plain_fetch_l2).  "overridden" names the choices KTCY_TILES set instead."""
    return {"amd": bool(_cpu.amd), "family": _cpu.family, "overridden": sorted(TILES_OVERRIDDEN),
            **{name: bool(value) if TILE_CHOICE_LIMITS[name] == 1 else value
               for name, value in _tile_values(_tiles).items()}}

def variants():
    """Every compiled kernel variant: formats served, ISA, needs, and whether this CPU runs it."""
    out = []
    for i in range(KTCY_NUM_VARIANTS):
        v = KTCY_VARIANTS[i]
        out.append({"name": v.name.decode(), "isa": ISAS[v.isa],
                    "formats": [f for j, f in enumerate(FORMATS) if v.formats & (1 << j)],
                    "needs": [name for bit, name in _NEED_NAMES.items() if v.needs & bit],
                    "runnable": (v.needs & ~_satisfied) == 0})
    return out

# ---------------------------------------------------------------- dispatch table

cdef int _best[KTCY_NUM_FORMATS][KTCY_NUM_ISAS]  # variant index per (format, isa), -1 when none runs here
cdef int _auto[KTCY_NUM_FORMATS]                 # the ISA picked per format by the policy, -1 when none
_policy = {}

cdef void _fill_best():
    cdef int f, isa, i
    for f in range(KTCY_NUM_FORMATS):
        for isa in range(KTCY_NUM_ISAS):
            _best[f][isa] = -1
            for i in range(KTCY_NUM_VARIANTS):
                if (KTCY_VARIANTS[i].formats & (1 << f)) and KTCY_VARIANTS[i].isa == isa \
                        and (KTCY_VARIANTS[i].needs & ~_satisfied) == 0:
                    _best[f][isa] = i
                    break

def _amx_switch(value):
    """(AMX on?, the problem with the value or None) for a CPUINFER_ENABLE_AMX value: ON unless
    it says OFF; a value that says neither keeps AMX on and is reported (a typo such as "of"
    must not pass for OFF unnoticed)."""
    word = (value or "ON").strip().upper()
    if word in ("OFF", "0", "FALSE", "NO"):
        return False, None
    if word in ("ON", "1", "TRUE", "YES"):
        return True, None
    return True, f"CPUINFER_ENABLE_AMX={value!r} is neither ON nor OFF (nor 1/0, TRUE/FALSE, YES/NO); AMX stays enabled"

def _isa_name(name):
    """An ISA name as given (KTCY_ISA, isa=) in the canonical lower case; other types unchanged."""
    return name.strip().lower() if isinstance(name, str) else name

def configure_dispatch(forced_isa=None, amx_enabled=True, strict=True):
    """Set the per-format ISA choice.  Called at import with KTCY_ISA and CPUINFER_ENABLE_AMX
    (strict=False: an unknown KTCY_ISA does not fail the import - `ktcy info` and `ktcy convert`
    must still run - but every kernel lookup raises, naming the variable)."""
    global _policy
    cdef int f
    forced_isa = _isa_name(forced_isa)
    bad = forced_isa is not None and forced_isa not in ISAS
    if bad and strict:
        raise ValueError(f"KTCY_ISA={forced_isa!r} is not an ISA name; choose one of {', '.join(ISAS)}")
    _policy = {"forced": forced_isa, "amx_enabled": bool(amx_enabled), "reasons": {},
               "error": f"KTCY_ISA={forced_isa!r} is not an ISA name; choose one of {', '.join(ISAS)}" if bad else None}
    for f in range(KTCY_NUM_FORMATS):
        _auto[f] = -1
        if bad:
            continue
        if forced_isa is not None:
            isa = ISAS.index(forced_isa)
            if _usable(f, isa):
                _auto[f] = isa
                _policy["reasons"][FORMATS[f]] = f"forced by KTCY_ISA={forced_isa}"
            continue
        for isa in _AUTO_ORDER:
            if _usable(f, isa):
                _auto[f] = isa
                skipped = " (AMX disabled by CPUINFER_ENABLE_AMX=OFF)" if not amx_enabled and isa != KTCY_AMX \
                    and _best[f][KTCY_AMX] >= 0 else ""
                _policy["reasons"][FORMATS[f]] = f"best available{skipped}"
                break

def _usable(int f, int isa):
    if f < 0 or f >= KTCY_NUM_FORMATS or isa < 0 or isa >= KTCY_NUM_ISAS or _best[f][isa] < 0:
        return False
    return isa != KTCY_AMX or _policy["amx_enabled"]

def available_isas():
    """ISAs with at least one runnable kernel here (amx only when CPUINFER_ENABLE_AMX allows)."""
    return [ISAS[i] for i in range(KTCY_NUM_ISAS) if any(_usable(f, i) for f in range(KTCY_NUM_FORMATS))]

def _unsupported(format_name, isa_name):
    f = _format_index(format_name)
    isa = ISAS.index(isa_name)
    if isa == KTCY_AMX and not KTCY_ENABLE_AMX:
        why = "this build has no AMX kernels (built with CPUINFER_ENABLE_AMX=OFF)"
    elif isa == KTCY_AMX and _best[f][isa] >= 0 and not _policy["amx_enabled"]:
        why = "AMX is disabled by CPUINFER_ENABLE_AMX=OFF"
    else:
        missing = set()
        for i in range(KTCY_NUM_VARIANTS):
            v = KTCY_VARIANTS[i]
            if v.isa == isa and v.formats & (1 << f):
                missing |= {name for bit, name in _NEED_NAMES.items() if v.needs & bit & ~_satisfied}
        why = "this CPU lacks " + " / ".join(sorted(missing)) if missing else "no such kernel is built"
    runnable = [ISAS[i] for i in range(KTCY_NUM_ISAS) if _usable(f, i)]
    return UnsupportedISAError(f"ISA {isa_name!r} cannot run {format_name}: {why}. "
                               f"Available for {format_name}: {', '.join(runnable)}")

def resolve(format_name, isa_name=None):
    """(isa, variant name) that runs format_name, forced by isa_name or chosen by the policy."""
    f = _format_index(format_name)
    if isa_name is None:
        if _policy["error"]:
            raise ValueError(_policy["error"])
        if _auto[f] < 0:
            raise _unsupported(format_name, _policy["forced"])
        isa = _auto[f]
    else:
        isa_name = _isa_name(isa_name)
        if isa_name not in ISAS:
            raise ValueError(f"unknown ISA {isa_name!r}; choose one of {', '.join(ISAS)}")
        isa = ISAS.index(isa_name)
        if not _usable(f, isa):
            raise _unsupported(format_name, isa_name)
    return ISAS[isa], KTCY_VARIANTS[_best[f][isa]].name.decode()

def kernel_table():
    """{format: {"isa", "variant", "reason"}} as the policy chose; raises if a forced ISA can't run."""
    table = {}
    for f, name in enumerate(FORMATS):
        isa, variant = resolve(name)
        table[name] = {"isa": isa, "variant": variant, "reason": _policy["reasons"][name]}
    return table

_fill_best()
_amx_on, AMX_SWITCH_PROBLEM = _amx_switch(os.environ.get("CPUINFER_ENABLE_AMX"))
if AMX_SWITCH_PROBLEM:
    _log.warning(AMX_SWITCH_PROBLEM)
configure_dispatch((os.environ.get("KTCY_ISA") or "").strip() or None, _amx_on, strict=False)

# ---------------------------------------------------------------- threads

cdef int _num_threads = 1
# libgomp's thread pool does not survive fork(): in a forked child a parallel region waits forever
# for threads that exist only in the parent.  A child forked after `import ktcy` therefore runs
# every kernel on one thread (as PyTorch's children do); "spawn" children start afresh.
cdef bint _forked = False
cdef int _threads_before_fork = 1
cdef bint _fork_said = False  # the child's one warning given (or not needed: 1 thread asked for)

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

cdef void _after_fork_in_child() noexcept nogil:
    global _forked, _num_threads, _threads_before_fork, _fork_said
    _forked, _fork_said = True, False
    _threads_before_fork, _num_threads = _num_threads, 1

# at the C level, not os.register_at_fork: a fork from native code (a C library, ctypes) runs
# no Python hooks, and its child hung in the first parallel region all the same
if pthread_atfork(NULL, NULL, _after_fork_in_child) != 0:
    raise ImportError("ktcy: pthread_atfork failed; without it a forked child would hang in OpenMP")

cdef int _team(int n) except -1:
    """The OpenMP team for n requested threads: n, or 1 in a forked child, where the first
    parallel call that would have used more says so once (at the call, not at the fork: a
    child that never runs a kernel hears nothing)."""
    global _fork_said
    if not _forked:
        return n
    if not _fork_said and max(n, _threads_before_fork) > 1:
        _fork_said = True
        _log.warning("ktcy runs on 1 thread in this forked process: OpenMP's threads do not survive fork() "
                     "(start workers with the 'spawn' or 'forkserver' method to use %d)", max(n, _threads_before_fork))
    return 1

def usable_cpus():
    """CPUs this process may run on (its affinity mask), the most threads that can help.  Asked
    of OpenMP, not of the affinity call: with OMP_PROC_BIND or OMP_PLACES set, libgomp pins the
    main thread to one CPU when it starts, and counts the CPUs of the mask from before."""
    return max(1, openmp.omp_get_num_procs())

def check_thread_count(n, what="thread count"):
    """n as an int in [1, usable CPUs], or ValueError: OpenMP aborts the whole process (or
    crashes) when asked for tens of thousands of threads, and more threads than CPUs never help."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {n!r}")
    cpus = usable_cpus()
    if n < 1 or n > cpus:
        raise ValueError(f"{what} must be between 1 and {cpus} (the CPUs this process may use), got {n}")
    return int(n)

def set_num_threads(n):
    global _num_threads, _fork_said
    n = check_thread_count(n)
    if _forked and n == 1:
        _fork_said = True  # one thread asked for: nothing to say
    _num_threads = _team(n)

def get_num_threads():
    return _num_threads

# ---------------------------------------------------------------- weight quantization and layout

cdef int64_t _quantize_unit(int fmt, const float *w, int64_t n, int64_t k, int group, int64_t i, void *q,
                            int64_t ldq, float *scale, uint8_t *aux, float *mins, int64_t ld_scale) noexcept nogil:
    """Quantizes unit i (a row; for FP8 blocks a stripe of 128 rows) by the format's rule
    (include/ktcy/quantize.h); aux: zero points or E8M0 exponents; mins: INT4_MIN's and INT8_MIN's.  >= 0 names
    a bad row."""
    if fmt == KTCY_FMT_INT8:
        return ktcy_quantize_int8_rows(w, k, k, i, i + 1, <int8_t *>q, ldq, scale)
    if fmt == KTCY_FMT_INT4:
        return ktcy_quantize_int4_rows(w, k, k, group, i, i + 1, <int8_t *>q, ldq, scale, ld_scale)
    if fmt == KTCY_FMT_INT4_ZP:
        return ktcy_quantize_asym_rows(w, k, k, group, i, i + 1, <int8_t *>q, ldq, scale, aux, NULL, ld_scale, 15)
    if fmt == KTCY_FMT_INT4_MIN:
        return ktcy_quantize_asym_rows(w, k, k, group, i, i + 1, <int8_t *>q, ldq, scale, NULL, mins, ld_scale, 15)
    if fmt == KTCY_FMT_INT8_GROUP:
        return ktcy_quantize_int8_group_rows(w, k, k, group, i, i + 1, <int8_t *>q, ldq, scale, ld_scale)
    if fmt == KTCY_FMT_INT8_MIN:
        return ktcy_quantize_asym_rows(w, k, k, group, i, i + 1, <int8_t *>q, ldq, scale, NULL, mins, ld_scale, 255)
    if fmt == KTCY_FMT_MXFP4 or fmt == KTCY_FMT_MXFP4_A8:
        return ktcy_quantize_mxfp4_rows(w, k, k, i, i + 1, <uint8_t *>q, ldq, aux, ld_scale)
    if fmt == KTCY_FMT_FP8_PERCHANNEL:
        return ktcy_quantize_fp8_rows(w, k, k, i, i + 1, <uint8_t *>q, ldq, scale)
    if fmt == KTCY_FMT_FP8_BLOCK:
        return ktcy_quantize_fp8_block_rows(w, k, n, k, i * KTCY_SCALE_BLOCK, <uint8_t *>q, ldq, scale)
    return -2

def quantize_weights(int fmt, const float[:, ::1] w, int group=0):
    """(codes, scales) of W[n][k] by the format's rule (include/ktcy/quantize.h): INT8 and FP8
    per-channel scales [n]; INT4 and INT8_GROUP codes [n][k_pad] with scales [k_pad/group][n_pad]; FP8 block
    scales [ceil(n/128)][ceil(k/128)]; formats with zero points return (codes, scales, zero
    points [k_pad/group][n_pad]) with codes minus 8, INT4_MIN (codes minus 8, scales, mins
    [k_pad/group][n_pad]), INT8_MIN (codes minus 128, scales, mins); MXFP4 returns (E2M1 codes, E8M0 exponents
    [n][ceil(k/32)]).  Rows are quantized in parallel."""
    _check_format_code(fmt)
    cdef const ktcy_format_desc *d = ktcy_format(fmt)
    cdef int64_t n = w.shape[0], k = w.shape[1], i, bad = 0, B = KTCY_SCALE_BLOCK
    cdef int64_t units = n, ld_scale = 0, k_pad = k
    if d.code == KTCY_CODE_BF16 or d.scale == KTCY_SCALE_NONE:
        raise ValueError(f"format {FORMATS[fmt]} has no quantizer")
    if group == 0 and d.scale != KTCY_SCALE_GROUP:
        group = d.groups  # the one group a format without group scales may have (MXFP4_A8: 32)
    if not ktcy_group_ok(fmt, group):
        raise ValueError(f"group size {group} is not valid for {FORMATS[fmt]}")
    if d.scale == KTCY_SCALE_GROUP:
        k_pad = ktcy_k_pad(fmt, k, group)
    q = np.zeros((n, k_pad), np.uint8 if d.code in (KTCY_CODE_E4M3, KTCY_CODE_E2M1) else np.int8)
    if d.scale == KTCY_SCALE_GROUP:
        ld_scale = ktcy_n_pad(n)
        scale = np.zeros((k_pad // group, ld_scale), np.float32)
    elif d.scale == KTCY_SCALE_BLOCK128:
        units = (n + B - 1) // B
        scale = np.zeros((units, (k + B - 1) // B), np.float32)
    else:
        scale = np.zeros(n, np.float32)
    if d.scale == KTCY_SCALE_IN_BLOCK:
        ld_scale = (k + KTCY_E2M1_SUB_K - 1) // KTCY_E2M1_SUB_K
        scale = np.zeros(1, np.float32)
        zero = np.full((n, ld_scale), 127, np.uint8)
    else:
        zero = np.full(scale.shape, 8, np.uint8) if d.zero_points else np.zeros(1, np.uint8)
    cdef const uint8_t[:, ::1] qv = q.view(np.uint8)
    cdef float[::1] sv = scale.reshape(-1)
    mins = np.zeros(scale.shape if d.mins else 1, np.float32)
    cdef uint8_t[::1] zv = zero.reshape(-1)
    cdef float[::1] mv = mins.reshape(-1)
    result = ((q, zero) if d.scale == KTCY_SCALE_IN_BLOCK else (q, scale, zero) if d.zero_points
              else (q, scale, mins) if d.mins else (q, scale))
    if n == 0 or k == 0:
        return result
    cdef int team = _team(_num_threads)
    for i in prange(units, nogil=True, num_threads=team, schedule="dynamic"):
        if _quantize_unit(fmt, &w[0, 0], n, k, group, i, <void *>&qv[0, 0], k_pad, &sv[0], &zv[0], &mv[0],
                          ld_scale) >= 0:
            bad += 1
    if bad:  # prange reductions give a count, not the row; numpy finds the first offender
        row = int(np.flatnonzero(~np.isfinite(np.asarray(w)).all(axis=1))[0])
        raise ValueError(f"weight row {row} holds NaN or infinity; it cannot be quantized")
    return result

def to_bf16_bits(const float[:, ::1] w):
    """float32 -> bfloat16 bit patterns, round to nearest even, NaN kept NaN."""
    cdef int64_t n = w.shape[0], k = w.shape[1], r, i
    out = np.empty((n, k), np.uint16)
    cdef uint16_t[:, ::1] ov = out
    cdef int team = _team(_num_threads)
    for r in prange(n, nogil=True, num_threads=team, schedule="static"):
        for i in range(k):
            ov[r, i] = ktcy_f32_to_bf16(w[r, i])
    return out

def mxfp4_to_bf16_bits(const uint8_t[::1] codes, const uint8_t[::1] exps):
    """E2M1 codes times 2^(e - 127) as bf16 bits, the kernels' decode (include/ktcy/numeric.h)."""
    if codes.shape[0] != exps.shape[0]:
        raise ValueError("codes and exps must have the same length")
    out = np.empty(codes.shape[0], np.uint16)
    cdef uint16_t[::1] ov = out
    cdef int64_t i
    for i in range(codes.shape[0]):
        ov[i] = ktcy_mxfp4_to_bf16(codes[i], exps[i])
    return out

def e4m3_to_bf16_bits(const uint8_t[::1] codes):
    out = np.empty(codes.shape[0], np.uint16)
    cdef uint16_t[::1] ov = out
    cdef int64_t i
    for i in range(codes.shape[0]):
        ov[i] = ktcy_e4m3_to_bf16(codes[i])
    return out

def f32_to_e4m3(const float[::1] x):
    out = np.empty(x.shape[0], np.uint8)
    cdef uint8_t[::1] ov = out
    cdef int64_t i
    for i in range(x.shape[0]):
        ov[i] = ktcy_f32_to_e4m3(x[i])
    return out

def padded_shape(int fmt, int64_t n, int64_t k, int group=0):
    """(n_pad, k_pad, K elements per packed block) of a packed W[n][k] (include/ktcy/formats.h)."""
    _check_format_code(fmt)
    return ktcy_n_pad(n), ktcy_k_pad(fmt, k, group), ktcy_format(fmt).block_k

def packed_shapes(int fmt, int64_t n, int64_t k, int group=0):
    """{"data": (bytes,), "scale": (rows, cols) or None, "colsum": (n_pad,) or None, "zero": (rows,
    cols) or None}: the arrays a packed W[n][k] consists of, by the descriptor (what every loader
    checks before C reads them).  Group scales and zero points: (panels, groups, 16); INT4_MIN's
    scales and mins: (panels, groups, 32), each group's 16 scales then its 16 mins."""
    _check_format_code(fmt)
    if n < 1 or k < 1:
        raise ValueError(f"a packed weight needs N >= 1 and K >= 1, got {n} x {k}")
    if not ktcy_group_ok(fmt, group):
        raise ValueError(f"group size {group} is not valid for {FORMATS[fmt]}")
    cdef int64_t shape[2]
    cdef int64_t zshape[2]
    ktcy_scale_shape(fmt, n, k, group, shape)
    ktcy_zero_shape(fmt, n, k, group, zshape)
    cs = ktcy_colsum_count(fmt, n)
    scale = (shape[0], shape[1]) if shape[0] else None
    zero = (zshape[0], zshape[1]) if zshape[0] else None
    if ktcy_format(fmt).scale == KTCY_SCALE_GROUP:
        width = 2 if ktcy_format(fmt).mins else 1
        scale = (shape[0], shape[1] // (KTCY_PANEL * width), KTCY_PANEL * width)
        zero = (zshape[0], zshape[1] // KTCY_PANEL, KTCY_PANEL) if zero else None
    return {"data": (ktcy_data_bytes(fmt, n, k, group),), "scale": scale, "colsum": (cs,) if cs else None, "zero": zero}

def int8_column_sums(const int8_t[::1] data, int64_t n_pad, int64_t k_pad):
    """Sum over K of each channel's codes, read from INT8 blocks (16 rows x 16 channels x 4)."""
    if n_pad % 16 or k_pad % 64 or data.shape[0] != n_pad * k_pad:
        raise ValueError("INT8 blocks do not fit the padded shape")
    sums = np.zeros(n_pad, np.int32)
    cdef int32_t[::1] out = sums
    cdef int64_t p, b, r, c, base
    cdef int32_t acc
    with nogil:
        for p in range(n_pad // 16):
            for c in range(16):
                acc = 0
                for b in range(k_pad // 64):
                    base = (p * (k_pad // 64) + b) * 1024 + c * 4
                    for r in range(16):
                        acc = acc + data[base + r * 64] + data[base + r * 64 + 1] + data[base + r * 64 + 2] \
                            + data[base + r * 64 + 3]
                out[p * 16 + c] = acc
    return sums


def layout(int fmt, codes, int64_t n, int64_t k, int group=0, block_scales=None):
    """Packs an [n][>=k] code matrix (int8, uint8 or uint16 bits) into the format's blocks;
    block_scales: the [n][k_pad/block_k] uint8 exponents of formats that keep them in the block."""
    shapes = packed_shapes(fmt, n, k, group)
    cdef const ktcy_format_desc *d = ktcy_format(fmt)
    cdef const uint8_t[:, ::1] bs
    cdef const uint8_t *bs_ptr = NULL
    cdef int64_t bs_ld = 0
    if d.scale == KTCY_SCALE_IN_BLOCK:
        bs = np.ascontiguousarray(block_scales, np.uint8)
        if bs.shape[0] != n or bs.shape[1] != (k + KTCY_E2M1_SUB_K - 1) // KTCY_E2M1_SUB_K:
            raise ValueError(f"block scales must be [{n}, {(k + KTCY_E2M1_SUB_K - 1) // KTCY_E2M1_SUB_K}]")
        bs_ptr, bs_ld = &bs[0, 0], bs.shape[1]
    cdef int64_t k_pad = ktcy_k_pad(fmt, k, group), n_pad = ktcy_n_pad(n)
    cdef int64_t panels = n_pad // KTCY_PANEL, p
    codes = np.asarray(codes)
    width = 2 if d.code == KTCY_CODE_BF16 else 1  # what ktcy_layout_panels reads per code
    if codes.ndim != 2 or codes.dtype.itemsize != width or codes.dtype.kind not in "iu":
        raise ValueError(f"{FORMATS[fmt]} codes must be a 2-D array of {8 * width}-bit integers, "
                         f"got {codes.dtype} {codes.shape}")
    cdef int64_t ld = codes.shape[1]
    if codes.shape[0] < n or ld < k:
        raise ValueError(f"codes of shape {codes.shape} do not cover {n} x {k}")
    # C-ordered and aligned (copied where not): ktcy_layout_panels reads 16-bit codes as uint16
    cdef const uint8_t[:, ::1] raw = np.require(codes, None, ["C", "A"]).view(np.uint8)
    data = np.empty(shapes["data"], np.uint8)
    colsum = np.zeros(n_pad, np.int32) if shapes["colsum"] else None
    cdef uint8_t[::1] dv = data
    cdef int32_t[::1] cv
    cdef int32_t *cptr = NULL
    if colsum is not None:
        cv = colsum
        cptr = &cv[0]
    cdef const void *src = &raw[0, 0] if n > 0 and ld > 0 else NULL
    cdef int team = _team(_num_threads)
    for p in prange(panels, nogil=True, num_threads=team, schedule="static"):
        ktcy_layout_panels(fmt, src, ld, n, k, k_pad, p, p + 1, &dv[0], cptr)
        if bs_ptr != NULL:
            ktcy_layout_block_scales(bs_ptr, bs_ld, n, k_pad, p, p + 1, &dv[0])
    return data, colsum

# ---------------------------------------------------------------- activations

cdef ktcy_quant_act_fn _quant_act_for(int need) noexcept:
    """The int8 activation quantizer of the widest ISA in `need` (KTCY_NEED_* bits) that this CPU
    runs; every version writes the same bytes (act_quant.h)."""
    if need & KTCY_NEED_AVX512 and _satisfied & KTCY_NEED_AVX512:
        return ktcy_quantize_act_int8_avx512
    if need & (KTCY_NEED_AVX512 | KTCY_NEED_AVX2) and _satisfied & KTCY_NEED_AVX2:
        return ktcy_quantize_act_int8_avx2
    return ktcy_quantize_act_int8

cdef ktcy_e2m1_starts_fn _e2m1_starts_for(int need) noexcept:
    """MXFP4_A8's block sums (act_quant.h) on the same rule as _quant_act_for."""
    if need & (KTCY_NEED_AVX512 | KTCY_NEED_AVX2) and _satisfied & KTCY_NEED_AVX2:
        return ktcy_act_e2m1_starts_avx2
    return ktcy_act_e2m1_starts

cdef ktcy_bf16_act_fn _bf16_act_for(int need) noexcept:
    """The bf16 activation conversion on the same rule as _quant_act_for."""
    if need & KTCY_NEED_AVX512 and _satisfied & KTCY_NEED_AVX512:
        return ktcy_convert_act_bf16_avx512
    if need & (KTCY_NEED_AVX512 | KTCY_NEED_AVX2) and _satisfied & KTCY_NEED_AVX2:
        return ktcy_convert_act_bf16_avx2
    return ktcy_convert_act_bf16

_QUANT_ACT_NEEDS = {"ref": 0, "avx2": KTCY_NEED_AVX2, "avx512": KTCY_NEED_AVX512}

cdef int _act_isa_need(str isa) except -1:
    if isa not in _QUANT_ACT_NEEDS:
        raise ValueError(f"unknown quantizer ISA {isa!r}; choose one of {', '.join(_QUANT_ACT_NEEDS)}")
    cdef int need = _QUANT_ACT_NEEDS[isa]
    if need & ~_satisfied:
        raise UnsupportedISAError(f"this CPU cannot run the {isa} activation quantizer")
    return need

def quantize_act_int8(str isa, const float[:, ::1] x, int64_t k_pad, int group=0):
    """(codes [m, k_pad] int8, scales [m] float32, group sums [m, k_pad // group] int32 or None)
    of the rows of x by the activation quantizer of one ISA (ref, avx2, avx512): the tests hold
    the vector versions to the portable one byte for byte."""
    cdef int need = _act_isa_need(isa)
    cdef int64_t m = x.shape[0], k = x.shape[1]
    if k_pad < k or group < 0 or (group and k_pad % group):
        raise ValueError(f"k_pad {k_pad} does not hold K = {k} in groups of {group}")
    q = np.ones((m, k_pad), np.int8)  # not zeros: the padding must be written
    scale = np.zeros(m, np.float32)
    sums = np.zeros((m, k_pad // group), np.int32) if group else None
    cdef int8_t[:, ::1] qv = q
    cdef float[::1] sv = scale
    cdef int32_t[:, ::1] gv
    cdef int32_t *gptr = NULL
    if group:
        gv = sums
        gptr = &gv[0, 0]
    cdef ktcy_quant_act_fn fn = _quant_act_for(need)
    if m > 0:
        with nogil:
            fn(&x[0, 0], k, k, k_pad, 0, m, &qv[0, 0], &sv[0], group, gptr)
    return q, scale, sums

def act_e2m1_starts(str isa, const int8_t[:, ::1] q):
    """MXFP4_A8's block sums of int8 rows [m, k_pad] (k_pad a multiple of 32) by one ISA's version
    (ref, avx2), for the tests."""
    cdef int64_t m = q.shape[0], k_pad = q.shape[1]
    if k_pad % 32:
        raise ValueError(f"rows of {k_pad} codes are not whole 32-K blocks")
    out = np.zeros((m, k_pad // 32), np.int32)
    cdef int32_t[:, ::1] ov = out
    cdef ktcy_e2m1_starts_fn fn = _e2m1_starts_for(_act_isa_need(isa))
    if m > 0 and k_pad > 0:
        with nogil:
            fn(&q[0, 0], k_pad, 0, m, &ov[0, 0])
    return out

def convert_act_bf16(str isa, const float[:, ::1] x, int64_t k_pad):
    """The bf16 bits [m, k_pad] of the rows of x by the conversion of one ISA (ref, avx2, avx512),
    for the tests."""
    cdef int need = _act_isa_need(isa)
    cdef int64_t m = x.shape[0], k = x.shape[1]
    if k_pad < k:
        raise ValueError(f"k_pad {k_pad} does not hold K = {k}")
    out = np.ones((m, k_pad), np.uint16)  # not zeros: the padding must be written
    cdef uint16_t[:, ::1] ov = out
    cdef ktcy_bf16_act_fn fn = _bf16_act_for(need)
    if m > 0:
        with nogil:
            fn(&x[0, 0], k, k, k_pad, 0, m, &ov[0, 0])
    return out

cdef _made_once(bint made, str what):
    """The C views of these objects point into what their first __init__ checked: a second call
    would swap arrays under a view a kernel may be reading (or leave it half made)."""
    if made:
        raise TypeError(f"a {what} is made once; make a new one")

cdef class Activations:
    """Rows converted once for a format: int8 codes + scales (+ group sums) or bf16 bits, padded
    to m_pad = a multiple of 16 rows (zeros) so AMX tiles and rounded-up micro-tiles stay inside."""
    cdef readonly object q, bf16, scale, group_sum  # the buffers view points into: never replaced
    cdef ktcy_act view
    cdef readonly int fmt
    cdef bint made

    def __init__(self, int fmt, const float[:, ::1] x, int64_t k_pad, int group=0):
        _made_once(self.made, "Activations")
        self.made = True
        _check_format_code(fmt)
        cdef const ktcy_format_desc *d = ktcy_format(fmt)
        cdef int64_t m = x.shape[0], k = x.shape[1], m_pad = (m + 15) // 16 * 16 if m > 0 else 16, r
        cdef int gsum_group = group if d.groups else 0  # GROUP formats' group, MXFP4_A8's E8M0 block
        if k_pad < k or k_pad % d.block_k or (gsum_group and (gsum_group <= 0 or k_pad % gsum_group)):
            raise ValueError(f"k_pad {k_pad} does not fit K = {k} in {FORMATS[fmt]} blocks (group {group})")
        if fmt == KTCY_FMT_MXFP4_A8 and gsum_group != KTCY_E2M1_SUB_K:  # its block sums: a word pair per 32 K
            raise ValueError(f"MXFP4_A8 activations take group {KTCY_E2M1_SUB_K} (its E8M0 block), not {group}")
        self.fmt = fmt
        cdef int8_t[:, ::1] qv
        cdef uint16_t[:, ::1] bv
        cdef float[::1] sv
        cdef int32_t[:, ::1] gv
        cdef int32_t *gptr = NULL
        cdef ktcy_quant_act_fn quant_act
        cdef ktcy_e2m1_starts_fn e2m1_starts = NULL
        cdef int quant_group = gsum_group
        cdef ktcy_bf16_act_fn bf16_act
        cdef int team = _team(_num_threads)
        memset(&self.view, 0, sizeof(ktcy_act))
        self.view.m, self.view.m_pad, self.view.k_pad, self.view.group = m, m_pad, k_pad, gsum_group
        _set_tile_choices(&self.view)
        if d.act == KTCY_ACT_INT8:
            self.q = np.zeros((m_pad, k_pad), np.int8)
            self.scale = np.zeros(m_pad, np.float32)
            qv, sv = self.q, self.scale
            if gsum_group:
                self.group_sum = np.zeros((m_pad, k_pad // gsum_group), np.int32)
                gv = self.group_sum
                gptr = &gv[0, 0]
            self.view.q, self.view.scale, self.view.group_sum = &qv[0, 0], &sv[0], gptr
            if m > 0 and k > 0:
                quant_act = _quant_act_for(KTCY_NEED_AVX512)
                if fmt == KTCY_FMT_MXFP4_A8:  # its block sums have their own form
                    e2m1_starts, quant_group = _e2m1_starts_for(KTCY_NEED_AVX512), 0
                for r in prange(m, nogil=True, num_threads=team, schedule="static"):
                    quant_act(&x[0, 0], k, k, k_pad, r, r + 1, &qv[0, 0], &sv[0], quant_group, gptr)
                    if e2m1_starts != NULL:
                        e2m1_starts(&qv[0, 0], k_pad, r, r + 1, gptr)
        else:
            self.bf16 = np.zeros((m_pad, k_pad), np.uint16)
            bv = self.bf16
            self.view.bf16 = &bv[0, 0]
            if m > 0 and k > 0:
                bf16_act = _bf16_act_for(KTCY_NEED_AVX512)
                for r in prange(m, nogil=True, num_threads=team, schedule="static"):
                    bf16_act(&x[0, 0], k, k, k_pad, r, r + 1, &bv[0, 0])

# ---------------------------------------------------------------- GEMM driver

cdef class Weight:
    """A ktcy_weight over arrays owned by Python (a PackedWeight or a mapped file).  Every array
    a kernel reads is checked here against the shape the format descriptor implies: this is the
    last line before C code trusts sizes."""
    cdef ktcy_weight view
    cdef object keep
    cdef readonly int fmt
    cdef bint made

    def __init__(self, int fmt, int group, int64_t n, int64_t k, data, scale, colsum, zero=None):
        _made_once(self.made, "Weight")
        self.made = True
        shapes = packed_shapes(fmt, n, k, group)
        name = FORMATS[fmt]
        # one int32 sum per row (a group's cannot overflow)
        if ktcy_format(fmt).code == KTCY_CODE_S8 and ktcy_format(fmt).scale != KTCY_SCALE_GROUP and k > INT8_MAX_K:
            raise ValueError(f"{name} weights with K = {k} > {INT8_MAX_K} would overflow the int32 sums")
        cdef const uint8_t[::1] dv = _checked(data, np.uint8, shapes["data"], f"{name} packed data")
        cdef const float[::1] sv
        cdef const int32_t[::1] cv
        cdef const uint8_t[::1] zv
        memset(&self.view, 0, sizeof(ktcy_weight))
        self.fmt = fmt
        self.view.format, self.view.group, self.view.n, self.view.k = fmt, group, n, k
        self.view.n_pad, self.view.k_pad = ktcy_n_pad(n), ktcy_k_pad(fmt, k, group)
        self.view.data = &dv[0]
        if ktcy_format(fmt).code == KTCY_CODE_E4M3:  # one pass: which decode the AVX2 kernels may use
            with nogil:
                self.view.nan_codes = ktcy_e4m3_any_nan(&dv[0], dv.shape[0])
        if shapes["scale"] is not None:
            sv = _checked(scale, np.float32, shapes["scale"], f"{name} scale")
            self.view.scale = &sv[0]
        if shapes["colsum"] is not None:
            cv = _checked(colsum, np.int32, shapes["colsum"], f"{name} colsum")
            self.view.colsum = &cv[0]
        if shapes["zero"] is not None:
            zv = _checked(zero, np.uint8, shapes["zero"], f"{name} zero points")
            if np.asarray(zv).max() > 15:
                raise ValueError(f"{name} zero points must lie in [0, 15]")
            self.view.zero = &zv[0]
        self.keep = (data, scale, colsum, zero)

    @property
    def group(self):
        return self.view.group

    @property
    def shape(self):
        return (self.view.n, self.view.k)

def _checked(a, dtype, shape, what):
    """a as a flat C-contiguous array of dtype holding exactly prod(shape) elements (a 1-D array
    of that size or an array of that shape), else ValueError/TypeError; never copies."""
    if a is None:
        raise ValueError(f"{what} is missing; the format needs {shape}")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{what} must be {np.dtype(dtype)}, got {a.dtype}")
    count = int(np.prod(shape))
    if a.shape not in (tuple(shape), (count,)):
        raise ValueError(f"{what} has shape {a.shape}; the format needs {tuple(shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if not a.flags.aligned:  # C reads it through typed pointers
        raise ValueError(f"{what} must be aligned (its address a multiple of {a.dtype.alignment} bytes)")
    return a.reshape(-1)

# INT8 sums (q_x + 128) * q_w in int32 on VNNI (then subtracts 128 * column sum): 255 * 128 * K
# (code -128) stays below 2^31 up to K = 65793.
INT8_MAX_K = 65536

cdef int _gemm_parallel(ktcy_gemm_fn fn, const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                        int64_t pb, int64_t pe, int nthreads, char *message) noexcept nogil:
    """Splits panels [pb, pe) into one contiguous chunk per thread (ktcy_split_panels) and runs fn
    on each with its own scratch.  Returns a ktcy_status; message gets the first failure's text."""
    cdef int64_t panels = pe - pb, per, chunks, c, p0, p1
    cdef int64_t scratch_bytes = ktcy_gemm_scratch_bytes(w.k_pad)
    cdef int failed = KTCY_OK
    cdef int *status
    cdef char *messages
    if panels <= 0 or a.m == 0:
        return KTCY_OK
    per = ktcy_split_panels(panels, nthreads)
    chunks = (panels + per - 1) // per
    if chunks < nthreads:
        nthreads = <int>chunks
    cdef char *scratch = <char *>malloc(scratch_bytes * nthreads)
    status = <int *>malloc(chunks * sizeof(int))
    messages = <char *>malloc(chunks * 160)
    if scratch == NULL or status == NULL or messages == NULL:
        free(scratch)
        free(status)
        free(messages)
        return KTCY_ERR_SCRATCH
    for c in prange(chunks, num_threads=nthreads, schedule="static"):
        p0 = pb + c * per
        p1 = p0 + per
        if p1 > pe:
            p1 = pe
        status[c] = fn(a, w, y, ldy, p0, p1, scratch + openmp.omp_get_thread_num() * scratch_bytes)
        _take_message(status[c], messages + c * 160)  # the emulator's message is thread-local
    for c in range(chunks):
        if status[c] != KTCY_OK and failed == KTCY_OK:
            failed = status[c]
            strncpy(message, messages + c * 160, 159)
            message[159] = 0
    free(scratch)
    free(status)
    free(messages)
    return failed

cdef inline void _take_message(int st, char *dst) noexcept nogil:
    """Copies this thread's emulator fault text to its own slot (no shared buffer) and clears it."""
    dst[0] = 0
    if st == KTCY_ERR_TILE:
        strncpy(dst, ktcy_emu.message, 159)
        dst[159] = 0
        ktcy_emu_clear_error()

cdef int _variant_index(str format_name, str variant_name) except -1:
    cdef int i, f = _format_index(format_name)
    for i in range(KTCY_NUM_VARIANTS):
        if KTCY_VARIANTS[i].name.decode() == variant_name:
            if not KTCY_VARIANTS[i].formats & (1 << f):
                raise ValueError(f"kernel {variant_name} does not serve {format_name}")
            if KTCY_VARIANTS[i].needs & ~_satisfied:
                raise UnsupportedISAError(f"kernel {variant_name} needs instructions this CPU lacks")
            return i
    raise ValueError(f"no kernel named {variant_name!r} in this build")

def gemm(str format_name, str variant_name, Activations act, Weight weight, float[:, ::1] out, **tiles):
    """out[m, :n] = act @ weight.T with one kernel variant; the GIL is released.  tiles: tile
    choices by name (TILE_CHOICE_LIMITS, registry.h), each within its limit, in place of this
    CPU's for this call, so tests reach every one on any CPU."""
    cdef ktcy_gemm_fn fn = KTCY_VARIANTS[_variant_index(format_name, variant_name)].fn
    cdef ktcy_act view = act.view
    if tiles:
        view.tiles = _with_choices(view.tiles, {name: _check_tile_choice(name, value) for name, value in tiles.items()})
    cdef char message[160]
    cdef int st, team = _team(_num_threads)
    cdef int64_t panels = weight.view.n_pad // KTCY_PANEL
    message[0] = 0
    if weight.fmt != _format_index(format_name) or act.fmt != weight.fmt:
        raise ValueError(f"activations ({FORMATS[act.fmt]}) and weight ({FORMATS[weight.fmt]}) "
                         f"must both be {format_name}")
    if act.view.k_pad != weight.view.k_pad or act.view.group != weight.view.group:
        raise ValueError(f"activations prepared for k_pad {act.view.k_pad} (group {act.view.group}) do not fit a "
                         f"weight with k_pad {weight.view.k_pad} (group {weight.view.group})")
    if out.shape[0] < act.view.m or out.shape[1] < weight.view.n:
        raise ValueError("output buffer too small")
    with nogil:
        st = _gemm_parallel(fn, &view, &weight.view, &out[0, 0] if out.shape[0] > 0 else NULL,
                            out.shape[1], 0, panels, team, message)
    _raise_status(st, message)

cdef _raise_status(int st, char *message):
    if st == KTCY_ERR_TILE:
        raise TileError("AMX tile fault (emulated): " + (<bytes>message).decode(errors="replace"))
    if st == KTCY_ERR_FORMAT:
        raise RuntimeError("internal error: a kernel was handed a weight format it does not serve")
    if st != KTCY_OK:
        raise MemoryError("could not allocate GEMM scratch")

def ahead_shares(int64_t nbytes, int64_t tiles, int64_t nkb):
    """Each row tile's share of nbytes fetched ahead over nkb K blocks (prefetch.h), as
    (first byte offset, lines per block); for tests.  Nothing is read."""
    cdef ktcy_span span
    cdef ktcy_ahead s
    span.at, span.bytes, span.panel_bytes = <const uint8_t *>(<uintptr_t>1 << 30), nbytes, 0  # never dereferenced
    shares = []
    for t in range(tiles):
        s = ktcy_ahead_share(span, t, tiles, nkb)
        shares.append((<int64_t>(s.at - <uintptr_t>span.at) if s.lines else 0, s.lines))
    return shares

def stream_ahead(int64_t next_offset, int64_t next_bytes, int64_t next_panel_bytes, int slot, int64_t panel_offset,
                 int64_t kb, int64_t nkb, int64_t ahead, int64_t block_bytes):
    """The byte offset (from an arbitrary base) a streaming tile prefetches for block kb of panel
    slot `slot`, its panel at panel_offset and the next panels (next_bytes of them, none if 0) at
    next_offset (prefetch.h); for tests.  Nothing is read."""
    cdef uintptr_t base = <uintptr_t>1 << 40  # never dereferenced
    cdef ktcy_span cont
    cont.at = <const uint8_t *>(base + next_offset) if next_bytes else NULL
    cont.bytes, cont.panel_bytes = next_bytes, next_panel_bytes
    return <int64_t>(ktcy_stream_ahead(cont, slot, <const uint8_t *>(base + panel_offset), kb, nkb, ahead,
                                       block_bytes) - base)

# ---------------------------------------------------------------- this thread's MXCSR, for the tests

cdef extern from "<xmmintrin.h>":
    unsigned int _mm_getcsr() nogil
    void _mm_setcsr(unsigned int value) nogil

def mxcsr(value=None):
    """This thread's SSE control word (MXCSR); with a value, set it and return the previous one.
    The tests set DAZ/FTZ (bits 6 and 15) as `torch.set_flush_denormal(True)` does."""
    cdef unsigned int old = _mm_getcsr()
    if value is not None:
        if not 0 <= value <= 0xFFFF:
            raise ValueError("MXCSR is a 16-bit control word")
        _mm_setcsr(<unsigned int>value)
    return old

def amx_release_tiles():
    """TILERELEASE on the calling thread, as other code sharing ktcy's threads may do (tests).
    Only where AMX is usable: elsewhere the instruction faults."""
    if "amx" not in available_isas():
        raise UnsupportedISAError("amx_release_tiles: AMX is not usable here")
    ktcy_amx_release_tiles()

# ---------------------------------------------------------------- emulated tile unit, instruction level

def emu_reset():
    ktcy_emu_tilerelease()
    ktcy_emu_clear_error()

def emu_error():
    return (<bytes>ktcy_emu.message).decode() if ktcy_emu.error else None

def emu_ldtilecfg(const uint8_t[::1] config):
    if config.shape[0] != 64:
        raise ValueError("a tile configuration is 64 bytes")
    ktcy_emu_ldtilecfg(&config[0])

cdef _emu_check_tile(int t, int64_t rows, int64_t colsb, str what):
    """The tile's configured shape must fit the array the emulator reads or writes (an
    unconfigured tile is the emulator's own fault to report: it moves no bytes)."""
    if not 0 <= t < 8:
        raise ValueError(f"tmm{t} does not exist (0..7)")
    if ktcy_emu.rows[t] and (rows < ktcy_emu.rows[t] or colsb < ktcy_emu.colsb[t]):
        raise ValueError(f"tmm{t} is configured as {ktcy_emu.rows[t]} x {ktcy_emu.colsb[t]} bytes; "
                         f"{what} is {rows} x {colsb}")

def emu_tileloadd(int t, const uint8_t[:, ::1] src):
    _emu_check_tile(t, src.shape[0], src.shape[1], "the source")
    ktcy_emu_tileloadd(t, &src[0, 0], src.shape[1])

def emu_tilestored(int t, int rows, int colsb):
    _emu_check_tile(t, rows, colsb, "the destination asked for")
    out = np.zeros((rows, colsb), np.uint8)
    cdef uint8_t[:, ::1] ov = out
    ktcy_emu_tilestored(t, &ov[0, 0], colsb)
    return out

def emu_tilezero(int t):
    ktcy_emu_tilezero(t)

def emu_tdpbssd(int c, int a, int b):
    ktcy_emu_tdpbssd(c, a, b)

def emu_tdpbf16ps(int c, int a, int b):
    ktcy_emu_tdpbf16ps(c, a, b)

# ---------------------------------------------------------------- MoE engine
include "_moe_engine.pxi"

# ---------------------------------------------------------------- roofline probes
include "_roofline.pxi"
