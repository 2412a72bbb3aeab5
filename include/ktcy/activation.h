/* SwiGLU, g <- silu(g) * u = g / (1 + exp(-g)) * u, over one row segment, with the same result
 * bits on every ISA (the MoE's INT8 bit-identity across machines depends on it: the SwiGLU
 * output is quantized next).  exp(x) = 2^n * 2^f with n = rint(x log2 e), |f| <= 1/2, and a
 * degree-6 polynomial for 2^f evaluated with fused multiply-adds (fmaf in C, vfmadd in
 * vectors: both round once).  x is clamped to [-80, 80] first, so 2^n is a normal power of two
 * and the product exact; outside that range 1 + exp(-g) is either 1 (g > 80) or e^80, so that
 * silu(g) is g e^-80 (1.8e-35 |g|: -1.8e-5 at g = -1e30) where it is ~0.  NaN passes through
 * the clamps (min/max keep the NaN operand) and stays NaN. */
#ifndef KTCY_ACTIVATION_H
#define KTCY_ACTIVATION_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "numeric.h"

#define KTCY_EXP_CLAMP 80.0f
#define KTCY_LOG2E 1.44269504f
/* 2^f on [-1/2, 1/2], highest coefficient first */
#define KTCY_EXP_C6 1.5403530e-4f
#define KTCY_EXP_C5 1.3333558e-3f
#define KTCY_EXP_C4 9.6181291e-3f
#define KTCY_EXP_C3 5.5504109e-2f
#define KTCY_EXP_C2 2.4022651e-1f
#define KTCY_EXP_C1 6.9314718e-1f

typedef void (*ktcy_swiglu_fn)(float *g, const float *u, int64_t n);
/* GPT-OSS's clamped variant: g <- (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'),
 * g' = min(g, limit); sigmoid through the same exp, so it too gives the same bits everywhere. */
typedef void (*ktcy_glu_clamped_fn)(float *g, const float *u, int64_t n, float alpha, float limit);

static inline float ktcy_exp_scalar(float x) {
    x = KTCY_EXP_CLAMP < x ? KTCY_EXP_CLAMP : x;
    x = -KTCY_EXP_CLAMP > x ? -KTCY_EXP_CLAMP : x;
    const float t = x * KTCY_LOG2E, n = ktcy_rint_small(t), f = t - n;
    float p = fmaf(KTCY_EXP_C6, f, KTCY_EXP_C5);
    p = fmaf(p, f, KTCY_EXP_C4);
    p = fmaf(p, f, KTCY_EXP_C3);
    p = fmaf(p, f, KTCY_EXP_C2);
    p = fmaf(p, f, KTCY_EXP_C1);
    p = fmaf(p, f, 1.0f);
    const int32_t ni = n == n ? (int32_t)n : 0; /* NaN: p is NaN already */
    return p * ktcy_pow2(ni);
}

static inline void ktcy_swiglu_ref(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + ktcy_exp_scalar(-g[i])) * u[i];
}

static inline void ktcy_glu_clamped_ref(float *g, const float *u, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        const float gc = limit < g[i] ? limit : g[i];
        float uc = limit < u[i] ? limit : u[i];
        uc = -limit > uc ? -limit : uc;
        g[i] = (uc + 1.0f) * (gc / (1.0f + ktcy_exp_scalar(-(alpha * gc))));
    }
}

__attribute__((target("avx2,fma"))) static inline __m256 ktcy_exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(KTCY_EXP_CLAMP), x);
    x = _mm256_max_ps(_mm256_set1_ps(-KTCY_EXP_CLAMP), x);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(KTCY_LOG2E));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(KTCY_EXP_C6), f, _mm256_set1_ps(KTCY_EXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(KTCY_EXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(KTCY_EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(KTCY_EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(KTCY_EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) static inline void ktcy_swiglu_avx2(float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i < 8 ? n - i : 8)), lanes);
        const __m256 gv = _mm256_maskload_ps(g + i, m), uv = _mm256_maskload_ps(u + i, m);
        const __m256 e = ktcy_exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_maskstore_ps(g + i, m, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
    }
}

__attribute__((target("avx2,fma"))) static inline void ktcy_glu_clamped_avx2(float *g, const float *u, int64_t n, float alpha,
                                                                      float limit) {
    const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
    const __m256 a = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i < 8 ? n - i : 8)), lanes);
        const __m256 gc = _mm256_min_ps(lim, _mm256_maskload_ps(g + i, m));
        const __m256 uc = _mm256_max_ps(nlim, _mm256_min_ps(lim, _mm256_maskload_ps(u + i, m)));
        const __m256 e = ktcy_exp_avx2(_mm256_sub_ps(zero, _mm256_mul_ps(a, gc)));
        _mm256_maskstore_ps(g + i, m, _mm256_mul_ps(_mm256_add_ps(uc, one), _mm256_div_ps(gc, _mm256_add_ps(one, e))));
    }
}

__attribute__((target("avx512f"))) static inline __m512 ktcy_exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(KTCY_EXP_CLAMP), x);
    x = _mm512_max_ps(_mm512_set1_ps(-KTCY_EXP_CLAMP), x);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(KTCY_LOG2E));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(KTCY_EXP_C6), f, _mm512_set1_ps(KTCY_EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KTCY_EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KTCY_EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KTCY_EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(KTCY_EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

__attribute__((target("avx512f"))) static inline void ktcy_swiglu_avx512(float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
        const __m512 e = ktcy_exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
    }
}

__attribute__((target("avx512f"))) static inline void ktcy_glu_clamped_avx512(float *g, const float *u, int64_t n, float alpha,
                                                                      float limit) {
    const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
    const __m512 a = _mm512_set1_ps(alpha), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 gc = _mm512_min_ps(lim, _mm512_maskz_loadu_ps(m, g + i));
        const __m512 uc = _mm512_max_ps(nlim, _mm512_min_ps(lim, _mm512_maskz_loadu_ps(m, u + i)));
        const __m512 e = ktcy_exp_avx512(_mm512_sub_ps(zero, _mm512_mul_ps(a, gc)));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(_mm512_add_ps(uc, one), _mm512_div_ps(gc, _mm512_add_ps(one, e))));
    }
}

#endif
