/* Byte-code decodes with AVX-512 that several variants share: E2M1 quads by VBMI lookups
 * (MXFP4_A8, MXFP4), E4M3 to bf16 with BW alone (FP8 on AVX-512 without VBMI, AMX's B tiles). */
#ifndef KTCY_DECODE_AVX512_H
#define KTCY_DECODE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "numeric.h"
#include "skeleton.h"

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

#endif
