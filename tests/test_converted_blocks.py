"""Converted experts inside whole blocks (issue 13): MoEModel.from_pretrained(path, experts_path=folder)
and `ktcy run-block --experts folder` - routers and shared experts from the checkpoint, routed
experts mapped from a folder written by `ktcy convert`, checked to belong to that checkpoint."""
import logging
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ktcy
from checkpoints import make_checkpoint, make_gpt_oss_checkpoint
from ktcy.convert import convert
from ktcy.output_guard import OutputLock
from ktcy.packed_io import layer_file_name
from ktcy.safetensors_io import CheckpointError, write
from test_model import FAMILIES, E, H

METHODS = {"qwen3": ("INT8", "INT4", "BF16"), "qwen2": ("INT8", "INT4", "BF16"), "mixtral": ("INT8", "INT4", "BF16"),
           "deepseek": ("INT8", "INT4", "BF16"), "deepseek_fp8": ("FP8", "INT8", "INT4", "BF16")}


def build(path, family, seed=0, hidden=H, inter=64):
    """A checkpoint of the family (deepseek_fp8: DeepSeek-V3 with FP8 128x128-block experts as
    released) with its routers and shared experts in a second shard."""
    fp8 = "block" if family == "deepseek_fp8" else None
    family = "deepseek" if fp8 else family
    layers = make_checkpoint(path, E=E, H=hidden, I=inter, top_k=2, num_layers=4, dense_layers=(0,), seed=seed,
                             fp8=fp8, **FAMILIES[family])
    rng = np.random.default_rng(seed + 100)
    extra = {}
    for L in layers:
        p = f"model.layers.{L}.block_sparse_moe" if family == "mixtral" else f"model.layers.{L}.mlp"
        extra[f"{p}.gate.weight"] = (rng.standard_normal((E, hidden)) * 0.3).astype(ml_dtypes.bfloat16)
        if family == "deepseek":
            extra[f"{p}.gate.e_score_correction_bias"] = (rng.standard_normal(E) * 0.1).astype(np.float32)
        shared_i = {"qwen2": 96, "deepseek": 2 * inter}.get(family)
        if shared_i:
            name = f"{p}.shared_expert" if family == "qwen2" else f"{p}.shared_experts"
            for proj, shape in (("gate", (shared_i, hidden)), ("up", (shared_i, hidden)), ("down", (hidden, shared_i))):
                extra[f"{name}.{proj}_proj.weight"] = (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
            if family == "qwen2":
                extra[f"{p}.shared_expert_gate.weight"] = (rng.standard_normal((1, hidden)) * 0.1).astype(ml_dtypes.bfloat16)
    write(os.path.join(path, "extra.safetensors"), extra)
    return sorted(layers)


def quiet_convert(src, dst, method=None, **kw):
    return convert(src, dst, method=method, progress=_Silent(), **kw)


class _Silent:
    def bar(self, *_):
        pass

    def line(self, _):
        pass

    def close(self):
        pass


def same_packed(a, b):
    """Every packed array of two MoE layers holds the same bytes."""
    for proj in ("gate", "up", "down"):
        for wa, wb in zip(getattr(a, proj), getattr(b, proj)):
            for part in ("data", "scale", "colsum", "zero"):
                x, y = getattr(wa, part), getattr(wb, part)
                if (x is None) != (y is None) or (x is not None and x.tobytes() != y.tobytes()):
                    return False
    return a.format == b.format and len(a.gate) == len(b.gate)


def assert_same_blocks(converted, reference, hidden=H):
    assert list(converted.blocks) == list(reference.blocks)
    rng = np.random.default_rng(7)
    for name, block in converted.blocks.items():
        ref = reference.blocks[name]
        assert same_packed(block.experts, ref.experts), name
        assert (block.shared is None) == (ref.shared is None)
        if block.shared is not None:
            assert same_packed(block.shared.moe, ref.shared.moe)
        for T in (1, 5, 40):
            h = rng.standard_normal((T, hidden)).astype(np.float32)
            assert np.array_equal(block.forward(h), ref.forward(h)), (name, T)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: checkpoint folder}, built once for the module."""
    root = tmp_path_factory.mktemp("ckpts")
    return {family: (root / family, build(root / family, family)) for family in METHODS}


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory):
    """{(family, method): converted folder}, converted once for the module."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family, methods in METHODS.items():
        for method in methods:
            out[family, method] = root / f"{family}-{method}"
            quiet_convert(checkpoints[family][0], out[family, method], method)
    return out


