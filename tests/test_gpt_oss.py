"""GPT-OSS as released: MXFP4 expert blocks with interleaved gate/up and biases, the router with
bias (softmax over the top-k logits) and the clamped SwiGLU, against a float64 numpy version of
GPT-OSS's block written here; every ISA; convert -> load bit-exact; refusals."""
import json
import os

import numpy as np
import pytest

import ktcy
from checkpoints import make_gpt_oss_checkpoint
from ktcy.convert import convert
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write

E, H, I, K = 8, 128, 96, 4
LIMIT = 0.8  # small enough that the clamps act on these weights (checked below)
ALPHA = 1.702


class Quiet:
    def bar(self, *a):
        pass

    def line(self, text):
        pass


def experts_reference(x, ids, w, t, limit=LIMIT, stats=None):
    """float64: per chosen expert, gate/up with biases, g = min(gate, limit), u = clip(up, ±limit),
    (u + 1) * g * sigmoid(alpha * g), then down with bias, weighted by the routing weights."""
    out = np.zeros((x.shape[0], H))
    xd = x.astype(np.float64)
    for r in range(x.shape[0]):
        for j, e in enumerate(ids[r]):
            gate = t["gate"][e] @ xd[r] + t["gate_bias"][e]
            up = t["up"][e] @ xd[r] + t["up_bias"][e]
            if stats is not None:
                stats.append((gate > limit).mean() + (np.abs(up) > limit).mean())
            g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
            act = (u + 1) * g / (1 + np.exp(-ALPHA * g))
            out[r] += w[r, j] * (t["down"][e] @ act + t["down_bias"][e])
    return out


def router_reference(x, t):
    logits = x.astype(np.float64) @ t["router"].T + t["router_bias"]
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(logits, ids, axis=1)
    p = np.exp(top - top.max(axis=1, keepdims=True))
    return ids, p / p.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_gpt_oss_checkpoint(path, E=E, H=H, I=I, top_k=K, swiglu_limit=LIMIT)


def test_experts_load_as_mxfp4_with_exact_codes(checkpoint):
    path, truth = checkpoint
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "MXFP4"
    assert (moe.config.activation, moe.config.swiglu_limit, moe.config.swiglu_alpha) == ("gpt_oss", LIMIT, ALPHA)
    for proj in ("gate", "up", "down"):
        for e in range(E):
            assert np.array_equal(getattr(moe, proj)[e].dequantize(), truth[1][proj][e]), (proj, e)


def test_block_matches_float64_gpt_oss(checkpoint):
    path, truth = checkpoint
    block = ktcy.MoEModel.from_pretrained(path).blocks["model.layers.0.mlp.experts"]
    assert block.router.kind == "gpt_oss" and block.shared is None
    x = np.random.default_rng(5).standard_normal((7, H)).astype(np.float32)
    t = truth[0]
    ids_ref, w_ref = router_reference(x, t)
    ids, w = block.route(x)
    assert np.array_equal(ids, ids_ref)
    assert np.allclose(w, w_ref, rtol=1e-5, atol=1e-6) and np.allclose(w.sum(axis=1), 1)
    stats = []
    ref = experts_reference(x, ids_ref, w_ref, t, stats=stats)
    assert np.mean(stats) > 0.05  # the clamps are exercised
    y = block.forward(x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3  # bf16 activations


def test_every_isa_runs_the_layer(checkpoint):
    path, truth = checkpoint
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(5)])
    w = rng.random((5, K)).astype(np.float32)
    ref = experts_reference(x, ids, w, truth[1])
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        y = ktcy.load_experts(path, 1, isa=isa).forward(x, ids, w)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3, isa


def test_mxfp4_a8_keeps_the_released_codes_on_every_isa(checkpoint, caplog):
    """method="MXFP4_A8": the same codes and exponents as stored (no dequantize-and-quantize
    warning), the same bits on every ISA (integer kernels), within the int8 activations' error."""
    path, truth = checkpoint
    stored = ktcy.load_experts(path, 1)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(5)])
    w = rng.random((5, K)).astype(np.float32)
    ref = experts_reference(x, ids, w, truth[1])
    outs = []
    for isa in [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]:
        moe = ktcy.load_experts(path, 1, method="MXFP4_A8", isa=isa)
        assert moe.format == "MXFP4_A8"
        for proj in ("gate", "up", "down"):
            for e in range(E):
                kept, held = getattr(moe, proj)[e], getattr(stored, proj)[e]
                assert np.array_equal(kept.codes(), held.codes()), (proj, e)
                assert np.array_equal(kept.block_exponents(), held.block_exponents()), (proj, e)
        outs.append(moe.forward(x, ids, w))
        assert np.linalg.norm(outs[-1] - ref) / np.linalg.norm(ref) < 2.5e-2, isa
    assert all(np.array_equal(outs[0], y) for y in outs)
    assert not [r for r in caplog.records if "quantizes it again" in r.getMessage()]


