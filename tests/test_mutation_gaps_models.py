"""Behaviour that a second round of mutation testing found unpinned, in the layers above the
kernels: a converted folder checked against its checkpoint (top_k, architectures, the last
expert, scales, biases), MoEModel's describe() and inject_expert_backend over rules, what the
ranks of an expert-parallel layer compare and hold, run-block's zero tokens, the converter's
clean-up of dead temporaries.  Each test here fails under the mutant it was written for."""
import json
import os
import shutil

import numpy as np
import pytest

import ktcy
from ktcy.safetensors_io import CheckpointError
from test_cli_ux import assert_one_line_error, checkpoint, ktcy_cli  # noqa: F401  (checkpoint: a fixture)
from test_converted_blocks import build, quiet_convert


def _edited_copy(src, dst, edit):
    """A copy of checkpoint src (new source fingerprint) whose model.safetensors went through edit(tensors)."""
    pytest.importorskip("torch")  # the bf16 tensors are edited as torch tensors
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_reconverted_check_compares_scales_and_the_last_expert(tmp_path):
    """A checkpoint copy (other fingerprint) is compared with the folder on the first AND last
    expert, on every packed part: weights scaled by 2 keep the INT8 codes and change only the
    scales; a change in the last expert only must be found too."""
    ckpt = tmp_path / "ckpt"
    build(ckpt, "qwen3")
    quiet_convert(ckpt, tmp_path / "conv", "INT8", layers="1")
    # an unchanged copy is accepted (weights compared, they match)
    same = _edited_copy(ckpt, tmp_path / "same", lambda t: None)
    assert len(ktcy.MoEModel.from_pretrained(same, experts_path=tmp_path / "conv", layers=[1]).blocks) == 1

    def double_gate_0(t):
        name = "model.layers.1.mlp.experts.0.gate_proj.weight"
        t[name] = t[name] * 2  # exact in bf16: same INT8 codes, scale x2
    scaled = _edited_copy(ckpt, tmp_path / "scaled", double_gate_0)
    with pytest.raises(CheckpointError, match=r"other weights than .*expert 0 gate differs"):
        ktcy.MoEModel.from_pretrained(scaled, experts_path=tmp_path / "conv", layers=[1])

    def change_last(t):
        name = "model.layers.1.mlp.experts.7.down_proj.weight"
        t[name] = -t[name]
    last = _edited_copy(ckpt, tmp_path / "last", change_last)
    with pytest.raises(CheckpointError, match=r"other weights than .*expert 7 down differs"):
        ktcy.MoEModel.from_pretrained(last, experts_path=tmp_path / "conv", layers=[1])


@pytest.mark.parametrize("key, value, match", [
    # top_k is part of the shape a converted folder must share with the checkpoint
    ("num_experts_per_tok", 4, r"converted from another model \(top_k 2 there, 4 in"),
    # the copied config.json's architectures are compared, not only model_type
    ("architectures", ["OtherForCausalLM"],
     r"converted from another model \(architectures \['Test'\] there, \['OtherForCausalLM'\] in"),
])
def test_a_folder_converted_from_another_config_is_refused(tmp_path, key, value, match):
    ckpt = tmp_path / "ckpt"
    build(ckpt, "qwen3")
    quiet_convert(ckpt, tmp_path / "conv", "INT8", layers="1")
    with open(ckpt / "config.json") as f:
        config = json.load(f)
    config[key] = value
    with open(ckpt / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=match):
        ktcy.MoEModel.from_pretrained(ckpt, experts_path=tmp_path / "conv", layers=[1])


def test_describe_counts_the_shared_experts_bytes(tmp_path):
    from test_model import build as build_model
    build_model(tmp_path / "ckpt", "qwen2")
    model = ktcy.MoEModel.from_pretrained(tmp_path / "ckpt", layers=[1])
    block = model.blocks["model.layers.1.mlp.experts"]
    row = model.describe()[0]
    assert row["shared_experts"] and block.shared.moe.nbytes > 0
    assert row["bytes"] == block.experts.nbytes + block.shared.moe.nbytes


def test_ranks_compare_their_routing_weights_too():
    """ExpertParallelMoE's input header (what ranks compare before the all_reduce) changes when
    only topk_weights differ; otherwise ranks called with other weights would sum mismatched slots."""
    pytest.importorskip("torch")
    from types import SimpleNamespace
    from ktcy.distributed.expert_parallel import _HEADER, ExpertParallelMoE
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 0]], np.int64)
    w = np.full((3, 2), 0.5, np.float32)
    w2 = w.copy()
    w2[1, 0] = 0.25
    me = SimpleNamespace(reduce="slots")
    a = ExpertParallelMoE._header(me, (x, ids, w, 3))
    b = ExpertParallelMoE._header(me, (x, ids, w2, 3))
    differ = [name for name, p, q in zip(_HEADER, a, b) if p != q]
    assert differ == ["topk_weights"]