@pytest.mark.parametrize("family,method", [(f, m) for f, ms in METHODS.items() for m in ms])
def test_converted_experts_give_the_checkpoints_block_outputs(checkpoints, folders, family, method):
    path, layers = checkpoints[family]
    folder = folders[family, method]
    reference = ktcy.MoEModel.from_pretrained(path, backend=method)
    model = ktcy.MoEModel.from_pretrained(path, experts_path=folder)
    assert_same_blocks(model, reference)
    for block in model.blocks.values():
        assert block.experts_from == os.path.join(str(folder), layer_file_name(block.layer))
        assert block.describe()["experts_from"] == block.experts_from
        assert block.experts.format == ktcy.formats.canonical_format(method)
    assert f"experts_path={str(folder)!r}" in repr(model) and "experts_from=" in repr(model.blocks[next(iter(model.blocks))])
    # the same format spelled as a KTransformers backend still maps the files
    named = ktcy.MoEModel.from_pretrained(path, experts_path=folder, backend="AMX" + method if method != "BF16" else "AMXBF16")
    assert all(b.experts_from.endswith(".safetensors") for b in named.blocks.values())


def test_checkpoint_description_says_where_experts_come_from(checkpoints):
    path, _ = checkpoints["qwen3"]
    model = ktcy.MoEModel.from_pretrained(path, layers=[1])
    assert model.describe()[0]["experts_from"] == str(path)
    assert "experts_path" not in repr(model)


def test_another_format_is_packed_from_the_checkpoint_not_the_file(checkpoints, folders, caplog):
    path, _ = checkpoints["qwen2"]
    folder = folders["qwen2", "INT8"]
    with caplog.at_level(logging.WARNING, logger="ktcy"):
        model = ktcy.MoEModel.from_pretrained(path, experts_path=folder, backend="BF16")
    lines = [r.getMessage() for r in caplog.records if "packed from the checkpoint" in r.getMessage()]
    assert len(lines) == 1 and "layers 1-3" in lines[0] and "INT8" in lines[0] and "BF16" in lines[0]
    assert all(b.experts_from == str(path) for b in model.blocks.values())
    # BF16 from the checkpoint is exact; from the INT8 file it would carry INT8's rounding
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, backend="BF16"))


def test_rules_mix_converted_and_repacked_blocks(checkpoints, folders):
    path, _ = checkpoints["deepseek"]
    folder = folders["deepseek", "INT8"]
    rules = [{"match": {"name": r"^model\.layers\.2\."}, "replace": {"kwargs": {"backend": "AMXINT4"}}},
             {"match": {"name": r"^model\.layers\."}, "replace": {"kwargs": {"backend": "AMXINT8"}}}]
    model = ktcy.MoEModel.from_pretrained(path, experts_path=folder, rules=rules)
    rows = {r["layer"]: r for r in model.describe()}
    assert rows[2]["format"] == "INT4" and rows[2]["experts_from"] == str(path)
    assert rows[1]["format"] == rows[3]["format"] == "INT8"
    assert rows[1]["experts_from"] == os.path.join(str(folder), layer_file_name(1))
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, rules=rules))


def test_inject_expert_backend_follows_the_same_rule(checkpoints, folders, caplog):
    path, _ = checkpoints["mixtral"]
    folder = folders["mixtral", "INT4"]
    model = ktcy.MoEModel.from_pretrained(path, experts_path=folder)
    with caplog.at_level(logging.WARNING, logger="ktcy"):
        changed = model.inject_expert_backend(r"^model\.layers\.[12]\.", "AMXBF16")
    assert changed == ["model.layers.1.block_sparse_moe.experts", "model.layers.2.block_sparse_moe.experts"]
    assert any("inject_expert_backend asks BF16" in r.getMessage() for r in caplog.records)
    rows = {r["layer"]: r for r in model.describe()}
    assert rows[1]["format"] == "BF16" and rows[1]["experts_from"] == str(path)
    assert rows[3]["format"] == "INT4" and rows[3]["experts_from"].startswith(str(folder))
    model.inject_expert_backend(r"^model\.layers\.1\.", "INT4")  # back to the folder's format: the file again
    assert model.describe()[1]["experts_from"] == os.path.join(str(folder), layer_file_name(1))
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, rules=[
        {"match": {"name": r"^model\.layers\.2\."}, "replace": {"kwargs": {"backend": "BF16"}}},
        {"match": {"name": ".*"}, "replace": {"kwargs": {"backend": "INT4"}}}]))