def test_default_activation_settings_without_config_values(tmp_path):
    make_gpt_oss_checkpoint(tmp_path, E=4, H=64, I=32, top_k=2, num_layers=1)
    cfg = ktcy.load_experts(tmp_path, 0).config
    assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) == ("gpt_oss", 1.702, 7.0)


@pytest.mark.parametrize("method", [None, "INT8", "MXFP4_A8"])
def test_convert_round_trip_is_bit_exact(checkpoint, tmp_path, method):
    path, truth = checkpoint
    out = tmp_path / "packed"
    assert convert(path, out, method=method, progress=Quiet()) == [0, 1]
    meta = SafetensorsFile(str(out / "ktcy_layer_0001.safetensors")).metadata
    assert (meta["activation"], float(meta["swiglu_alpha"]), float(meta["swiglu_limit"]), meta["bias"]) \
        == ("gpt_oss", ALPHA, LIMIT, "down,gate,up")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(9)])
    w = rng.random((9, K)).astype(np.float32)
    packed, original = ktcy.load_experts(out, 1), ktcy.load_experts(path, 1, method=method)
    assert packed.format == (method or "MXFP4") and packed.config.activation == "gpt_oss"
    assert np.array_equal(packed.forward(x, ids, w), original.forward(x, ids, w))
    del packed  # the mapped file stays checked while the layer lives, and closes after


def test_other_formats_dequantize_exactly_first(checkpoint):
    path, truth = checkpoint
    import ml_dtypes
    moe = ktcy.load_experts(path, 1, method="BF16")
    assert np.array_equal(moe.gate[3].dequantize(), truth[1]["gate"][3].astype(ml_dtypes.bfloat16).astype(np.float64))
    assert moe.config.activation == "gpt_oss" and moe.bias is not None


