/* Every GEMM kernel variant: a format's traits header (fmt_*.h) compiled into an ISA skeleton
 * (gemm_*_tpl.h), one block per variant, each defining the entry point ktcy_gemm_<variant>
 * that registry.h lists with the CPU features it needs.  The target attribute of a block is
 * exactly the set of features the variant executes. */
#ifndef KTCY_KERNELS_H
#define KTCY_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "fp_env.h"
#include "numeric.h"
#include "pack.h"
#include "prefetch.h"
#include "tile_emu.h"
#include "types.h"

/* Skeletons (KT_SKEL) and what a loaded weight row holds (KT_WKIND). */
#define KT_SKEL_REF 0
#define KT_SKEL_AVX2 1
#define KT_SKEL_AVX512 2
#define KT_SKEL_AMX 3
#define KT_W_S8 0
#define KT_W_U8 1
#define KT_W_BF16 2

typedef struct { __m512i v0, v1; } kt_vec2; /* one AVX-512 operand, or its even/odd bf16 halves as floats */
typedef struct { __m256i i; __m256 e, o; } kt_w256; /* half an AVX2 weight row: int8 lanes, or even/odd floats */

/* bf16 pairs (even K element low, odd high) as the even and odd element in float lanes. */
__attribute__((target("avx2"))) static inline kt_w256 kt_bf16_split(__m256i v) {
    kt_w256 w;
    w.i = v;
    w.e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    w.o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    return w;
}
/* v x s x f for sums v, scales s and a row factor f (a power of two): s x f first, one rounding
 * for the product, where s x f is a normal float; else (v x s) x f, exact in f where the true
 * product is normal.  A tiny scale and a tiny f (the wide decode shifts small rows by up to
 * 2^-112) made s x f subnormal or zero, and every row of such a call came out 0. */
__attribute__((target("avx2"))) static inline __m256 kt_times_scale_row(__m256 v, __m256 s, float f) {
    const __m256 fv = _mm256_set1_ps(f), sf = _mm256_mul_ps(s, fv);
    const __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), sf);
    const __m256 normal = _mm256_and_ps(_mm256_cmp_ps(mag, _mm256_set1_ps(0x1p-126f), _CMP_GE_OQ),
                                        _mm256_cmp_ps(mag, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ));
    return _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(v, s), fv), _mm256_mul_ps(v, sf), normal);
}
/* kt_times_scale_row for a scale that is one number for all 8 lanes (FP8's block scale): s x f
 * and its range test are worked out once per row and group, and each sum vector then takes one
 * multiply, the same IEEE operations as kt_times_scale_row's lanes, so the same bits.  Per lane,
 * that test and blend were 8 of the ~10 vector operations of a group's end, competing with the
 * FMAs for their ports. */
typedef struct { __m256 s, f, sf; int normal; } kt_scale_row;
__attribute__((target("avx2"))) static inline kt_scale_row kt_scale_row_make(float s, float f) {
    kt_scale_row r;
    const float sf = s * f, mag = __builtin_fabsf(sf);
    r.s = _mm256_set1_ps(s);
    r.f = _mm256_set1_ps(f);
    r.sf = _mm256_set1_ps(sf);
    r.normal = mag >= 0x1p-126f && mag < __builtin_inff();
    return r;
}
__attribute__((target("avx2"))) static inline __m256 kt_scale_row_apply(__m256 v, kt_scale_row r) {
    return r.normal ? _mm256_mul_ps(v, r.sf) : _mm256_mul_ps(_mm256_mul_ps(v, r.s), r.f);
}
/* Powers of two 2^(e - 127) from 16 E8M0 exponents (channels 0-15), for the 8 channels of half h
 * as in-lane unpacks leave them (KT_LANE_SPLIT: 0-3, 8-11 | 4-7, 12-15).  Exponents above 254
 * are clamped: packing lets blocks of zero codes carry any, and 2^128 would turn their zero sums
 * into NaN. */
__attribute__((target("avx2"))) static inline __m256 kt_e8m0_half(const uint8_t *e16, int h) {
    const __m128i e = _mm_loadu_si128((const __m128i *)e16);
    const __m128i e8 = h ? _mm_shuffle_epi32(e, 0x0D) : _mm_shuffle_epi32(e, 0x08);
    const __m256i e32 = _mm256_min_epu32(_mm256_cvtepu8_epi32(e8), _mm256_set1_epi32(254));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e32, 23));
}
static inline __attribute__((target("avx2"))) kt_w256 kt_int_half(__m256i v) {
    kt_w256 w;
    w.i = v;
    w.e = w.o = _mm256_setzero_ps();
    return w;
}

