"""Hugging Face checkpoints, ktcy.load_experts, the converter and packed files (issue: checkpoints)."""
import json
import os
import signal
import struct
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import ktcy
from checkpoints import make_checkpoint
from conftest import per_channel_groups
from ktcy import convert as convert_mod
from ktcy.packed_io import layer_file_name, map_layer, read_metadata
from ktcy.safetensors_io import CheckpointError

QUIET = convert_mod.Progress(quiet=True)


def inputs(H, T=5, E=4, k=2, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64),
            rng.random((T, k)).astype(np.float32))


def from_arrays(stored, fmt, E=4, H=128, I=64, k=2, **scales):
    cfg = ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(fmt))
    return ktcy.MoE.from_weights(cfg, stored["gate"], stored["up"], stored["down"], **scales)


# where the decoder layers sit: causal LMs, LLaVA-style wrappers, and transformers' multimodal
# models (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V: model.language_model.layers)
@pytest.mark.parametrize("style,dtype,root,shards", [
    ("qwen", "bf16", "model.layers", 1), ("qwen", "fp16", "model.layers", 2), ("mixtral", "fp32", "model.layers", 1),
    ("fused", "bf16", "language_model.model.layers", 1), ("qwen", "bf16", "model.language_model.layers", 2),
    ("fused", "bf16", "model.language_model.layers", 1),
])
def test_load_experts_matches_from_weights(tmp_path, style, dtype, root, shards):
    truth = make_checkpoint(tmp_path, style=style, dtype=dtype, layers_root=root, shards=shards)
    L = 1
    loaded = ktcy.load_experts(tmp_path, L)
    assert loaded.format == "BF16" and loaded.config.top_k == 2
    ref = from_arrays(truth[L], "BF16")
    x, ids, w = inputs(128)
    assert np.array_equal(loaded.forward(x, ids, w), ref.forward(x, ids, w))
    int8 = ktcy.load_experts(tmp_path, L, method="AMXINT8")
    assert int8.format == "INT8"
    assert np.array_equal(int8.forward(x, ids, w), from_arrays(truth[L], "INT8").forward(x, ids, w))


@pytest.mark.parametrize("fp8,fmt,scale_key", [("block", "FP8_BLOCK", None), ("channel", "FP8_PERCHANNEL", None)])
def test_fp8_checkpoints_keep_their_precision(tmp_path, fp8, fmt, scale_key):
    truth = make_checkpoint(tmp_path, fp8=fp8, H=256, I=192)
    L = 2
    loaded = ktcy.load_experts(tmp_path, L)
    assert loaded.format == fmt
    t = truth[L]
    scales = {f"{p}_scale": np.stack(t[p + "_scale"]) for p in ("gate", "up", "down")}
    ref = from_arrays({p: np.stack(t[p + "_codes"]) for p in ("gate", "up", "down")}, fmt, H=256, I=192, **scales)
    x, ids, w = inputs(256)
    assert np.array_equal(loaded.forward(x, ids, w), ref.forward(x, ids, w))
    # quantizing FP8 on load to INT8 goes through the dequantized (codes x scale) weights
    int8 = ktcy.load_experts(tmp_path, L, method="INT8")
    assert np.array_equal(int8.forward(x, ids, w), from_arrays(t, "INT8", H=256, I=192).forward(x, ids, w))


@pytest.mark.parametrize("method", ["INT8", "AMXINT4", "BF16", "FP8_PERCHANNEL"])
def test_convert_then_load_equals_loading_the_checkpoint(tmp_path, method):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src)
    written = convert_mod.convert(src, out, method=method, progress=QUIET)
    assert written == [1, 2]
    x, ids, w = inputs(128)
    for L in written:
        packed = ktcy.load_experts(out, L)
        direct = ktcy.load_experts(src, L, method=method)
        assert packed.format == direct.format
        assert np.array_equal(packed.forward(x, ids, w), direct.forward(x, ids, w))
        # the same file runs on every ISA (INT8 bit-identically)
        for isa in ("ref", "amx_emu"):
            other = ktcy.load_experts(out, L, isa=isa)
            y = other.forward(x, ids, w)
            if packed.format == "INT8":
                assert np.array_equal(y, packed.forward(x, ids, w))
            else:
                ref = packed.forward(x, ids, w)
                assert np.linalg.norm(y - ref) <= 1e-5 * np.linalg.norm(ref)
    meta = read_metadata(out / layer_file_name(1))[1]
    assert meta["layout_version"] == "2" and meta["ktcy_version"] == ktcy.__version__
    assert json.load(open(out / "ktcy_model.json"))["layers"] == [1, 2]


