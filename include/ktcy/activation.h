/* SwiGLU, g <- silu(g) * u = g / (1 + exp(-g)) * u, over one row segment.  The AVX-512 path
 * computes exp as 2^n * 2^f (n = round(x log2 e), |f| <= 1/2) with a degree-6 polynomial for
 * 2^f (relative error ~2e-7, below the bf16/int8 rounding the result gets next) and vscalefps
 * for 2^n, which also takes care of overflow to infinity and underflow to zero. */
#ifndef KTCY_ACTIVATION_H
#define KTCY_ACTIVATION_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline void ktcy_swiglu_ref(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

__attribute__((target("avx512f"))) static inline __m512 ktcy_exp_avx512(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504f);
    __m512 t = _mm512_mul_ps(x, log2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f"))) static void ktcy_swiglu_avx512(float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
        __m512 e = ktcy_exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, uv));
    }
}

#endif
