"""ggml's block formats decoded to float32, value for value what llama.cpp's own dequantization
gives (its float32 operations in its order: a block scale times a sub-block scale first, then
times the code, then the offset subtracted).

Each decoder takes blocks uint8 [nb, bytes per block] and returns float32 [nb, values per
block].  Layouts (ggml's block structs; f16 = IEEE half, little-endian):
  Q4_0  d f16, 16 bytes: value j low nibble of byte j, value j+16 its high nibble; d * (q - 8)
  Q4_1  d, m f16, nibbles as Q4_0; d * q + m
  Q5_0  d f16, 32 high bits (uint32, bit j for value j), nibbles as Q4_0; d * (q - 16)
  Q5_1  d, m f16, high bits, nibbles; d * q + m
  Q8_0  d f16, 32 int8; d * q
  Q2_K  16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, d, dmin
        f16: value 128h + 32j + i is bits 2j..2j+1 of byte 32h + i; sub-block = value // 16;
        (d * scale) * q - (dmin * min)
  Q3_K  32 bytes of high bits, 64 bytes of 2-bit codes (as Q2_K), 12 bytes of 6-bit scales,
        d f16: the high bit of value 128h + 32j + i is bit 4h + j of byte i, and the code is
        q - 4 where it is clear; scale s - 32 per 16 values; (d * (s - 32)) * code
  Q4_K  d, dmin f16, 12 bytes of 6-bit scales and mins, 128 bytes: value 64c + i low nibble of
        byte 32c + i (sub-block 2c), value 64c + 32 + i its high nibble (sub-block 2c + 1);
        (d * scale) * q - (dmin * min)
  Q5_K  as Q4_K with 32 high-bit bytes before the nibbles: bit 2c (low nibble) or 2c + 1
  Q6_K  128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d f16: in half h, value
        128h + 32j + i takes the low (j < 2) or high (j >= 2) nibble of byte 64h + 32(j % 2) + i
        and bits 2j..2j+1 of high byte 32h + i on top; (d * scale) * (q - 32), 16 values a scale
  MXFP4 E8M0 exponent e, nibbles as Q4_0 holding E2M1 codes; (2 E2M1) * 2^(e - 128)
  IQ4_NL d f16, nibbles as Q4_0 indexing 16 int8 levels (IQ4_LEVELS); d * level
  IQ4_XS d f16, 16 high bits (uint16, bits 2i..2i+1 for sub-block i), 4 bytes of low nibbles
        (sub-block i in byte i // 2, low nibble first), 128 bytes of nibbles as Q4_0 per 32
        values; (d * (scale - 32)) * level, scale the 6-bit high << 4 | low"""
import numpy as np

from ktcy.gguf_io import BLOCK_SIZES
from ktcy.kernels import E2M1_VALUES
from ktcy.safetensors_io import CheckpointError

_NIBBLE_SHIFTS = np.array([0, 4], np.uint8)