/* 8 outputs of one row from dst on, the first `valid` of them (fewer at the weight's last channels). */
__attribute__((target("avx2"))) static inline void kt_store8(float *dst, int64_t valid, __m256 v) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(dst, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 8 ? valid : 8)), lanes), v);
}
/* The 16 outputs of one row and panel, in halves v[2], stored in channel order.  lane_split: the
 * halves hold channels 0-3, 8-11 and 4-7, 12-15 (what in-lane byte unpacks give), put back in
 * order here, once per output. */
__attribute__((target("avx2"))) static inline void kt_store16(float *dst, int64_t valid, __m256 v[2], int lane_split) {
    if (lane_split) {
        const __m256 lo = v[0], hi = v[1];
        v[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
        v[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
    kt_store8(dst, valid, v[0]);
    if (valid > 8) kt_store8(dst + 8, valid - 8, v[1]);
}

/* A few-row path's sweep over panels [pb, pe) (KT_FEW_ROWS): TILE(MB, NP, p0, next, ...) for the
 * call's a->m rows (1-4) and NP panels from p0 (next: what follows, prefetch.h), W12 panels for
 * 1-2 rows and W34 for 3-4 (the accumulators' limit), one where fewer are left.  Every tile
 * shape is a compile-time constant.  Uses the including skeleton's KT_BK and KT_BB. */
#define KT_FEW_ROWS_SWEEP(TILE, W12, W34, a, w, pb, pe, ...)                                     \
    for (int64_t p_ = (pb); p_ < (pe);) {                                                        \
        const int wide_ = (a)->m > 2 ? (W34) : (W12);                                            \
        const int np_ = (pe) - p_ >= wide_ ? wide_ : 1;                                          \
        const ktcy_span next_ = ktcy_next_group(a, w, p_ + np_, pe, np_, KT_BK, KT_BB);          \
        switch ((a)->m) {                                                                        \
        case 1: if (np_ > 1) TILE(1, W12, p_, next_, __VA_ARGS__); else TILE(1, 1, p_, next_, __VA_ARGS__); break; \
        case 2: if (np_ > 1) TILE(2, W12, p_, next_, __VA_ARGS__); else TILE(2, 1, p_, next_, __VA_ARGS__); break; \
        case 3: if (np_ > 1) TILE(3, W34, p_, next_, __VA_ARGS__); else TILE(3, 1, p_, next_, __VA_ARGS__); break; \
        default: if (np_ > 1) TILE(4, W34, p_, next_, __VA_ARGS__); else TILE(4, 1, p_, next_, __VA_ARGS__); break; \
        }                                                                                        \
        p_ += np_;                                                                               \
    }

/* MXFP4's few-row calls on 16-bit integers (fmt_mxfp4.h, AVX2 and AVX-512): each 32-K block of a
 * bf16 row as q = x * 2^(141 - F), F the exponent field of the block's largest |x|, rounded to
 * nearest even (exact for every x of at least 2^-8 of that largest: bf16 has 8 significant bits;
 * an error of at most 2^-15 of it below), |q| <= 32640, split into a signed high byte and an
 * unsigned low one (AVX-512's vpdpbusd) or kept as int16 words (AVX2's vpmaddwd); with each
 * block's factor 2^(F - 142) (the 1/2 of the codes' 2 e2m1 included) and 12 times its sum of q
 * (the codes' + 12).  Blocks of zeros and bf16 subnormals count as
 * zero (vdpbf16ps reads subnormals so).  A block whose largest |x| lies outside [2^-111, 2^119)
 * would take 2^(F - 142), or a block sum times it, out of float's normal range (inf and NaN
 * among them): the row is refused (0) and the whole call keeps its bf16 path, so there the
 * other rows' last bits follow that path too (as FP8's float path does with its wide rows). */
#define KT_I16_MIN_FIELD 16
#define KT_I16_MAX_FIELD 245
__attribute__((target("avx2"))) static inline int kt_mxfp4_i16_row(const uint16_t *src, int64_t nkb, uint8_t *row,
                                                                   int words, float *t, int32_t *bias) {
    for (int64_t g = 0; g < nkb; ++g, src += 32) {
        /* words: the block's 32 q in K order, 16 at hi and 16 at lo; else its high and low bytes */
        uint8_t *hi = words ? row + g * 64 : row + g * 32, *lo = words ? hi + 32 : row + (nkb + g) * 32;
        const __m256i mag = _mm256_max_epu16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)src), _mm256_set1_epi16(0x7FFF)),
                                             _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(src + 16)),
                                                              _mm256_set1_epi16(0x7FFF)));
        __m128i top = _mm_max_epu16(_mm256_castsi256_si128(mag), _mm256_extracti128_si256(mag, 1));
        top = _mm_max_epu16(top, _mm_srli_si128(top, 8));
        top = _mm_max_epu16(top, _mm_srli_si128(top, 4));
        top = _mm_max_epu16(top, _mm_srli_si128(top, 2));
        const int field = _mm_extract_epi16(top, 0) >> 7;
        if (field == 0) {
            _mm256_storeu_si256((__m256i *)hi, _mm256_setzero_si256());
            _mm256_storeu_si256((__m256i *)lo, _mm256_setzero_si256());
            t[g] = 0.0f;
            bias[g] = 0;
            continue;
        }
        if (field < KT_I16_MIN_FIELD || field > KT_I16_MAX_FIELD) return 0;
        const __m256 times = _mm256_castsi256_ps(_mm256_set1_epi32((268 - field) << 23)); /* 2^(141 - F), exact */
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            const __m256i x = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * i))), 16);
            const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(x), times),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(scaled);
            sum = _mm256_add_epi32(sum, q[i]);
        }
        /* the packs work per 128-bit lane: each is followed by the qword order 0, 2, 1, 3 */
        const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
        const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
        if (words) {
            _mm256_storeu_si256((__m256i *)hi, w01);
            _mm256_storeu_si256((__m256i *)lo, w23);
        } else {
            const __m256i bytes = _mm256_set1_epi16(0xFF);
            _mm256_storeu_si256((__m256i *)hi, _mm256_permute4x64_epi64(
                _mm256_packs_epi16(_mm256_srai_epi16(w01, 8), _mm256_srai_epi16(w23, 8)), 0xD8));
            _mm256_storeu_si256((__m256i *)lo, _mm256_permute4x64_epi64(
                _mm256_packus_epi16(_mm256_and_si256(w01, bytes), _mm256_and_si256(w23, bytes)), 0xD8));
        }
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_add_epi32(s, _mm_srli_si128(s, 8));
        s = _mm_add_epi32(s, _mm_srli_si128(s, 4));
        t[g] = ktcy_pow2(field - 142);
        bias[g] = 12 * _mm_cvtsi128_si32(s);
    }
    return 1;
}
#undef KT_I16_MIN_FIELD
#undef KT_I16_MAX_FIELD

