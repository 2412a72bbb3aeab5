/* AMX GEMM skeleton, format-agnostic, written once against a tile API and instantiated per
 * (format, binding) by kernels.h: with the real _tile_* instructions (ISA amx) and over
 * tile_emu.h (ISA amx_emu).  The instantiation defines KT_GEMM, KT_TRAITS, KT_TARGET and the
 * binding: KT_TILE_CONFIG(cfg) KT_TILE_LOADED(cfg) KT_TILE_LOAD(t, p, stride)
 * KT_TILE_STORE(t, p, stride) KT_TILE_ZERO(t) KT_TILE_DP_I8(c, a, b) KT_TILE_DP_BF16(c, a, b)
 * KT_TILE_FAILED().  No include guard.
 *
 * Blocking: 2 A tiles (32 rows) x 2 B tiles (2 panels = 32 channels) -> 4 C tiles, as kt-kernel.
 * tmm0..3 = C, tmm4..5 = A, tmm6..7 = B.  Activation buffers hold m_pad rows (a multiple of
 * 16, zero past m), so every A tile is a full 16 rows and one configuration serves all M.
 * Int8 activations use TDPBSSD (s8 x s8), bf16 ones TDPBF16PS.
 *
 * The traits header gives:
 *   KT_(prepare_b)(w, p, np, buf)     the np panels from p as tile blocks (1024 B, KT_BK K values,
 *                                     panel stride k_pad / KT_BK blocks): the packed data itself, or
 *                                     unpacked / decoded into buf
 *   KT_(group_len)(w)                 K values per scale group (k_pad when the whole row is one)
 *   KT_(tile_group)(acc, c, a, m, w, n, g)  folds one C element (int32 or float) of group g, row m, into acc
 *   KT_(tile_final)(acc, a, w, m, n)  the output
 *
 * Per-thread scratch (64-byte aligned):  C tiles [32][32] (4 KiB) | acc [32][32] float (4 KiB) |
 *                                        B blocks of 2 panels when prepare_b unpacks/decodes */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_SKEL KT_SKEL_AMX

#include KT_TRAITS

static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

/* Palette-1 config: C tiles 16 x 64 B; A 16 x a_colsb; B a_colsb/4 x 64 B. */
KT_AI void KT_(configure)(int a_colsb) {
    uint8_t cfg[64] __attribute__((aligned(64)));
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (int t = 0; t < 8; ++t) {
        int colsb = (t == 4 || t == 5) ? a_colsb : 64;
        int rows = (t == 6 || t == 7) ? a_colsb / 4 : 16;
        cfg[16 + 2 * t] = (uint8_t)colsb;
        cfg[48 + t] = (uint8_t)rows;
    }
    if (!KT_TILE_LOADED(cfg)) KT_TILE_CONFIG(cfg); /* once per thread while the shape holds */
}

/* One K step of the 2x2 tile block: A rows from a (row stride lda bytes), B tiles at b0/b1. */
KT_AI void KT_(step)(const void *a, int64_t lda, const void *b0, const void *b1, int mt, int np) {
    KT_TILE_LOAD(4, a, lda);
    if (mt == 2) KT_TILE_LOAD(5, (const uint8_t *)a + 16 * lda, lda);
    KT_TILE_LOAD(6, b0, 64);
    if (np == 2) KT_TILE_LOAD(7, b1, 64);
#if KT_INT_ACT
    KT_TILE_DP_I8(0, 4, 6);
    if (np == 2) KT_TILE_DP_I8(1, 4, 7);
    if (mt == 2) { KT_TILE_DP_I8(2, 5, 6); if (np == 2) KT_TILE_DP_I8(3, 5, 7); }
#else
    KT_TILE_DP_BF16(0, 4, 6);
    if (np == 2) KT_TILE_DP_BF16(1, 4, 7);
    if (mt == 2) { KT_TILE_DP_BF16(2, 5, 6); if (np == 2) KT_TILE_DP_BF16(3, 5, 7); }
#endif
}

KT_AI void KT_(zero_c)(void) { KT_TILE_ZERO(0); KT_TILE_ZERO(1); KT_TILE_ZERO(2); KT_TILE_ZERO(3); }

/* C tile (i, j) -> c[(16 i + row) * 32 + 16 j + col] (32 x 32 int32 or float). */
KT_AI void KT_(store_c)(void *c, int mt, int np) {
    uint8_t *base = (uint8_t *)c;
    KT_TILE_STORE(0, base, 128);
    if (np == 2) KT_TILE_STORE(1, base + 64, 128);
    if (mt == 2) { KT_TILE_STORE(2, base + 16 * 128, 128); if (np == 2) KT_TILE_STORE(3, base + 16 * 128 + 64, 128); }
}

KT_TARGET static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
    const int64_t nkb = w->k_pad / KT_BK, lda = a->k_pad * KT_ASIZE;
    const int64_t glen = KT_(group_len)(w), kstep = glen < KT_BK ? glen : KT_BK;
    const uint8_t *arows = KT_INT_ACT ? (const uint8_t *)a->q : (const uint8_t *)a->bf16;
#if KT_INT_ACT
    int32_t *c = (int32_t *)ktcy_align64(scratch);
#else
    float *c = (float *)ktcy_align64(scratch);
#endif
    float *acc = (float *)(c + 32 * 32);
    uint8_t *buf = (uint8_t *)(acc + 32 * 32);
    KT_(configure)((int)(kstep * KT_ASIZE));
    for (int64_t p = pb; p < pe; p += 2) {
        const int np = pe - p >= 2 ? 2 : 1;
        const uint8_t *b0 = KT_(prepare_b)(w, p, np, buf), *b1 = b0 + nkb * 1024;
        for (int64_t m0 = 0; m0 < a->m; m0 += 32) {
            const int mt = a->m - m0 > 16 ? 2 : 1;
            memset(acc, 0, 32 * 32 * sizeof(float));
            for (int64_t k0 = 0; k0 < w->k_pad; k0 += glen) {
                KT_(zero_c)();
                for (int64_t k = k0; k < k0 + glen && k < w->k_pad; k += kstep) {
                    /* B rows for K offset k: block k / KT_BK, row (k % KT_BK) / KT_KPR, 64 bytes a row */
                    const int64_t boff = (k / KT_BK) * 1024 + (k % KT_BK) / KT_KPR * 64;
                    KT_(step)(arows + m0 * lda + k * KT_ASIZE, lda, b0 + boff, b1 + boff, mt, np);
                }
                KT_(store_c)(c, mt, np);
                for (int64_t i = 0; i < 16 * mt; ++i)
                    for (int64_t j = 0; j < 16 * np; ++j)
                        acc[i * 32 + j] = KT_(tile_group)(acc[i * 32 + j], c[i * 32 + j], a, m0 + i, w, p * 16 + j,
                                                                  k0 / glen);
            }
            for (int64_t i = 0; i < 16 * mt && m0 + i < a->m; ++i)
                for (int64_t j = 0; j < 16 * np && p * 16 + j < w->n; ++j)
                    y[(m0 + i) * ldy + p * 16 + j] = KT_(tile_final)(acc[i * 32 + j], a, w, m0 + i, p * 16 + j);
        }
    }
    return KT_TILE_FAILED() ? KTCY_ERR_TILE : KTCY_OK;
}

#include "traits_end.h"
