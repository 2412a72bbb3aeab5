/* AVX2 pieces the skeleton and the format traits share: bf16 pairs and int8 lanes as a
 * weight row's halves, scaling sums by per-channel scales and a row factor, E8M0 powers of
 * two, and storing 8 or 16 outputs of a row. */
#ifndef KTCY_VEC_AVX2_H
#define KTCY_VEC_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "numeric.h"
#include "skeleton.h"

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

#endif
