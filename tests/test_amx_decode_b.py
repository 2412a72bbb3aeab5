"""The AMX kernels decode B one 1024-byte tile block at a time (gemm_amx_tpl.h, decode_b).  The bf16
formats (MXFP4, FP8) decode a panel pair's blocks two ahead of its first row block's TDPs; its later
row blocks, and the rows of the next activation chunk (128 rows), read or decode the pair again.
Whatever the route, a row's outputs depend on that row alone: the same rows in another row block,
chunk or call give the same bits, and every output agrees with float64 on the dequantized weights
(bf16 activations: within 1e-5; the integer formats' values are held by test_int4,
test_amx_one_step_groups and test_mxfp4_a8).  K spans 1, 2, 3 and many 32-K bf16 blocks (1, 1, 2
and many 64-K int8 blocks); 39 outputs make a pair of panels and a one-panel tail; the call of 10
rows is one 16-row A tile."""
import numpy as np
import pytest

from conftest import bf16_round, rel_err_rows
from ktcy import _native, kernels

FORMATS = ("MXFP4", "FP8_PERCHANNEL", "FP8_BLOCK", "INT4", "INT4_ZP", "INT4_MIN", "MXFP4_A8")
AMX_VARIANTS = [(v["name"], fmt) for fmt in FORMATS for v in _native.variants()
                if v["isa"] in ("amx", "amx_emu") and fmt in v["formats"]]


@pytest.mark.parametrize("variant, fmt", AMX_VARIANTS)
@pytest.mark.parametrize("k", [32, 64, 96, 1000])
def test_rows_give_the_same_bits_in_every_row_block_and_chunk(variant, fmt, k, one_thread):
    if not next(v for v in _native.variants() if v["name"] == variant)["runnable"]:
        pytest.skip(f"{variant}: this CPU cannot run it")
    rng = np.random.default_rng(k)
    w = (rng.standard_normal((39, k)) * 0.05).astype(np.float32)
    packed = kernels.pack(w, fmt)
    block = rng.standard_normal((32, k)).astype(np.float32)
    x = np.tile(block, (5, 1))  # row blocks 0-3 of the first chunk, then the second chunk
    y = kernels.linear_variant(x, packed, variant)
    for copy in range(1, 5):
        assert y[32 * copy:32 * (copy + 1)].tobytes() == y[:32].tobytes(), f"{variant} K={k} copy {copy}"
    assert kernels.linear_variant(block[:10], packed, variant).tobytes() == y[:10].tobytes()
    if fmt in ("MXFP4", "FP8_PERCHANNEL", "FP8_BLOCK"):
        reference = bf16_round(block).astype(np.float64) @ packed.dequantize().T
        assert rel_err_rows(y[:32], reference) <= 1e-5, f"{variant} K={k}"