def _rewrite(path, edit):
    f = SafetensorsFile(str(path / "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    edit(tensors)
    os.remove(path / "model.safetensors")
    write(str(path / "model.safetensors"), tensors, {"format": "pt"})


P = "model.layers.0.mlp"
TAMPERED = {
    "scales_shape": (lambda t: t.__setitem__(f"{P}.experts.gate_up_proj_scales", t[f"{P}.experts.gate_up_proj_scales"][:, :, :1]),
                     "gate_up_proj_scales"),
    "blocks_missing": (lambda t: t.pop(f"{P}.experts.gate_up_proj_blocks"), "gate_up_proj"),
    "nan_exponent": (lambda t: t[f"{P}.experts.gate_up_proj_scales"].__setitem__((1, 2, 0), 255),
                     "gate_up_proj_scales"),
    "bias_shape": (lambda t: t.__setitem__(f"{P}.experts.gate_up_proj_bias", t[f"{P}.experts.gate_up_proj_bias"][:, :-2]),
                   "gate_up_proj_bias"),
    "router_bias_missing": (lambda t: t.pop(f"{P}.router.bias"), "router.bias"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_tampered_checkpoints_are_refused(tmp_path, case):
    make_gpt_oss_checkpoint(tmp_path, E=4, H=64, I=32, top_k=2, num_layers=1)
    edit, named = TAMPERED[case]
    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=named):
        ktcy.MoEModel.from_pretrained(tmp_path)


def test_run_block_cli(checkpoint, tmp_path):
    import subprocess
    import sys
    path, truth = checkpoint
    h = np.random.default_rng(8).standard_normal((3, H)).astype(np.float32)
    np.save(tmp_path / "h.npy", h)
    r = subprocess.run([sys.executable, "-m", "ktcy", "run-block", str(path), "--layer", "1", "--input",
                        str(tmp_path / "h.npy"), "--output", str(tmp_path / "y.npy")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "MXFP4" in r.stdout
    ids, w = router_reference(h, truth[1])
    ref = experts_reference(h, ids, w, truth[1])
    y = np.load(tmp_path / "y.npy")
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3


def test_bf16_gpt_oss_layout(tmp_path):
    """GPT-OSS dequantized to BF16 keeps [E, H, 2I] gate_up_proj (in x out, interleaved) and
    [E, I, H] down_proj: read as the same weights."""
    import ml_dtypes
    truth = make_gpt_oss_checkpoint(tmp_path / "mx", E=4, H=64, I=32, top_k=2, num_layers=1, swiglu_limit=LIMIT)[0]
    gu = np.empty((4, 64, 64))
    gu[:, :, 0::2], gu[:, :, 1::2] = truth["gate"].transpose(0, 2, 1), truth["up"].transpose(0, 2, 1)
    f = SafetensorsFile(str(tmp_path / "mx" / "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys() if "_blocks" not in k and "_scales" not in k}
    tensors[f"{P}.experts.gate_up_proj"] = gu.astype(ml_dtypes.bfloat16)
    tensors[f"{P}.experts.down_proj"] = truth["down"].transpose(0, 2, 1).astype(ml_dtypes.bfloat16)
    os.makedirs(tmp_path / "bf16")
    write(str(tmp_path / "bf16" / "model.safetensors"), tensors, {"format": "pt"})
    cfg = json.loads((tmp_path / "mx" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    moe = ktcy.load_experts(tmp_path / "bf16", 0)
    assert moe.format == "BF16" and moe.config.activation == "gpt_oss"
    for proj in ("gate", "up", "down"):
        assert np.array_equal(getattr(moe, proj)[1].dequantize(), truth[proj][1]), proj
    x = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)
    ids, w = np.array([[0, 1], [2, 3], [1, 3], [0, 2]]), np.full((4, 2), 0.5, np.float32)
    assert np.array_equal(moe.forward(x, ids, w), ktcy.load_experts(tmp_path / "mx", 0, method="BF16").forward(x, ids, w))


@pytest.mark.parametrize("case", ["no_bias_tensors", "bad_activation", "bad_alpha", "bad_bias_list"])
def test_converted_block_settings_are_checked(checkpoint, tmp_path, case):
    path, _ = checkpoint
    out = tmp_path / "packed"
    convert(path, out, layers="1", progress=Quiet())
    layer = str(out / "ktcy_layer_0001.safetensors")
    f = SafetensorsFile(layer)
    tensors, meta = {k: np.array(f.get(k)) for k in f.keys()}, dict(f.metadata)
    del f
    if case == "no_bias_tensors":  # the metadata still lists them: refused, not run without biases
        tensors = {k: v for k, v in tensors.items() if not k.endswith(".bias")}
        match = "bias"
    elif case == "bad_activation":
        meta["activation"] = "relu"
        match = "activation"
    elif case == "bad_alpha":
        meta["swiglu_alpha"] = "x"
        match = "swiglu_alpha"
    else:
        meta["bias"] = "gate,side"
        match = "bias"
    os.remove(layer)
    write(layer, tensors, meta)
    with pytest.raises(CheckpointError, match=match):
        ktcy.load_experts(out, 1)


def test_hf_fp8_export_refuses_gpt_oss(checkpoint, tmp_path):
    from ktcy.output_guard import ConvertError
    from ktcy.hf_fp8 import convert_to_hf_fp8
    src = tmp_path / "bf16"
    os.makedirs(src)
    path, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    f = SafetensorsFile(str(path / "model.safetensors"))
    write(str(src / "model.safetensors"), {k: np.array(f.get(k)) for k in f.keys()}, {"format": "pt"})
    with pytest.raises(ConvertError, match="GPT-OSS"):
        convert_to_hf_fp8(src, tmp_path / "fp8", progress=Quiet())


def test_injected_int8_backend_keeps_biases_and_activation(checkpoint):
    path, truth = checkpoint
    model = ktcy.MoEModel.from_pretrained(path, layers=[1])
    assert model.inject_expert_backend(r"model\.layers\.1\.", "AMXINT8") == ["model.layers.1.mlp.experts"]
    block = model.blocks["model.layers.1.mlp.experts"]
    assert block.experts.format == "INT8" and block.experts.config.activation == "gpt_oss"
    x = np.random.default_rng(10).standard_normal((6, H)).astype(np.float32)
    ids, w = router_reference(x, truth[1])
    ref = experts_reference(x, ids, w, truth[1])
    assert np.linalg.norm(block.forward(x) - ref) / np.linalg.norm(ref) < 0.03  # int8 weights and activations
