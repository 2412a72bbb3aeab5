/* Activation rows -> what the kernels multiply: symmetric int8 codes per row (+ per-group code
 * sums) for the INT8-activation formats, bf16 bits for the others.  Each has the portable
 * definition and AVX2 / AVX-512 versions that write the same bytes.  Every MoE call converts its
 * tokens and every SwiGLU row through here; at T = 512 the portable int8 loop (built for baseline
 * SSE2) took about 8% of an AMX INT8 layer's time on one thread.
 *
 * Why the vector versions are exact: they do the portable version's float operations in the same
 * order (x * inv, then + and - 1.5 * 2^23 for round-half-to-even, then the clamp to +-127), each
 * correctly rounded on every lane, and they find the row's largest |x| on the bit patterns as the
 * portable version does.  One pass serves both the maximum and the finiteness check: a row is
 * finite exactly when its largest |x| bit pattern lies below infinity's. */
#ifndef KTCY_ACT_QUANT_H
#define KTCY_ACT_QUANT_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"

typedef void (*ktcy_quant_act_fn)(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0, int64_t m1,
                                  int8_t *q, float *scale, int group, int32_t *gsum);
typedef void (*ktcy_bf16_act_fn)(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0, int64_t m1,
                                 uint16_t *out);

static inline float ktcy_clamp127(float v) { return v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v; }

/* One activation's code: x * inv rounded half to even, clamped (the vector versions' order too). */
static inline int8_t ktcy_act_code(float x, float inv) { return (int8_t)ktcy_clamp127(ktcy_rint_small(x * inv)); }

#define KTCY_ABS_BITS_INF 0x7F800000u /* |x| bit patterns at or above this: infinity or NaN */
/* Rows whose largest |x| lies below 2^-120 quantize to zero codes and a zero scale: there 127/amax
 * would overflow (x * inf made NaN codes, which C does not define as int8), and no model's
 * activations are that small. */
#define KTCY_ABS_BITS_TINY 0x03800000u

/* A row's scale from its largest |x| bit pattern.  Returns 127 / amax, or 0 for a row this
 * writes as zero codes itself: non-finite (scale NaN) or tiny (scale 0). */
static inline float ktcy_act_row_start(uint32_t amax_bits, float *scale, int8_t *out, int64_t k) {
    if (amax_bits >= KTCY_ABS_BITS_INF || amax_bits < KTCY_ABS_BITS_TINY) {
        *scale = amax_bits >= KTCY_ABS_BITS_INF ? NAN : 0.0f;
        memset(out, 0, (size_t)k);
        return 0.0f;
    }
    const float amax = ktcy_bits_f32(amax_bits);
    *scale = amax / 127.0f;
    return 127.0f / amax;
}

/* The row's codes past k and its group sums, shared by every version (integer work). */
static inline void ktcy_act_row_tail(int8_t *out, int64_t k, int64_t k_pad, int group, int32_t *gsum_row) {
    memset(out + k, 0, (size_t)(k_pad - k));
    if (group > 0)
        for (int64_t g = 0; g < k_pad / group; ++g) {
            int32_t s = 0;
            for (int i = 0; i < group; ++i) s += out[g * group + i];
            gsum_row[g] = s;
        }
}

/* MXFP4_A8's block sums (fmt_mxfp4_a8.h), written after the codes (a quantizer called with no
 * group), in the form AVX2's int16 sums start from: per row and 32-K block, -12 x the sum of the
 * codes at K = 0, 1 (mod 4) in the low 16 bits and -12 x the sum at K = 2, 3 (mod 4) in the high
 * 16 (each at most 12 x 16 x 127 = 24384 in size).  Every version writes the same words. */
typedef void (*ktcy_e2m1_starts_fn)(const int8_t *q, int64_t k_pad, int64_t m0, int64_t m1, int32_t *starts);

static inline int32_t ktcy_e2m1_start_words(int32_t low, int32_t high) {
    return (int32_t)((uint32_t)(uint16_t)(-12 * low) | (uint32_t)(uint16_t)(-12 * high) << 16);
}

static inline void ktcy_act_e2m1_starts(const int8_t *q, int64_t k_pad, int64_t m0, int64_t m1, int32_t *starts) {
    const int64_t blocks = k_pad / 32;
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
            const int8_t *c = q + m * k_pad + b * 32;
            int32_t low = 0, high = 0;
            for (int i = 0; i < 32; i += 4) {
                low += c[i] + c[i + 1];
                high += c[i + 2] + c[i + 3];
            }
            starts[m * blocks + b] = ktcy_e2m1_start_words(low, high);
        }
}

