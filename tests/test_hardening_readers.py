"""Hostile checkpoints for the readers (issue 16: items 5, 6, 11, 13, 14, 15; issue 17: paths,
hub ids, repr, docstrings).  Every file is written by the test; each case is one regression."""
import json
import os
import struct
import time

import ml_dtypes
import numpy as np
import pytest

import ktcy
from conftest import time_limit
from checkpoints import make_checkpoint
from ktcy import convert as convert_mod
from ktcy.checkpoint import Checkpoint, MoEArchitecture
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write

QUIET = convert_mod.Progress(quiet=True)


def inputs(H=128, T=5, E=4, k=2, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64),
            rng.random((T, k)).astype(np.float32))


def same_layer(a, b):
    x, ids, w = inputs(a.config.hidden_size, E=a.config.num_experts)
    return a.format == b.format and np.array_equal(a.forward(x, ids, w), b.forward(x, ids, w))


def edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def add_routers(path, E=4, H=128, layers=(1, 2)):
    """Router weights in a second shard, so MoEModel can build blocks (qwen names)."""
    rng = np.random.default_rng(7)
    write(os.path.join(path, "extra.safetensors"),
          {f"model.layers.{L}.mlp.gate.weight": (rng.standard_normal((E, H)) * 0.3).astype(ml_dtypes.bfloat16)
           for L in layers})


# --- item 5: a tensor in two shards without an index ------------------------------------------

def test_duplicate_tensor_across_shards_without_index_is_refused(tmp_path):
    make_checkpoint(tmp_path)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    write(tmp_path / "stray.safetensors", {name: np.zeros((64, 128), ml_dtypes.bfloat16)})
    with pytest.raises(CheckpointError, match=r"stored in both model\.safetensors and stray\.safetensors"):
        ktcy.load_experts(tmp_path, 1)


# --- item 6: config values against what is stored, and checked for type and range ------------

def test_num_experts_below_what_is_stored_is_refused(tmp_path):
    make_checkpoint(tmp_path, extra_config={"num_experts": 3, "num_experts_per_tok": 2})
    with pytest.raises(CheckpointError, match=r"config.json: num_experts is 3, but layer 1 stores 4 experts"):
        ktcy.load_experts(tmp_path, 1)


def test_num_experts_above_what_is_stored_is_refused(tmp_path):
    make_checkpoint(tmp_path, style="mixtral", extra_config={"num_local_experts": 6})
    with pytest.raises(CheckpointError, match=r"num_local_experts is 6, but layer 1 stores 4 experts .*experts\.4\.w1"):
        ktcy.load_experts(tmp_path, 1)


def test_fused_experts_count_is_checked_too(tmp_path):
    make_checkpoint(tmp_path, style="fused", extra_config={"num_experts": 3})
    with pytest.raises(CheckpointError, match="config.json implies"):
        ktcy.load_experts(tmp_path, 1)


@pytest.mark.parametrize("value", [1, "1", "[0]", [0, "1"], [True], [0, 7], {"0": 1}])
def test_mlp_only_layers_of_the_wrong_type_is_refused_not_ignored(tmp_path, value):
    make_checkpoint(tmp_path, extra_config={"mlp_only_layers": value})
    with pytest.raises(CheckpointError, match=r"config.json: mlp_only_layers must be a list of layer numbers"):
        Checkpoint(tmp_path)


def test_mlp_only_layers_as_a_list_is_understood(tmp_path):
    make_checkpoint(tmp_path, num_layers=3, dense_layers=(0,))
    edit_config(tmp_path, mlp_only_layers=[0, 2])
    assert Checkpoint(tmp_path).arch.moe_layers == (1,)


@pytest.mark.parametrize("key,value", [
    ("hidden_size", "128"), ("hidden_size", 128.0), ("hidden_size", True), ("hidden_size", -128),
    ("num_experts", 0), ("num_experts", [4]), ("num_experts_per_tok", 5), ("num_experts_per_tok", 0),
    ("num_hidden_layers", "3"), ("moe_intermediate_size", None), ("decoder_sparse_step", 0),
    ("decoder_sparse_step", "1"), ("first_k_dense_replace", -1), ("moe_layer_freq", 1.5),
])
def test_every_config_value_is_type_and_range_checked(tmp_path, key, value):
    make_checkpoint(tmp_path)
    edit_config(tmp_path, **{key: value})
    if key == "moe_intermediate_size":  # None falls back to intermediate_size; remove both
        edit_config(tmp_path, intermediate_size=None)
        key = "moe_intermediate_size / intermediate_size"
    with pytest.raises(CheckpointError, match=rf"config.json: {key}"):
        ktcy.load_experts(tmp_path, 1)


@pytest.mark.parametrize("key,value", [("norm_topk_prob", "no"), ("n_group", 0), ("n_group", 9),
                                       ("topk_group", 3), ("routed_scaling_factor", "2.5"),
                                       ("routed_scaling_factor", -1), ("shared_expert_intermediate_size", "96")])
def test_router_config_values_are_checked(tmp_path, key, value):
    make_checkpoint(tmp_path, extra_config={"n_group": 2, key: value})
    add_routers(tmp_path)
    rng = np.random.default_rng(3)
    if key == "shared_expert_intermediate_size":
        write(tmp_path / "shared.safetensors", {
            f"model.layers.{L}.mlp.shared_expert.{p}_proj.weight": (rng.standard_normal(s) * 0.02).astype(ml_dtypes.bfloat16)
            for L in (1, 2) for p, s in (("gate", (96, 128)), ("up", (96, 128)), ("down", (128, 96)))})
    with pytest.raises(CheckpointError, match=rf"config.json: {key}"):
        ktcy.MoEModel.from_pretrained(tmp_path, layers=[1])


DEEPSEEK_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1,
                   "norm_topk_prob": True, "routed_scaling_factor": 2.5}