/* Where the rows live in a GEMM's scratch: the region past every other path's share (types.h),
 * so no call on the same scratch, the gate's own fallback included, can overwrite what the up
 * projection reuses; a 64-byte header (made: the rows are there), then the rows' high and low
 * bytes (k_pad each) or, words, the rows' q as int16 (2 k_pad bytes), factors t [rows][k_pad / 32]
 * and bias sums [rows][k_pad / 32]. */
typedef struct { int32_t *made; uint8_t *rows; float *t; int32_t *bias; } kt_i16_rows;
/* The rows of call a (k_pad of its weight) made in scratch, or reused from the call before on it
 * (a->rows_in_scratch: the gate's, for the up projection; one variant serves both, so one
 * layout).  made 0: use the bf16 path. */
__attribute__((target("avx2"))) static inline kt_i16_rows kt_mxfp4_i16_rows(const ktcy_act *a, int64_t k_pad, int words,
                                                                            void *scratch) {
    kt_i16_rows r;
    const int64_t nkb = k_pad / 32;
    r.made = (int32_t *)ktcy_align64((uint8_t *)scratch + ktcy_gemm_scratch_shared_bytes(k_pad));
    r.rows = (uint8_t *)r.made + 64;
    r.t = (float *)(r.rows + KTCY_I16_MAX_ROWS * 2 * k_pad);
    r.bias = (int32_t *)(r.t + KTCY_I16_MAX_ROWS * nkb);
    if (!a->rows_in_scratch) {
        *r.made = a->m <= KTCY_I16_MAX_ROWS;
        for (int64_t m = 0; m < a->m && *r.made; ++m)
            *r.made = kt_mxfp4_i16_row(a->bf16 + m * a->k_pad, nkb, r.rows + m * 2 * k_pad, words, r.t + m * nkb,
                                       r.bias + m * nkb);
    }
    return r;
}

