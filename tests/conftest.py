"""Shared helpers: which kernels run here, and float64 / exact numpy references built
independently of the C code."""
import signal
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest

from ktcy import _native
from ktcy.kernels import E2M1_VALUES

ALL_ISAS = ("ref", "avx2", "avx512", "amx", "amx_emu")


def runnable_variants(fmt):
    """Every compiled variant that serves fmt and runs on this CPU (amx_emu always does)."""
    return [v["name"] for v in _native.variants() if fmt in v["formats"] and v["runnable"]]


def isa_params():
    """One param per ISA; those this machine cannot run are skipped with the reason."""
    out = []
    for isa in ALL_ISAS:
        marks = () if isa in _native.available_isas() else (
            pytest.mark.skip(reason=f"ISA {isa} is not usable on this CPU/OS/build"),)
        out.append(pytest.param(isa, marks=marks, id=isa))
    return out


def quantize_rows_int8(x):
    """Activation rule: scale = amax/127, q = rint(x * (127/amax)) in float32, clipped."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
    return q, (amax / np.float32(127)).astype(np.float32)


def int8_exact_reference(q_x, s_x, q_w, s_w):
    """(float32)acc * a_scale * w_scale, the documented INT8 epilogue order, from integers."""
    acc = q_x.astype(np.int64) @ q_w.astype(np.int64).T
    return (acc.astype(np.float32) * s_x[:, None]) * s_w[None, :]


# MXFP4 variants whose few-row calls (up to i16_rows) run on 16-bit integers, with the variant whose
# tiles they share for the other calls (AVX2: none apart).
MXFP4_I16_PATHS = {"mxfp4_avx512_vbmi": "mxfp4_avx512_bf16", "mxfp4_avx2": None}
# The tile choices that send MXFP4 calls of up to 4 rows to the 16-bit path on every variant, or
# keep them all on the bf16 tiles (AVX-512: i16_rows, AVX2: avx2_i16_rows).
I16_PATH_ON = {"i16_rows": 4, "avx2_i16_rows": 4}
I16_PATH_OFF = {"i16_rows": 0, "avx2_i16_rows": 0}


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def rel_err_rows(y, ref):
    """Max over elements of |y - ref|, each normalised by the L2 norm of its row of ref."""
    norms = np.linalg.norm(ref, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return float(np.max(np.abs(y.astype(np.float64) - ref) / norms)) if ref.size else 0.0


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    """Run every test from its own temporary folder: `python -m ktcy ...` subprocesses must
    import the installed package, never the uncompiled ./ktcy of a source checkout."""
    monkeypatch.chdir(tmp_path)


@contextmanager
def time_limit(seconds):
    """Fails the test instead of hanging it (a FIFO opened blocking, an endless loop)."""
    def expire(*_):
        raise TimeoutError(f"took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def per_channel_groups(a, n):
    """[n, groups] from a packed group array by its documented panel-major layout (include/ktcy/
    formats.h): (group g, channel c) at (c // 16 * groups + g) * 16 + c % 16."""
    flat = a.reshape(-1)
    groups = flat.size // (-(-n // 16) * 16)
    c = np.arange(n)[:, None]
    return flat[(c // 16 * groups + np.arange(groups)[None, :]) * 16 + c % 16]


def per_channel_group_pairs(a, n):
    """INT4_MIN's ([n, groups] scales, [n, groups] mins) by the documented layout: each panel's
    group holds 16 scales, then 16 mins, at (c // 16 * groups + g) * 32 + c % 16 (+ 16)."""
    flat = a.reshape(-1)
    groups = flat.size // (-(-n // 16) * 32)
    c = np.arange(n)[:, None]
    at = (c // 16 * groups + np.arange(groups)[None, :]) * 32 + c % 16
    return flat[at], flat[at + 16]


def int4_exact_reference(x, packed):
    """INT4 / INT4_ZP / INT4_MIN / INT8_GROUP / INT8_MIN by the documented epilogue, from integers:
    per group the int32 sum of q_x * (code - zero point), acc = acc + float(sum) * scale, and with mins then
    acc = fma(float(sum of q_x), min, acc) (float32, groups in order), then times the row scale."""
    n, k = packed.shape
    g, k_pad = packed.group_size, packed.k_pad
    q_x, s_x = quantize_rows_int8(x)
    qx = np.zeros((x.shape[0], k_pad), np.int64)
    qx[:, :k] = q_x
    qw = np.zeros((n, k_pad), np.int64)
    qw[:, :k] = packed.codes().astype(np.int64)
    if packed.zero is not None:  # INT4's codes() are already code - 8
        qw[:, :k] -= np.repeat(per_channel_groups(packed.zero, n).astype(np.int64), g, axis=1)[:, :k]
    mins = None
    if packed.format in ("INT4_MIN", "INT8_MIN"):
        scale, mins = per_channel_group_pairs(packed.scale, n)
    else:
        scale = per_channel_groups(packed.scale, n)
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(k_pad // g):
        part = qx[:, j * g:(j + 1) * g] @ qw[:, j * g:(j + 1) * g].T
        acc = (acc + part.astype(np.float32) * scale[:, j][None, :]).astype(np.float32)
        if mins is not None:  # a fused multiply-add: float64 holds the product and sum exactly here
            gsum = qx[:, j * g:(j + 1) * g].sum(axis=1).astype(np.float64)
            acc = (acc + gsum[:, None] * mins[:, j][None, :].astype(np.float64)).astype(np.float32)
    return (acc * s_x[:, None]).astype(np.float32)


def mxfp4_a8_exact_reference(x, packed):
    """MXFP4_A8 by the documented epilogue, from integers: per 32-K block the int32 sum of
    q_x * (2 x E2M1 value), acc = acc + float(sum) * (row scale * 0.5) * 2^(e - 127) in float32,
    blocks in order (the kernels' fused multiply-add by the power of two rounds the same while
    that product is a normal float, as it is where this is used)."""
    n, k = packed.shape
    q_x, s_x = quantize_rows_int8(x)
    twice = (2 * E2M1_VALUES).astype(np.int64)
    qw = twice[packed.codes()]
    exps = np.minimum(packed.block_exponents().astype(np.int64), 254)
    t = (s_x * np.float32(0.5)).astype(np.float32)
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(exps.shape[1]):
        part = q_x[:, j * 32:(j + 1) * 32].astype(np.int64) @ qw[:, j * 32:(j + 1) * 32].T
        scaled = (part.astype(np.float32) * t[:, None]).astype(np.float32)
        acc = (acc + scaled * np.exp2(exps[:, j] - 127).astype(np.float32)[None, :]).astype(np.float32)
    return acc


def ordered_slot_sum(slots):
    """MoE.forward's documented reduction of forward_slots: (((0 + s[:, 0]) + s[:, 1]) + ...) in float32."""
    y = np.zeros((slots.shape[0], slots.shape[2]), np.float32)
    for j in range(slots.shape[1]):
        y += slots[:, j]
    return y


@pytest.fixture
def one_thread():
    """ktcy on one thread for the test: the kernels run on the calling thread (whose MXCSR a test
    may set), and one call walks every panel (more threads split them into pairs first)."""
    import ktcy
    threads = ktcy.get_num_threads()
    ktcy.set_num_threads(1)
    yield
    ktcy.set_num_threads(threads)


@pytest.fixture
def long_run(request):
    """The long runs are opt-in: `-m fuzz` (the default suite stays fast)."""
    expr = request.config.getoption("markexpr") or ""
    if "fuzz" not in expr or "not fuzz" in expr:
        pytest.skip("long fuzz run: select it with -m fuzz")


def i16_bound(xb, wd):
    """What the 16-bit path may add to the bf16 path's error, per output, from the bf16-rounded
    activations xb and the dequantized weights wd: each value off by at most 2^-15 of its 32-value
    block's largest |x| (README), times the weights' block sums of |w|."""
    xa, wa = np.abs(xb), np.abs(wd)
    bound = np.zeros((xa.shape[0], wa.shape[0]))
    for b in range(0, xa.shape[1], 32):
        bound += 2.0 ** -15 * xa[:, b:b + 32].max(axis=1, keepdims=True) * wa[:, b:b + 32].sum(axis=1)[None, :]
    return bound