@pytest.mark.parametrize("extra,bias,match", [
    ({"model_type": "llama4"}, False, r"model_type 'llama4' is not a family whose router ktcy computes"),
    ({"model_type": "hunyuan_v1_moe"}, True, r"model_type 'hunyuan_v1_moe' is not a family"),
    ({"model_type": "ernie4_5_moe", "routed_scaling_factor": 2.0}, True, r"routed_scaling_factor 2.0 does not fit a "
                                                                           r"ernie4_5_moe router"),
    ({"model_type": "deepseek_v2", "norm_topk_prob": True}, False, r"norm_topk_prob true in a deepseek_v2 router"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, False, r"topk_method 'noaux_tc' is not a choice"),
    ({"model_type": "deepseek_v2"}, True, r"model.layers.1.mlp has an e_score_correction_bias, but a deepseek_v2 "
                                        r"router has no use"),
    ({"model_type": "minimax_m2", "routed_scaling_factor": 2.0}, True, r"routed_scaling_factor 2.0 does not fit a "
                                                                          r"minimax_m2 router"),
    ({"model_type": "minimax_m2", "scoring_func": "softmax"}, True, r"scoring_func 'softmax' does not fit a minimax_m2"),
    ({"routed_scaling_factor": 2.5}, False, r"routed_scaling_factor 2.5 does not fit a softmax router"),
    ({}, True, r"model.layers.1.mlp has an e_score_correction_bias, but a softmax router has no use"),
    ({"model_type": "mixtral"}, True, r"model.layers.1.mlp has an e_score_correction_bias, but a mixtral"),
    ({"model_type": "qwen3_moe", "scoring_func": "sigmoid"}, False, r"scoring_func 'sigmoid' does not fit a softmax"),
    ({**DEEPSEEK_ROUTER, "topk_method": "group_limited_greedy"}, True, r"topk_method 'group_limited_greedy' is not"),
    ({**DEEPSEEK_ROUTER, "model_type": "deepseek_v3", "routed_scaling_factor": None, "first_k_dense_replace": 0}, True,
     r"a deepseek_v3 router needs routed_scaling_factor in config.json"),
    ({k: v for k, v in DEEPSEEK_ROUTER.items() if k not in ("n_group", "topk_group")}, True,
     r"a deepseek_v3 router needs n_group, topk_group in config.json"),
])
def test_routers_ktcy_does_not_compute_are_refused(tmp_path, extra, bias, match):
    """A family with a router of its own, or a config or router tensor the convention would leave
    unused, must not run on another family's router (other experts, other weights, no error)."""
    # every layer holds experts (no mlp_only_layers): each family's own MoE-layer rule then holds
    make_checkpoint(tmp_path, dense_layers=(), extra_config={k: v for k, v in extra.items() if v is not None})
    add_routers(tmp_path)
    if bias:
        write(tmp_path / "bias.safetensors", {f"model.layers.{L}.mlp.gate.e_score_correction_bias":
                                              np.zeros(4, np.float32) for L in (1, 2)})
    with pytest.raises(CheckpointError, match=r"config.json: " + match):
        ktcy.MoEModel.from_pretrained(tmp_path, layers=[1])
    assert ktcy.load_experts(tmp_path, 1).config.num_experts == 4  # the experts alone still load


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu", 3])
def test_experts_of_another_activation_are_refused_not_run_as_silu(tmp_path, act):
    """ktcy's experts are SiLU-gated (or GPT-OSS's clamped SwiGLU): a config.json naming another
    hidden_act loaded silently before, with other outputs than the model's own."""
    src = tmp_path / "ckpt"
    make_checkpoint(src, extra_config={"hidden_act": act})
    add_routers(src)
    match = rf"config.json: hidden_act {act!r}: ktcy's experts are SiLU-gated"
    with pytest.raises(CheckpointError, match=match):
        ktcy.load_experts(src, 1)
    with pytest.raises(CheckpointError, match=match):
        ktcy.MoEModel.from_pretrained(src, layers=[1])
    with pytest.raises(CheckpointError, match=match):
        convert_mod.convert(src, tmp_path / "out", method="INT8", progress=QUIET)
    assert not any(n.startswith("ktcy_layer_") for n in os.listdir(tmp_path / "out")) if (tmp_path / "out").exists() \
        else True


@pytest.mark.parametrize("act", ["silu", "swish"])
def test_silu_under_either_name_loads(tmp_path, act):
    make_checkpoint(tmp_path, extra_config={"hidden_act": act})
    assert ktcy.load_experts(tmp_path, 1).config.activation == "silu"


def test_a_deepseek_router_with_every_key_is_built(tmp_path):
    make_checkpoint(tmp_path, extra_config=DEEPSEEK_ROUTER)
    add_routers(tmp_path)
    block = next(iter(ktcy.MoEModel.from_pretrained(tmp_path, layers=[1]).blocks.values()))
    assert block.router.kind == "deepseek_v3" and block.router.routed_scaling_factor == 2.5


def test_converted_group_size_must_match_the_file(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src)
    convert_mod.convert(src, out, method="INT4", progress=QUIET)
    assert same_layer(ktcy.load_experts(out, 1, group_size=64), ktcy.load_experts(out, 1))
    with pytest.raises(CheckpointError, match="packed as INT4 with group size 64; group_size=32"):
        ktcy.load_experts(out, 1, group_size=32)
    out8 = tmp_path / "packed8"
    convert_mod.convert(src, out8, method="INT8", progress=QUIET)
    with pytest.raises(CheckpointError, match=r"packed as INT8 \(no group size\)"):
        ktcy.load_experts(out8, 1, group_size=64)


