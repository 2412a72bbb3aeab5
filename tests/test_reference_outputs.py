"""Stored references: the numbers must not depend on the machine, the ISA or the code's shape.

gemm_reference_v1.npz holds kernels.linear outputs computed on the portable path by the build
before the format-descriptor redesign; moe_reference_v1.npz holds MoE.forward outputs computed
with isa="ref"; int4_asym_reference_v1.npz both for INT4_ZP and INT4_MIN, int8_group_reference_v1.npz
for INT8_GROUP, INT8_MIN and layers whose down has its own format (reference_data.py).  Integer formats must match them bit for bit on every ISA this host runs plus
amx_emu (so a file made on an AVX-512 host checks an AVX2-only one, and the other way round);
BF16/FP8 within 1e-6."""
import numpy as np
import pytest

import ktcy
from conftest import runnable_variants
from ktcy import kernels
from reference_data import (ASYM_CASES, ASYM_REFERENCE, GEMM_REFERENCE, GEMM_SHAPES, INT8_GROUP_CASES,
                            INT8_GROUP_REFERENCE, INT8_MIN_CASES, INT8_MIN_REFERENCE, MIXED_LAYER, MIXED_LAYER_Q5_K_M,
                            MOE_REFERENCE, MOE_SHAPE, formula, moe_inputs)

GEMM_CASES = [("INT8", 0), ("INT4", 32), ("INT4", 64), ("INT4", 128), ("BF16", 0), ("FP8_PERCHANNEL", 0),
              ("FP8_BLOCK", 0)]


@pytest.mark.parametrize("fmt,group", GEMM_CASES)
@pytest.mark.parametrize("i", range(len(GEMM_SHAPES)))
def test_gemm_matches_stored_reference_on_every_variant(fmt, group, i):
    m, n, k = GEMM_SHAPES[i]
    expect = np.load(GEMM_REFERENCE)[f"Y{i}_{fmt}_{group}"]
    packed = kernels.pack(formula((n, k), 10 + i, 1.0), fmt, group_size=group or 64)
    X = formula((m, k), 20 + i, 1.0)
    variants = runnable_variants(fmt)
    assert any(v.endswith("_ref") for v in variants) and any(v.startswith("amx_emu") for v in variants)
    for v in variants:
        y = kernels.linear_variant(X, packed, v)
        if fmt in ("INT8", "INT4"):
            assert np.array_equal(y, expect), v
        else:
            assert np.max(np.abs(y - expect)) <= 1e-6 * np.max(np.abs(expect)), v


def moe_isas():
    return [isa for isa in ktcy.available_isas() if isa != "amx"] + ["amx_emu"]


@pytest.mark.parametrize("fmt,group", [("INT8", 64), ("INT4", 32), ("INT4", 128)])
def test_moe_integer_formats_match_the_portable_reference_on_every_isa(fmt, group):
    gate, up, down, x, ids, w = moe_inputs()
    expect = np.load(MOE_REFERENCE)[f"{fmt}_{group}"]
    s = MOE_SHAPE
    isas = moe_isas()
    assert {"ref", "amx_emu"} <= set(isas)
    for isa in isas:
        cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(fmt, group_size=group), isa=isa)
        layer = ktcy.MoE.from_weights(cfg, gate, up, down)
        for T in (s["T"], 1):
            assert np.array_equal(layer.forward(x[:T], ids[:T], w[:T]), expect[:T]), (isa, T)


@pytest.mark.parametrize("fmt,group", ASYM_CASES + INT8_GROUP_CASES + INT8_MIN_CASES)
def test_asymmetric_int4_matches_its_stored_reference_on_every_variant_and_isa(fmt, group):
    stored = np.load({"INT8_GROUP": INT8_GROUP_REFERENCE, "INT8_MIN": INT8_MIN_REFERENCE}.get(fmt, ASYM_REFERENCE))
    for i, (m, n, k) in enumerate(GEMM_SHAPES):
        packed = kernels.pack(formula((n, k), 10 + i, 1.0), fmt, group_size=group)
        X = formula((m, k), 20 + i, 1.0)
        for v in runnable_variants(fmt):
            assert np.array_equal(kernels.linear_variant(X, packed, v), stored[f"Y{i}_{fmt}_{group}"]), (v, i)
    gate, up, down, x, ids, w = moe_inputs()
    s = MOE_SHAPE
    for isa in moe_isas():
        cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(fmt, group_size=group), isa=isa)
        assert np.array_equal(ktcy.MoE.from_weights(cfg, gate, up, down).forward(x, ids, w),
                              stored[f"MOE_{fmt}_{group}"]), isa


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_swiglu_gives_the_same_bits_on_every_isa(isa):
    if isa not in ktcy.available_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    g = np.concatenate([formula((20000,), 7, 30.0),
                        np.array([0, -0.0, 88, -88, 200, -200, 1e-40, 80, -80, 3e38, -3e38], np.float32)])
    u = formula(g.shape, 8, 2.0)
    ref = ktcy._native.swiglu("ref", g, u)
    assert np.array_equal(ktcy._native.swiglu(isa, g, u).view(np.uint32), ref.view(np.uint32))
    with np.errstate(over="ignore"):
        exact = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    inside = np.abs(g) < 80
    assert np.max(np.abs(ref[inside] - exact[inside]) / np.maximum(np.abs(exact[inside]), 1e-30)) < 1e-5
    nan = ktcy._native.swiglu(isa, np.array([np.nan], np.float32), np.ones(1, np.float32))
    assert np.isnan(nan).all()


@pytest.mark.parametrize("layer,reference", [(MIXED_LAYER, INT8_GROUP_REFERENCE), (MIXED_LAYER_Q5_K_M, INT8_MIN_REFERENCE)],
                         ids=["Q4_K_M", "Q5_K_M"])
def test_a_layer_with_down_in_its_own_format_matches_its_stored_reference_on_every_isa(layer, reference):
    stored = np.load(reference)["MOE_MIXED"]
    gate, up, down, x, ids, w = moe_inputs()
    s = MOE_SHAPE
    (gu, gu_group), (dn, dn_group) = layer
    for isa in moe_isas():
        cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(gu, group_size=gu_group), isa=isa,
                             down_quant_config=ktcy.QuantConfig(dn, group_size=dn_group))
        assert np.array_equal(ktcy.MoE.from_weights(cfg, gate, up, down).forward(x, ids, w), stored), isa