/* The scalar loop costs as much as 3% of an AVX2 GEMM at M = 512: the pair sums in one vpmaddubsw,
 * each dword's words split by two vpmaddwd, then two horizontal adds. */
__attribute__((target("avx2"))) static inline void ktcy_act_e2m1_starts_avx2(const int8_t *q, int64_t k_pad, int64_t m0,
                                                                            int64_t m1, int32_t *starts) {
    const int64_t blocks = k_pad / 32;
    const __m256i ones = _mm256_set1_epi8(1), low_word = _mm256_set1_epi32(1), high_word = _mm256_set1_epi32(0x10000);
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
            const __m256i pairs = _mm256_maddubs_epi16(ones, _mm256_loadu_si256((const __m256i *)(q + m * k_pad + b * 32)));
            const __m256i both = _mm256_hadd_epi32(_mm256_madd_epi16(pairs, low_word), _mm256_madd_epi16(pairs, high_word));
            __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            sum = _mm_hadd_epi32(sum, sum); /* low, high, low, high */
            starts[m * blocks + b] = ktcy_e2m1_start_words(_mm_cvtsi128_si32(sum), _mm_extract_epi32(sum, 1));
        }
}

/* Symmetric int8 per row, scale = amax/127 (0 for zero and tiny rows, KTCY_ABS_BITS_TINY).  A
 * row holding NaN or infinity gets a NaN scale and zero codes, so the non-finite value reaches that row's outputs (and no other row's).  Codes
 * past k are zero up to k_pad.  When group > 0 the per-group code sums (INT4 kernels subtract
 * 8 * sum) are written too. */
static inline void ktcy_quantize_act_int8(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                          int64_t m1, int8_t *q, float *scale, int group, int32_t *gsum) {
    for (int64_t m = m0; m < m1; ++m) {
        const float *row = x + m * ldx;
        int8_t *out = q + m * k_pad;
        const uint32_t bits = ktcy_row_finite(row, k) ? ktcy_f32_bits(ktcy_row_amax(row, k)) : KTCY_ABS_BITS_INF;
        const float inv = ktcy_act_row_start(bits, scale + m, out, k);
        if (inv > 0.0f)
            for (int64_t i = 0; i < k; ++i) out[i] = ktcy_act_code(row[i], inv);
        ktcy_act_row_tail(out, k, k_pad, group, group > 0 ? gsum + m * (k_pad / group) : 0);
    }
}

__attribute__((target("avx2"))) static inline void ktcy_quantize_act_int8_avx2(const float *x, int64_t ldx, int64_t k,
                                                                              int64_t k_pad, int64_t m0, int64_t m1,
                                                                              int8_t *q, float *scale, int group,
                                                                              int32_t *gsum) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    for (int64_t m = m0; m < m1; ++m) {
        const float *row = x + m * ldx;
        int8_t *out = q + m * k_pad;
        const int64_t k8 = k / 8 * 8;
        __m256i vmax = _mm256_setzero_si256();
        for (int64_t i = 0; i < k8; i += 8)
            vmax = _mm256_max_epi32(vmax, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + i)), abs_mask));
        __m128i h = _mm_max_epi32(_mm256_castsi256_si128(vmax), _mm256_extracti128_si256(vmax, 1));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        const uint32_t head = (uint32_t)_mm_cvtsi128_si32(h), tail = ktcy_f32_bits(ktcy_row_amax(row + k8, k - k8));
        const uint32_t bits = head > tail ? head : tail;
        const float inv = ktcy_act_row_start(bits, scale + m, out, k);
        if (inv > 0.0f) {
            const __m256 vinv = _mm256_set1_ps(inv), magic = _mm256_set1_ps(12582912.0f);
            const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
            for (int64_t i = 0; i < k8; i += 8) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + i), vinv);
                v = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_add_ps(v, magic), magic), lo), hi);
                const __m256i c = _mm256_cvtps_epi32(v); /* integral already: exact */
                const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
                _mm_storel_epi64((__m128i *)(out + i), _mm_packs_epi16(w, w));
            }
            for (int64_t i = k8; i < k; ++i) out[i] = ktcy_act_code(row[i], inv);
        }
        ktcy_act_row_tail(out, k, k_pad, group, group > 0 ? gsum + m * (k_pad / group) : 0);
    }
}