def _f16(blocks, at):
    """The f16 field at byte `at` of every block, as float32 [nb, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs):
    """16 bytes per row -> 32 codes: the low nibbles, then the high ones (Q4_0's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(blocks, at, count):
    """`count` bits from little-endian bytes at `at`: bit j as uint8 0/1 in column j."""
    return np.unpackbits(np.ascontiguousarray(blocks[:, at:at + count // 8]), axis=1, bitorder="little")


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0_codes(b):
    """Q5_0's signed codes q - 16 (int16 [nb, 32]): the nibbles with their fifth bits on top."""
    return (_nibbles(b[:, 6:22]) | (_high_bits(b, 2, 32) << 4)).astype(np.int16) - 16


def _q5_0(b):
    return _f16(b, 0) * _q5_0_codes(b).astype(np.float32)


def _q5_1_codes(b):
    """Q5_1's codes 0..31 (uint8 [nb, 32]): the nibbles with their fifth bits on top."""
    return _nibbles(b[:, 8:24]) | (_high_bits(b, 4, 32) << 4)


def _q5_1(b):
    return _f16(b, 0) * _q5_1_codes(b).astype(np.float32) + _f16(b, 2)


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32) * _f16(b, 0)


def _two_bit_codes(qs):
    """64 bytes -> 256 codes: value 128h + 32j + i = bits 2j.. of byte 32h + i."""
    nb = qs.shape[0]
    halves = qs.reshape(nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return (halves & 3).reshape(nb, 256)


def _per_sub_block(values, scale, size):
    """values [nb, 256] with one multiplier per `size` of them, scale [nb, 256 // size]."""
    nb = values.shape[0]
    return (values.reshape(nb, -1, size) * scale[:, :, None]).reshape(nb, 256)


def _q2_k(b):
    scales, d, dmin = b[:, 0:16], _f16(b, 80), _f16(b, 82)
    step = d * (scales & 0x0F).astype(np.float32)
    low = dmin * (scales >> 4).astype(np.float32)
    q = _two_bit_codes(b[:, 16:80]).astype(np.float32)
    nb = b.shape[0]
    return (q.reshape(nb, 16, 16) * step[:, :, None] - low[:, :, None]).reshape(nb, 256)


def _q3_k_scales(s):
    """12 bytes -> 16 six-bit scales: low nibbles of bytes 0..7 are scales 0..7 and their high
    nibbles scales 8..15; scale i's top two bits are bits 2(i // 4).. of byte 8 + i % 4."""
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    i = np.arange(16)
    top = (s[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (top << 4)).astype(np.int16) - 32


def _q3_k(b):
    d = _f16(b, 108)
    step = d * _q3_k_scales(b[:, 96:108]).astype(np.float32)
    q = _two_bit_codes(b[:, 32:96]).astype(np.int16)
    hbits = _high_bits(b, 0, 256).reshape(-1, 32, 8)            # [nb, byte i, bit]
    nb = b.shape[0]
    # value 128h + 32j + i takes bit 4h + j of byte i
    high = hbits.transpose(0, 2, 1).reshape(nb, 2, 4, 32).reshape(nb, 256)
    code = (q - 4 * (1 - high)).astype(np.float32)
    return _per_sub_block(code, step, 16)


def _k_scale_min(s):
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 mins: sub-blocks 0..3 in the low six
    bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 in the nibbles of bytes 8..11
    with their top two bits in the spare bits 6..7 of bytes 0..3 (scales) and 4..7 (mins)."""
    scale = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    low = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return scale.astype(np.float32), low.astype(np.float32)


def _k_quant(b, q):
    """Q4_K / Q5_K: codes q [nb, 256] in sub-blocks of 32 with a scale and a min each."""
    scale, low = _k_scale_min(b[:, 4:16])
    step, offset = _f16(b, 0) * scale, _f16(b, 2) * low
    nb = b.shape[0]
    return (q.astype(np.float32).reshape(nb, 8, 32) * step[:, :, None] - offset[:, :, None]).reshape(nb, 256)


def _k_nibbles(qs):
    """128 bytes -> 256 codes: value 64c + i the low nibble of byte 32c + i, 64c + 32 + i its high one."""
    nb = qs.shape[0]
    return (qs.reshape(nb, 4, 1, 32) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1) & 0x0F).reshape(nb, 256)


def _q4_k(b):
    return _k_quant(b, _k_nibbles(b[:, 16:144]))


def q4_k_parts(raw, n, k):
    """Q4_K's [n, k] tensor as (codes 0..15 uint8 [n, k], scale d * sc [n, k/32], min -(dmin * m)
    [n, k/32]) in float32, each exact (an 11-bit significand times a 6-bit integer): s * q + min
    is the value _q4_k decodes before its float32 rounding."""
    b = raw.reshape(n * k // 256, 144)
    sc, low = _k_scale_min(b[:, 4:16])
    return (_k_nibbles(b[:, 16:144]).reshape(n, k).astype(np.uint8), (_f16(b, 0) * sc).reshape(n, k // 32),
            -(_f16(b, 2) * low).reshape(n, k // 32))


def q4_01_parts(type_name, raw, n, k):
    """Q4_0's or Q4_1's [n, k] tensor as (nibbles 0..15 uint8 [n, k], d [n, k/32], Q4_1's m
    [n, k/32] or None): w = d * (q - 8), or d * q + m."""
    b = raw.reshape(n * k // 32, -1)
    start = 4 if type_name == "Q4_1" else 2
    low = _f16(b, 2).reshape(n, k // 32) if type_name == "Q4_1" else None
    return _nibbles(b[:, start:start + 16]).reshape(n, k), _f16(b, 0).reshape(n, k // 32), low


def int8_group_parts(type_name, raw, n, k):
    """Q8_0's, Q5_0's or Q6_K's [n, k] tensor as (codes int8 [n, k], scale [n, k / group]
    float32, group): Q8_0 q and d, Q5_0 q - 16 and d (group 32), Q6_K q - 32 and d * sc (group
    16).  Each scale is exact (an 11-bit significand times an 8-bit integer) and so is s * q (at
    most 24 significant bits): the value the decoder above gives, bit for bit."""
    if type_name == "Q6_K":
        b = raw.reshape(n * k // 256, 210)
        return _q6_k_codes(b).astype(np.int8).reshape(n, k), _q6_k_steps(b).reshape(n, k // 16), 16
    b = raw.reshape(n * k // 32, -1)
    if type_name == "Q8_0":
        codes = np.ascontiguousarray(b[:, 2:34]).view(np.int8)
    elif type_name == "Q5_0":
        codes = _q5_0_codes(b).astype(np.int8)
    else:
        raise ValueError(f"{type_name} has no int8 codes with one scale per group")
    return codes.reshape(n, k), _f16(b, 0).reshape(n, k // 32), 32


def _q5_k_codes(b):
    """Q5_K's codes 0..31 (uint8 [nb, 256]): Q4_K's nibbles with bit t of high byte i on top of
    value 32t + i."""
    nb = b.shape[0]
    bits = _high_bits(b, 16, 256).reshape(nb, 32, 8).transpose(0, 2, 1).reshape(nb, 256)
    return _k_nibbles(b[:, 48:176]) | (bits << 4)


def _q5_k(b):
    return _k_quant(b, _q5_k_codes(b))


def int8_min_parts(type_name, raw, n, k):
    """Q5_K's or Q5_1's [n, k] tensor as (codes 0..31 uint8 [n, k], scale [n, k/32], min
    [n, k/32]) in float32: Q5_K d * sc and -(dmin * m), Q5_1 d and m.  Each is exact (an 11-bit
    significand times a 6-bit integer), so s * q + min rounded as the decoders round is their
    value bit for bit."""
    if type_name == "Q5_K":
        b = raw.reshape(n * k // 256, 176)
        sc, low = _k_scale_min(b[:, 4:16])
        return (_q5_k_codes(b).reshape(n, k), (_f16(b, 0) * sc).reshape(n, k // 32),
                -(_f16(b, 2) * low).reshape(n, k // 32))
    if type_name != "Q5_1":
        raise ValueError(f"{type_name} has no 5-bit codes with a scale and a min per group")
    b = raw.reshape(n * k // 32, 24)
    return _q5_1_codes(b).reshape(n, k), _f16(b, 0).reshape(n, k // 32), _f16(b, 2).reshape(n, k // 32)


def _q6_k_codes(b):
    """Q6_K's signed codes q - 32 (int16 [nb, 256]).  Half h of 128 values: value 32j + i is the
    low (j = 0, 1) or high (j = 2, 3) nibble of low-byte 32(j % 2) + i, with bits 2j..2j+1 of
    high-byte i on top."""
    nb = b.shape[0]
    low = b[:, 0:128].reshape(nb, 2, 1, 2, 32) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1, 1) & 0x0F   # [nb, h, nib, j%2, i]
    low = low.reshape(nb, 2, 4, 32)
    high = (b[:, 128:192].reshape(nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    return (low | (high << 4)).reshape(nb, 256).astype(np.int16) - 32


def _q6_k_steps(b):
    """d * sc per 16 values, float32 [nb, 16] (exact: an 11-bit significand times an int8)."""
    return _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)


def _q6_k(b):
    return _per_sub_block(_q6_k_codes(b).astype(np.float32), _q6_k_steps(b), 16)


def _mxfp4(b):
    """ggml's order: E2M1 x 2 (its table holds doubled values) times 2^(e - 128), a float32 that
    is subnormal for e < 2; E8M0's 255 is not NaN there but 2^127."""
    codes = _nibbles(b[:, 1:17])
    e = b[:, 0:1].astype(np.uint32)
    half = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)
    return (2 * E2M1_VALUES + 0.0).astype(np.float32)[codes] * half  # code 8 is +0 in ggml's table


# IQ4_NL's and IQ4_XS's 16 levels: a 4-bit grid denser near zero, in int8 steps
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_nl(b):
    return _f16(b, 0) * IQ4_LEVELS[_nibbles(b[:, 2:18])]


def _iq4_xs(b):
    nb, sub = len(b), np.arange(8)
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).astype(np.int32)
    low = b[:, 4:8].astype(np.int32)
    scale = ((low[:, sub // 2] >> (4 * (sub % 2))) & 0xF) | (((high >> (2 * sub)) & 3) << 4)
    step = _f16(b, 0) * (scale.astype(np.float32) - 32)
    levels = IQ4_LEVELS[_nibbles(b[:, 8:].reshape(nb * 8, 16)).reshape(nb, 8, 32)]
    return (step[:, :, None] * levels).reshape(nb, 256)


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
            "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4,
            "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": None}


def dequantize(type_name, raw, shape):
    """float32 values of `shape` (rows innermost, a whole number of the type's blocks) from the
    stored bytes of ggml type `type_name`."""
    if type_name in PLAIN:
        if type_name == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.view(PLAIN[type_name]).astype(np.float32).reshape(shape)
    blocks = raw.reshape(-1, BLOCK_SIZES[type_name][1])
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN or inf block scale: refused where packed
        return DECODERS[type_name](blocks).astype(np.float32, copy=False).reshape(shape)


def require_decodable(where, name, type_name):
    """CheckpointError naming the tensor unless ktcy decodes its ggml type."""
    if not supported(type_name):
        raise CheckpointError(f"{where}: {name} is {type_name}, a ggml type ktcy does not decode (it reads "
                              f"{', '.join(list(PLAIN) + list(DECODERS))})")


def supported(type_name):
    return type_name in PLAIN or type_name in DECODERS
