"""GEMM per format x ISA x M on a Qwen3-30B-A3B expert projection (N 1536 = gate+up rows, K 2048)."""
import numpy as np
import pytest

from support import isa_list, record
from ktcy import kernels

N, K = 1536, 2048
FORMATS = ["BF16", "INT8", "INT4", "FP8_PERCHANNEL", "FP8_BLOCK"]


@pytest.fixture(scope="module")
def packed(rng):
    W = (rng.standard_normal((N, K), np.float32) * 0.02)
    return {fmt: kernels.pack(W, fmt) for fmt in FORMATS}


@pytest.mark.parametrize("m", [1, 4, 128])
@pytest.mark.parametrize("isa", isa_list())
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm(benchmark, roof, packed, rng, fmt, isa, m):
    p = packed[fmt]
    X = rng.standard_normal((m, K), np.float32)
    out = np.empty((m, N), np.float32)
    benchmark.group = f"gemm {fmt} M={m}"
    benchmark(kernels.linear, X, p, isa, out)
    record(benchmark, roof, fmt, isa, p.nbytes, 2 * m * N * K)