__attribute__((target("avx512f,avx512bw"))) static inline void ktcy_quantize_act_int8_avx512(
    const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0, int64_t m1, int8_t *q, float *scale,
    int group, int32_t *gsum) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t m = m0; m < m1; ++m) {
        const float *row = x + m * ldx;
        int8_t *out = q + m * k_pad;
        const int64_t k16 = k / 16 * 16;
        const __mmask16 tail = (__mmask16)((1u << (k - k16)) - 1u);
        __m512i vmax = _mm512_setzero_si512();
        for (int64_t i = 0; i < k16; i += 16)
            vmax = _mm512_max_epi32(vmax, _mm512_and_si512(_mm512_loadu_si512(row + i), abs_mask));
        if (tail) /* masked-off lanes load as zero */
            vmax = _mm512_max_epi32(vmax, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, row + k16), abs_mask));
        const uint32_t bits = (uint32_t)_mm512_reduce_max_epi32(vmax);
        const float inv = ktcy_act_row_start(bits, scale + m, out, k);
        if (inv > 0.0f) {
            const __m512 vinv = _mm512_set1_ps(inv), magic = _mm512_set1_ps(12582912.0f);
            const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
            for (int64_t i = 0; i < k; i += 16) {
                const __mmask16 lanes = i < k16 ? (__mmask16)0xFFFF : tail;
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + i), vinv);
                v = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_add_ps(v, magic), magic), lo), hi);
                _mm512_mask_cvtsepi32_storeu_epi8(out + i, lanes, _mm512_cvtps_epi32(v)); /* integral: exact */
            }
        }
        ktcy_act_row_tail(out, k, k_pad, group, group > 0 ? gsum + m * (k_pad / group) : 0);
    }
}

/* bf16 rows: round to nearest even, NaN kept NaN (quieted), codes past k zero up to k_pad. */
static inline void ktcy_convert_act_bf16(const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0,
                                         int64_t m1, uint16_t *out) {
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t i = 0; i < k; ++i) out[m * k_pad + i] = ktcy_f32_to_bf16(x[m * ldx + i]);
        memset(out + m * k_pad + k, 0, (size_t)(k_pad - k) * 2);
    }
}

/* ktcy_f32_to_bf16 on 8 lanes, in integers as it is written (no vcvtneps2bf16: AVX2 has none). */
__attribute__((target("avx2"))) static inline __m256i ktcy_bf16_bits8(__m256i u) {
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

__attribute__((target("avx2"))) static inline void ktcy_convert_act_bf16_avx2(const float *x, int64_t ldx, int64_t k,
                                                                             int64_t k_pad, int64_t m0, int64_t m1,
                                                                             uint16_t *out) {
    for (int64_t m = m0; m < m1; ++m) {
        const float *row = x + m * ldx;
        uint16_t *o = out + m * k_pad;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            const __m256i b = ktcy_bf16_bits8(_mm256_loadu_si256((const __m256i *)(row + i)));
            /* values lie in 0..0xFFFF, which packus keeps as they are */
            const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
            _mm_storeu_si128((__m128i *)(o + i), _mm_packus_epi32(lo, hi));
        }
        for (; i < k; ++i) o[i] = ktcy_f32_to_bf16(row[i]);
        memset(o + k, 0, (size_t)(k_pad - k) * 2);
    }
}

__attribute__((target("avx512f,avx512bw"))) static inline void ktcy_convert_act_bf16_avx512(
    const float *x, int64_t ldx, int64_t k, int64_t k_pad, int64_t m0, int64_t m1, uint16_t *out) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    for (int64_t m = m0; m < m1; ++m) {
        const float *row = x + m * ldx;
        uint16_t *o = out + m * k_pad;
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 lanes = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1u);
            const __m512i u = _mm512_maskz_loadu_epi32(lanes, row + i);
            const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs_mask), inf);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
            b = _mm512_mask_or_epi32(b, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
            _mm512_mask_cvtepi32_storeu_epi16(o + i, lanes, b);
        }
        memset(o + k, 0, (size_t)(k_pad - k) * 2);
    }
}

#endif