def test_packed_file_is_mapped_not_copied(tmp_path):
    """A Qwen3-30B-A3B-shaped layer (H 2048, I 768; 32 of the 128 experts to keep the test
    small): loading it adds < 10% of the file's size to anonymous memory."""
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src, E=32, H=2048, I=768, top_k=8, num_layers=2, dense_layers=(0,))
    convert_mod.convert(src, out, method="INT8", progress=QUIET)
    f = out / layer_file_name(1)
    code = ("import ktcy, sys\n"
            "def anon():\n"
            "    return int([l for l in open('/proc/self/status') if l.startswith('RssAnon')][0].split()[1]) * 1024\n"
            "before = anon(); m = ktcy.load_experts(sys.argv[1], 1); after = anon()\n"
            "print(after - before, m.nbytes)\n")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    grown, nbytes = (int(v) for v in r.stdout.split())
    size = os.path.getsize(f)
    print(f"\npacked layer {size / 2**20:.0f} MiB, loading grew anonymous RSS by {grown / 2**20:.1f} MiB")
    assert nbytes <= size and grown < 0.1 * size


def test_interrupted_write_leaves_no_complete_looking_file(tmp_path, monkeypatch):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src, num_layers=4, dense_layers=())
    real_write = convert_mod.write_layer
    calls = []

    def crash_on_second(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            with open(str(path) + ".partial", "wb") as f:   # half a file, then the "crash"
                f.write(b"\x10\x00\x00\x00")
            raise KeyboardInterrupt
        return real_write(path, *a, **kw)

    monkeypatch.setattr(convert_mod, "write_layer", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        convert_mod.convert(src, out, method="INT8", progress=QUIET)
    assert os.path.exists(out / layer_file_name(0)) and not os.path.exists(out / layer_file_name(1))
    monkeypatch.setattr(convert_mod, "write_layer", real_write)
    assert convert_mod.convert(src, out, method="INT8", resume=True, progress=QUIET) == [0, 1, 2, 3]
    fresh = tmp_path / "fresh"
    convert_mod.convert(src, fresh, method="INT8", progress=QUIET)
    for L in range(4):
        a = ktcy.load_experts(out, L)
        b = ktcy.load_experts(fresh, L)
        assert all(np.array_equal(p.data, q.data) for p, q in zip(a.down, b.down))


def test_killed_converter_then_resume(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src, E=8, H=512, I=256, num_layers=8, dense_layers=())
    tool = [sys.executable, "-m", "ktcy", "convert", "--input", str(src), "--output", str(out), "--method", "INT4"]
    proc = subprocess.Popen(tool, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not os.path.exists(out / layer_file_name(0)):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            read_metadata(out / name)  # every complete-looking file is complete
    r = subprocess.run(tool + ["--resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(json.load(open(out / "ktcy_model.json"))["layers"]) == list(range(8))
    x, ids, w = inputs(512)
    for L in (0, 7):
        assert np.array_equal(ktcy.load_experts(out, L).forward(x, ids, w),
                              ktcy.load_experts(src, L, method="INT4").forward(x, ids, w))


def test_cli_flags(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, num_layers=4, dense_layers=(0,))
    out = tmp_path / "qc"
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_cpu_weights.py")
    command = [sys.executable, tool] if os.path.exists(tool) else [sys.executable, "-m", "ktcy", "convert"]
    r = subprocess.run(command + ["--input-path", str(src), "--output", str(out),
                                  "--quant-config", '{"method": "FP8", "per_channel": true}', "--layers", "2-3",
                                  "--input-type", "bf16"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == [layer_file_name(2), layer_file_name(3)]
    assert ktcy.load_experts(out, 2).format == "FP8_PERCHANNEL"
    bad = subprocess.run([sys.executable, "-m", "ktcy", "convert", "--input", str(src), "--output", str(tmp_path / "x"),
                          "--input-type", "fp8"], capture_output=True, text=True)
    assert bad.returncode == 1 and "--input-type fp8" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "ktcy", "convert", "--input", str(src), "--output", str(tmp_path / "x"),
                          "--layers", "0"], capture_output=True, text=True)
    assert bad.returncode == 1 and "not MoE layers" in bad.stderr


def test_hf_fp8_output_loads_back(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "fp8"
    truth = make_checkpoint(src, H=256, I=128)
    r = subprocess.run([sys.executable, "-m", "ktcy", "convert", "--input-bf16-hf-path", str(src),
                        "--output-fp8-hf-path", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    loaded = ktcy.load_experts(out, 1)
    assert loaded.format == "FP8_PERCHANNEL"
    ref = from_arrays(truth[1], "FP8_PERCHANNEL", H=256, I=128)
    x, ids, w = inputs(256)
    assert np.array_equal(loaded.forward(x, ids, w), ref.forward(x, ids, w))
    from ktcy.safetensors_io import SafetensorsFile
    shard = SafetensorsFile(out / "model-fp8-layer0001.safetensors")
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert shard.dtype(name) == ml_dtypes.float8_e4m3fn and shard.shape(name + "_scale") == (128, 1)


def corrupt(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "header_length":
        data[:8] = struct.pack("<Q", len(data) * 2)
    elif how == "header_json":
        data[8] = ord("!")  # the opening brace of the JSON header
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how,match", [("truncated", "truncated"), ("header_length", "header length"),
                                       ("header_json", "not valid JSON")])
def test_bad_files_give_clear_errors(tmp_path, how, match):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src)
    convert_mod.convert(src, out, method="INT8", progress=QUIET)
    corrupt(out / layer_file_name(1), how)
    with pytest.raises(CheckpointError, match=match):
        ktcy.load_experts(out, 1)
    corrupt(src / "model.safetensors", how)
    with pytest.raises(CheckpointError, match=match):
        ktcy.load_experts(src, 1)


def test_foreign_and_old_files_are_refused(tmp_path):
    from ktcy.safetensors_io import write
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src)
    convert_mod.convert(src, out, method="INT8", progress=QUIET)
    with pytest.raises(CheckpointError, match="packed as INT8"):
        ktcy.load_experts(out, 2, method="BF16")
    write(out / layer_file_name(1), {"x": np.zeros(3, np.float32)}, {"format": "pt"})
    with pytest.raises(CheckpointError, match="not a ktcy packed-experts file"):
        ktcy.load_experts(out, 1)
    f = out / layer_file_name(2)
    from ktcy.safetensors_io import SafetensorsFile
    old = SafetensorsFile(f)
    tensors = {k: np.array(old.get(k)) for k in old.keys()}
    write(f, tensors, dict(old.metadata, layout_version="0"))
    with pytest.raises(CheckpointError, match="layout version '0'"):
        ktcy.load_experts(out, 2)
    with pytest.raises(CheckpointError, match="was not converted"):
        ktcy.load_experts(out, 0)


@pytest.mark.parametrize("method", ["INT4", "INT4_ZP"])
def test_layout_1_files_keep_loading(tmp_path, method):
    """Layout 1 stored group scales and zero points group-major, [E, groups, N_pad]; such a file
    still loads and runs exactly as its layout-2 twin."""
    from ktcy.safetensors_io import SafetensorsFile, write
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src, H=256, I=96)
    convert_mod.convert(src, out, method=method, progress=QUIET)
    x, ids, w = inputs(256)
    want = ktcy.load_experts(out, 1).forward(x, ids, w)
    f = out / layer_file_name(1)
    now = SafetensorsFile(f)
    tensors, rearranged = {}, 0
    for name in now.keys():
        a = np.array(now.get(name))
        if name.endswith((".scale", ".zero")):  # [E, panels, groups * 16] -> [E, groups, N_pad]
            n_pad = 256 if name.startswith("down") else 96
            old = np.stack([per_channel_groups(e, n_pad).T for e in a])
            rearranged += not np.array_equal(old.reshape(-1), a.reshape(-1))
            a = old
        tensors[name] = a
    assert rearranged == (6 if method == "INT4_ZP" else 3)
    v2 = {name: np.array(now.get(name)) for name in now.keys()}
    mapped = map_layer(f, experts=[2])
    v2_gate = mapped.weights["gate"][2]
    os.close(mapped.fd)
    write(f, tensors, dict(now.metadata, layout_version="1"))
    assert np.array_equal(ktcy.load_experts(out, 1).forward(x, ids, w), want)
    one = map_layer(f, experts=[2])  # a rank that keeps one expert rearranges only its arrays
    assert one.weights["gate"][0] is None and np.array_equal(one.weights["gate"][2].scale, v2_gate.scale)
    os.close(one.fd)
    write(f, v2, dict(now.metadata, layout_version="1"))  # layout-2 arrays under a layout-1 label
    with pytest.raises(CheckpointError, match="a layout-1 file holds"):
        ktcy.load_experts(out, 1)
    from ktcy.output_guard import ConvertError
    with pytest.raises(ConvertError, match="packed layout 1 on disk"):  # --resume does not keep old layers
        convert_mod.convert(src, out, method=method, resume=True, progress=QUIET)
    convert_mod.convert(src, out, method=method, resume=True, overwrite=True, progress=QUIET)
    assert read_metadata(f)[1]["layout_version"] == "2"
    assert np.array_equal(ktcy.load_experts(out, 1).forward(x, ids, w), want)


def test_missing_shard_tensor_and_wrong_shape(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, shards=2)
    os.remove(src / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors .* is missing"):
        ktcy.load_experts(src, 2)
    src2 = tmp_path / "hf2"
    make_checkpoint(src2, extra_config={"moe_intermediate_size": 32})
    with pytest.raises(CheckpointError, match=r"gate_proj.weight: shape \(64, 128\), config.json implies \(32, 128\)"):
        ktcy.load_experts(src2, 1)
    src3 = tmp_path / "hf3"
    make_checkpoint(src3, extra_config={"num_experts": 5})
    with pytest.raises(CheckpointError, match="experts.4.gate_proj.weight is missing"):
        ktcy.load_experts(src3, 1)
    with pytest.raises(CheckpointError, match="not an MoE layer"):
        ktcy.load_experts(src3, 0)
    with pytest.raises(CheckpointError, match="no config.json"):
        ktcy.load_experts(tmp_path, 0)


def test_moe_layer_selection_from_config():
    from ktcy.checkpoint import MoEArchitecture
    base = {"hidden_size": 8, "num_hidden_layers": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    assert MoEArchitecture.from_config(dict(base, num_experts=4, mlp_only_layers=[1], decoder_sparse_step=2)).moe_layers == (3, 5)
    assert MoEArchitecture.from_config(dict(base, n_routed_experts=4, first_k_dense_replace=3)).moe_layers == (3, 4, 5)
    # left out: transformers' DeepseekV3Config default (3) for DeepSeek-V3, 0 for the others
    assert MoEArchitecture.from_config(dict(base, n_routed_experts=4, model_type="deepseek_v3")).moe_layers == (3, 4, 5)
    assert MoEArchitecture.from_config(dict(base, num_experts=4, model_type="qwen3_moe")).moe_layers == tuple(range(6))
    assert MoEArchitecture.from_config({"text_config": dict(base, num_local_experts=4)}).moe_layers == tuple(range(6))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        MoEArchitecture.from_config({k: v for k, v in dict(base, num_experts=4).items() if k != "num_experts_per_tok"})


def test_requantizing_what_is_stored_quantized_warns_once(tmp_path, caplog, monkeypatch):
    import logging
    monkeypatch.setattr(ktcy.log, "_warned", set())
    make_checkpoint(tmp_path, fp8="channel", H=256, I=192)
    with caplog.at_level(logging.INFO, logger="ktcy"):
        ktcy.load_experts(tmp_path, 2)                    # as stored: nothing to say
        ktcy.load_experts(tmp_path, 2, method="BF16")     # exact: nothing to say
        assert not [r for r in caplog.records if "quantizes it again" in r.getMessage()]
        for layer in (1, 2):                              # FP8 = 128x128 blocks: re-quantized
            assert ktcy.load_experts(tmp_path, layer, method="FP8").format == "FP8_BLOCK"
    said = [r for r in caplog.records if "quantizes it again" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "stores FP8_PERCHANNEL" in said[0].getMessage() and "as FP8_BLOCK" in said[0].getMessage()
