/* AMX GEMM micro-kernels, written once against the tile API below and compiled twice by
 * gemm_amx.h: with the real _tile_* instructions (ISA amx) and over tile_emu.h (ISA amx_emu).
 * The binder defines KT_AMX_NAME(x), KT_AMX_TARGET and
 *   KT_TILE_CONFIG(cfg) KT_TILE_LOADED(cfg) KT_TILE_LOAD(t, p, stride) KT_TILE_STORE(t, p, stride)
 *   KT_TILE_ZERO(t) KT_TILE_DP_I8(c, a, b) KT_TILE_DP_BF16(c, a, b) KT_TILE_FAILED()
 * No include guard: included once per binding.
 *
 * Blocking: 2 A tiles (32 rows) x 2 B tiles (2 panels = 32 channels) -> 4 C tiles, as kt-kernel.
 * tmm0..3 = C, tmm4..5 = A, tmm6..7 = B.  Activation buffers hold m_pad rows (a multiple of
 * 16, zero past m), so every A tile is a full 16 rows and one configuration serves all M. */

#define KT_AMX_AI static inline __attribute__((always_inline)) KT_AMX_TARGET

/* Palette-1 config: C tiles 16 x 64 B; A 16 x a_colsb; B b_rows x 64 B. */
KT_AMX_AI void KT_AMX_NAME(configure)(int a_colsb) {
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
KT_AMX_AI void KT_AMX_NAME(step)(int bf16, const void *a, int64_t lda, const void *b0, const void *b1, int mt,
                                 int np) {
    KT_TILE_LOAD(4, a, lda);
    if (mt == 2) KT_TILE_LOAD(5, (const uint8_t *)a + 16 * lda, lda);
    KT_TILE_LOAD(6, b0, 64);
    if (np == 2) KT_TILE_LOAD(7, b1, 64);
    if (bf16) {
        KT_TILE_DP_BF16(0, 4, 6);
        if (np == 2) KT_TILE_DP_BF16(1, 4, 7);
        if (mt == 2) { KT_TILE_DP_BF16(2, 5, 6); if (np == 2) KT_TILE_DP_BF16(3, 5, 7); }
    } else {
        KT_TILE_DP_I8(0, 4, 6);
        if (np == 2) KT_TILE_DP_I8(1, 4, 7);
        if (mt == 2) { KT_TILE_DP_I8(2, 5, 6); if (np == 2) KT_TILE_DP_I8(3, 5, 7); }
    }
}

KT_AMX_AI void KT_AMX_NAME(zero_c)(void) { KT_TILE_ZERO(0); KT_TILE_ZERO(1); KT_TILE_ZERO(2); KT_TILE_ZERO(3); }

/* C tile (i, j) -> c[(16 i + row) * 32 + 16 j + col] (32 x 32 int32 or float). */
KT_AMX_AI void KT_AMX_NAME(store_c)(void *c, int mt, int np) {
    uint8_t *base = (uint8_t *)c;
    KT_TILE_STORE(0, base, 128);
    if (np == 2) KT_TILE_STORE(1, base + 64, 128);
    if (mt == 2) { KT_TILE_STORE(2, base + 16 * 128, 128); if (np == 2) KT_TILE_STORE(3, base + 16 * 128 + 64, 128); }
}

static inline uint8_t *KT_AMX_NAME(align64)(void *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

KT_AMX_TARGET static int KT_AMX_NAME(int8_gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                                int64_t pb, int64_t pe, void *scratch) {
    const int64_t nkb = w->k_pad / 64, lda = a->k_pad;
    int32_t *c = (int32_t *)KT_AMX_NAME(align64)(scratch);
    KT_AMX_NAME(configure)(64);
    for (int64_t p = pb; p < pe; p += 2) {
        const int np = pe - p >= 2 ? 2 : 1;
        const uint8_t *b0 = w->data + p * nkb * 1024, *b1 = b0 + nkb * 1024;
        for (int64_t m0 = 0; m0 < a->m; m0 += 32) {
            const int mt = a->m - m0 > 16 ? 2 : 1;
            KT_AMX_NAME(zero_c)();
            for (int64_t kb = 0; kb < nkb; ++kb)
                KT_AMX_NAME(step)(0, a->q + m0 * lda + kb * 64, lda, b0 + kb * 1024, b1 + kb * 1024, mt, np);
            KT_AMX_NAME(store_c)(c, mt, np);
            for (int64_t i = 0; i < 16 * mt && m0 + i < a->m; ++i)
                for (int64_t j = 0; j < 16 * np && p * 16 + j < w->n; ++j)
                    y[(m0 + i) * ldy + p * 16 + j] = (float)c[i * 32 + j] * a->scale[m0 + i] * w->scale[p * 16 + j];
        }
    }
    return KT_TILE_FAILED() ? KTCY_ERR_TILE : KTCY_OK;
}

/* INT4: the two panels are unpacked once to INT8 blocks in scratch; then each scale group is a
 * run of tile dot products (group 32 = half a block: A tiles 32 bytes wide, B tiles 8 rows)
 * whose int32 result is scaled into a float accumulator. */
KT_AMX_TARGET static int KT_AMX_NAME(int4_gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                                int64_t pb, int64_t pe, void *scratch) {
    const int64_t nkb = w->k_pad / 64, lda = a->k_pad, group = w->group, groups = w->k_pad / group;
    const int64_t a_groups = a->k_pad / a->group;
    int32_t *c = (int32_t *)KT_AMX_NAME(align64)(scratch);
    float *acc = (float *)(c + 32 * 32);
    int8_t *unpacked = (int8_t *)(acc + 32 * 32);
    const int kstep = group < 64 ? (int)group : 64;
    KT_AMX_NAME(configure)(kstep);
    for (int64_t p = pb; p < pe; p += 2) {
        const int np = pe - p >= 2 ? 2 : 1;
        for (int64_t i = 0; i < np * nkb * 512; ++i) {
            uint8_t byte = w->data[p * nkb * 512 + i];
            int64_t blk = i / 512, e = i % 512;
            unpacked[blk * 1024 + e] = (int8_t)((byte & 0x0F) - 8);
            unpacked[blk * 1024 + e + 512] = (int8_t)((byte >> 4) - 8);
        }
        const int8_t *b0 = unpacked, *b1 = unpacked + nkb * 1024;
        for (int64_t m0 = 0; m0 < a->m; m0 += 32) {
            const int mt = a->m - m0 > 16 ? 2 : 1;
            memset(acc, 0, 32 * 32 * sizeof(float));
            for (int64_t g = 0; g < groups; ++g) {
                KT_AMX_NAME(zero_c)();
                for (int64_t k = g * group; k < (g + 1) * group; k += kstep) {
                    /* B rows for K offset k: block k/64, row (k%64)/4, 64 bytes per row */
                    int64_t boff = (k / 64) * 1024 + (k % 64) / 4 * 64;
                    KT_AMX_NAME(step)(0, a->q + m0 * lda + k, lda, b0 + boff, b1 + boff, mt, np);
                }
                KT_AMX_NAME(store_c)(c, mt, np);
                for (int64_t i = 0; i < 16 * mt; ++i)
                    for (int64_t j = 0; j < 16 * np; ++j)
                        acc[i * 32 + j] = acc[i * 32 + j] + (float)c[i * 32 + j] * w->scale[g * w->n_pad + p * 16 + j];
            }
            (void)a_groups;
            for (int64_t i = 0; i < 16 * mt && m0 + i < a->m; ++i)
                for (int64_t j = 0; j < 16 * np && p * 16 + j < w->n; ++j)
                    y[(m0 + i) * ldy + p * 16 + j] = acc[i * 32 + j] * a->scale[m0 + i];
        }
    }
    return KT_TILE_FAILED() ? KTCY_ERR_TILE : KTCY_OK;
}

/* BF16 reads B tiles straight from the packed weight; FP8 first decodes the two panels to bf16
 * in scratch (exact), then runs the same TDPBF16PS loop.  FP8 block scales are applied per
 * 128-wide K group to the fp32 partial sums, per-channel scales once at the end. */
KT_AMX_TARGET static int KT_AMX_NAME(bf16_gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                                int64_t pb, int64_t pe, void *scratch) {
    const int64_t nkb = w->k_pad / 32, lda = a->k_pad * 2;
    const int64_t kblocks = (w->k + KTCY_FP8_SCALE_BLOCK - 1) / KTCY_FP8_SCALE_BLOCK;
    const int is_fp8 = w->format != KTCY_BF16, blockwise = w->format == KTCY_FP8_BLOCK;
    float *c = (float *)KT_AMX_NAME(align64)(scratch);
    float *acc = c + 32 * 32;
    uint16_t *decoded = (uint16_t *)(acc + 32 * 32);
    KT_AMX_NAME(configure)(64);
    for (int64_t p = pb; p < pe; p += 2) {
        const int np = pe - p >= 2 ? 2 : 1;
        const uint8_t *b0 = w->data + p * nkb * 1024;
        if (is_fp8) {
            for (int64_t i = 0; i < np * nkb * 512; ++i) decoded[i] = ktcy_e4m3_to_bf16(w->data[p * nkb * 512 + i]);
            b0 = (const uint8_t *)decoded;
        }
        const uint8_t *b1 = b0 + nkb * 1024;
        const int64_t span = blockwise ? KTCY_FP8_SCALE_BLOCK / 32 : nkb;
        for (int64_t m0 = 0; m0 < a->m; m0 += 32) {
            const int mt = a->m - m0 > 16 ? 2 : 1;
            memset(acc, 0, 32 * 32 * sizeof(float));
            for (int64_t kb0 = 0; kb0 < nkb; kb0 += span) {
                KT_AMX_NAME(zero_c)();
                for (int64_t kb = kb0; kb < kb0 + span && kb < nkb; ++kb)
                    KT_AMX_NAME(step)(1, (const uint8_t *)(a->bf16 + m0 * a->k_pad + kb * 32), lda,
                                      b0 + kb * 1024, b1 + kb * 1024, mt, np);
                KT_AMX_NAME(store_c)(c, mt, np);
                for (int64_t i = 0; i < 16 * mt; ++i)
                    for (int64_t j = 0; j < 16 * np; ++j) {
                        int64_t n = p * 16 + j;
                        float s = !blockwise ? 1.0f
                                : n < w->n ? w->scale[(n / KTCY_FP8_SCALE_BLOCK) * kblocks + kb0 / span] : 0.0f;
                        acc[i * 32 + j] = blockwise ? acc[i * 32 + j] + c[i * 32 + j] * s : c[i * 32 + j];
                    }
            }
            for (int64_t i = 0; i < 16 * mt && m0 + i < a->m; ++i)
                for (int64_t j = 0; j < 16 * np && p * 16 + j < w->n; ++j) {
                    float v = acc[i * 32 + j];
                    y[(m0 + i) * ldy + p * 16 + j] = w->format == KTCY_FP8_PERCHANNEL ? v * w->scale[p * 16 + j] : v;
                }
        }
    }
    return KT_TILE_FAILED() ? KTCY_ERR_TILE : KTCY_OK;
}

#undef KT_AMX_AI