def test_isa_applies_to_converted_blocks(checkpoints, folders):
    path, _ = checkpoints["qwen3"]
    model = ktcy.MoEModel.from_pretrained(path, experts_path=folders["qwen3", "INT8"], isa="ref", layers=[1])
    block = model.blocks["model.layers.1.mlp.experts"]
    assert block.experts.isa == "ref"
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, backend="INT8", isa="ref", layers=[1]))


def test_gpt_oss_converted_keeps_biases_and_activation(tmp_path):
    make_gpt_oss_checkpoint(tmp_path / "ckpt")
    quiet_convert(tmp_path / "ckpt", tmp_path / "conv")
    model = ktcy.MoEModel.from_pretrained(tmp_path / "ckpt", experts_path=tmp_path / "conv")
    assert all(b.experts.format == "MXFP4" and b.experts_from.endswith(".safetensors") for b in model.blocks.values())
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(tmp_path / "ckpt"))
    # a copy of the checkpoint (new fingerprint): MXFP4 codes and biases are compared instead
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy", copy_function=shutil.copyfile)
    assert len(ktcy.MoEModel.from_pretrained(tmp_path / "copy", experts_path=tmp_path / "conv").blocks) == 2
    make_gpt_oss_checkpoint(tmp_path / "other", seed=3)
    with pytest.raises(CheckpointError, match="converted from other weights"):
        ktcy.MoEModel.from_pretrained(tmp_path / "other", experts_path=tmp_path / "conv")
    # the same weights with another swiglu_limit in config.json: the file's activation no longer fits
    make_gpt_oss_checkpoint(tmp_path / "limit", swiglu_limit=5.0)
    with pytest.raises(CheckpointError, match=r"conv: layer 0 .*swiglu_limit 7\.0 in the file, 5\.0"):
        ktcy.MoEModel.from_pretrained(tmp_path / "limit", experts_path=tmp_path / "conv")


# ---- a folder that does not belong to the checkpoint ----

def test_other_model_is_named(checkpoints, folders, tmp_path):
    path, _ = checkpoints["qwen3"]
    with pytest.raises(CheckpointError, match=r"mixtral-INT8: converted from another model \(model_type "
                                              r"'mixtral' there, 'qwen3_moe' in"):
        ktcy.MoEModel.from_pretrained(path, experts_path=folders["mixtral", "INT8"])
    build(tmp_path / "wide", "qwen3", hidden=256)
    quiet_convert(tmp_path / "wide", tmp_path / "wide-int8", "INT8")
    with pytest.raises(CheckpointError, match=r"wide-int8: converted from another model \(hidden_size 256 there, 128 in"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "wide-int8")


def test_other_sizes_in_a_layer_file_are_named(checkpoints, tmp_path):
    """A manifest that fits but a layer file of other sizes (copied in from another conversion)."""
    path, _ = checkpoints["qwen3"]
    build(tmp_path / "narrow", "qwen3", inter=32)
    quiet_convert(tmp_path / "narrow", tmp_path / "narrow-conv", "INT8", layers="2")
    folder = tmp_path / "conv"
    quiet_convert(path, folder, "INT8")
    os.replace(tmp_path / "narrow-conv" / layer_file_name(2), folder / layer_file_name(2))
    with pytest.raises(CheckpointError, match=r"conv: layer 2 \(ktcy_layer_0002.safetensors\) does not fit the "
                                              r"checkpoint: intermediate_size 32 in the file, 64 in"):
        ktcy.MoEModel.from_pretrained(path, experts_path=folder)
    assert len(ktcy.MoEModel.from_pretrained(path, experts_path=folder, layers=[1, 3]).blocks) == 2


