"""MoE layers beyond the plain SwiGLU: expert biases, GPT-OSS's clamped activation, and codes as
released (INT4 / INT4_ZP / MXFP4 spec dicts) through from_experts."""
import numpy as np
import pytest

import ktcy
from conftest import bf16_round
from ktcy import _native, kernels
from reference_data import formula

E, K_TOP, H, I = 4, 2, 160, 96


def isas():
    return [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_clamped_glu_gives_the_same_bits_on_every_isa(isa):
    if isa not in ktcy.available_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    g = np.concatenate([formula((20000,), 3, 12.0), np.array([0, -0.0, 7, 7.5, -7.5, 100, -100, np.inf], np.float32)])
    u = np.concatenate([formula((20000,), 4, 12.0), np.array([1, 2, -8, 8, 0.5, 3, 9, 1], np.float32)])
    ref = _native.swiglu("ref", g, u, "gpt_oss", 1.702, 7.0)
    assert np.array_equal(_native.swiglu(isa, g, u, "gpt_oss", 1.702, 7.0).view(np.uint32), ref.view(np.uint32))
    gc, uc = np.minimum(g, 7.0).astype(np.float64), np.clip(u, -7.0, 7.0).astype(np.float64)
    with np.errstate(over="ignore"):
        exact = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
    inside = np.isfinite(g) & (np.abs(g) < 40)
    assert np.max(np.abs(ref[inside] - exact[inside]) / np.maximum(np.abs(exact[inside]), 1e-30)) < 1e-5


def layer_inputs(seed=1):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    bias = {"gate": rng.standard_normal((E, I), np.float32), "up": rng.standard_normal((E, I), np.float32),
            "down": rng.standard_normal((E, H), np.float32) * 0.1}
    x = rng.standard_normal((7, H)).astype(np.float32) * 2
    ids = np.array([[0, 1], [2, 3], [1, 1], [3, 0], [2, 0], [0, 3], [1, 2]])
    w = rng.random((7, K_TOP)).astype(np.float32)
    return gate, up, down, bias, x, ids, w


def reference(layer, bias, x, ids, w, activation):
    dq = {n: [getattr(layer, n)[e].dequantize() for e in range(E)] for n in ("gate", "up", "down")}
    xb = bf16_round(x).astype(np.float64)
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g = xb[t] @ dq["gate"][e].T + bias["gate"][e]
            u = xb[t] @ dq["up"][e].T + bias["up"][e]
            if activation == "gpt_oss":
                gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                h = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
            else:
                h = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * (bf16_round(h.astype(np.float32)).astype(np.float64) @ dq["down"][e].T
                                 + bias["down"][e])
    return out


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_biases_and_activation_match_float64_on_every_isa(activation):
    gate, up, down, bias, x, ids, w = layer_inputs()
    for isa in isas():
        cfg = ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("BF16"), isa=isa, activation=activation)
        layer = ktcy.MoE.from_weights(cfg, gate, up, down, bias=bias)
        y = layer.forward(x, ids, w)
        exact = reference(layer, bias, x, ids, w, activation)
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 4e-3, isa


def test_int8_with_biases_and_clamped_glu_is_identical_on_every_isa():
    gate, up, down, bias, x, ids, w = layer_inputs(2)
    outs = []
    for isa in isas():
        cfg = ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("INT8"), isa=isa, activation="gpt_oss",
                             swiglu_alpha=1.5, swiglu_limit=5.0)
        outs.append(ktcy.MoE.from_weights(cfg, gate, up, down, bias=bias).forward(x, ids, w))
    assert all(np.array_equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("bad", [{"gate": np.zeros((E, I + 1), np.float32)}, {"down": np.zeros((E, I), np.float32)},
                                 {"other": np.zeros((E, I), np.float32)}, {"up": np.full((E, I), np.nan, np.float32)}])
def test_bad_biases_are_refused(bad):
    gate, up, down, *_ = layer_inputs()
    with pytest.raises(ValueError, match="bias"):
        ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("BF16")), gate, up, down, bias=bad)


def test_bad_activation_config_is_refused():
    with pytest.raises(ValueError, match="activation"):
        ktcy.MoeConfig(E, K_TOP, H, I, activation="gelu")
    with pytest.raises(ValueError, match="swiglu_limit"):
        ktcy.MoeConfig(E, K_TOP, H, I, activation="gpt_oss", swiglu_limit=float("nan"))


def released_experts(kind, seed=3):
    """expert(e) returning codes as released with their spec dicts, and the float64 weights they mean."""
    rng = np.random.default_rng(seed)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    store, exact = {}, {}
    for e in range(E):
        for proj, (n, k) in shapes.items():
            if kind == "MXFP4":
                codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
                exps = rng.integers(118, 124, (n, -(-k // 32))).astype(np.uint8)
                spec = {"format": "MXFP4", "exponents": exps}
                value = kernels.E2M1_VALUES[codes] * np.exp2(np.repeat(exps.astype(np.float64), 32, axis=1)[:, :k] - 127)
            else:
                g = 32
                scale = rng.uniform(0.001, 0.01, (n, k // g)).astype(np.float32)
                if kind == "INT4":
                    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
                    spec = {"format": "INT4", "scale": scale, "group_size": g}
                    zero = np.zeros_like(scale)
                else:
                    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
                    zero = rng.integers(0, 16, (n, k // g)).astype(np.uint8)
                    spec = {"format": "INT4_ZP", "scale": scale, "zero_points": zero, "group_size": g}
                rep = lambda a: np.repeat(a.astype(np.float64), g, axis=1)  # noqa: E731
                value = (codes.astype(np.float64) - rep(zero)) * rep(scale)
            store[e, proj] = (codes, spec)
            exact[e, proj] = value
    return (lambda e: {p: store[e, p] for p in shapes}), exact


@pytest.mark.parametrize("kind,target", [("INT4_ZP", "INT4_ZP"), ("INT4", "INT4"), ("INT4", "INT4_ZP"),
                                         ("MXFP4", "MXFP4"), ("INT4_ZP", "BF16"), ("MXFP4", "BF16"),
                                         ("INT4", "INT4_MIN"), ("INT4_ZP", "INT4_MIN")])
def test_codes_as_released_are_packed_as_stored_or_converted(kind, target):
    expert, exact = released_experts(kind)
    cfg = ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig(target, group_size=32))
    layer = ktcy.MoE.from_experts(cfg, expert)
    for e in range(E):
        got = layer.gate[e].dequantize()
        # INT4 in INT4_ZP (z = 8) and in INT4_MIN (min = -8 s) exactly; INT4_ZP's -z s rounds in float32
        if target == kind or (kind, target) in (("INT4", "INT4_ZP"), ("INT4", "INT4_MIN")):
            assert np.array_equal(got, exact[e, "gate"])  # the released weights, bit for bit
        elif (kind, target) == ("INT4_ZP", "INT4_MIN"):
            assert np.array_equal(layer.gate[e].codes(), expert(e)["gate"][0])  # the codes as released
            assert np.abs(got - exact[e, "gate"]).max() <= np.abs(exact[e, "gate"]).max() * 2 ** -22
        else:
            assert np.abs(got - exact[e, "gate"]).max() <= np.abs(exact[e, "gate"]).max() * 2 ** -8
