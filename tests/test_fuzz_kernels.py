"""Differential fuzzing of the GEMM kernels: random shapes, groups, activation patterns, thread
counts and tile choices, every runnable variant (the portable path, amx_emu, AVX2, AVX-512) held to
its format's contract on each case:
  - INT8, INT4, INT4_ZP, INT4_MIN, MXFP4_A8: the same bits on every variant;
  - BF16, FP8, MXFP4: within 1e-5 of float64 on the same bf16-rounded activations and dequantized
    weights, or float32's summation bound where the terms cancel (MXFP4's 16-bit few-row path:
    within its documented rounding on top, README).
A failure names its seed; `case(seed)` reruns it alone.  The first fuzz run (2026-12-05: 40,000
cases) found FP8's AVX2 wide decode zeroing calls with tiny scales.  Default runs are short;
`pytest -m fuzz test_fuzz_kernels.py` runs the long one."""
import numpy as np
import pytest

import ktcy
from conftest import I16_PATH_OFF, I16_PATH_ON, MXFP4_I16_PATHS, bf16_round, i16_bound, rel_err_rows, runnable_variants
from ktcy import kernels
from ktcy.formats import descriptor, has_groups

INT_FORMATS = ("INT8", "INT4", "INT4_ZP", "INT4_MIN", "MXFP4_A8", "INT8_GROUP", "INT8_MIN")
FLOAT_FORMATS = ("BF16", "FP8_PERCHANNEL", "FP8_BLOCK", "MXFP4")
FORMATS = INT_FORMATS + FLOAT_FORMATS
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 32, 33, 36, 37, 64, 100)
PATTERNS = ("gaussian", "outlier", "zero_row", "tiny_row", "huge", "wide_row", "sparse")


@pytest.fixture
def restore_threads():
    threads = ktcy.get_num_threads()
    yield
    ktcy.set_num_threads(threads)


def activations(rng, m, k, pattern):
    x = rng.standard_normal((m, k)).astype(np.float32)
    if pattern == "outlier":
        x[:, rng.integers(k)] *= 1000
    elif pattern == "zero_row":
        x[rng.integers(m)] = 0
    elif pattern == "tiny_row":
        x[rng.integers(m)] *= np.float32(1e-30)
    elif pattern == "huge":
        x *= np.float32(1e4)
    elif pattern == "wide_row":  # a value of 2^15 or more: FP8's AVX2 wide decode for the whole call
        x[m - 1, rng.integers(k)] = 40000.0
    elif pattern == "sparse":
        x[rng.random((m, k)) < 0.9] = 0
    return x


def weights(rng, n, k):
    """Gaussian weights (scaled by the caller: scales from 1e-25 to 1e5), some blocks all zero."""
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    if k >= 64 and rng.random() < 0.3:  # all-zero blocks
        w[:, 32:64] = 0
    return w


def case(seed):
    """One random case: every runnable variant of a random format on a random shape against its
    contract.  Returns nothing; asserts with the seed in the message."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[rng.integers(len(FORMATS))]
    m = int(ROWS[rng.integers(len(ROWS))])
    n, k = int(rng.integers(1, 200)), int(rng.integers(1, 400))
    group = int(rng.choice(descriptor(fmt)["group_sizes"] if has_groups(fmt) else [32, 64, 128]))
    pattern = PATTERNS[rng.integers(len(PATTERNS))]
    ktcy.set_num_threads(int(rng.integers(1, 3)))
    size = 1.0 if pattern == "tiny_row" or rng.random() < 0.5 else float(10.0 ** rng.uniform(-25, 5))
    p = kernels.pack(weights(rng, n, k) * np.float32(size), fmt, group)
    X = activations(rng, m, k, pattern)
    tiles = {"one_panel_rows": [None, 0, 4][rng.integers(3)], "wide_tiles": [None, 0, 1][rng.integers(3)],
             "e2m1_panel_rows": [None, 0, 2][rng.integers(3)], "fp8_normal_panels": [None, 0, 1][rng.integers(3)],
             "plain_fetch_l2": [None, 0, 1][rng.integers(3)]}
    where = f"seed {seed}: {fmt} m={m} n={n} k={k} group={group} {pattern} weights x {size:.1e} {tiles}"
    outs = {v: kernels.linear_variant(X, p, v, **I16_PATH_OFF, **tiles) for v in runnable_variants(fmt)}
    assert all(np.all(np.isfinite(y)) for y in outs.values()), where
    if fmt in INT_FORMATS:
        first = next(iter(outs.values()))
        for v, y in outs.items():
            assert y.tobytes() == first.tobytes(), f"{where}: {v} differs"
        return
    xb, wd = bf16_round(X), p.dequantize().astype(np.float64)
    ref = xb @ wd.T
    # 1e-5 of the row's norm, or float32's bound for a sum of k terms where they cancel (an output
    # of one channel whose terms add up to 15,000 times it is 2e-5 of its norm off on every path)
    allowed = 1e-5 * np.linalg.norm(ref, axis=1, keepdims=True) + (k + 2) * 2.0 ** -24 * (np.abs(xb) @ np.abs(wd).T)
    for v, y in outs.items():
        excess = np.abs(y.astype(np.float64) - ref) - allowed
        assert np.all(excess <= 0), f"{where}: {v} {rel_err_rows(y, ref):.2e} of the row norm"
    if fmt == "MXFP4" and m <= 4:
        allowed += i16_bound(xb, wd)
        for v in set(MXFP4_I16_PATHS) & set(outs):
            y = kernels.linear_variant(X, p, v, **I16_PATH_ON, **tiles)
            excess = np.abs(y.astype(np.float64) - ref) - allowed
            assert np.all(excess <= 0), f"{where}: {v} 16-bit path {excess.max():.2e} past its bound"


@pytest.mark.parametrize("start", range(0, 240, 40))
def test_fuzz_kernels(start, restore_threads):
    for seed in range(start, start + 40):
        case(seed)


@pytest.mark.fuzz
@pytest.mark.parametrize("start", range(1000, 4000, 100))
def test_fuzz_kernels_long(start, long_run, restore_threads):
    for seed in range(start, start + 100):
        case(seed)