def test_same_shapes_other_weights_are_refused(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    build(tmp_path / "twin", "qwen3", seed=5)  # same config, other weights
    quiet_convert(tmp_path / "twin", tmp_path / "twin-conv", "INT8")
    with pytest.raises(CheckpointError, match=r"twin-conv: layer 1 was converted from other weights than .*"
                                              r"\(expert 0 gate differs"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "twin-conv")


@pytest.mark.parametrize("family,method", [("deepseek_fp8", "FP8"), ("qwen2", "INT4"), ("mixtral", "BF16")])
def test_a_copied_checkpoint_with_the_same_weights_is_accepted(checkpoints, folders, tmp_path, caplog, family, method):
    """A copy has new file times, so a new fingerprint; the weights decide."""
    path, layers = checkpoints[family]
    shutil.copytree(path, tmp_path / "copy", copy_function=shutil.copyfile)
    with caplog.at_level(logging.INFO, logger="ktcy"):
        model = ktcy.MoEModel.from_pretrained(tmp_path / "copy", experts_path=folders[family, method])
    assert sum("records another source fingerprint" in r.getMessage() for r in caplog.records) == len(layers)
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, backend=method))


def test_missing_layers_are_listed_unless_left_out(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    quiet_convert(path, tmp_path / "part", "INT8", layers="1,3")
    (tmp_path / "part" / "ktcy_layer_\u00b2\u00b3.safetensors").write_bytes(b"")  # str.isdigit() takes superscripts
    with pytest.raises(CheckpointError, match=r"part: layer 2 was not converted \(the folder holds layers 1, 3\); "
                                              r"convert them, or pass layers="):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "part")
    model = ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "part", layers=[3, 1])
    assert sorted(b.layer for b in model.blocks.values()) == [1, 3]
    assert_same_blocks(model, ktcy.MoEModel.from_pretrained(path, backend="INT8", layers=[3, 1]))
    quiet_convert(path, tmp_path / "one", "INT8", layers="1")
    with pytest.raises(CheckpointError, match=r"one: layers 2, 3 were not converted \(the folder holds layers 1\)"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "one")


