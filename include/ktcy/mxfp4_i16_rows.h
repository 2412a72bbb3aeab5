/* The activation rows of MXFP4's 16-bit integer few-row path (fmt_mxfp4.h, AVX2 and
 * AVX-512), made once per call in the GEMM's scratch. */
#ifndef KTCY_MXFP4_I16_ROWS_H
#define KTCY_MXFP4_I16_ROWS_H

#include <immintrin.h>
#include <stdint.h>

#include "numeric.h"
#include "types.h"

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

#endif
