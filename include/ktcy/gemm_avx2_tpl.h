/* AVX2 + FMA GEMM skeleton, format-agnostic; kernels.h instantiates it once per format with
 * KT_GEMM (entry point name), KT_TRAITS (fmt_*.h, included with KT_SKEL == KT_SKEL_AVX2) and
 * KT_TARGET.  A 64-byte packed row is two 256-bit halves (channels 0-7 and 8-15).  Integer
 * products use the exact |a| * (w * sign a) vpmaddubsw form (or unsigned code x signed
 * activation); bf16 uses even/odd FMAs.  No include guard.
 *
 * The traits header gives (see gemm_avx512_tpl.h for the common ones):
 *   KT_WKIND, KT_PREDECODE, KT_(has_groups), KT_(group_at)(w, kb, r, nkb) for any row r,
 *   KT_(half)(blk, r, h)                                     half h of row r of a packed block
 *   KT_(decode_panels)(src, dst, blocks)                     KT_PREDECODE only
 *   KT_(group_epilogue)(acc[4][2], facc[4][2], MB, a, w, m0, p, g)
 *   KT_(final)(acc, facc, a, w, m, n0)                       8 outputs of one row
 */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_SKEL KT_SKEL_AVX2

#include KT_TRAITS

static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

KT_AI __m256i KT_(dp)(__m256i acc, __m256i a, __m256i w) {
#if KT_INT_ACT
    if (KT_WKIND == KT_W_S8) {
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    __m256i pairs = _mm256_maddubs_epi16(w, a); /* unsigned code x signed activation, no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 f = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                               _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), _mm256_castsi256_ps(acc));
    f = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, odd)), _mm256_castsi256_ps(_mm256_and_si256(w, odd)), f);
    return _mm256_castps_si256(f);
#endif
}

/* PRE: panel p was decoded to 1024-byte bf16 blocks at `decoded`. */
KT_AI void KT_(micro)(const int MB, const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p,
                      float *y, int64_t ldy, const uint8_t *decoded) {
    const int64_t nkb = w->k_pad / KT_BK;
    const int64_t block_bytes = KT_PREDECODE ? 1024 : KT_BB;
    const uint8_t *panel = KT_PREDECODE ? decoded : w->data + p * nkb * KT_BB;
    const int groups = KT_(has_groups)(w);
    const uint8_t *arow[4];
    __m256i acc[4][2];
    __m256 facc[4][2];
    (void)decoded;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        arow[m] = (KT_INT_ACT ? (const uint8_t *)a->q : (const uint8_t *)a->bf16) + (m0 + m) * a->k_pad * KT_ASIZE;
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; ++h) { acc[m][h] = _mm256_setzero_si256(); facc[m][h] = _mm256_setzero_ps(); }
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint8_t *blk = panel + kb * block_bytes;
        const uint8_t *ak[4]; /* this block's activations of each row: row offsets below are immediates */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) ak[m] = arow[m] + kb * KT_BK * KT_ASIZE;
        _Pragma("GCC unroll 16")
        for (int r = 0; r < 16; ++r) {
#if KT_PREDECODE
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + r * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + r * 64 + 32));
#else
            const __m256i w0 = KT_(half)(blk, r, 0), w1 = KT_(half)(blk, r, 1);
#endif
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
                int32_t dword;
                memcpy(&dword, ak[m] + r * KT_KPR * KT_ASIZE, 4);
                __m256i av = _mm256_set1_epi32(dword);
                acc[m][0] = KT_(dp)(acc[m][0], av, w0);
                acc[m][1] = KT_(dp)(acc[m][1], av, w1);
            }
            if (groups) {
                const int64_t g = KT_(group_at)(w, kb, r, nkb);
                if (g >= 0) KT_(group_epilogue)(acc, facc, MB, a, w, m0, p, g);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB && m0 + m < a->m; ++m) {
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; ++h) {
            const int64_t n0 = p * 16 + h * 8, valid = w->n - n0;
            if (valid <= 0) break;
            const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 8 ? valid : 8)), lanes);
            _mm256_maskstore_ps(y + (m0 + m) * ldy + n0, mask, KT_(final)(acc[m][h], facc[m][h], a, w, m0 + m, n0));
        }
    }
}

KT_TARGET static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
    const int max_rows = KT_(has_groups)(w) ? 2 : 4;
    const int64_t nkb = w->k_pad / KT_BK;
    uint8_t *decoded = ktcy_align64(scratch);
    (void)nkb;
    for (int64_t p = pb; p < pe; ++p) {
#if KT_PREDECODE
        KT_(decode_panels)(w->data + p * nkb * KT_BB, decoded, nkb); /* once per panel, not per row tile */
#endif
        for (int64_t m0 = 0; m0 < a->m;) {
            const int64_t left = a->m - m0;
            const int mb = left >= max_rows ? max_rows : left <= 1 ? 1 : left <= 2 ? 2 : 4;
            if (mb == 1) KT_(micro)(1, a, w, m0, p, y, ldy, decoded);
            else if (mb == 2) KT_(micro)(2, a, w, m0, p, y, ldy, decoded);
            else KT_(micro)(4, a, w, m0, p, y, ldy, decoded);
            m0 += mb;
        }
    }
    return KTCY_OK;
}

#include "traits_end.h"
