"""MoE.forward / forward_slots with torch tensors: CPU float32 and bfloat16 read in place, results
of the caller's kind and dtype, out= tensors, tensors that require grad.  (CI installs torch; the
numpy core never imports it.)"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ktcy

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")

E, K_TOP, H, I = 5, 2, 96, 64


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(11)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    return ktcy.MoE.from_weights(ktcy.MoeConfig(E, K_TOP, H, I, ktcy.QuantConfig("INT8")), gate, up, down)


def inputs(T=6):
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K_TOP, replace=False) for _ in range(T)])
    w = rng.random((T, K_TOP)).astype(np.float32)
    return x, ids, w


def test_float32_tensors_give_the_numpy_result(layer):
    x, ids, w = inputs()
    ref = layer.forward(x, ids, w)
    y = layer.forward(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (6, H)
    assert np.array_equal(y.numpy(), ref)
    y32 = layer.forward(torch.from_numpy(x), torch.from_numpy(ids).to(torch.int32), torch.from_numpy(w))
    assert np.array_equal(y32.numpy(), ref)


def test_bfloat16_tensors_are_read_as_their_16_bit_words(layer):
    x, ids, w = inputs()
    xb = torch.from_numpy(x).to(torch.bfloat16)
    ref = layer.forward(x.astype(ml_dtypes.bfloat16), ids, w)        # the numpy bf16 path
    y = layer.forward(xb, torch.from_numpy(ids), torch.from_numpy(w).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    ref_w = layer.forward(x.astype(ml_dtypes.bfloat16), ids, w.astype(ml_dtypes.bfloat16))
    assert np.array_equal(y.float().numpy(), torch.from_numpy(ref_w).to(torch.bfloat16).float().numpy())
    assert np.abs(y.float().numpy() - ref).max() <= np.abs(ref).max() * 2 ** -7


def test_float16_tensors_give_float16_results(layer):
    """README: float16 hidden states are read in place and the result has x's dtype."""
    x, ids, w = inputs()
    x16 = torch.from_numpy(x).to(torch.float16)
    y = layer.forward(x16, torch.from_numpy(ids), torch.from_numpy(w))
    assert y.dtype == torch.float16 and y.shape == (6, H)
    ref = layer.forward(x16.numpy(), ids, w)  # the numpy float16 path, the same values
    assert torch.equal(y, torch.from_numpy(ref).to(torch.float16))
    out = torch.zeros((6, H), dtype=torch.float16)
    assert layer.forward(x16, ids, w, out=out) is out and torch.equal(out, y)


def test_a_tensor_that_requires_grad_and_a_strided_one(layer):
    x, ids, w = inputs()
    xt = torch.from_numpy(x).requires_grad_(True)
    y = layer.forward(xt, torch.from_numpy(ids), torch.from_numpy(w))
    assert not y.requires_grad and np.array_equal(y.numpy(), layer.forward(x, ids, w))
    wide = torch.zeros(6, 2 * H)
    wide[:, ::2] = torch.from_numpy(x)
    assert np.array_equal(layer.forward(wide[:, ::2], ids, w).numpy(), layer.forward(x, ids, w))


def test_out_tensors(layer):
    x, ids, w = inputs()
    ref = layer.forward(x, ids, w)
    out = torch.full((6, H), 3.0)
    assert layer.forward(torch.from_numpy(x), ids, w, out=out) is out
    assert np.array_equal(out.numpy(), ref)
    out16 = torch.zeros((6, H), dtype=torch.bfloat16)
    assert layer.forward(x, ids, w, out=out16) is out16
    assert torch.equal(out16, torch.from_numpy(ref).to(torch.bfloat16))
    slots = torch.empty((6, K_TOP, H))
    assert layer.forward_slots(torch.from_numpy(x), ids, w, out=slots) is slots
    assert np.array_equal(slots.numpy(), layer.forward_slots(x, ids, w))
    for bad in (torch.zeros((6, H + 1)), torch.zeros((6, H), dtype=torch.int32),
                torch.zeros((6, H), requires_grad=True)):
        with pytest.raises(ValueError, match="out"):
            layer.forward(x, ids, w, out=bad)


def test_id_minus_one_in_a_tensor(layer):
    x, ids, w = inputs()
    ids[:, 1] = -1
    y = layer.forward(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w))
    assert np.array_equal(y.numpy(), layer.forward(x, ids[:, :1].repeat(2, 1), np.pad(w[:, :1], ((0, 0), (0, 1)))))


def test_the_numpy_core_does_not_import_torch():
    code = ("import sys, numpy as np, ktcy\n"
            "m = ktcy.MoE.from_weights(ktcy.MoeConfig(2, 1, 64, 64), *(np.ones((2, 64, 64), np.float32),) * 3)\n"
            "m.forward(np.ones((1, 64), np.float32), np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensors_numpy_cannot_view_are_refused_by_name(layer):
    x, ids, w = inputs()
    with pytest.raises(TypeError, match="x is a torch.float8_e4m3fn tensor"):
        layer.forward(torch.from_numpy(x).to(torch.float8_e4m3fn), ids, w)
    with pytest.raises(TypeError, match="topk_weights is a torch.float8_e5m2 tensor"):
        layer.forward(x, ids, torch.from_numpy(w).to(torch.float8_e5m2))