def test_truncated_layer_file_is_named(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    quiet_convert(path, tmp_path / "conv", "INT8")
    f = tmp_path / "conv" / layer_file_name(3)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(CheckpointError, match=r"ktcy_layer_0003\.safetensors"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "conv")


def test_layer_file_of_another_layer_is_refused(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    folder = tmp_path / "conv"
    quiet_convert(path, folder, "INT8")
    os.remove(folder / layer_file_name(2))
    os.symlink(layer_file_name(1), folder / layer_file_name(2))  # inside the folder, but layer 1's file
    with pytest.raises(CheckpointError, match=r"layer 2 \(ktcy_layer_0002.safetensors\) does not fit the checkpoint: "
                                              "it holds layer 1"):
        ktcy.MoEModel.from_pretrained(path, experts_path=folder)


def test_symlink_out_of_the_folder_is_refused(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    folder = tmp_path / "conv"
    quiet_convert(path, folder, "INT8")
    os.replace(folder / layer_file_name(2), tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", folder / layer_file_name(2))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        ktcy.MoEModel.from_pretrained(path, experts_path=folder)
    # a symlink to the whole folder is fine: it is the same folder
    os.replace(tmp_path / "elsewhere.safetensors", folder / layer_file_name(2))
    os.symlink(folder, tmp_path / "link")
    model = ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "link", layers=[2])
    assert model.describe()[0]["experts_from"] == os.path.join(str(tmp_path / "link"), layer_file_name(2))


def test_not_a_converted_folder(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    with pytest.raises(CheckpointError, match="experts_path is the checkpoint itself"):
        ktcy.MoEModel.from_pretrained(path, experts_path=path)
    with pytest.raises(CheckpointError, match="nothing exists there"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "absent")
    with pytest.raises(TypeError):
        ktcy.MoEModel.from_pretrained(path, experts_path=3)
    quiet_convert(path, tmp_path / "conv", "INT8")
    with pytest.raises(CheckpointError, match="a converted folder holds experts only"):  # as before: path is the checkpoint
        ktcy.MoEModel.from_pretrained(tmp_path / "conv")
    os.remove(tmp_path / "conv" / "ktcy_model.json")  # as during a first conversion
    with pytest.raises(CheckpointError, match=r"no ktcy_model.json, so not a folder written by `ktcy convert`"):
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "conv")


def test_a_folder_being_converted_is_refused(checkpoints, folders):
    path, _ = checkpoints["qwen3"]
    folder = folders["qwen3", "INT8"]
    with OutputLock(folder):  # what a running `ktcy convert` holds
        with pytest.raises(CheckpointError, match=rf"a `ktcy convert` \(pid {os.getpid()}\) is writing this folder"):
            ktcy.MoEModel.from_pretrained(path, experts_path=folder)
    assert len(ktcy.MoEModel.from_pretrained(path, experts_path=folder).blocks) == 3  # lock released: usable


# ---- ktcy run-block --experts ----

def run_block(*args):
    return subprocess.run([sys.executable, "-m", "ktcy", "run-block", *map(str, args)], capture_output=True, text=True)


def test_run_block_with_converted_experts(checkpoints, folders, tmp_path):
    path, _ = checkpoints["deepseek_fp8"]
    h = np.random.default_rng(1).standard_normal((6, H)).astype(np.float32)
    np.save(tmp_path / "h.npy", h)
    for method in ("FP8", "INT4"):
        out = tmp_path / f"y-{method}.npy"
        r = run_block(path, "--layer", 2, "--experts", folders["deepseek_fp8", method], "--input", tmp_path / "h.npy",
                      "--output", out)
        assert r.returncode == 0, r.stderr
        assert f"experts from {folders['deepseek_fp8', method] / layer_file_name(2)}" in r.stdout
        expect = ktcy.MoEModel.from_pretrained(path, backend=method, layers=[2]).blocks["model.layers.2.mlp.experts"]
        assert np.array_equal(np.load(out), expect.forward(h))
    # another backend: packed from the checkpoint, said once on stderr
    r = run_block(path, "--layer", 2, "--experts", folders["deepseek_fp8", "INT4"], "--backend", "BF16",
                  "--input", tmp_path / "h.npy", "--output", tmp_path / "y-bf16.npy")
    assert r.returncode == 0, r.stderr
    assert f"experts from {path}" in r.stdout and r.stderr.count("packed from the checkpoint") == 1


@pytest.mark.parametrize("case,words", [
    ("absent", "nothing exists there"),
    ("other", "converted from another model"),
    ("missing", "layer 3 was not converted"),
])
def test_run_block_experts_errors_are_one_line(checkpoints, folders, tmp_path, case, words):
    path, _ = checkpoints["qwen3"]
    np.save(tmp_path / "h.npy", np.ones((2, H), np.float32))
    folder = {"absent": tmp_path / "absent", "other": folders["mixtral", "INT8"], "missing": tmp_path / "part"}[case]
    if case == "missing":
        quiet_convert(path, folder, "INT8", layers="1")
    r = run_block(path, "--layer", 3, "--experts", folder, "--input", tmp_path / "h.npy", "--output", tmp_path / "y.npy")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ktcy: error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(tmp_path / "y.npy")


def test_a_layer_file_replaced_after_the_check_is_refused(checkpoints, folders, tmp_path):
    """A file swapped between the metadata check and the mapping (another conversion finishing)."""
    from ktcy.checkpoint import Checkpoint
    from ktcy.converted import ConvertedFolder
    path, _ = checkpoints["qwen3"]
    shutil.copytree(folders["qwen3", "INT8"], tmp_path / "conv")
    folder = ConvertedFolder(tmp_path / "conv", Checkpoint(path))
    folder.require([1, 2, 3])
    shutil.copyfile(folders["qwen3", "BF16"] / layer_file_name(2), tmp_path / "conv" / layer_file_name(2))
    with pytest.raises(CheckpointError, match=r"ktcy_layer_0002.safetensors: changed while loading \(INT8 before, BF16 now"):
        folder.load(2)
    assert folder.load(1).format == "INT8"


@pytest.mark.parametrize("text,words", [
    ("[1, 2]", "not a ktcy packed-model manifest"),
    ('{"format": "ktcy.packed_model", "num_experts": 16, "top_k": 2, "hidden_size": 128, "intermediate_size": 64}',
     "converted from another model (num_experts 16 there, 8 in"),
    ("{not json", "ktcy_model.json"),
])
def test_a_damaged_manifest_is_named(checkpoints, folders, tmp_path, text, words):
    path, _ = checkpoints["qwen3"]
    shutil.copytree(folders["qwen3", "INT8"], tmp_path / "conv")
    (tmp_path / "conv" / "ktcy_model.json").write_text(text)
    with pytest.raises(CheckpointError) as err:
        ktcy.MoEModel.from_pretrained(path, experts_path=tmp_path / "conv")
    assert words in str(err.value)