def test_a_layer_file_with_biases_the_checkpoint_lacks_is_refused(tmp_path):
    """Re-checking a folder against a copied checkpoint: expert biases held by the file but not by
    the checkpoint mean other weights (the weights alone match)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    from ktcy.packed_io import layer_file_name
    from ktcy.safetensors_io import write
    ckpt = tmp_path / "ckpt"
    build(ckpt, "qwen3")
    quiet_convert(ckpt, tmp_path / "conv", "INT8", layers="1")
    f = str(tmp_path / "conv" / layer_file_name(1))
    tensors = load_file(f)
    with safe_open(f, "np") as s:
        meta = dict(s.metadata())
    tensors["gate.bias"] = np.full((8, 64), 0.5, np.float32)
    meta["bias"] = "gate"
    write(f, tensors, meta)
    copy = _edited_copy(ckpt, tmp_path / "copy", lambda t: None)
    with pytest.raises(CheckpointError, match=r"other weights than .*expert 0 gate bias differs"):
        ktcy.MoEModel.from_pretrained(copy, experts_path=tmp_path / "conv", layers=[1])



def test_run_block_refuses_zero_tokens(checkpoint, tmp_path):  # noqa: F811  (the fixture)
    src = tmp_path / "in.npy"
    np.save(src, np.ones((0, 128), np.float32))
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", src, "--output", tmp_path / "y.npy")
    assert_one_line_error(r, "--input", "(0, 128)", "T >= 1", rc=1)
    assert not (tmp_path / "y.npy").exists()


def test_a_symlink_named_like_a_dead_temporary_is_left_alone(tmp_path):
    """Clean-up of dead converters' temporaries removes regular files only, never a symlink."""
    import subprocess
    import sys
    from ktcy import convert as convert_mod
    from test_model import build as build_model
    build_model(tmp_path / "src", "qwen3")
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    link = out / f".ktcy_model.json.{gone.pid}.0badf00d.tmp"
    os.symlink(target, link)
    convert_mod.convert(tmp_path / "src", out, method="INT8", layers="1", progress=convert_mod.Progress(quiet=True))
    assert os.path.islink(link) and target.read_text() == "keep"


def test_inject_expert_backend_wins_over_the_rule_that_chose_the_backend(tmp_path):
    from test_model import build as build_model
    build_model(tmp_path / "ckpt", "qwen3")
    rules = [{"match": {"name": r"^model\.layers\..*\.mlp\.experts$"}, "replace": {"kwargs": {"backend": "INT8"}}}]
    model = ktcy.MoEModel.from_pretrained(tmp_path / "ckpt", rules=rules, layers=[1, 2])
    assert [r["format"] for r in model.describe()] == ["INT8", "INT8"]
    assert model.inject_expert_backend(r"^model\.layers\.1\.", "BF16") == ["model.layers.1.mlp.experts"]
    assert [r["format"] for r in model.describe()] == ["BF16", "INT8"]


def test_a_ranks_local_experts_keep_their_own_biases():
    """_local_moe (what each rank of ExpertParallelMoE runs) takes the bias rows of the global
    experts it holds: rank 1 of 2 holds experts 2 and 3, so its local expert 0 is global expert 2."""
    pytest.importorskip("torch")
    from ktcy.distributed.expert_parallel import _local_moe
    E, K, H, I = 4, 2, 64, 32
    rng = np.random.default_rng(1)
    cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig("BF16"))
    gate, up = ((rng.standard_normal((E, I, H)) * 0.1).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((E, H, I)) * 0.1).astype(np.float32)
    bias = {"gate": rng.standard_normal((E, I)).astype(np.float32),
            "up": rng.standard_normal((E, I)).astype(np.float32),
            "down": rng.standard_normal((E, H)).astype(np.float32)}
    full = ktcy.MoE.from_weights(cfg, gate, up, down, bias=bias)
    mine = (2, 3)
    packed = {name: [getattr(full, name)[e] for e in mine] for name in ("gate", "up", "down")}
    local = _local_moe(cfg, mine, packed, full.bias)
    for name in ("gate", "up", "down"):
        assert np.array_equal(np.asarray(local.bias[name]), bias[name][list(mine)])
    x = rng.standard_normal((3, H)).astype(np.float32)
    w = np.full((3, K), 0.5, np.float32)
    want = full.forward(x, np.array([[2, 3]] * 3, np.int64), w)
    assert np.array_equal(local.forward(x, np.array([[0, 1]] * 3, np.int64), w), want)
