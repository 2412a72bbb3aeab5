/* Portable C GEMM skeleton: the readable specification every ISA matches.  kernels.h
 * instantiates it once per format (KT_GEMM, KT_TRAITS; KT_SKEL == KT_SKEL_REF).
 *   Y[m][n] = final(... group(group(0, part_0), part_1) ...)
 * where part_g is the plain sum over group g's K values of activation x code (int32 for int8
 * activations, float in K order for bf16 ones).  Integer formats fix the float operation order
 * that every ISA reproduces bit for bit.  No include guard.
 *
 * The traits header gives:
 *   KT_(code)(w, p, nn, k)            the stored code (int32) or value (float) of channel p*16+nn at k
 *   KT_(group_len)(w)                 K values per scale group (k_pad when the whole row is one)
 *   KT_(group)(acc, part, a, m, w, n, g)  folds a group's partial sum (row m) into the float accumulator
 *   KT_(final)(acc, a, w, m, n)       the output */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline
#define KT_SKEL KT_SKEL_REF

#include KT_TRAITS

static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t p0, int64_t p1,
                   void *scratch) {
    (void)scratch;
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
    const int64_t glen = KT_(group_len)(w);
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t nn = 0; nn < KTCY_PANEL && p * KTCY_PANEL + nn < w->n; ++nn) {
            const int64_t n = p * KTCY_PANEL + nn;
            for (int64_t m = 0; m < a->m; ++m) {
                float acc = 0.0f;
                for (int64_t k0 = 0; k0 < w->k_pad; k0 += glen) {
                    KT_(part_t) part = 0;
                    for (int64_t k = k0; k < k0 + glen && k < w->k_pad; ++k) {
#if KT_INT_ACT
                        part += (int32_t)a->q[m * a->k_pad + k] * KT_(code)(w, p, nn, k);
#else
                        part += ktcy_bf16_to_f32(a->bf16[m * a->k_pad + k]) * KT_(code)(w, p, nn, k);
#endif
                    }
                    acc = KT_(group)(acc, part, a, m, w, n, k0 / glen);
                }
                y[m * ldy + n] = KT_(final)(acc, a, w, m, n);
            }
        }
    return KTCY_OK;
}

#include "traits_end.h"