def test_group_size_is_never_ignored_on_a_checkpoint(tmp_path):
    make_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="group_size applies to grouped formats"):
        ktcy.load_experts(tmp_path, 1, method="INT8", group_size=32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        ktcy.load_experts(tmp_path, 1, method="INT4", group_size=48)
    g32 = ktcy.load_experts(tmp_path, 1, method="INT4", group_size=32)
    assert g32.config.quant_config.group_size == 32
    assert same_layer(ktcy.load_experts(tmp_path, np.int64(1), method="INT4", group_size=np.int32(32)), g32)


# --- item 11: bounded reads, regular files only, no loop over a claimed layer count -----------

@pytest.mark.parametrize("which", ["config.json", "model.safetensors.index.json"])
def test_fifo_as_json_fails_at_once(tmp_path, which):
    make_checkpoint(tmp_path, shards=2)
    os.remove(tmp_path / which)
    os.mkfifo(tmp_path / which)
    with time_limit(5), pytest.raises(CheckpointError, match=rf"{which}: not a regular file"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("which", ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"])
def test_dev_zero_as_a_checkpoint_file_fails_at_once(tmp_path, which):
    make_checkpoint(tmp_path, shards=2)
    os.remove(tmp_path / which)
    os.symlink("/dev/zero", tmp_path / which)
    with time_limit(5), pytest.raises(CheckpointError, match="not a regular file|outside the checkpoint folder"):
        ktcy.load_experts(tmp_path, 1)


def test_fifo_as_a_shard_fails_at_once(tmp_path):
    make_checkpoint(tmp_path, shards=2)
    os.remove(tmp_path / "model-00001-of-00002.safetensors")
    os.mkfifo(tmp_path / "model-00001-of-00002.safetensors")
    with time_limit(5), pytest.raises(CheckpointError, match="not a regular file"):
        ktcy.load_experts(tmp_path, 1)


@pytest.mark.parametrize("which,size", [("config.json", 5 * 2**20), ("model.safetensors.index.json", 65 * 2**20),
                                        ("ktcy_model.json", 5 * 2**20)])
def test_oversized_json_is_refused_before_reading(tmp_path, which, size):
    src = tmp_path / "ckpt"
    make_checkpoint(src, shards=2)
    if which == "ktcy_model.json":
        convert_mod.convert(src, tmp_path / "packed", method="INT8", progress=QUIET)
    target = (tmp_path / "packed" if which == "ktcy_model.json" else src) / which
    with open(target, "r+b") as f:
        f.seek(size)
        f.write(b" ")  # a sparse file: its size alone must refuse it, before anything is read
    with time_limit(5), pytest.raises(CheckpointError, match=rf"{which}: \d+ bytes, more than"):
        ktcy.load_experts(target.parent, 1)


@pytest.mark.parametrize("layers", [10**8, 10**12, 10**30])
def test_huge_num_hidden_layers_is_refused_without_looping(tmp_path, layers):
    make_checkpoint(tmp_path)
    edit_config(tmp_path, num_hidden_layers=layers)
    t0 = time.perf_counter()
    with time_limit(10), pytest.raises(CheckpointError, match="config.json: num_hidden_layers"):
        ktcy.load_experts(tmp_path, 1)
    assert time.perf_counter() - t0 < 2


def test_num_hidden_layers_beyond_the_stored_layers_is_refused(tmp_path):
    make_checkpoint(tmp_path, num_layers=3)
    edit_config(tmp_path, num_hidden_layers=40)
    with pytest.raises(CheckpointError, match="num_hidden_layers is 40, but the checkpoint's tensors cover 3 layers"):
        Checkpoint(tmp_path)


def test_config_read_on_its_own_is_bounded():
    cfg = {"hidden_size": 8, "num_hidden_layers": 10**12, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
           "num_experts": 4}
    with time_limit(5), pytest.raises(CheckpointError, match="num_hidden_layers must be an integer >= 1 and <= 100000"):
        MoEArchitecture.from_config(cfg)


# --- item 13: the safetensors reader refuses what the format forbids --------------------------

def raw_safetensors(path, header, data=b"", header_len=None):
    """A file from a header (dict, or raw bytes written as they are) and a data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def two_tensors(a=(0, 8), b=(8, 16), shape_a=(2,), shape_b=(2,), dtype_a="F32"):
    return {"a": {"dtype": dtype_a, "shape": list(shape_a), "data_offsets": list(a)},
            "b": {"dtype": "F32", "shape": list(shape_b), "data_offsets": list(b)}}


BAD_FILES = {
    "overlap": (two_tensors(a=(0, 8), b=(4, 12)), 16, r"tensor 'b' \(bytes 4-12\) overlaps tensor 'a'"),
    "gap": (two_tensors(a=(0, 8), b=(12, 20)), 20, r"bytes 8-12 before tensor 'b' belong to no tensor"),
    "trailing": (two_tensors(), 24, r"bytes 16-24 at the end of the file belong to no tensor"),
    "negative_dim": (two_tensors(shape_a=(-2,)), 16, r"tensor 'a': shape \[-2\] is not a list of non-negative"),
    "float_dim": (two_tensors(shape_a=(2.0,)), 16, r"tensor 'a': shape \[2.0\]"),
    "string_dim": ({"a": {"dtype": "F32", "shape": "22", "data_offsets": [0, 16]}}, 16, r"tensor 'a': shape '22'"),
    "bool_dim": (two_tensors(shape_a=(True, 2)), 16, r"tensor 'a': shape \[true, 2\]|tensor 'a': shape \[True, 2\]"),
    "wrong_size": (two_tensors(shape_a=(3,)), 16, r"tensor 'a' claims 8 bytes for shape \(3,\)"),
    "overflow": (two_tensors(shape_a=(2**40, 2**40, 2**40)), 16, r"tensor 'a': shape \[1099511627776, .*spans 2\^62 bytes"),
    "just_below_overflow": (two_tensors(shape_a=(2**30, 2**29)), 16, r"tensor 'a' claims 8 bytes"),
    # numpy cannot hold such a shape even at size 0 ("array is too big"), so it is refused by name
    "empty_but_huge": (two_tensors(shape_a=(0, 2**61, 2**61), a=(0, 0), b=(0, 8)), 8, r"tensor 'a': shape \[0, .*spans 2\^62"),
    "unknown_dtype": (two_tensors(dtype_a="F4"), 16, r"tensor 'a': unsupported dtype 'F4'"),
    "dtype_not_string": (two_tensors(dtype_a=4), 16, r"tensor 'a': unsupported dtype 4"),
    "past_end": (two_tensors(b=(8, 16)), 12, r"tensor 'b' ends at byte 16 of a 12-byte data section"),
    "offsets_reversed": (two_tensors(a=(8, 0)), 16, r"data_offsets \[8, 0\] are not 0 <= begin <= end"),
    "offsets_three": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, 8, r"is not \[begin, end\]"),
    "offsets_float": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, 8, r"is not \[begin, end\]"),
    "entry_list": ({"a": [1, 2]}, 0, r"tensor 'a': entry is not an object"),
    "entry_missing": ({"a": {"dtype": "F32", "shape": [2]}}, 8, r"tensor 'a': entry lacks data_offsets"),
    "metadata_list": ({"__metadata__": ["x"]}, 0, r"__metadata__ must map strings to strings"),
    "metadata_int": ({"__metadata__": {"format": 1}}, 0, r"__metadata__ must map strings to strings"),
    "header_list": ([1, 2], 0, r"header is not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_safetensors_reader_refuses_malformed_headers(tmp_path, case):
    header, data_len, match = BAD_FILES[case]
    f = raw_safetensors(tmp_path / "x.safetensors", header, bytes(data_len))
    with pytest.raises(CheckpointError, match=match) as err:
        SafetensorsFile(f)
    assert str(f) in str(err.value)


@pytest.mark.parametrize("raw,match", [
    (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
     r"header lists 'a' twice"),
    (b'{"a":{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}}', r"header lists 'shape' twice"),
    (b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', r"header is not UTF-8"),
    (b'\xef\xbb\xbf{}', r"not valid JSON"),
    (b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', r"NaN, which is not JSON"),
    (b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,8]}}', r"not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, r"not valid JSON"),
])
def test_safetensors_reader_refuses_ambiguous_or_undecodable_headers(tmp_path, raw, match):
    f = raw_safetensors(tmp_path / "x.safetensors", raw, bytes(8))
    with pytest.raises(CheckpointError, match=match):
        SafetensorsFile(f)


@pytest.mark.parametrize("header_len,match", [(2**63, "header length"), (2**64 - 1, "header length"),
                                              (200, "header length 200 does not fit")])
def test_safetensors_header_length_absurd_or_past_the_end(tmp_path, header_len, match):
    f = raw_safetensors(tmp_path / "x.safetensors", two_tensors(), bytes(16), header_len=header_len)
    with pytest.raises(CheckpointError, match=match):
        SafetensorsFile(f)


def test_well_formed_files_still_read(tmp_path):
    tensors = {"empty": np.zeros((0, 3), np.float32), "w": np.arange(6, dtype=np.float32).reshape(2, 3),
               "codes": np.arange(5, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
               "idx": np.arange(3, dtype=np.uint32)}
    write(tmp_path / "ok.safetensors", tensors, {"format": "pt"})
    f = SafetensorsFile(tmp_path / "ok.safetensors")
    assert f.metadata == {"format": "pt"} and set(f.keys()) == set(tensors)
    for name, a in tensors.items():
        assert f.get(name).dtype == a.dtype and np.array_equal(f.get(name).view(np.uint8), a.view(np.uint8))
    # the header may be padded with spaces (our writer aligns it to 8 bytes)
    raw_safetensors(tmp_path / "padded.safetensors", json.dumps(two_tensors()).encode() + b"     ", bytes(16))
    assert SafetensorsFile(tmp_path / "padded.safetensors").shape("b") == (2,)


def test_writer_refuses_names_the_reader_would_misread(tmp_path):
    for name in ("__metadata__", 3):
        with pytest.raises(ValueError, match="cannot be stored"):
            write(tmp_path / "x.safetensors", {name: np.zeros(2, np.float32)})
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_malformed_shard_in_a_checkpoint_names_file_and_tensor(tmp_path):
    make_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    header[name]["data_offsets"] = header["model.layers.1.mlp.experts.0.gate_proj.weight"]["data_offsets"]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(blob[8 + n:]))
    with pytest.raises(CheckpointError, match=rf"{path}: .*overlaps"):
        ktcy.load_experts(tmp_path, 1)


# --- item 14: index shard names stay in the folder --------------------------------------------

def rewrite_index(path, shard_name):
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: shard_name if v.startswith("model-00001") else v for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE", ""])
def test_index_shard_names_are_confined(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, shards=2)
    os.rename(ckpt / "model-00001-of-00002.safetensors", tmp_path / "outside.safetensors")
    rewrite_index(ckpt, str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder|is not a file name"):
        ktcy.load_experts(ckpt, 1)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, shards=2)
    os.rename(ckpt / "model-00001-of-00002.safetensors", tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", ckpt / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="a symlink out of the folder is refused"):
        ktcy.load_experts(ckpt, 1)
    os.remove(ckpt / "model.safetensors.index.json")  # the same without an index
    with pytest.raises(CheckpointError, match="a symlink out of the folder is refused"):
        ktcy.load_experts(ckpt, 1)


def test_symlinks_inside_the_folder_are_fine(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, shards=2)
    os.mkdir(ckpt / "store")
    os.rename(ckpt / "model-00001-of-00002.safetensors", ckpt / "store" / "s1.safetensors")
    os.symlink("store/s1.safetensors", ckpt / "model-00001-of-00002.safetensors")
    assert ktcy.load_experts(ckpt, 1).format == "BF16"


# --- item 15: wrong exception types become CheckpointError with the file named ----------------

def test_checkpoint_path_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing: not a folder \(nothing exists there\)"):
        ktcy.load_experts(tmp_path / "missing", 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        Checkpoint(tmp_path / "file")
    make_checkpoint(tmp_path / "c")
    os.remove(tmp_path / "c" / "config.json")
    os.mkdir(tmp_path / "c" / "config.json")
    with pytest.raises(CheckpointError, match=r"config.json: a folder; expected a file"):
        ktcy.load_experts(tmp_path / "c", 1)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        ktcy.load_experts(123, 1)
    with pytest.raises(TypeError, match="layer must be an integer"):
        ktcy.load_experts(tmp_path / "c", "1")


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe{}", r"config.json: not UTF-8"), (b"[1, 2]", r"config.json: expected a JSON object"),
    (b'{"hidden_size": 128, "hidden_size": 64}', r"config.json: the file lists 'hidden_size' twice"),
    (b'{"hidden_size": Infinity}', r"config.json: the file holds Infinity, which is not JSON"),
    (b"{" * 100000, r"config.json: the file is not valid JSON"),
])
def test_bad_config_bytes(tmp_path, content, match):
    make_checkpoint(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        ktcy.load_experts(tmp_path, 1)


@pytest.mark.parametrize("doc,match", [
    ([], "malformed index"), ({"weight_map": []}, "malformed index"), ({}, "malformed index"),
    ({"weight_map": {"model.layers.1.mlp.experts.0.gate_proj.weight": 5}}, "is not a file name"),
    ({"weight_map": {"model.layers.1.mlp.experts.0.gate_proj.weight": None}}, "is not a file name"),
])
def test_bad_index_values(tmp_path, doc, match):
    make_checkpoint(tmp_path, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: (shard name .* )?{match}"):
        ktcy.load_experts(tmp_path, 1)


def test_bad_model_file_of_a_converted_folder(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "packed"
    make_checkpoint(src)
    convert_mod.convert(src, out, method="INT8", progress=QUIET)
    (out / "ktcy_model.json").write_text("[]")
    with pytest.raises(CheckpointError, match="ktcy_model.json: expected a JSON object"):
        ktcy.load_experts(out, 1)
    (out / "ktcy_model.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="ktcy_model.json: not UTF-8"):
        ktcy.load_experts(out, 1)


# --- issue 17: ~, hub ids, repr, documentation ------------------------------------------------

def test_tilde_is_expanded_everywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    make_checkpoint(tmp_path / "ckpt")
    add_routers(tmp_path / "ckpt")
    direct = ktcy.load_experts(tmp_path / "ckpt", 1)
    assert same_layer(ktcy.load_experts("~/ckpt", 1), direct)
    assert Checkpoint("~/ckpt").path == str(tmp_path / "ckpt")
    assert list(ktcy.MoEModel.from_pretrained("~/ckpt").blocks) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    convert_mod.convert(tmp_path / "ckpt", tmp_path / "packed", method="INT8", progress=QUIET)
    assert ktcy.load_experts("~/packed", 1).format == "INT8"


def hub_snapshot(cache, repo_id, revision="0123456789abcdef0123456789abcdef01234567"):
    """A checkpoint in the Hugging Face cache layout: snapshot files are symlinks into blobs/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    staging = cache / "staging"
    make_checkpoint(staging)
    add_routers(staging)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(staging))):
        os.rename(staging / name, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


@pytest.mark.parametrize("env,cache", [("HF_HUB_CACHE", "hub"), ("HF_HOME", "hub"),
                                       ("XDG_CACHE_HOME", "huggingface/hub"), ("HOME", ".cache/huggingface/hub")])
def test_hub_id_is_found_in_the_local_cache(tmp_path, monkeypatch, env, cache):
    cache = tmp_path / cache
    snap = hub_snapshot(cache, "Org/Tiny-MoE")
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else tmp_path))
    assert same_layer(ktcy.load_experts("Org/Tiny-MoE", 1), ktcy.load_experts(snap, 1))
    assert Checkpoint("Org/Tiny-MoE").path == str(snap)
    assert len(ktcy.MoEModel.from_pretrained("Org/Tiny-MoE").blocks) == 2