#define KTCY_AVX512_BASE "avx512f,avx512bw,avx512vl,avx512dq"
/* F16C (vcvtph2ps, the FP8 decode of rows too wide for the bit-move decode) comes with every AVX2
 * CPU (Intel since Ivy Bridge, AMD since Piledriver); the dispatcher requires it with AVX2. */
#define KTCY_AVX2_BASE "avx2,fma,f16c"

/* 2 x E2M1 value + 12 of codes 0..15, in [0, 24] (2 x 0.5 = 1, ..., 2 x -6 = -12): MXFP4's codes
 * as the unsigned bytes of integer dot products (the + 12 folds into the activations' block sums). */
#define KTCY_E2M1_TWICE_BIASED 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
/* The constants of kt_e2m1_quad_vbmi: dword j <- bytes 2j, 2j + 1, 2j, 2j + 1; the table every 16 bytes. */
typedef struct { __m512i pick, lut; } kt_e2m1_vbmi;
__attribute__((target(KTCY_AVX512_BASE))) static inline kt_e2m1_vbmi kt_e2m1_vbmi_make(void) {
    kt_e2m1_vbmi c;
    uint8_t pick[64];
    for (int i = 0; i < 64; ++i) pick[i] = (uint8_t)(2 * (i / 4) + (i & 1));
    c.pick = _mm512_loadu_si512(pick);
    c.lut = _mm512_broadcast_i32x4(_mm_setr_epi8(KTCY_E2M1_TWICE_BIASED));
    return c;
}
/* One quad row of an E2M1 sub-block (32 bytes: channel j's bytes 2j, 2j + 1 hold K 0, 1 in their
 * low nibbles and K 2, 3 in their high ones) as 16 dwords of 2 e2m1 + 12, channels in order, in
 * 3 operations after the load: vpermb copies each channel's byte pair into both halves of its
 * dword, a word shift under a mask brings the high nibbles down in the upper half, and vpermb
 * looks the codes up (it reads an index's low 6 bits, and the table repeats every 16 bytes, so
 * the bits above each nibble need no mask). */
#if KTCY_ENABLE_AVX512_VBMI
__attribute__((target(KTCY_AVX512_BASE ",avx512vbmi"))) static inline __m512i kt_e2m1_quad_vbmi(const kt_e2m1_vbmi *c,
                                                                                             const uint8_t *src) {
    const __m512i pairs = _mm512_permutexvar_epi8(c->pick, _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)src)));
    return _mm512_permutexvar_epi8(_mm512_mask_srli_epi16(pairs, (__mmask32)0xAAAAAAAAu, pairs, 4), c->lut);
}
#endif

/* E4M3 codes to bf16 with AVX-512 BW alone (no VBMI byte lookups): 32 codes widened to words,
 * their 7 magnitude bits looked up in the 128-entry table (KTCY_E4M3_TO_BF16, the scalar
 * decode's) by two 64-entry vpermt2w and a blend on bit 6, the sign merged in: the bits of
 * ktcy_e4m3_to_bf16 for all 256 codes, NaN included, at about 8 operations per 32 codes where
 * the scalar loop took about 3 per code. */
typedef struct { __m512i t0, t1, t2, t3; } kt_e4m3_bw;
/* F and BW only, so the AMX variants (no DQ in their target) inline it too */
__attribute__((target("avx512f,avx512bw"))) static inline kt_e4m3_bw kt_e4m3_bw_make(void) {
    kt_e4m3_bw c;
    c.t0 = _mm512_loadu_si512(KTCY_E4M3_TO_BF16);
    c.t1 = _mm512_loadu_si512(KTCY_E4M3_TO_BF16 + 32);
    c.t2 = _mm512_loadu_si512(KTCY_E4M3_TO_BF16 + 64);
    c.t3 = _mm512_loadu_si512(KTCY_E4M3_TO_BF16 + 96);
    return c;
}
/* count codes (a multiple of 32) from src as bf16 at dst, in order. */
__attribute__((target("avx512f,avx512bw"))) static inline void kt_e4m3_to_bf16_bw(const kt_e4m3_bw *c, const uint8_t *src,
                                                                                uint16_t *dst, int64_t count) {
    for (int64_t i = 0; i < count; i += 32) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i)));
        const __m512i low = _mm512_permutex2var_epi16(c->t0, b, c->t1), high = _mm512_permutex2var_epi16(c->t2, b, c->t3);
        const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), low, high);
        /* mag | (b << 8 & 0x8000) */
        _mm512_storeu_si512(dst + i, _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8));
    }
}

