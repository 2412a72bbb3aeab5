/* Epilogues of a format whose float sums are already the outputs (no scales, or scales folded
 * into the decoded weights): BF16, MXFP4.  Included by such a traits header, for the skeleton
 * being instantiated; no include guard. */
#if KT_SKEL == KT_SKEL_REF || KT_SKEL == KT_SKEL_AMX
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->k_pad; }
#endif

#if KT_SKEL == KT_SKEL_REF
KT_AI float KT_(group)(float acc, float part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    (void)a; (void)m; (void)w; (void)n; (void)g;
    return acc + part;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)a; (void)w; (void)m; (void)n;
    return acc;
}
#elif KT_SKEL == KT_SKEL_AVX2
#include "traits_no_groups.h"
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc; (void)a; (void)w; (void)m; (void)n0;
    return _mm256_castsi256_ps(acc);
}
#elif KT_SKEL == KT_SKEL_AVX512
#include "traits_no_groups.h"
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc; (void)a; (void)w; (void)m; (void)n0;
    return acc;
}
#elif KT_SKEL == KT_SKEL_AMX
#include "traits_amx_one_group.h"
KT_AI float KT_(tile_group)(float acc, float c, float r, float s) { (void)r; (void)s; return acc + c; }
KT_AI void KT_(final_cols)(const ktcy_weight *w, int64_t p, int np, float *t) {
    (void)w; (void)p;
    for (int j = 0; j < 16 * np; ++j) t[j] = 1.0f;
}
KT_AI float KT_(final_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
KT_AI float KT_(tile_final)(float acc, float r, float t) { (void)r; (void)t; return acc; }
#endif