def test_unknown_hub_id_is_refused_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=r"not found locally .*huggingface-cli download Qwen/Qwen3-30B-A3B.* or pass a folder"):
        ktcy.load_experts("Qwen/Qwen3-30B-A3B", 1)
    with pytest.raises(CheckpointError, match="huggingface-cli download"):
        ktcy.MoEModel.from_pretrained("Qwen/Qwen3-30B-A3B")


def test_hub_snapshot_choice_without_or_with_a_stale_refs_main(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = hub_snapshot(cache, "Org/Tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    refs = cache / "models--Org--Tiny" / "refs" / "main"
    refs.write_text("feedface")
    with pytest.raises(CheckpointError, match="names revision feedface, but .* is missing"):
        ktcy.load_experts("Org/Tiny", 1)
    os.remove(refs)  # the only snapshot is used
    assert Checkpoint("Org/Tiny").path == str(snap)
    os.mkdir(snap.parent / "feedface")
    with pytest.raises(CheckpointError, match="several cached revisions"):
        ktcy.load_experts("Org/Tiny", 1)


@pytest.mark.parametrize("ref", ["../../../etc", "/abs", "a/b", ""])
def test_hub_refs_main_cannot_name_a_path(tmp_path, monkeypatch, ref):
    cache = tmp_path / "hub"
    hub_snapshot(cache, "Org/Tiny")
    (cache / "models--Org--Tiny" / "refs" / "main").write_text(ref)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(CheckpointError, match="refs/main: not a revision name"):
        ktcy.load_experts("Org/Tiny", 1)


def test_repr_of_model_and_block(tmp_path):
    make_checkpoint(tmp_path)
    add_routers(tmp_path)
    model = ktcy.MoEModel.from_pretrained(tmp_path, backend="INT8")
    text = repr(model)
    assert text.startswith("MoEModel(architecture=Test,") and "blocks=2" in text and "layers=1-2" in text
    assert "experts=4" in text and "hidden_size=128" in text and "formats=INT8" in text
    isa = model.blocks["model.layers.1.mlp.experts"].experts.isa
    assert f"isa={isa}" in text
    block = repr(model.blocks["model.layers.1.mlp.experts"])
    assert block.startswith("MoEBlock('model.layers.1.mlp.experts', layer=1, experts=4, top_k=2")
    assert "format=INT8" in block and "router=softmax" in block and "shared_experts=False" in block


def test_public_loaders_document_parameters_and_errors():
    for fn, words in ((ktcy.load_experts, ("isa", "group_size", "progress", "method", "Raises", "Returns")),
                      (ktcy.MoEModel.from_pretrained, ("rules", "backend", "layers", "isa", "Raises", "Returns")),
                      (ktcy.MoEModel.inject_expert_backend, ("layer_regex", "backend", "Raises", "Returns"))):
        assert all(w in fn.__doc__ for w in words), fn.__name__
        assert fn.__annotations__.get("return") is not None, fn.__name__


def test_layers_argument_is_type_checked(tmp_path):
    make_checkpoint(tmp_path)
    add_routers(tmp_path)
    with pytest.raises(TypeError, match="layers must be an iterable"):
        ktcy.MoEModel.from_pretrained(tmp_path, layers=1)
    with pytest.raises(TypeError, match="each of layers must be an integer"):
        ktcy.MoEModel.from_pretrained(tmp_path, layers=["1"])
    assert list(ktcy.MoEModel.from_pretrained(tmp_path, layers=np.arange(2, 3)).blocks) == ["model.layers.2.mlp.experts"]


# ---- the fiftieth stop's review: scales, routers and shapes read as their names say ----

def _fp8_block_checkpoint(path, *, H=256, I=2, gate_scale=None, shared_down_scale=None, code=None):
    """FP8 block-scaled experts (E = 2) whose gate grid (1, 2) holds as many values as gate has rows."""
    os.makedirs(path, exist_ok=True)
    cfg = {"model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": 1, "num_experts": 2,
           "num_experts_per_tok": 1, "moe_intermediate_size": I}
    rng, t = np.random.default_rng(0), {}
    for e in range(2):
        for p, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
            t[name] = rng.uniform(-1, 1, (n, k)).astype(ml_dtypes.float8_e4m3fn)
            t[name + "_scale_inv"] = np.ones((-(-n // 128), -(-k // 128)), np.float32)
    g = "model.layers.0.mlp.experts.0.gate_proj.weight"
    if gate_scale is not None:
        t[g + "_scale_inv"] = gate_scale
    if code is not None:
        t[g].view(np.uint8)[1, 3] = code
    if shared_down_scale is not None:
        cfg["n_shared_experts"] = 1
        sp = "model.layers.0.mlp.shared_experts"
        for p, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            t[f"{sp}.{p}_proj.weight"] = rng.uniform(-1, 1, (n, k)).astype(ml_dtypes.float8_e4m3fn)
            t[f"{sp}.{p}_proj.weight_scale_inv"] = np.ones((-(-n // 128), -(-k // 128)), np.float32)
        t[f"{sp}.down_proj.weight_scale_inv"] = shared_down_scale
        t["model.layers.0.mlp.gate.weight"] = (rng.standard_normal((2, H)) * 0.1).astype(ml_dtypes.bfloat16)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write(os.path.join(path, "model.safetensors"), t)
    return t


def test_fp8_block_scales_are_applied_by_block_even_when_they_number_n(tmp_path):
    # gate [2, 256] has a (1, 2) grid: two values, as many as rows; the second covers columns 128-255
    scale = np.array([[1.0, 100.0]], np.float32)
    t = _fp8_block_checkpoint(tmp_path, gate_scale=scale)
    codes = t["model.layers.0.mlp.experts.0.gate_proj.weight"].astype(np.float32)
    expect = codes * np.repeat(scale, 128, axis=1)
    got = Checkpoint(tmp_path).layer(0).dequantized(0)["gate"]
    assert np.array_equal(got, expect)
    moe = ktcy.load_experts(tmp_path, 0, method="BF16")  # packed from the dequantized weights
    x = np.zeros((1, 256), np.float32)
    x[0, 200] = 1.0
    gate = moe.gate[0].dequantize()
    assert np.array_equal(gate[:, 200], expect[:, 200].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_shared_expert_fp8_scales_are_checked_for_every_projection(tmp_path):
    bad = np.ones((3, 3), np.float32)  # down_proj [256, 2]'s grid is (2, 1)
    _fp8_block_checkpoint(tmp_path, shared_down_scale=bad)
    for backend in (None, "BF16"):
        with pytest.raises(CheckpointError, match=r"shared_experts\.down_proj\.weight_scale_inv.*\(2, 1\)"):
            ktcy.MoEModel.from_pretrained(str(tmp_path), backend=backend)


@pytest.mark.parametrize("case", ["nan scale", "inf scale", "nan code 0x7F", "nan code 0xFF"])
def test_fp8_checkpoint_nan_scales_and_codes_are_refused_naming_the_tensor(tmp_path, case):
    scale = {"nan scale": np.array([[np.nan, 1.0]], np.float32),
             "inf scale": np.array([[1.0, np.inf]], np.float32)}.get(case)
    code = {"nan code 0x7F": 0x7F, "nan code 0xFF": 0xFF}.get(case)
    _fp8_block_checkpoint(tmp_path, gate_scale=scale, code=code)
    needle = "weight_scale_inv: scale at" if scale is not None else r"gate_proj\.weight: the E4M3 code at \(1, 3\) is NaN"
    for method in (None, "BF16", "INT8"):
        with pytest.raises(CheckpointError, match=needle):
            ktcy.load_experts(tmp_path, 0, method=method)


@pytest.mark.parametrize("case", ["int32", "nan", "fp8", "shape"])
def test_router_weights_must_be_finite_floats_of_the_config_shape(tmp_path, case):
    make_checkpoint(tmp_path, num_layers=1, dense_layers=())
    path = os.path.join(tmp_path, "model.safetensors")
    f = SafetensorsFile(path)
    t = {n: np.array(f.get(n)) for n in f.keys()}
    del f
    router = (np.random.default_rng(0).standard_normal((4, 128)) * 0.1).astype(np.float32)
    if case == "nan":
        router[2, 7] = np.nan
    if case in ("int32", "fp8"):
        router = router.astype(np.int32 if case == "int32" else ml_dtypes.float8_e4m3fn)
    elif case == "shape":
        router = router[:3]
    t["model.layers.0.mlp.gate.weight"] = router
    write(path, t)
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight"):
        ktcy.MoEModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("shape", [[4, 4] + [1] * 40, [0, 2 ** 70]])
def test_safetensors_shapes_numpy_cannot_view_are_refused_naming_the_tensor(tmp_path, shape):
    path = tmp_path / "t.safetensors"
    n = int(np.prod(shape, dtype=object)) * 4
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * n)
    with pytest.raises(CheckpointError, match=r"tensor 'w': shape .* dimensions"):
        SafetensorsFile(path)


def test_a_float_weight_with_nan_names_layer_expert_and_projection(tmp_path):
    make_checkpoint(tmp_path, num_layers=1, dense_layers=())
    path = os.path.join(tmp_path, "model.safetensors")
    f = SafetensorsFile(path)
    t = {n: np.array(f.get(n)) for n in f.keys()}
    del f
    t["model.layers.0.mlp.experts.1.down_proj.weight"][3, 5] = np.nan
    write(path, t)
    for method in (None, "INT8"):
        with pytest.raises(CheckpointError, match=r"layer 0: down\[1\]: weight row 3 holds NaN"):
            ktcy.load_experts(tmp_path, 0, method=method)


BASE_CONFIG = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 8, "moe_intermediate_size": 4,
               "num_hidden_layers": 3}


@pytest.mark.parametrize("kinds", [["dense", "sparse"], ["dense", "sparse", "moe"], "sparse", ["sparse"] * 4])
def test_mlp_layer_types_that_do_not_list_each_layer_are_refused(kinds):
    with pytest.raises(CheckpointError, match=r"cfg: mlp_layer_types must list 'dense' or 'sparse' for each of the 3"):
        MoEArchitecture.from_config({**BASE_CONFIG, "mlp_layer_types": kinds}, "cfg")


@pytest.mark.parametrize("extra,moe", [
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, (0, 2)),   # no model_type: every key counts
    ({"mlp_only_layers": [0], "moe_layer_freq": 2}, (2,)),
    ({"model_type": "glm4_moe_lite"}, (1, 2)),       # its config class's default: the first layer dense
    ({"model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense", "sparse"]}, (0, 2)),
    ({"model_type": "glm4_moe"}, (1, 2)),            # Glm4MoeConfig's first_k_dense_replace default
    ({"model_type": "deepseek_v2"}, (0, 1, 2)),      # DeepseekV2Config's: 0
    ({"model_type": "qwen3_next", "mlp_only_layers": [1], "decoder_sparse_step": 1}, (0, 2)),
    # keys the family's transformers model does not read, set to values that change nothing
    ({"model_type": "deepseek_v3", "first_k_dense_replace": 1, "moe_layer_freq": 1, "mlp_only_layers": []}, (1, 2)),
    ({"model_type": "minimax_m2", "decoder_sparse_step": 1, "first_k_dense_replace": 0}, (0, 1, 2)),
    ({"model_type": "glm4_moe", "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse", "sparse"]}, (1, 2)),
    ({"model_type": "ernie4_5_moe"}, (1, 2)),        # Ernie4_5_MoeConfig's: from layer 1 to the last
    ({"model_type": "ernie4_5_moe", "moe_layer_start_index": 0, "moe_layer_end_index": 1}, (0, 1)),
    ({"model_type": "ernie4_5_moe", "moe_layer_start_index": 0, "moe_layer_interval": 2}, (1,)),
    ({"model_type": "ernie4_5_moe", "moe_num_experts": 4, "moe_k": 2, "num_experts": None}, (1, 2)),
])
def test_moe_layers_follow_each_familys_rule(extra, moe):
    cfg = {k: v for k, v in {**BASE_CONFIG, **extra}.items() if v is not None}
    assert MoEArchitecture.from_config(cfg, "cfg").moe_layers == moe


@pytest.mark.parametrize("extra,key", [
    # transformers' model for each family reads only its own keys: one of another family's that
    # would make other layers MoE layers is refused, not followed nor ignored in silence
    ({"model_type": "qwen3_5_moe_text", "decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ({"model_type": "minimax_m2", "mlp_only_layers": [0]}, "mlp_only_layers \\[0\\]"),
    ({"model_type": "glm4_moe", "first_k_dense_replace": 1, "moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"model_type": "deepseek_v2", "moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"model_type": "qwen3_next", "first_k_dense_replace": 2}, "first_k_dense_replace 2"),
    ({"model_type": "glm4_moe", "mlp_layer_types": ["sparse"] * 3}, "mlp_layer_types"),
    ({"model_type": "glm4_moe_lite", "first_k_dense_replace": 2}, "first_k_dense_replace 2"),
    ({"model_type": "ernie4_5_moe", "mlp_only_layers": [1]}, "mlp_only_layers \\[1\\]"),
    ({"model_type": "qwen3_moe", "moe_layer_start_index": 2}, "moe_layer_start_index 2"),
])
def test_layer_keys_the_family_does_not_read_are_refused_where_they_disagree(extra, key):
    with pytest.raises(CheckpointError, match=rf"cfg: {key}.* would make other layers MoE layers than "
                                              rf"{extra['model_type']}'s own rule"):
        MoEArchitecture.from_config({**BASE_CONFIG, **extra}, "cfg")


@pytest.mark.parametrize("config,renormalised", [
    ({"model_type": "qwen3_moe"}, False),                                   # Qwen3MoeConfig's default
    ({"model_type": "qwen3_next"}, True),                                   # Qwen3NextConfig's default
    ({"model_type": "qwen3_next", "norm_topk_prob": False}, False),
    ({"model_type": "qwen3_5_moe_text", "norm_topk_prob": False}, True),    # its module has no such switch
    ({"model_type": "qwen3_vl_moe_text"}, True),
    ({"model_type": "minimax_m2", "norm_topk_prob": False}, True),
    ({"model_type": "deepseek_v2", "topk_method": "greedy"}, False),
])
def test_each_family_renormalises_as_transformers_does(config, renormalised):
    from ktcy.routing import kind_settings, router_kind
    cfg = {**BASE_CONFIG, **config}
    arch = MoEArchitecture.from_config(cfg, "cfg")
    settings = kind_settings(router_kind(cfg, "model.layers.1.mlp", "cfg", config["model_type"] == "minimax_m2"), cfg,
                             arch.router_settings())
    assert settings["norm_topk_prob"] is renormalised and settings["n_group"] == 1


@pytest.mark.parametrize("width", [64, 32])
def test_qwen3_vl_moe_stacks_of_square_experts_are_refused_as_ambiguous(tmp_path, width):
    """Qwen3-VL-MoE's fused stacks may be stored [in, out] or [out, in]; down_proj's shape tells
    which, except where hidden_size equals the expert width (and transformers, which decides by
    each stack's shape, leaves a square gate_up_proj as it is where it is twice the width)."""
    make_checkpoint(tmp_path, style="fused", H=64, I=width, extra_config={"model_type": "qwen3_vl_moe_text"})
    with pytest.raises(CheckpointError, match=rf"experts: hidden_size 64 with an expert width of {width}: whether "
                                              r"the stacks are stored \[in, out\] is ambiguous"):
        ktcy.load_experts(tmp_path, 1)


@pytest.mark.parametrize("model_type", ["minimax_m2", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "dots1",
                                        "deepseek_v3"])
def test_a_single_chosen_expert_is_weighted_as_each_family_does(model_type):
    """At num_experts_per_tok 1, GLM's and MiniMax's transformers modules renormalise the one
    weight to 1; DeepSeek's own code (which ktcy follows for DeepSeek-V3 and Kimi-K2) keeps the
    sigmoid score."""
    from ktcy.routing import Router, kind_settings, router_kind
    rng = np.random.default_rng(0)
    E, H = 8, 16
    cfg = {"model_type": model_type, "n_routed_experts": E, "num_experts_per_tok": 1, "hidden_size": H,
           "moe_intermediate_size": 4, "num_hidden_layers": 2, "n_group": 1, "topk_group": 1,
           "norm_topk_prob": True, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0}
    kind = router_kind(cfg, "model.layers.1.mlp", "cfg", True)
    router = Router(kind=kind, weight=rng.standard_normal((E, H)), top_k=1, bias=np.linspace(-0.05, 0.05, E),
                    **kind_settings(kind, cfg, MoEArchitecture.from_config(cfg, "cfg").router_settings()))
    h = rng.standard_normal((5, H)).astype(np.float32)
    ids, w = router(h)
    scores = 1 / (1 + np.exp(-(h @ router.weight.T)))
    want = np.take_along_axis(scores, ids, axis=1) if model_type == "deepseek_v3" else np.ones((5, 1))
    np.testing.assert_allclose(w, want, rtol=1e-6)


def test_deepseek_v2_greedy_ignores_its_groups():
    """topk_method greedy is plain top-k over every expert, whatever n_group says (transformers
    reads the groups only for group_limited_greedy)."""
    from ktcy.routing import Router, kind_settings, router_kind
    rng = np.random.default_rng(1)
    E, H = 8, 16
    cfg = {"model_type": "deepseek_v2", "n_routed_experts": E, "num_experts_per_tok": 3, "hidden_size": H,
           "moe_intermediate_size": 4, "num_hidden_layers": 2, "n_group": 4, "topk_group": 1,
           "topk_method": "greedy", "routed_scaling_factor": 2.0}
    kind = router_kind(cfg, "model.layers.1.mlp", "cfg")
    router = Router(kind=kind, weight=rng.standard_normal((E, H)), top_k=3,
                    **kind_settings(kind, cfg, MoEArchitecture.from_config(cfg, "cfg").router_settings()))
    h = rng.standard_normal((6, H)).astype(np.float32)
    logits = (h @ router.weight.T).astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids, w = router(h)
    assert np.array_equal(np.sort(ids, axis=1), np.sort(np.argsort(-probs, axis=1)[:, :3], axis=1))
    np.testing.assert_allclose(w, 2.0 * np.take_along_axis(probs, ids, axis=1), rtol=1e-5)


@pytest.mark.parametrize("groups,match", [
    ({"n_group": 3, "topk_group": 1}, r"n_group 3 does not divide 4 experts"),
    ({"n_group": 4, "topk_group": 1}, r"1 of 4 groups hold fewer than the 2 experts a token takes"),
])
def test_group_choices_that_cannot_be_made_are_refused(tmp_path, groups, match):
    make_checkpoint(tmp_path, dense_layers=(), extra_config={**DEEPSEEK_ROUTER, "model_type": "deepseek_v3",
                                                             "first_k_dense_replace": 0, **groups})
    add_routers(tmp_path)
    with pytest.raises(CheckpointError, match=r"config.json: " + match):
        ktcy.MoEModel.from_pretrained(tmp_path, layers=[1])


def test_ernie_router_chooses_with_its_bias_and_weights_without_it():
    """ERNIE 4.5: the bias (moe_statics) moves the choice, not the weights, which are the chosen
    probabilities over their sum, that sum at least moe_norm_min."""
    from ktcy.routing import Router
    rng = np.random.default_rng(3)
    E, H, T = 8, 16, 6
    weight, h = rng.standard_normal((E, H)), rng.standard_normal((T, H)).astype(np.float32)
    logits = (h @ weight.T.astype(np.float32)).astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    bias = np.zeros(E)
    bias[[2, 5]] = 1.0  # lifts experts 2 and 5 above any probability
    ids, w = Router(kind="ernie4_5_moe", weight=weight, top_k=2, bias=bias, norm_min=1e-12)(h)
    assert np.array_equal(np.sort(ids, axis=1), np.tile([2, 5], (T, 1)))
    chosen = np.take_along_axis(probs, ids, axis=1)
    np.testing.assert_allclose(w, chosen / chosen.sum(axis=1, keepdims=True), rtol=1e-5)
    _, w = Router(kind="ernie4_5_moe", weight=weight, top_k=2, bias=bias, norm_min=10.0)(h)
    np.testing.assert_allclose(w, chosen / 10.0, rtol=1e-5)


def test_moe_layer_freq_counts_from_layer_zero_as_deepseeks_code():
    """DeepSeek's own code (and Kimi's): MoE where layer >= first_k_dense_replace and
    layer % moe_layer_freq == 0, the period counted from layer 0, not from the first MoE layer."""
    cfg = {**BASE_CONFIG, "num_hidden_layers": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert MoEArchitecture.from_config(cfg, "cfg").moe_layers == (2, 4, 6)
