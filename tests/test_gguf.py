"""GGUF models (llama.cpp's files) read by ktcy.load_experts: files written by the `gguf` package
(llama.cpp's own Python writer), every decoded ggml type equal bit for bit to that package's
dequantization, codes ktcy holds kept as stored (Q4_0 -> INT4 group 32, Q4_K and Q4_1 -> INT4_MIN
group 32, Q8_0 and Q5_0 -> INT8_GROUP group 32, Q6_K -> INT8_GROUP group 16, MXFP4, BF16), the others
refused without a method and quantized again with one, MoE forward against float64 on every
ISA, split files, and damaged or foreign files refused with a CheckpointError."""
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import gguf  # the test extra's: llama.cpp's own writer and dequantization, the reference here
import ktcy
from ktcy.convert import convert
from ktcy.gguf_checkpoint import ARCHITECTURES, GGUFCheckpoint
from ktcy.gguf_io import GGML_TYPES, GGUFFile
from ktcy.gguf_quants import DECODERS, dequantize
from ktcy.output_guard import ConvertError, source_fingerprint
from ktcy.packed_io import read_metadata
from ktcy.safetensors_io import SafetensorsFile, write
from ktcy.safetensors_io import CheckpointError

T = gguf.GGMLQuantizationType
E, H, I, TOP_K = 4, 256, 256, 2   # K-quants store rows in blocks of 256 values
# byte offsets of each block type's f16 fields (ggml's block structs), set to finite values in
# the random blocks so that the decoded weights are usable
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(type_name, values, rng):
    """Bytes of `values` values (a multiple of the block) in ggml type type_name: random codes and
    sub-block scales, finite small f16 block scales, MXFP4 exponents around 2^-6."""
    block, nbytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    if type_name in ("F32", "F16", "BF16"):
        x = (rng.standard_normal(values) * 0.05).astype(np.float32)
        return x.astype(np.float16).view(np.uint8) if type_name == "F16" else \
            gguf.quants.quantize(x, T.BF16) if type_name == "BF16" else x.view(np.uint8)
    b = rng.integers(0, 256, (values // block, nbytes), dtype=np.uint8)
    for at in F16_FIELDS.get(type_name, ()):
        b[:, at:at + 2] = (rng.uniform(-1, 1, (len(b), 1)) * 2e-3).astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":
        b[:, 0] = rng.integers(118, 126, len(b))
    return b.reshape(-1)


def write_model(path, types, arch="qwen3moe", layers=(1,), per_expert=False, meta=None, split_max_tensors=0,
                seed=0, biases=False):
    """A GGUF model whose layers `layers` hold E experts, projection p in ggml type types[p];
    returns {(L, proj): float32 [E, N, K] values as the gguf package decodes them}."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    keys = {f"{arch}.block_count": max(layers) + 1, f"{arch}.expert_count": E, f"{arch}.expert_used_count": TOP_K,
            f"{arch}.embedding_length": H, f"{arch}.expert_feed_forward_length": I}
    keys.update(meta or {})
    for key, value in keys.items():
        if value is not None:  # None: a key left out
            w.add_uint32(key, value)
    truth = {}
    for L in layers:
        for proj in ("gate", "up", "down"):
            n, k = (H, I) if proj == "down" else (I, H)
            tname = types[proj]
            raw = random_blocks(tname, E * n * k, rng)
            values = gguf.quants.dequantize(raw, T[tname]) if tname != "F32" else raw.view(np.float32)
            truth[L, proj] = np.asarray(values, np.float32).reshape(E, n, k)
            row_bytes = raw.size // (E * n)
            stack = raw.view(np.float32 if tname == "F32" else np.uint8).reshape(E, n, -1)
            if tname == "F16":
                stack = raw.view(np.float16).reshape(E, n, k)
            dtype = None if tname in ("F32", "F16") else T[tname]
            if per_expert:
                for e in range(E):
                    w.add_tensor(f"blk.{L}.ffn_{proj}.{e}.weight", np.ascontiguousarray(stack[e]), raw_dtype=dtype)
            else:
                w.add_tensor(f"blk.{L}.ffn_{proj}_exps.weight", stack, raw_dtype=dtype)
            assert row_bytes > 0
            if biases:
                b = (rng.standard_normal((E, n)) * 0.5).astype(np.float32)
                truth[L, proj + "_bias"] = b
                w.add_tensor(f"blk.{L}.ffn_{proj}_exps.bias", b)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return truth


def silu_reference(x, ids, wts, truth, L):
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float64)
        for j, e in enumerate(ids[t]):
            g = truth[L, "gate"][e].astype(np.float64) @ xt
            u = truth[L, "up"][e].astype(np.float64) @ xt
            out[t] += wts[t, j] * (truth[L, "down"][e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return out


def inputs(seed=3, T_=7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T_, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T_)])
    return x, ids, rng.random((T_, TOP_K)).astype(np.float32)


def isas():
    return [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]


def rel(y, ref):
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


def test_type_table_is_ggmls():
    for type_id, (name, block, nbytes) in GGML_TYPES.items():
        assert int(T[name]) == type_id and gguf.GGML_QUANT_SIZES[T[name]] == (block, nbytes), name


@pytest.mark.parametrize("type_name", sorted(DECODERS) + ["F16", "BF16"])
def test_decoders_equal_ggufs_bit_for_bit(type_name):
    """Every code and scale pattern (random bytes, f16 block scales anywhere, NaN/inf ones too)."""
    rng = np.random.default_rng(7)
    block, nbytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    raw = rng.integers(0, 256, 2048 * nbytes, dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = np.asarray(gguf.quants.dequantize(raw, T[type_name]), np.float32).reshape(-1)
        mine = dequantize(type_name, raw, (2048 * block,))
    assert mine.dtype == np.float32
    same = (mine.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(mine) & np.isnan(ref))
    assert same.all(), (type_name, np.flatnonzero(~same)[:5])


def test_q4_0_is_kept_as_int4_group_32(tmp_path):
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"})
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "INT4" and moe.gate[0].group_size == 32
    for proj in ("gate", "up", "down"):
        for e in range(E):
            assert np.array_equal(getattr(moe, proj)[e].dequantize(np.float32), truth[1, proj][e]), (proj, e)
    x, ids, wts = inputs()
    y = moe.forward(x, ids, wts)
    assert rel(y, silu_reference(x, ids, wts, truth, 1)) < 0.03  # the int8 activations' error only
    for isa in isas():  # integer kernels: the same bits everywhere
        assert np.array_equal(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, wts), y), isa


@pytest.mark.parametrize("types", [("BF16", "BF16", "BF16"), ("F16", "F32", "BF16")])
def test_float_types_load_as_bf16(tmp_path, types):
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, dict(zip(("gate", "up", "down"), types)))
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "BF16"
    x, ids, wts = inputs(4, 1)  # T = 1
    ref = silu_reference(x, ids, wts, truth, 1)
    for isa in isas():
        assert rel(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, wts), ref) < 6e-3, isa


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K", "Q6_K"), ("Q8_0", "Q8_0", "Q2_K"), ("Q5_K", "Q2_K", "Q3_K"),
                                   ("Q4_1", "Q5_0", "Q5_1"), ("Q4_0", "Q4_0", "Q3_K"), ("IQ4_XS", "IQ4_XS", "IQ4_NL"),
                                   ("Q5_K", "Q6_K", "Q8_0")])
def test_other_types_need_a_method_and_dequantize_exactly(tmp_path, types, caplog):
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, dict(zip(("gate", "up", "down"), types)))
    with pytest.raises(CheckpointError, match="no ktcy format holds as stored; pass a method") as err:
        ktcy.load_experts(path, 1)
    assert types[2] in str(err.value)
    layer = GGUFCheckpoint(path).layer(1)
    for proj in ("gate", "up", "down"):
        assert np.array_equal(layer.dequantized(2)[proj], truth[1, proj][2])
    x, ids, wts = inputs(5, 12)
    ref = silu_reference(x, ids, wts, truth, 1)
    bf16 = ktcy.load_experts(path, 1, method="BF16")
    assert rel(bf16.forward(x, ids, wts), ref) < 6e-3
    with caplog.at_level("WARNING", logger="ktcy"):
        int8 = ktcy.load_experts(path, 1, method="AMXINT8")
    assert int8.format == "INT8" and rel(int8.forward(x, ids, wts), ref) < 0.03
    assert "loading it as INT8 dequantizes " in caplog.text and "quantizes it again" in caplog.text
    assert f"{types[2]} (" in caplog.text


def assert_kept_layer_runs_everywhere(path, moe, truth):
    """moe, layer 1 of the GGUF at path as stored: within the int8 activations' error of float64
    on the file's values, and the same bits on every ISA, prefill and decode (T = 1)."""
    x, ids, wts = inputs()
    y = moe.forward(x, ids, wts)
    assert rel(y, silu_reference(x, ids, wts, truth, 1)) < 0.03
    for isa in isas():
        other = ktcy.load_experts(path, 1, isa=isa)
        assert np.array_equal(other.forward(x, ids, wts), y), isa
        assert np.array_equal(other.forward(x[:1], ids[:1], wts[:1]), y[:1]), isa


def _q4_k_fields(raw, n, k):
    """Q4_K's fields read from ggml's block_q4_K (144 bytes per 256 values: f16 d, f16 dmin, 12
    bytes of 6-bit scales and mins, 128 bytes of nibbles), written here from the format, apart
    from the reader: (codes [n, k], scale d * sc [n, k/32], min -(dmin * m) [n, k/32])."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = b[:, 4:16].astype(np.int32)
    sc, m = np.zeros((len(b), 8), np.int32), np.zeros((len(b), 8), np.int32)
    for j in range(8):  # get_scale_min_k4
        if j < 4:
            sc[:, j], m[:, j] = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            m[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    codes = np.zeros((len(b), 256), np.uint8)
    for c in range(4):  # 64 values per 32 bytes: low nibbles first, then high
        q = b[:, 16 + 32 * c:16 + 32 * (c + 1)]
        codes[:, 64 * c:64 * c + 32], codes[:, 64 * c + 32:64 * c + 64] = q & 0xF, q >> 4
    scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
    mins = -(dmin * m.astype(np.float32)).reshape(n, k // 32)
    return codes.reshape(n, k), scale, mins


def _q4_1_fields(raw, n, k):
    """block_q4_1 (20 bytes per 32 values: f16 d, f16 m, 16 bytes: value j the low nibble of byte
    j, value j + 16 its high one): (codes, d, m), w = d * q + m."""
    b = raw.reshape(-1, 20)
    codes = np.concatenate([b[:, 4:] & 0xF, b[:, 4:] >> 4], axis=1).reshape(n, k)
    half = lambda at: b[:, at:at + 2].copy().view(np.float16).astype(np.float32).reshape(n, k // 32)  # noqa: E731
    return codes, half(0), half(2)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_1"])
def test_q4_k_and_q4_1_are_kept_as_int4_min_group_32(tmp_path, type_name):
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, {"gate": type_name, "up": type_name, "down": type_name})
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "INT4_MIN" and moe.gate[0].group_size == 32
    layer = GGUFCheckpoint(path).layer(1)
    fields = _q4_k_fields if type_name == "Q4_K" else _q4_1_fields
    for proj in ("gate", "up", "down"):
        for e in range(E):
            p = getattr(moe, proj)[e]
            codes, scale, mins = fields(layer._raw(proj, e)[1], *p.shape)
            assert np.array_equal(p.codes(), codes), (proj, e)
            assert np.array_equal(p.group_scales()[:, :p.shape[0]].T, scale), (proj, e)
            assert np.array_equal(p.group_mins()[:, :p.shape[0]].T, mins), (proj, e)
            # s * q + min in float32 is llama.cpp's value, bit for bit
            assert np.array_equal(p.dequantize(np.float32), truth[1, proj][e]), (proj, e)
    x, ids, wts = inputs()
    y = moe.forward(x, ids, wts)
    assert rel(y, silu_reference(x, ids, wts, truth, 1)) < 0.03  # the int8 activations' error only
    for isa in isas():  # the same bits everywhere
        assert np.array_equal(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, wts), y), isa


def _five_bit_codes(high_bytes, nibble_bytes):
    """Q5_0's and Q5_1's codes 0..31 [blocks, 32]: value j is the low nibble of byte j (j < 16) or
    the high nibble of byte j - 16, with bit j of the little-endian uint32 of high bits on top."""
    high = np.ascontiguousarray(high_bytes).view(np.uint32)[:, 0]
    codes = np.zeros((len(high), 32), np.uint8)
    for j in range(32):
        nib = nibble_bytes[:, j % 16] & 0xF if j < 16 else nibble_bytes[:, j % 16] >> 4
        codes[:, j] = nib | (((high >> j) & 1) << 4)
    return codes


def _q5_fields(type_name, raw, n, k):
    """Q5_K's and Q5_1's codes, scales and mins read from ggml's block structs, written here from
    the format apart from the reader: (codes 0..31 [n, k], scale [n, k/32], min [n, k/32]).
      block_q5_1: f16 d, f16 m, uint32 high bits (bit j: value j's fifth bit), 16 bytes of
        nibbles (value j the low nibble of byte j, value j + 16 its high one); w = d * q + m.
      block_q5_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (as Q4_K), 32 bytes qh,
        128 bytes qs: value 64c + i is the low nibble of qs byte 32c + i, 64c + 32 + i its high
        one, and bit 2c (resp. 2c + 1) of qh byte i on top; w = d * sc * q - dmin * m."""
    if type_name == "Q5_1":
        b = raw.reshape(-1, 24)
        codes = _five_bit_codes(b[:, 4:8], b[:, 8:24])
        half = lambda at: b[:, at:at + 2].copy().view(np.float16).astype(np.float32).reshape(n, k // 32)  # noqa: E731
        return codes.reshape(n, k), half(0), half(2)
    b = raw.reshape(-1, 176)
    as_q4_k = np.concatenate([b[:, :16], b[:, 48:]], axis=1)  # d, dmin, scales, nibbles: Q4_K's block
    nibbles, scale, mins = _q4_k_fields(np.ascontiguousarray(as_q4_k), n, k)
    codes = nibbles.reshape(-1, 256).copy()
    for c in range(4):
        for i in range(32):
            codes[:, 64 * c + i] |= ((b[:, 16 + i] >> (2 * c)) & 1) << 4
            codes[:, 64 * c + 32 + i] |= ((b[:, 16 + i] >> (2 * c + 1)) & 1) << 4
    return codes.reshape(n, k), scale, mins


@pytest.mark.parametrize("types", [("Q5_K",) * 3, ("Q5_1",) * 3, ("Q5_K", "Q5_K", "Q6_K"), ("Q5_1", "Q5_1", "Q8_0")])
def test_q5_k_and_q5_1_are_kept_as_int8_min_group_32(tmp_path, types, caplog):
    """Kept as stored with method=None: the file's codes, scales and mins; s * q + min in float32
    is llama.cpp's value bit for bit.  Q5_K_M's Q6_K down (and Q8_0 beside Q5_1) keeps its own
    format, INT8_GROUP."""
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, dict(zip(("gate", "up", "down"), types)))
    with caplog.at_level("WARNING", logger="ktcy"):
        moe = ktcy.load_experts(path, 1)
    assert "quantizes it again" not in caplog.text
    assert moe.format == "INT8_MIN" and moe.gate[0].group_size == 32
    assert moe.down_format == ("INT8_MIN" if types[2] == types[0] else "INT8_GROUP")
    layer = GGUFCheckpoint(path).layer(1)
    for proj, type_name in zip(("gate", "up", "down"), types):
        for e in range(E):
            p = getattr(moe, proj)[e]
            if type_name.startswith("Q5"):
                codes, scale, mins = _q5_fields(type_name, layer._raw(proj, e)[1], *p.shape)
                assert np.array_equal(p.codes(), codes), (proj, e)
                assert np.array_equal(p.group_scales()[:, :p.shape[0]].T, scale), (proj, e)
                assert np.array_equal(p.group_mins()[:, :p.shape[0]].T, mins), (proj, e)
            assert np.array_equal(p.dequantize(np.float32), truth[1, proj][e]), (proj, e)
    assert max(int(p.codes().max()) for p in moe.gate) == 31  # five bits, kept in bytes
    assert_kept_layer_runs_everywhere(path, moe, truth)


def _int8_group_fields(type_name, raw, n, k):
    """Q8_0's, Q5_0's and Q6_K's codes and scales read from ggml's block structs, written here
    from the format apart from the reader: (codes int8 [n, k], scale [n, k / group]).
      block_q8_0: f16 d, 32 int8 codes.
      block_q5_0: f16 d, uint32 high bits (bit j: value j's fifth bit), 16 bytes of nibbles
        (value j the low nibble of byte j, value j + 16 its high one); code q - 16.
      block_q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d; per 128 values (half h),
        value 32j + i: ql byte 64h + 32(j % 2) + i (low nibble for j < 2, high for j >= 2),
        bits 2j..2j+1 of qh byte 32h + i on top; code q - 32, scale d * sc[value / 16]."""
    half = lambda b, at: b[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    if type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        return b[:, 2:].copy().view(np.int8).reshape(n, k), half(b, 0).reshape(n, k // 32)
    if type_name == "Q5_0":
        b = raw.reshape(-1, 22)
        codes = _five_bit_codes(b[:, 2:6], b[:, 6:22]).astype(np.int16) - 16
        return codes.astype(np.int8).reshape(n, k), half(b, 0).reshape(n, k // 32)
    b = raw.reshape(-1, 210)
    codes = np.zeros((len(b), 256), np.int16)
    for h in range(2):
        for j in range(4):
            for i in range(32):
                ql = b[:, 64 * h + 32 * (j % 2) + i]
                nib = ql & 0xF if j < 2 else ql >> 4
                codes[:, 128 * h + 32 * j + i] = (nib | (((b[:, 128 + 32 * h + i] >> (2 * j)) & 3) << 4)) - 32
    scale = half(b, 208) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return codes.astype(np.int8).reshape(n, k), scale.reshape(n, k // 16)


@pytest.mark.parametrize("types,groups", [(("Q8_0",) * 3, (32, 32)), (("Q5_0",) * 3, (32, 32)), (("Q6_K",) * 3, (16, 16)),
                                          (("Q8_0", "Q5_0", "Q6_K"), (16, 16)), (("Q6_K", "Q8_0", "Q8_0"), (16, 16))])
def test_q8_0_q5_0_and_q6_k_are_kept_as_int8_group(tmp_path, types, groups, caplog):
    """Kept as stored with method=None: the codes and scales of the file, s * q in float32 equal
    to llama.cpp's value bit for bit.  One format takes one group, the smallest of its tensors'
    (a group-32 scale twice beside Q6_K's 16: the same values, no warning), as convert writes it."""
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, dict(zip(("gate", "up", "down"), types)))
    with caplog.at_level("WARNING", logger="ktcy"):
        moe = ktcy.load_experts(path, 1)
        assert ktcy.load_experts(path, 1, group_size=16).gate[0].group_size == 16  # split exactly: no warning
    assert "quantizes it again" not in caplog.text
    assert moe.format == moe.down_format == "INT8_GROUP"
    assert (moe.gate[0].group_size, moe.down[0].group_size) == groups
    layer = GGUFCheckpoint(path).layer(1)
    for proj, type_name in zip(("gate", "up", "down"), types):
        group = groups[proj == "down"]
        for e in range(E):
            p = getattr(moe, proj)[e]
            codes, scale = _int8_group_fields(type_name, layer._raw(proj, e)[1], *p.shape)
            assert np.array_equal(p.codes(), codes), (proj, e)
            own = p.shape[1] // scale.shape[1]  # the tensor's group: 32 or 16
            assert np.array_equal(np.repeat(scale, own // group, axis=1), p.group_scales()[:, :p.shape[0]].T), (proj, e)
            assert np.array_equal(p.dequantize(np.float32), truth[1, proj][e]), (proj, e)
    if "Q8_0" in types:  # random Q8_0 bytes hold code -128 too (llama.cpp writes -127..127)
        assert min(p.codes().min() for p in moe.gate + moe.up + moe.down) == -128
    x, ids, wts = inputs()
    y = moe.forward(x, ids, wts)
    assert rel(y, silu_reference(x, ids, wts, truth, 1)) < 0.03  # the int8 activations' error only
    for isa in isas():  # the same bits everywhere
        assert np.array_equal(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, wts), y), isa


def test_q4_k_m_layer_keeps_every_tensor_as_stored(tmp_path, caplog):
    """Q4_K_M stores ffn_down as Q6_K in some layers: method=None keeps gate and up as INT4_MIN
    group 32 and down as INT8_GROUP group 16, every value llama.cpp's, on every ISA; the
    projections' kernels are named."""
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    with caplog.at_level("WARNING", logger="ktcy"):
        moe = ktcy.load_experts(path, 1)
    assert "quantizes it again" not in caplog.text
    assert (moe.format, moe.gate[0].group_size, moe.down_format, moe.down[0].group_size) == ("INT4_MIN", 32, "INT8_GROUP", 16)
    assert moe.config.down_quant_config == ktcy.QuantConfig("INT8_GROUP", group_size=16)
    assert "INT4_MIN on" in moe.kernel and "gate and up; down: INT8_GROUP on" in moe.kernel
    for e in range(E):
        for proj in ("gate", "up", "down"):
            assert np.array_equal(getattr(moe, proj)[e].dequantize(np.float32), truth[1, proj][e]), (proj, e)
    assert_kept_layer_runs_everywhere(path, moe, truth)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ktcy"):  # a group that is not the stored one's divisor: said once
        regrouped = ktcy.load_experts(path, 1, group_size=64)
    assert (regrouped.gate[0].group_size, regrouped.down[0].group_size) == (64, 64)
    assert "loading gate and up as INT4_MIN group 64 dequantizes" in caplog.text
    assert "loading down as INT8_GROUP group 64 dequantizes" in caplog.text


def test_q4_k_m_layer_with_int4_min_keeps_gate_and_up(tmp_path, caplog):
    """With method="INT4_MIN" gate and up stay as stored, down is quantized again (one format, as
    a converted folder holds it)."""
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    with caplog.at_level("WARNING", logger="ktcy"):
        moe = ktcy.load_experts(path, 1, method="INT4_MIN")
    assert "dequantizes Q6_K (down) and quantizes it again" in caplog.text and "the rest stays as stored" in caplog.text
    assert moe.format == "INT4_MIN" and moe.gate[0].group_size == 32
    for e in range(E):
        for proj in ("gate", "up"):
            assert np.array_equal(getattr(moe, proj)[e].dequantize(np.float32), truth[1, proj][e]), (proj, e)
        assert not np.array_equal(moe.down[e].dequantize(np.float32), truth[1, "down"][e])
    x, ids, wts = inputs()
    kept = dict(truth)
    kept[1, "down"] = np.stack([moe.down[e].dequantize(np.float32) for e in range(E)])  # the 4-bit down
    assert rel(moe.forward(x, ids, wts), silu_reference(x, ids, wts, kept, 1)) < 0.03  # int8 activations' error
    assert rel(moe.forward(x, ids, wts), silu_reference(x, ids, wts, truth, 1)) < 0.1  # and Q6_K's down to 4 bits


def test_gpt_oss_mxfp4_kept_with_biases_and_its_activation(tmp_path):
    path = str(tmp_path / "m.gguf")
    truth = write_model(path, {"gate": "MXFP4", "up": "MXFP4", "down": "MXFP4"}, arch="gpt-oss", biases=True)
    moe = ktcy.load_experts(path, 1)
    assert moe.format == "MXFP4" and moe.config.activation == "gpt_oss"
    assert (moe.config.swiglu_alpha, moe.config.swiglu_limit) == (1.702, 7.0)
    for proj in ("gate", "up", "down"):
        assert np.array_equal(getattr(moe, proj)[1].dequantize(np.float32), truth[1, proj][1]), proj
    x, ids, wts = inputs(6)
    x *= 8  # gate and up reach the clamp at 7
    out = np.zeros((x.shape[0], H))
    clamped = []
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            gate = truth[1, "gate"][e].astype(np.float64) @ x[t] + truth[1, "gate_bias"][e]
            up = truth[1, "up"][e].astype(np.float64) @ x[t] + truth[1, "up_bias"][e]
            clamped.append((gate > 7).mean() + (np.abs(up) > 7).mean())
            g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
            act = (u + 1) * g / (1 + np.exp(-1.702 * g))
            out[t] += wts[t, j] * (truth[1, "down"][e].astype(np.float64) @ act + truth[1, "down_bias"][e])
    assert np.mean(clamped) > 0.02
    for isa in isas():
        assert rel(ktcy.load_experts(path, 1, isa=isa).forward(x, ids, wts), out) < 6e-3, isa


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_listed_loads_with_its_activation(tmp_path, arch):
    path = str(tmp_path / "m.gguf")
    # Mixtral's files (arch "llama") state the expert width as the model's feed_forward_length
    meta = {f"{arch}.expert_feed_forward_length": None, f"{arch}.feed_forward_length": I} if arch == "llama" else {}
    write_model(path, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, arch=arch, meta=meta, biases=arch == "gpt-oss")
    moe = ktcy.load_experts(path, 1)
    assert moe.config.activation == ("gpt_oss" if arch == "gpt-oss" else "silu")
    assert (moe.config.num_experts, moe.config.top_k, moe.config.hidden_size, moe.config.intermediate_size) == (E, TOP_K, H, I)


def test_per_expert_tensors_and_split_files(tmp_path):
    one = str(tmp_path / "one.gguf")
    truth = write_model(one, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, per_expert=True, layers=(0, 2))
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_model(str(split_dir / "m.gguf"), {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, layers=(0, 2),
                split_max_tensors=4)
    parts = sorted(os.listdir(split_dir))
    assert len(parts) == 2 and parts[0].endswith("-00001-of-00002.gguf")
    x, ids, wts = inputs(8)
    ref = silu_reference(x, ids, wts, truth, 2)
    y = ktcy.load_experts(one, 2).forward(x, ids, wts)
    assert rel(y, ref) < 0.03
    for target in (split_dir, split_dir / parts[1]):  # the folder, or any part, names the model
        assert np.array_equal(ktcy.load_experts(target, 2).forward(x, ids, wts), y)
    assert GGUFCheckpoint(one).arch.moe_layers == (0, 2)
    with pytest.raises(CheckpointError, match="layer 1 is not an MoE layer"):
        ktcy.load_experts(one, 1)
    os.remove(split_dir / parts[1])
    with pytest.raises(CheckpointError, match="is missing"):
        ktcy.load_experts(split_dir / parts[0], 2)


def _header_end(path):
    """Offset of the first tensor's bytes: the data section."""
    f = GGUFFile(path)
    return min(t.begin for t in f.tensors.values())


def _patch(path, at, data):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _tensor_info_offset(path, name):
    """Where tensor `name`'s directory entry (its name string's length) starts."""
    raw = open(path, "rb").read()
    key = name.encode()
    return raw.index(struct.pack("<Q", len(key)) + key)


BAD_FILES = {
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) - 100), "runs past the end of the file"),
    "header only": (lambda p: os.truncate(p, 20), "too short|runs past the end"),
    "magic": (lambda p: _patch(p, 0, b"GGML"), "not a GGUF file"),
    "version": (lambda p: _patch(p, 4, struct.pack("<I", 1)), "GGUF version 1"),
    "big-endian": (lambda p: _patch(p, 4, struct.pack(">I", 3)), "big-endian"),
    "tensor count": (lambda p: _patch(p, 8, struct.pack("<Q", 1 << 40)), "tensors"),
    "unknown type": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4 + 24,
                                      struct.pack("<I", 77)), "unknown ggml type 77"),
    "undecoded type": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4 + 24,
                                        struct.pack("<I", 16)), "IQ2_XXS, a ggml type ktcy does not decode"),
    "offset past end": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4 + 24 + 4,
                                         struct.pack("<Q", 1 << 50)), "runs past the end of the file"),
    "misaligned": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4 + 24 + 4,
                                    struct.pack("<Q", 8)), "not a multiple of the alignment"),
    "overlap": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4 + 24 + 4,
                                 struct.pack("<Q", 0)), "overlap"),
    "dims": (lambda p: _patch(p, _tensor_info_offset(p, "blk.1.ffn_up_exps.weight") + 8 + 24 + 4,
                              struct.pack("<Q", 128)), r"blk.1.ffn_up_exps.weight is \[4, 256, 128\]"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_damaged_files_are_refused_naming_the_problem(tmp_path, case):
    path = str(tmp_path / "m.gguf")
    write_model(path, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"})
    edit, message = BAD_FILES[case]
    edit(path)
    with pytest.raises(CheckpointError, match=message):
        ktcy.load_experts(path, 1)


@pytest.mark.parametrize("meta, message", [
    ({"general.architecture": "grok"}, "not an MoE architecture ktcy reads"),
    ({"qwen3moe.expert_count": 8}, r"is \[4, 256, 256\] .* implies \[8, 256, 256\]"),
    ({"qwen3moe.expert_used_count": 9}, "expert_used_count 9 exceeds"),
    ({"qwen3moe.embedding_length": 128}, "implies"),
    ({"qwen3moe.block_count": 1}, "block_count is 1, but the file stores experts of layer 1"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path, meta, message):
    path = str(tmp_path / "m.gguf")
    meta = dict(meta)
    arch = meta.pop("general.architecture", "qwen3moe")
    write_model(path, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, arch=arch, meta=meta)
    with pytest.raises(CheckpointError, match=message):
        ktcy.load_experts(path, 1)


def test_bit_flips_in_the_header_give_checkpoint_errors_or_a_layer(tmp_path):
    """Any single byte of the header and directory changed: a CheckpointError or a loaded layer,
    never another exception or a crash."""
    path = str(tmp_path / "m.gguf")
    write_model(path, {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"})
    original = open(path, "rb").read()
    end = _header_end(path)
    rng = np.random.default_rng(11)
    for at in rng.choice(end, 120, replace=False):
        damaged = bytearray(original)
        damaged[at] ^= int(rng.integers(1, 256))
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            ktcy.load_experts(path, 1)
        except CheckpointError:
            pass


class Quiet:
    def bar(self, *a):
        pass

    def line(self, text):
        pass


def _rewritten(path, flat=None, **changes):
    """The packed layer file at `path` written again with its metadata changed (None: removed)
    and the tensor `flat` as one row per expert."""
    old = SafetensorsFile(path)
    tensors = {k: np.array(old.get(k)) for k in old.keys()}
    if flat:
        tensors[flat] = tensors[flat].reshape(len(tensors[flat]), -1)
    meta = {k: v for k, v in dict(old.metadata, **changes).items() if v is not None}
    write(path, tensors, meta)


def test_a_converted_q4_k_m_layer_is_loaded_as_packed_and_its_down_format_checked(tmp_path):
    """The folder keeps Q4_K_M's two formats: a method or group size that is not what a side
    holds is refused, a conversion in one format is another conversion, and metadata that
    contradicts the layout is refused before any block is read."""
    path, out = str(tmp_path / "m.gguf"), tmp_path / "packed"
    write_model(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, layers=(1, 2))
    assert convert(path, out, progress=Quiet()) == [1, 2]
    with pytest.raises(CheckpointError, match=r"packed as INT4_MIN \(down INT8_GROUP\); converting to INT4_MIN needs"):
        ktcy.load_experts(out, 1, method="INT4_MIN")
    with pytest.raises(CheckpointError, match="packed as INT4_MIN with group size 32 and down as INT8_GROUP with group "
                                              "size 16; group_size=32 needs"):
        ktcy.load_experts(out, 1, group_size=32)
    assert convert(path, out, resume=True, progress=Quiet()) == [1, 2]  # kept: the same record
    with pytest.raises(ConvertError, match="down INT8_GROUP group 16 on disk, INT4_MIN group 32 asked"):
        convert(path, out, method="INT4_MIN", resume=True, progress=Quiet())
    f = str(out / "ktcy_layer_0002.safetensors")
    good = open(f, "rb").read()
    refusals = [({"down_weight_format": None}, "layout version 3 without metadata down_weight_format"),
                ({"layout_version": "2"}, "metadata down_weight_format in a layout 2 file"),
                ({"down_weight_format": "INT5"}, "unknown down weight format 'INT5'"),
                ({"down_group_size": "x"}, "down_group_size='x' is not a whole number"),
                ({"down_scale_kind": "channel"}, "down_scale_kind 'channel' contradicts INT8_GROUP"),
                ({"down_weight_format": "INT4_MIN", "down_group_size": "32"}, "down.data is uint8"),
                ({"down_weight_format": "INT4_MIN"}, "down: group size 16 is not valid for INT4_MIN"),
                ({"down_group_size": "32"}, "down.scale is float32"),
                ({"flat": "down.scale"}, "down.scale is float32")]  # layout 3's group arrays as written
    for changes, message in refusals:
        _rewritten(f, **changes)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            ktcy.load_experts(out, 2)
        with open(f, "wb") as w:
            w.write(good)
    x, ids, wts = inputs(4)
    assert np.array_equal(ktcy.load_experts(out, 2).forward(x, ids, wts), ktcy.load_experts(path, 2).forward(x, ids, wts))
    # the folder against another checkpoint of the same shape (a Hugging Face one, whose layers
    # hold one format): named as converted from other weights
    from checkpoints import make_checkpoint
    from ktcy.checkpoint import Checkpoint
    from ktcy.converted import ConvertedFolder
    hf = tmp_path / "hf"
    make_checkpoint(hf, E=E, H=H, I=I, top_k=TOP_K, num_layers=3)
    with pytest.raises(CheckpointError, match="converted from other weights than .*down as INT8_GROUP beside INT4_MIN"):
        ConvertedFolder(out, Checkpoint(str(hf))).load(1)


@pytest.mark.parametrize("arch, types, method", [("qwen3moe", ("Q4_0",) * 3, None), ("gpt-oss", ("MXFP4",) * 3, None),
                                                 ("gpt-oss", ("MXFP4",) * 3, "MXFP4_A8"),
                                                 ("deepseek2", ("Q4_K", "Q4_K", "Q6_K"), "INT4"),
                                                 ("qwen3moe", ("Q4_K",) * 3, None),
                                                 ("qwen3moe", ("Q4_K", "Q4_K", "Q6_K"), "INT4_MIN"),
                                                 ("qwen3moe", ("Q4_K", "Q4_K", "Q6_K"), None),
                                                 ("qwen3moe", ("Q4_0", "Q4_0", "Q8_0"), None),
                                                 ("qwen3moe", ("Q8_0", "Q8_0", "Q6_K"), None),
                                                 ("qwen3moe", ("Q5_K", "Q5_K", "Q6_K"), None)])
def test_convert_round_trip_equals_loading_the_gguf(tmp_path, arch, types, method):
    """A converted layer is the GGUF layer as load_experts packs it, byte for byte: Q4_K_M's Q6_K
    down too, in a format of its own (layout 3), and Q8_0 beside Q6_K in one format (group 16)."""
    path, out = str(tmp_path / "m.gguf"), tmp_path / "packed"
    write_model(path, dict(zip(("gate", "up", "down"), types)), arch=arch, layers=(1, 2), biases=arch == "gpt-oss")
    assert convert(path, out, method=method, progress=Quiet()) == [1, 2]
    assert not (out / "config.json").exists()
    x, ids, wts = inputs(9)
    for L in (1, 2):
        direct, packed = ktcy.load_experts(path, L, method=method), ktcy.load_experts(out, L)
        assert (packed.format, packed.down_format) == (direct.format, direct.down_format)
        assert packed.config.activation == direct.config.activation
        assert np.array_equal(packed.forward(x, ids, wts), direct.forward(x, ids, wts))
        for proj in ("gate", "up", "down"):
            held, fresh = getattr(packed, proj)[3], getattr(direct, proj)[3]
            assert (held.format, held.group_size) == (fresh.format, fresh.group_size), proj
            for part in ("data", "scale", "colsum", "zero"):
                a, b = getattr(held, part), getattr(fresh, part)
                assert (a is None and b is None) or np.array_equal(np.ravel(a), np.ravel(b)), (proj, part)
    own_down = packed.down_format != packed.format
    assert read_metadata(str(out / "ktcy_layer_0001.safetensors"))[1]["layout_version"] == ("3" if own_down else "2")
    assert convert(path, out, method=method, resume=True, progress=Quiet()) == [1, 2]  # the fingerprint matches
    os.utime(path, ns=(1, 1))  # the GGUF "changed": its layers are converted again, not kept
    with pytest.raises(ConvertError, match="differs from this conversion"):
        convert(path, out, method=method, resume=True, progress=Quiet())


def test_convert_cli_errors_are_one_line(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_model(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    for extra, message in ((["--method", "INT8", "--input-type", "bf16"], "stores ggml types"),
                           (["--group-size", "32"], "the target format is the checkpoint’s own precision")):
        r = subprocess.run([sys.executable, "-m", "ktcy", "convert", "-i", path, "-o", str(tmp_path / "o"), *extra],
                           capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(CheckpointError, match="no tensor blk.1.ffn_gate_inp.weight"):  # experts only
        ktcy.MoEModel.from_pretrained(path, backend="INT8")


# Found by an adversarial review (each failed before its fix)
Q4_0 = {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}


def _writer(path, arch="qwen3moe", blocks=2, extra=None):
    w = gguf.GGUFWriter(path, arch)
    keys = {f"{arch}.block_count": blocks, f"{arch}.expert_count": E, f"{arch}.expert_used_count": TOP_K,
            f"{arch}.embedding_length": H, f"{arch}.expert_feed_forward_length": I}
    keys.update(extra or {})
    for k, v in keys.items():
        w.add_uint32(k, v)
    return w


def _close(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# metadata vs tensors, hostile counts

def test_per_expert_tensors_beyond_expert_count_are_refused(tmp_path):
    """Legacy per-expert files: blk.L.ffn_gate.{e}.weight for e = 0..3, but expert_count = 2.
    The fused layout refuses this (shape [4, ...] vs metadata [2, ...]); the per-expert one
    silently loads only experts 0 and 1 and drops the others."""
    path = str(tmp_path / "m.gguf")
    write_model(path, Q4_0, per_expert=True, meta={"qwen3moe.expert_count": 2})
    with pytest.raises(CheckpointError, match="expert"):
        ktcy.load_experts(path, 1)


def test_huge_expert_count_with_per_expert_tensors_fails_fast(tmp_path):
    """expert_count = 2^31 (the largest _meta_int accepts) with per-expert tensors: the reader
    builds a list of 2^31 tensor names before it looks any up -> MemoryError (here under a
    4 GiB address-space limit; without one it eats ~100+ GiB or is OOM-killed)."""
    path = str(tmp_path / "m.gguf")
    write_model(path, Q4_0, per_expert=True, meta={"qwen3moe.expert_count": 1 << 31})
    code = ("import resource, ktcy\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from ktcy.safetensors_io import CheckpointError\n"
            f"try:\n    ktcy.load_experts({path!r}, 1)\n"
            "except CheckpointError as e:\n    print('CLEAN', e)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    except subprocess.TimeoutExpired:
        pytest.fail("load_experts ran for over 60 s on a 1 MB file")
    assert "CLEAN" in r.stdout, r.stderr[-800:]


def test_lone_part_of_a_split_model_is_refused(tmp_path):
    """The first part of a split set renamed (or copied) to plain m.gguf: split.count = 2 says
    half the tensors are elsewhere, yet it opens as a whole model; layer 2 then fails with a
    misleading 'no tensor blk.2.ffn_up_exps.weight', and layer 0 loads."""
    split = tmp_path / "split"
    split.mkdir()
    write_model(str(split / "m.gguf"), Q4_0, layers=(0, 2), split_max_tensors=4)
    first = sorted(os.listdir(split))[0]
    lone = str(tmp_path / "m.gguf")
    shutil.copy(split / first, lone)
    with pytest.raises(CheckpointError, match="split"):
        GGUFCheckpoint(lone)


# companions the reader ignores

def test_per_expert_scale_tensors_are_not_ignored(tmp_path):
    """llama.cpp reads optional blk.L.ffn_{gate,up,down}_exps.scale ({n_expert} F32, any
    architecture) and multiplies each expert's output by it: refused, not left out."""
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    w = _writer(path)
    raws = {}
    for proj in ("gate", "up", "down"):
        raws[proj] = random_blocks("Q4_0", E * 256 * 256, rng)
        w.add_tensor(f"blk.1.ffn_{proj}_exps.weight", raws[proj].reshape(E, 256, -1), raw_dtype=T.Q4_0)
    scale = np.array([2.0, 0.5, 3.0, 1.0], np.float32)
    w.add_tensor("blk.1.ffn_down_exps.scale", scale)
    _close(w)
    with pytest.raises(CheckpointError, match="blk.1.ffn_down_exps.scale: ktcy's experts have no per-expert scale"):
        ktcy.load_experts(path, 1)


def test_expert_biases_of_other_architectures_are_not_ignored(tmp_path):
    """ffn_*_exps.bias is read for GPT-OSS only; llama.cpp adds the biases for any architecture
    that stores them: a qwen3moe file with them is refused, not loaded without them."""
    path = str(tmp_path / "m.gguf")
    write_model(path, Q4_0, biases=True)
    with pytest.raises(CheckpointError, match="blk.1.ffn_gate_exps.bias: ktcy's experts have no per-expert bias"):
        ktcy.load_experts(path, 1)


def test_mixed_per_expert_types_load_with_a_method(tmp_path):
    """Legacy per-expert tensors whose types differ between experts (early Mixtral K-quant
    files): with a method every expert is dequantized and quantized again anyway, yet the layer
    is refused ('ktcy packs a layer's experts in one format'), against the README's 'layers
    that mix them ... need a method'."""
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(1)
    w = _writer(path)
    truth = {}
    for proj in ("gate", "up", "down"):
        for e in range(E):
            t = "Q8_0" if (proj == "down" and e == 3) else "Q4_0"
            raw = random_blocks(t, 256 * 256, rng)
            truth[proj, e] = np.asarray(gguf.quants.dequantize(raw, T[t]), np.float32).reshape(256, 256)
            w.add_tensor(f"blk.1.ffn_{proj}.{e}.weight", raw.reshape(256, -1), raw_dtype=T[t])
    _close(w)
    moe = ktcy.load_experts(path, 1, method="BF16")
    assert moe.format == "BF16"
    layer = GGUFCheckpoint(path).layer(1)
    assert np.array_equal(layer.dequantized(3)["down"], truth["down", 3])


# convert

def test_convert_refuses_output_in_the_gguf_folder(tmp_path):
    """'converters never write into their input': with a GGUF input, refuse_output_in_input
    compares the output with the .gguf *file*, so `ktcy convert -i folder -o folder` (or -o the
    folder holding the file) writes ktcy_model.json and layer files next to the GGUF.  The
    folder then reads as a converted folder: load_experts(folder) no longer reads the GGUF and
    converting it again is refused."""
    folder = tmp_path / "model"
    folder.mkdir()
    write_model(str(folder / "m.gguf"), Q4_0)
    with pytest.raises(ConvertError, match="input"):
        convert(str(folder), str(folder), progress=Quiet())


def test_gguf_rewritten_in_place_during_convert_is_refused(tmp_path):
    """GGUFFile.raw() checks the size only (SafetensorsFile also checks the mtime): a GGUF
    rewritten in place with same-sized bytes between two layers of a conversion goes unnoticed,
    and the output folder mixes two models under the first one's fingerprint."""
    path, other = str(tmp_path / "m.gguf"), str(tmp_path / "other.gguf")
    write_model(path, Q4_0, layers=(1, 2), seed=0)
    write_model(other, Q4_0, layers=(1, 2), seed=5)
    assert os.path.getsize(path) == os.path.getsize(other)

    class Swap(Quiet):
        def line(self, text):
            if text.startswith("layer 1"):
                with open(other, "rb") as f:
                    data = f.read()
                with open(path, "r+b") as f:
                    f.write(data)
                os.utime(path, ns=(time.time_ns() + 10**9,) * 2)

    with pytest.raises((CheckpointError, ConvertError), match="changed"):
        convert(path, str(tmp_path / "out"), progress=Swap())


def test_convert_checks_every_layer_before_writing(tmp_path):
    """Layer 1 Q4_0 (kept as INT4), layer 2 Q2_K (needs a method), method=None: convert packs
    and writes layer 1, then fails on layer 2, leaving a layer file and no manifest; a rerun
    with --method INT4 then meets a 'differs from this conversion' conflict.  wanted(L) can be
    evaluated for every chosen layer before any work."""
    path, out = str(tmp_path / "m.gguf"), tmp_path / "out"
    rng = np.random.default_rng(0)
    w = _writer(path, blocks=3)
    for L, t in ((1, "Q4_0"), (2, "Q2_K")):
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.{L}.ffn_{proj}_exps.weight", random_blocks(t, E * 256 * 256, rng).reshape(E, 256, -1),
                         raw_dtype=T[t])
    _close(w)
    with pytest.raises(CheckpointError, match="pass a method"):
        convert(path, out, progress=Quiet())
    assert not [n for n in (os.listdir(out) if out.exists() else []) if n.startswith("ktcy_layer_")]


def test_fingerprint_covers_the_tensor_directory(tmp_path):
    """source_fingerprint hashes the first MiB of each part, documented as 'its header and
    tensor directory, or most of them'; with a tokenizer in the metadata (any real model: MBs of
    tokens and merges) the tensor directory lies entirely past that MiB.  A tensor's type
    changed in place (Q4_0 -> IQ4_NL, same 18-byte blocks, same size and mtime) keeps the
    fingerprint, so --resume keeps layers of the old file.  The safetensors fingerprint hashes
    whole headers."""
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    w = _writer(path)
    w.add_token_list([f"token{i:06d}" for i in range(100000)])  # ~1.9 MB of metadata
    for proj in ("gate", "up", "down"):
        w.add_tensor(f"blk.1.ffn_{proj}_exps.weight", random_blocks("Q4_0", E * 256 * 256, rng).reshape(E, 256, -1),
                     raw_dtype=T.Q4_0)
    _close(w)
    raw = open(path, "rb").read()
    key = b"blk.1.ffn_down_exps.weight"
    type_at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 3 * 8
    assert type_at > 1 << 20 and struct.unpack("<I", raw[type_at:type_at + 4])[0] == int(T.Q4_0)
    st = os.stat(path)
    before = source_fingerprint(path)
    with open(path, "r+b") as f:
        f.seek(type_at)
        f.write(struct.pack("<I", int(T.IQ4_NL)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source_fingerprint(path) != before


def test_merged_gate_up_tensors_are_named_in_the_refusal(tmp_path):
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(2)
    w = _writer(path)
    w.add_tensor("blk.1.ffn_gate_up_exps.weight", random_blocks("Q4_0", E * 512 * 256, rng).reshape(E, 512, -1),
                 raw_dtype=T.Q4_0)
    w.add_tensor("blk.1.ffn_down_exps.weight", random_blocks("Q4_0", E * 256 * 256, rng).reshape(E, 256, -1),
                 raw_dtype=T.Q4_0)
    _close(w)
    with pytest.raises(CheckpointError, match="merged gate_up expert tensors are not read"):
        ktcy.load_experts(path, 1)


@pytest.mark.parametrize("clamps, loads", [([0.0, 0.0], True), ([0.0, 7.0], False)])
def test_per_layer_swiglu_clamps_are_refused_unless_all_zero(tmp_path, clamps, loads):
    """{arch}.swiglu_clamp_exp: one limit per layer, 0 for none (llama.cpp)."""
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(3)
    w = _writer(path)
    w.add_array("qwen3moe.swiglu_clamp_exp", clamps)
    for proj in ("gate", "up", "down"):
        w.add_tensor(f"blk.1.ffn_{proj}_exps.weight", random_blocks("Q4_0", E * 256 * 256, rng).reshape(E, 256, -1),
                     raw_dtype=T.Q4_0)
    _close(w)
    if loads:
        assert ktcy.load_experts(path, 1).format == "INT4"
    else:
        with pytest.raises(CheckpointError, match="swiglu_clamp_exp"):
            ktcy.load_experts(path, 1)


def test_convert_refusals_leave_no_output_folder(tmp_path):
    """A GGUF that is missing, or an --input-type it cannot meet: one line, and nothing written."""
    path = str(tmp_path / "m.gguf")
    write_model(path, Q4_0)
    for source, extra, message in ((str(tmp_path / "absent.gguf"), [], "absent.gguf: no such file"),
                                   (path, ["--input-type", "bf16"], "stores ggml types")):
        out = tmp_path / "out"
        r = subprocess.run([sys.executable, "-m", "ktcy", "convert", "-i", source, "-o", str(out), *extra],
                           capture_output=True, text=True)
        assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()
