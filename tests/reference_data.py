"""Deterministic inputs for the stored-reference tests, from integer formulas (no RNG whose
stream could change between numpy versions), and the stored outputs' file names."""
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
GEMM_REFERENCE = DATA / "gemm_reference_v1.npz"   # kernels.linear outputs before the descriptor redesign
MOE_REFERENCE = DATA / "moe_reference_v1.npz"     # MoE.forward outputs on the portable path (isa="ref")
# the asymmetric INT4 formats' kernels.linear and MoE.forward outputs on the portable path, made
# by asym_reference_arrays() (python tests/reference_data.py) when INT4_MIN came in, 2026-12-07
ASYM_REFERENCE = DATA / "int4_asym_reference_v1.npz"
ASYM_CASES = [("INT4_ZP", 32), ("INT4_ZP", 128), ("INT4_MIN", 32), ("INT4_MIN", 128)]
# INT8_GROUP's outputs the same way, and a layer whose down has its own format (Q4_K_M's pair),
# made by int8_group_reference_arrays() when they came in, 2026-12-07
INT8_GROUP_REFERENCE = DATA / "int8_group_reference_v1.npz"
INT8_GROUP_CASES = [("INT8_GROUP", 16), ("INT8_GROUP", 128)]
MIXED_LAYER = (("INT4_MIN", 32), ("INT8_GROUP", 16))  # gate and up, down
# INT8_MIN's, and Q5_K_M's pair, made by int8_min_reference_arrays() when it came in, 2026-12-08
INT8_MIN_REFERENCE = DATA / "int8_min_reference_v1.npz"
INT8_MIN_CASES = [("INT8_MIN", 16), ("INT8_MIN", 32)]
MIXED_LAYER_Q5_K_M = (("INT8_MIN", 32), ("INT8_GROUP", 16))
GEMM_SHAPES = [(1, 40, 200), (17, 72, 300), (33, 48, 520)]

MOE_SHAPE = dict(E=5, k=3, H=136, I=48, T=9)      # H, I not multiples of 64; expert 4 gets no token


def formula(shape, seed, scale):
    """A fixed pseudo-random array in [-scale, scale] from integer arithmetic."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    v = ((i * 7919 + seed * 104729) ** 2 + i * 31) % 20011
    return (v.astype(np.float64) / 10005.5 - 1.0).astype(np.float32).reshape(shape) * np.float32(scale)


def moe_inputs():
    s = MOE_SHAPE
    gate = formula((s["E"], s["I"], s["H"]), 1, 0.05)
    up = formula((s["E"], s["I"], s["H"]), 2, 0.05)
    down = formula((s["E"], s["H"], s["I"]), 3, 0.05)
    x = formula((s["T"], s["H"]), 4, 1.0)
    ids = (np.arange(s["T"] * s["k"]).reshape(s["T"], s["k"]) * 7) % (s["E"] - 1)
    ids[0] = [0, 0, 1]  # a repeated id
    weights = formula((s["T"], s["k"]), 5, 0.5) + np.float32(0.5)
    return gate, up, down, x, ids.astype(np.int64), weights


def _stored_arrays(cases, variant):
    """{"Y{i}_{fmt}_{group}": kernels.linear on GEMM_SHAPES[i], "MOE_{fmt}_{group}": MoE.forward on
    moe_inputs()} for `cases`, on the portable kernels (`variant`), from weights quantized by ktcy."""
    import ktcy
    from ktcy import kernels
    out = {}
    gate, up, down, x, ids, w = moe_inputs()
    s = MOE_SHAPE
    for fmt, group in cases:
        for i, (m, n, k) in enumerate(GEMM_SHAPES):
            packed = kernels.pack(formula((n, k), 10 + i, 1.0), fmt, group_size=group)
            out[f"Y{i}_{fmt}_{group}"] = kernels.linear_variant(formula((m, k), 20 + i, 1.0), packed, variant)
        cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(fmt, group_size=group), isa="ref")
        out[f"MOE_{fmt}_{group}"] = ktcy.MoE.from_weights(cfg, gate, up, down).forward(x, ids, w)
    return out


def asym_reference_arrays():
    return _stored_arrays(ASYM_CASES, "int4_ref")


def _mixed_layer_output(layer):
    """MoE.forward on moe_inputs() of a layer (gate and up, down) = ((format, group), (format,
    group)) on the portable kernels."""
    import ktcy
    gate, up, down, x, ids, w = moe_inputs()
    s = MOE_SHAPE
    (gu, gu_group), (dn, dn_group) = layer
    cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(gu, group_size=gu_group), isa="ref",
                         down_quant_config=ktcy.QuantConfig(dn, group_size=dn_group))
    return ktcy.MoE.from_weights(cfg, gate, up, down).forward(x, ids, w)


def int8_group_reference_arrays():
    """_stored_arrays for INT8_GROUP_CASES, plus "MOE_MIXED": MoE.forward of MIXED_LAYER on the
    portable kernels."""
    return dict(_stored_arrays(INT8_GROUP_CASES, "int8_group_ref"), MOE_MIXED=_mixed_layer_output(MIXED_LAYER))


def int8_min_reference_arrays():
    """_stored_arrays for INT8_MIN_CASES, plus "MOE_MIXED": MoE.forward of MIXED_LAYER_Q5_K_M."""
    return dict(_stored_arrays(INT8_MIN_CASES, "int8_group_ref"), MOE_MIXED=_mixed_layer_output(MIXED_LAYER_Q5_K_M))


if __name__ == "__main__":  # python tests/reference_data.py [asym|int8_group|int8_min]: writes that file
    import sys
    which = sys.argv[1] if len(sys.argv) > 1 else "asym"
    made = {"asym": (ASYM_REFERENCE, asym_reference_arrays), "int8_group": (INT8_GROUP_REFERENCE, int8_group_reference_arrays),
            "int8_min": (INT8_MIN_REFERENCE, int8_min_reference_arrays)}
    path, arrays = made[which]
    np.savez(path, **arrays())
