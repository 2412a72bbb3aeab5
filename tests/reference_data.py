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


def int8_group_reference_arrays():
    """_stored_arrays for INT8_GROUP_CASES, plus "MOE_MIXED": MoE.forward of MIXED_LAYER on the
    portable kernels."""
    import ktcy
    out = _stored_arrays(INT8_GROUP_CASES, "int8_group_ref")
    gate, up, down, x, ids, w = moe_inputs()
    s = MOE_SHAPE
    (gu, gu_group), (dn, dn_group) = MIXED_LAYER
    cfg = ktcy.MoeConfig(s["E"], s["k"], s["H"], s["I"], ktcy.QuantConfig(gu, group_size=gu_group), isa="ref",
                         down_quant_config=ktcy.QuantConfig(dn, group_size=dn_group))
    out["MOE_MIXED"] = ktcy.MoE.from_weights(cfg, gate, up, down).forward(x, ids, w)
    return out


if __name__ == "__main__":  # python tests/reference_data.py [asym|int8_group]: writes that file
    import sys
    which = sys.argv[1] if len(sys.argv) > 1 else "asym"
    if which == "asym":
        np.savez(ASYM_REFERENCE, **asym_reference_arrays())
    else:
        np.savez(INT8_GROUP_REFERENCE, **int8_group_reference_arrays())