/* ---- portable C ---- */
#define KT_GEMM ktcy_gemm_int8_ref
#define KT_TRAITS "fmt_int8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_int4_ref
#define KT_TRAITS "fmt_int4.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_bf16_ref
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_fp8_ref
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_mxfp4_ref
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_mxfp4_a8_ref
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS

/* ---- AVX2 + FMA ---- */
#define KT_GEMM ktcy_gemm_int8_avx2
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_int4_avx2
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_bf16_avx2
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_fp8_avx2
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_mxfp4_avx2
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx2
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET

/* ---- AVX-512: a fast variant per format (VNNI, AVX512-BF16, VBMI) and an F+BW one ---- */
#define KT_GEMM ktcy_gemm_int8_avx512_vnni
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_avx512bw
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int4_avx512_vnni
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int4_avx512bw
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16
#define KT_GEMM ktcy_gemm_bf16_avx512_bf16
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_bf16_avx512f
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_fp8_avx512_vbmi
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_fp8_avx512f
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_avx512_vbmi
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16,avx512vnni,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#if KTCY_ENABLE_AVX512_BF16
#define KT_GEMM ktcy_gemm_mxfp4_avx512_bf16
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_mxfp4_avx512f
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512_vbmi
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512_vnni
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512bw
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI

/* ---- AMX over the emulated tile unit: always built, never picked automatically ---- */
#define KT_TARGET
/* a GEMM reports its own faults: one left on this thread by an earlier use of the emulator
 * (the instruction-level helpers) must not fail it */
#define KT_TILE_CONFIG(cfg) (ktcy_emu_clear_error(), ktcy_emu_ldtilecfg(cfg))
#define KT_TILE_RELEASE() ktcy_emu_tilerelease()
#define KT_TILE_LOAD(t, p, stride) ktcy_emu_tileloadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) ktcy_emu_tilestored(t, p, stride)
#define KT_TILE_ZERO(t) ktcy_emu_tilezero(t)
#define KT_TILE_DP_I8(c, a, b) ktcy_emu_tdpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) ktcy_emu_tdpbf16ps(c, a, b)
#define KT_TILE_FAILED() (ktcy_emu.error)
#define KT_AMX_REAL 0
#define KT_GEMM ktcy_gemm_amx_emu_int8
#define KT_TRAITS "fmt_int8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_int4
#define KT_TRAITS "fmt_int4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_bf16
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_fp8
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_mxfp4
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_mxfp4_a8
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_RELEASE
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED
#undef KT_AMX_REAL

/* ---- real AMX tiles ---- */
#if KTCY_ENABLE_AMX
#define KT_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl")))
#define KT_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define KT_TILE_RELEASE() _tile_release()
#define KT_TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_DP_I8(c, a, b) _tile_dpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define KT_TILE_FAILED() 0
#define KT_AMX_REAL 1 /* real tiles: the traits may use AVX-512 F/BW/VL beside them */
#define KT_GEMM ktcy_gemm_amx_int8
#define KT_TRAITS "fmt_int8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_int4
#define KT_TRAITS "fmt_int4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_bf16
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_fp8
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_mxfp4
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_mxfp4_a8
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_RELEASE
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED
#undef KT_AMX_REAL

/* TILERELEASE on the calling thread: the tests' stand-in for other code on ktcy's threads
 * (oneDNN under torch) that releases the tiles between two ktcy calls.  -1: AMX not built. */
__attribute__((target("amx-tile"))) static inline int ktcy_amx_release_tiles(void) { _tile_release(); return 0; }
#else
static inline int ktcy_amx_release_tiles(void) { return -1; }
#endif

#endif
