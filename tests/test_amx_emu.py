"""The plain-C model of the AMX tile unit, instruction by instruction (Intel SDM semantics), and
the proof that the real and emulated AMX kernels are one source."""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ktcy import _native

INCLUDE = Path(__file__).resolve().parents[1] / "include" / "ktcy"


def config(shapes, palette=1, extra=None):
    """64-byte LDTILECFG image; shapes = {tile: (rows, colsb)}."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = palette
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t] = colsb & 0xFF
        cfg[17 + 2 * t] = colsb >> 8
        cfg[48 + t] = rows
    for offset, value in (extra or {}).items():
        cfg[offset] = value
    return cfg


@pytest.fixture(autouse=True)
def fresh_tiles():
    _native.emu_reset()
    yield
    _native.emu_reset()


def dp_setup(m, kbytes, n_dwords):
    _native.emu_ldtilecfg(config({0: (m, 4 * n_dwords), 1: (m, kbytes), 2: (kbytes // 4, 4 * n_dwords)}))
    assert _native.emu_error() is None


def test_tdpbssd_matches_int64_reference_modulo_2_32():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    c0 = rng.integers(-2**31, 2**31, (16, 16), dtype=np.int64).astype(np.int32)
    dp_setup(16, 64, 16)
    _native.emu_tileloadd(0, c0.view(np.uint8).reshape(16, 64))
    _native.emu_tileloadd(1, a.view(np.uint8))
    _native.emu_tileloadd(2, b.view(np.uint8))
    _native.emu_tdpbssd(0, 1, 2)
    got = _native.emu_tilestored(0, 16, 64).view(np.int32)
    # B row k holds 4 K values for each of 16 columns: B[k][4n + i]
    bk = b.reshape(16, 16, 4).transpose(1, 0, 2).reshape(16, 64).astype(np.int64)  # [n][k]
    exact = c0.astype(np.int64) + a.astype(np.int64) @ bk.T
    assert np.array_equal(got, ((exact + 2**31) % 2**32 - 2**31).astype(np.int32))


def test_tdpbssd_wraps_around_int32():
    dp_setup(1, 4, 1)
    _native.emu_tileloadd(0, np.array([2**31 - 10], np.int32).view(np.uint8).reshape(1, 4))
    _native.emu_tileloadd(1, np.full((1, 4), 127, np.int8).view(np.uint8))
    _native.emu_tileloadd(2, np.full((1, 4), 127, np.int8).view(np.uint8))
    _native.emu_tdpbssd(0, 1, 2)
    got = int(_native.emu_tilestored(0, 1, 4).view(np.int32)[0, 0])
    assert got == 2**31 - 10 + 4 * 127 * 127 - 2**32


def bf16_bits(values):
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def run_bf16(c0, a_bits, b_bits):
    """One TDPBF16PS with C [m, n] float32, A [m, 2k] bf16 bits, B [k, 2n] bf16 bits."""
    m, n = c0.shape
    k = a_bits.shape[1] // 2
    dp_setup(m, 4 * k, n)
    _native.emu_tileloadd(0, np.ascontiguousarray(c0, np.float32).view(np.uint8))
    _native.emu_tileloadd(1, np.ascontiguousarray(a_bits).view(np.uint8))
    _native.emu_tileloadd(2, np.ascontiguousarray(b_bits).view(np.uint8))
    _native.emu_tdpbf16ps(0, 1, 2)
    assert _native.emu_error() is None
    return _native.emu_tilestored(0, m, 4 * n).view(np.float32)


def test_tdpbf16ps_sequential_fp32_sums():
    rng = np.random.default_rng(1)
    a = bf16_bits(rng.standard_normal((16, 32)))
    b = bf16_bits(rng.standard_normal((16, 32)))
    c0 = rng.standard_normal((16, 16)).astype(np.float32)
    got = run_bf16(c0, a, b)
    af = a.view(ml_dtypes.bfloat16).astype(np.float32)
    bf = b.view(ml_dtypes.bfloat16).astype(np.float32).reshape(16, 16, 2)  # [k][n][pair]
    expect = c0.copy()
    for k in range(16):
        for i in range(2):
            expect = (expect + af[:, 2 * k + i][:, None] * bf[k, :, i][None, :]).astype(np.float32)
    assert np.array_equal(got, expect)


def test_tdpbf16ps_denormal_inputs_read_as_zero():
    denormal = np.array([[0x0001, 0x0000]], np.uint16)     # smallest bf16 subnormal, then +0
    big = bf16_bits([[2.0 ** 100, 0.0]])
    got = run_bf16(np.zeros((1, 1), np.float32), denormal, big)
    assert got[0, 0] == 0.0                                  # 2^-133 * 2^100 would be 2^-33


def test_tdpbf16ps_flushes_denormal_results():
    c0 = np.array([[2.0 ** -126]], np.float32)               # smallest normal
    a = bf16_bits([[2.0 ** -63, 0.0]])
    b = bf16_bits([[-(2.0 ** -64), 0.0]])
    got = run_bf16(c0, a, b)                                 # 2^-126 - 2^-127 = 2^-127: denormal
    assert got[0, 0] == 0.0 and not np.signbit(got[0, 0])


def test_tdpbf16ps_nan_propagates():
    got = run_bf16(np.zeros((1, 1), np.float32), np.array([[0x7FC0, 0]], np.uint16), bf16_bits([[1.0, 1.0]]))
    assert np.isnan(got[0, 0])


def test_tileloadd_honours_stride_and_zeroes_the_rest():
    _native.emu_ldtilecfg(config({3: (2, 8)}))
    src = np.arange(2 * 24, dtype=np.uint8).reshape(2, 24)     # stride 24, 8 bytes used per row
    _native.emu_tileloadd(3, src)
    assert np.array_equal(_native.emu_tilestored(3, 2, 8), src[:, :8])
    _native.emu_tilezero(3)
    assert not _native.emu_tilestored(3, 2, 8).any()


@pytest.mark.parametrize("cfg,message", [
    (config({0: (16, 64)}, palette=2), "palette 2"),
    (config({0: (16, 64)}, extra={5: 1}), "byte 5"),
    (config({0: (17, 64)}), "17 rows"),
    (config({0: (16, 68)}), "68 bytes"),
    (config({0: (16, 0)}), "has 16 rows but 0 bytes"),
    (config({9: (1, 4)}), "tile 9 does not exist"),
])
def test_bad_tile_config_is_reported(cfg, message):
    _native.emu_ldtilecfg(cfg)
    err = _native.emu_error()
    assert err is not None and message in err


def test_dot_product_shape_rules():
    _native.emu_ldtilecfg(config({0: (16, 64), 1: (16, 64), 2: (8, 64)}))
    _native.emu_tdpbssd(0, 1, 2)
    assert "A.colsb/4 = 16 but B has 8 rows" in _native.emu_error()
    _native.emu_reset()
    _native.emu_ldtilecfg(config({0: (16, 64), 1: (16, 64), 2: (16, 64)}))
    _native.emu_tdpbssd(0, 0, 2)
    assert "tiles must differ" in _native.emu_error()
    _native.emu_reset()
    _native.emu_ldtilecfg(config({0: (16, 64), 1: (16, 64)}))
    _native.emu_tdpbf16ps(0, 1, 5)
    assert "tmm5 is not configured" in _native.emu_error()


def test_unconfigured_use_is_an_error():
    _native.emu_tilezero(0)
    assert "not configured" in _native.emu_error()


def test_amx_and_amx_emu_kernels_come_from_one_source():
    binder = (INCLUDE / "kernels.h").read_text()
    body = (INCLUDE / "gemm_amx_tpl.h").read_text()
    emu, real = binder.split("/* ---- real AMX tiles ---- */")
    # the binder includes the one skeleton once per (format, binding), with no kernel code of its own
    formats = ("int8", "int4", "bf16", "fp8", "mxfp4", "mxfp4_a8", "int8_group", "int8_min")
    for part, prefix in ((emu, "amx_emu"), (real, "amx")):
        assert part.count('#include "gemm_amx_tpl.h"') == len(formats)
        for f in formats:
            assert f"#define KT_GEMM ktcy_gemm_{prefix}_{f}\n" in part
    assert "KT_TILE_DP_I8(c, a, b) ktcy_emu_tdpbssd" in emu and "KT_TILE_DP_I8(c, a, b) _tile_dpbssd" in real
    assert "#ifndef" not in body.split("\n#define", 1)[0]   # no include guard: meant to be included repeatedly
    # no other header calls tile operations: there is no second, hand-kept copy
    for header in INCLUDE.glob("*.h"):
        if header.name not in ("gemm_amx_tpl.h", "kernels.h"):
            assert "KT_TILE_" not in header.read_text(), header.name
    # and the build registered both bindings of each kernel
    names = {v["name"] for v in _native.variants()}
    assert {f"amx_emu_{f}" for f in formats} <= names
    if _native.build_info()["amx"]:
        assert {f"amx_{f}" for f in formats} <= names
