/* INT8 traits: s8 codes in the whole int8 range (-128 included: compressed-tensors' symmetric
 * scale is amax / 127.5), one scale per output channel, int8 activations.
 *   y[m][n] = (float)sum_k(q_x[m][k] * q_w[n][k]) * x_scale[m] * w_scale[n]   (this order on every ISA)
 * Included by a skeleton instantiation (KT_SKEL says which); no include guard. */
#define KT_ROW KTCY_ROW_INT8
#define KT_FORMATS (1 << KTCY_FMT_INT8)
#include "traits_begin.h"

#if KT_SKEL == KT_SKEL_REF
KT_AI int32_t KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    return ktcy_int8_block_code(w->data, w->k_pad, p, nn, k);
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->k_pad; }
KT_AI float KT_(group)(float acc, int32_t part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    (void)a; (void)m; (void)w; (void)n; (void)g;
    return acc + (float)part;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    return acc * a->scale[m] * w->scale[n];
}

#elif KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_S8
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#define KT_WIDE_TILE 1 /* each broadcast serves 4 weight halves, each |w| 3 rows; per CPU (ktcy_wide_tiles) */
/* One-row calls stream two panels at once on AMD cores too: with no decode work per row, the
 * second stream's misses in flight pay (a Zen 3 ran MoE T = 1, 2 and 4 in 0.85-0.88x the time,
 * median of 7 interleaved rounds), where the decoding formats ran slower that way
 * (ktcy_one_panel_rows). */
#define KT_ONE_ROW_TWO_PANELS 1
#include "traits_plain_rows.h"
#include "traits_no_groups.h"
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc;
    __m256 out = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(a->scale[m]));
    return _mm256_mul_ps(out, _mm256_loadu_ps(w->scale + n0));
}

#elif KT_SKEL == KT_SKEL_AVX512
#define KT_WKIND KT_W_S8
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#include "traits_plain_rows.h"
#include "traits_no_groups.h"
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc;
    __m512 out = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(a->scale[m]));
    return _mm512_mul_ps(out, _mm512_loadu_ps(w->scale + n0));
}

#elif KT_SKEL == KT_SKEL_AMX
KT_AI const uint8_t *KT_(prepare_b)(const ktcy_weight *w, int64_t p, int np, uint8_t *buf) {
    (void)np; (void)buf;
    return w->data + p * (w->k_pad / 64) * 1024; /* the packed block is the B tile */
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->k_pad; }
#include "traits_amx_one_group.h"
KT_AI float KT_(tile_group)(float acc, int32_t c, float r, float s) {
    (void)r; (void)s;
    return acc + (float)c;
}
KT_AI void KT_(final_cols)(const ktcy_weight *w, int64_t p, int np, float *t) {
    for (int j = 0; j < 16 * np; ++j) t[j] = w->scale[p * 16 + j];
}
KT_AI float KT_(final_row)(const ktcy_act *a, int64_t m) { return a->scale[m]; }
KT_AI float KT_(tile_final)(float acc, float r, float t) { return acc * r * t; }

#else
#error "fmt_int8.h: no traits for this skeleton"
#endif
