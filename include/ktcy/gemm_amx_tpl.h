/* AMX GEMM skeleton, format-agnostic, written once against a tile API and instantiated per
 * (format, binding) by kernels.h: with the real _tile_* instructions (ISA amx) and over
 * tile_emu.h (ISA amx_emu).  The instantiation defines KT_GEMM, KT_TRAITS, KT_TARGET and the
 * binding: KT_TILE_CONFIG(cfg) KT_TILE_RELEASE() KT_TILE_LOAD(t, p, stride)
 * KT_TILE_STORE(t, p, stride) KT_TILE_ZERO(t) KT_TILE_DP_I8(c, a, b) KT_TILE_DP_BF16(c, a, b)
 * KT_TILE_FAILED() KT_AMX_REAL (1: real tiles, so AVX-512 F/BW/VL may decode).  No include guard.
 *
 * Blocking: 2 A tiles (32 rows) x 2 B tiles (2 panels = 32 channels) -> 4 C tiles, as kt-kernel.
 * tmm0..3 = C, tmm4..5 = A, tmm6..7 = B.  Activation buffers hold m_pad rows (a multiple of
 * 16; the results of rows past m are dropped), so every A tile is a full 16 rows and one
 * configuration serves all M.
 * Int8 activations use TDPBSSD (s8 x s8), bf16 ones TDPBF16PS.
 *
 * The traits header gives:
 *   KT_(prepare_b)(w, p, np, buf)     the np panels from p as tile blocks (1024 B, KT_BK K values,
 *                                     panel stride k_pad / KT_BK blocks): the packed data itself;
 *   or, with KT_AMX_DECODE_B 1,
 *   KT_(decode_b_block)(w, p, kb, dst) block kb of panel p unpacked / decoded into a tile block
 *                                     (and KT_AMX_DECODE_IN_LOOP 1: decoded as the TDPs go, decode_b)
 *   KT_(group_len)(w)                 K values per scale group (k_pad when the whole row is one)
 *   KT_(group_cols)(w, p, np, g, s)   s[j]: column j's factor for group g of panels p, p + 1
 *   KT_(group_row)(a, m)              row m's factor for the groups
 *   KT_(tile_group)(acc, c, r, s)     one C element (int32 or float) folded into acc
 *   KT_(final_cols)(w, p, np, t)      t[j]: column j's factor for the output
 *   KT_(final_row)(a, m)              row m's factor for the output
 *   KT_(tile_final)(acc, r, t)        the output
 * and, with KT_AMX_GROUP_MINS 1 (a float term per row and column of each group, INT4_MIN's min):
 *   KT_(has_mins)(w)                  whether this weight has it (group_cols then writes the
 *                                     columns' values KT_AMX_MIN_COLS floats after the factors)
 *   KT_(min_row)(a, m, g, groups)     row m's value for group g, added times the column's to acc
 *   and with KT_AMX_CODE_BIAS 1 too, for weights with mins:
 *   KT_(code_bias_row)(a, m, g, groups) an int32 added to row m's C elements of group g before
 *                                     they are folded (INT8_MIN: 128 x the group sum)
 * The epilogues run a row at a time over contiguous columns with the factors hoisted, so the
 * compiler vectorizes them: on real tiles they follow every group's TDPs and would otherwise
 * cost more than the TDPs themselves.
 *
 * Per-thread scratch (64-byte aligned):  C tiles [32][32] (4 KiB) | acc [32][32] float (4 KiB) |
 *     B blocks of 2 panels when the format decodes them | KTCY_AMX_A_ROWS activation rows in tile order |
 *     the panel pair's column factors [groups][KT_COLS] float (cols_table)
 * Loops: activation chunks of KTCY_AMX_A_ROWS rows (packed once) > panel pairs (B prepared once
 * per chunk) > 32-row blocks > scale groups > K steps; where a group is one K step,
 * 32-row blocks > 16-row halves > groups (one_step_groups). */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_SKEL KT_SKEL_AMX
/* floats per group in the column table: 32 factors, and 32 mins after them */
#define KT_AMX_MIN_COLS 32
#define KT_COLS (2 * KT_AMX_MIN_COLS)

#include KT_TRAITS

#if KT_INT_ACT
#define KT_C_T int32_t
#else
#define KT_C_T float
#endif

static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

#ifndef KT_AMX_DECODE_B
#define KT_AMX_DECODE_B 0
#endif
#ifndef KT_AMX_DECODE_IN_LOOP
#define KT_AMX_DECODE_IN_LOOP 0
#endif
#ifndef KT_AMX_CODE_BIAS
#define KT_AMX_CODE_BIAS 0
#endif
#ifndef KT_AMX_GROUP_MINS
#define KT_AMX_GROUP_MINS 0
#endif
#define KT_DECODE_AHEAD 2 /* blocks decoded ahead of the TDPs (decode_b) */
#define KT_B_AHEAD 4      /* K blocks between a B tile's fetch and its load (step) */

/* Block kb of both panels of a pair into buf (panel stride nkb), if kb is a block of the row.
 * KT_AMX_DECODE_IN_LOOP: a panel pair's first row block on the 2 x 2 path decodes block
 * kb + KT_DECODE_AHEAD just after issuing the TDPs of block kb, so the core decodes while the tile
 * unit multiplies (the later row blocks find the pair decoded).  Decoded whole before the TDPs,
 * the two ran one after the other.  A Xeon with AMX, MoE of 128 experts (about 32 rows each),
 * against decoding first: MXFP4 T = 512 0.87x the time, T = 128 0.96x; FP8 block 0.89x and
 * 0.92x; FP8 per channel (64 experts) T = 512 0.87x.  One block ahead gained less (MXFP4 one
 * projection of 32 rows 0.90x against 0.80x), four the same as two.  The integer formats decode
 * first: their groups' folds keep the core busy between TDPs, and decoding there gained nothing
 * (INT4, INT4_ZP 0.98-1.01x) or lost (MXFP4_A8 with 64 rows an expert 1.03-1.04x). */
KT_AI void KT_(decode_b)(const ktcy_weight *w, int64_t p, int np, int64_t kb, int64_t nkb, uint8_t *buf) {
#if KT_AMX_DECODE_B
    if (kb < nkb)
        for (int q = 0; q < np; ++q) KT_(decode_b_block)(w, p + q, kb, buf + (q * nkb + kb) * 1024);
#else
    (void)w; (void)p; (void)np; (void)kb; (void)nkb; (void)buf;
#endif
}

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
    /* GCC 12 does not see that LDTILECFG reads the 64 bytes and dropped the stores above (seen
     * in a stand-alone test: only byte 0 was written, and the next tile instruction faulted). */
    __asm__ volatile("" : : "r"(cfg) : "memory");
    /* Every call: other code on this thread (oneDNN under torch, say) may have loaded its own
     * configuration or released the tiles since, and a tile instruction then faults (#UD; a
     * configuration cached per thread crashed the hf tests on a Xeon with AMX). */
    KT_TILE_CONFIG(cfg);
}

/* One K step of the 2x2 tile block: A rows from a (row stride lda bytes), B tiles at b0/b1. */
KT_AI void KT_(step)(const void *a, int64_t lda, const void *b0, const void *b1, int mt, int np) {
    /* B tiles KT_B_AHEAD K blocks on, into L2: each B tile feeds only 2 TDPs at 32 rows, and its
     * load stalled them (one projection from memory, M = 16-32: 0.70-0.90x the time with the next
     * block fetched into L1).  Into L2 and further ahead, the fetches of memory no longer hold
     * the L1 miss buffers that the A tiles' loads from L2 wait for (perf of the MoE: the A load
     * took the most samples); past a panel's end they fetch the next panel, which the next pair
     * reads.  A Xeon with AMX, 128 experts of about 32 rows, 2 threads, against the next block
     * into L1: two blocks ahead INT8 T = 512 0.97x the time (with the larger AMX work items),
     * four ahead 0.98x of that; BF16 the same at two and four. */
    for (int l = 0; l < 16; ++l) {
#if KT_AMX_DECODE_B /* B decoded into the scratch just before: from L2 into L1, a block on */
        _mm_prefetch((const char *)b0 + 1024 + 64 * l, _MM_HINT_T0);
        if (np == 2) _mm_prefetch((const char *)b1 + 1024 + 64 * l, _MM_HINT_T0);
#else
        _mm_prefetch((const char *)b0 + 1024 * KT_B_AHEAD + 64 * l, _MM_HINT_T1);
        if (np == 2) _mm_prefetch((const char *)b1 + 1024 * KT_B_AHEAD + 64 * l, _MM_HINT_T1);
#endif
    }
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

/* Group g's C tiles (c) folded into acc, for the rows that are outputs.  The first group folds
 * into zeros given as a constant rather than stored (the same expression, so the same bits; the
 * 4 KiB clear per 32-row block had been 4-5% of an INT8 layer's GEMM time at T=512). */
KT_AI void KT_(fold_rows)(float *restrict acc, const KT_C_T *restrict c, int rows, const int cols, const ktcy_act *a,
                          int64_t m0, const float *s, int64_t g, int64_t mins_groups) {
    for (int i = 0; i < rows; ++i) {
        const float r = KT_(group_row)(a, m0 + i);
        float *restrict ar = acc + i * 32;
        const KT_C_T *restrict cr = c + i * 32;
#if KT_AMX_GROUP_MINS && KT_AMX_CODE_BIAS
        const KT_C_T cb = mins_groups ? KT_(code_bias_row)(a, m0 + i, g, mins_groups) : 0;
#else
        const KT_C_T cb = 0;
#endif
        if (g == 0)
            for (int j = 0; j < cols; ++j) ar[j] = KT_(tile_group)(0.0f, cr[j] + cb, r, s[j]);
        else
            for (int j = 0; j < cols; ++j) ar[j] = KT_(tile_group)(ar[j], cr[j] + cb, r, s[j]);
#if KT_AMX_GROUP_MINS
        if (mins_groups) { /* added after the group's product, as the vector kernels do: the same bits */
            const float mr = KT_(min_row)(a, m0 + i, g, mins_groups);
            for (int j = 0; j < cols; ++j) ar[j] = fmaf(mr, s[KT_AMX_MIN_COLS + j], ar[j]);
        }
#endif
    }
}
/* s: the group's column factors, from the panel pair's table (cols_table); mins_groups: the
 * weight's group count when it has mins (KT_AMX_GROUP_MINS), else 0. */
KT_AI void KT_(fold_group)(float *restrict acc, const KT_C_T *restrict c, int rows, int cols, const ktcy_act *a,
                           int64_t m0, const float *restrict s, int64_t g, int64_t mins_groups) {
    /* two full panels, the usual case, as a constant: the row loop becomes straight vector code
     * (with the vector column factors: one projection at M = 512, MXFP4_A8 with a group per
     * 32 K 0.80x the time, INT4 g64 0.86x) */
    if (cols == 32) KT_(fold_rows)(acc, c, rows, 32, a, m0, s, g, mins_groups);
    else KT_(fold_rows)(acc, c, rows, cols, a, m0, s, g, mins_groups);
}
/* The group count fold_group takes: 0 without mins. */
KT_AI int64_t KT_(mins_groups)(const ktcy_weight *w, int64_t groups) {
#if KT_AMX_GROUP_MINS
    return KT_(has_mins)(w) ? groups : 0;
#else
    (void)w; (void)groups;
    return 0;
#endif
}

/* Every group's column factors of panels p, p + 1, once per panel pair: 32 floats a group.  Written
 * per group just before its fold (scalar stores, then read as vectors), they could not be forwarded
 * and the fold's loads waited for every store before them to drain, the C tiles' stores behind the
 * TDPs included: each group's TDPs and fold ran one after the other (a Xeon with AMX, INT4 g64:
 * 35% of the GEMM's samples on that wait). */
KT_AI void KT_(cols_table)(float *restrict table, const ktcy_weight *w, int64_t p, int np, int64_t groups) {
    for (int64_t g = 0; g < groups; ++g) KT_(group_cols)(w, p, np, g, table + KT_COLS * g);
}

/* Formats whose scale group is one K step (INT4 g32/g64 with or without zero points, MXFP4_A8;
 * MXFP4 scales its blocks in the decode and has one group): per 16-row half, the groups' C tiles
 * alternate between tmm0/1 and tmm2/3, their A tile between tmm4 and tmm5, and their stores
 * between two 16 x 32 buffers of c.  A group's tiles are stored after the next group's TDPs are
 * issued and folded one group later, so no load or store waits on the TDPs just issued and the
 * core folds while the tile unit works.  With all four C tiles on one group (2 x 2 blocking) the
 * TDPs, tile stores and fold ran one after the other.  One 1536 x 2048 projection on a Xeon with
 * AMX, this path with the factor table below against 2 x 2 without it: INT4 g64 0.76-0.93x the
 * time (512-32 rows), MXFP4_A8 0.76-0.77x.  Groups of several K steps keep the 2 x 2 blocking
 * (FP8 block scales: 1.1-1.2x the time this way). */
#if KT_INT_ACT
#define KT_DP(c, a, b) KT_TILE_DP_I8(c, a, b)
#else
#define KT_DP(c, a, b) KT_TILE_DP_BF16(c, a, b)
#endif
#define KT_GROUP_TDPS(c0, c1, at, g)                                                                         \
    do {                                                                                                   \
        const int64_t k = (g) * kstep, boff = (k / KT_BK) * 1024 + (k % KT_BK) / KT_KPR * 64;              \
        KT_TILE_ZERO(c0);                                                                                  \
        KT_TILE_LOAD(at, ah + (g) * 32 * rb, rb);                                                          \
        KT_TILE_LOAD(6, b0 + boff, 64);                                                                    \
        KT_DP(c0, at, 6);                                                                                  \
        if (np == 2) { KT_TILE_ZERO(c1); KT_TILE_LOAD(7, b1 + boff, 64); KT_DP(c1, at, 7); }               \
    } while (0)
#define KT_GROUP_STORE(c0, c1, to)                                                                           \
    do {                                                                                                   \
        KT_TILE_STORE(c0, to, 128);                                                                        \
        if (np == 2) KT_TILE_STORE(c1, (uint8_t *)(to) + 64, 128);                                         \
    } while (0)
KT_AI void KT_(one_step_groups)(float *restrict acc, KT_C_T *restrict c, const uint8_t *ab, int64_t rb,
                                const uint8_t *b0, const uint8_t *b1, int np, int rows, int cols,
                                const ktcy_act *a, int64_t m0, const ktcy_weight *w, const float *table,
                                int64_t kstep) {
    const int64_t ng = w->k_pad / kstep; /* k_pad is a multiple of the 64-K block, kstep 16, 32 or 64 */
    const int64_t mg = KT_(mins_groups)(w, ng);
    KT_C_T *const even = c, *const odd = c + 16 * 32;
    for (int h = 0; 16 * h < rows; ++h) {
        const uint8_t *ah = ab + 16 * h * rb; /* a block's A tiles: rows 0-15, then 16-31, per step */
        float *acch = acc + 16 * h * 32;
        const int hrows = rows - 16 * h < 16 ? rows - 16 * h : 16;
        /* group g: TDPs into tile pair g % 2; stored one group later, when its TDPs are done, into
         * buffer g % 2; folded one group after that */
        for (int64_t g = 0; g < ng; ++g) {
            if (g % 2 == 0) {
                KT_GROUP_TDPS(0, 1, 4, g);
                if (g > 0) KT_GROUP_STORE(2, 3, odd);
            } else {
                KT_GROUP_TDPS(2, 3, 5, g);
                KT_GROUP_STORE(0, 1, even);
            }
            if (g > 1) KT_(fold_group)(acch, g % 2 ? odd : even, hrows, cols, a, m0 + 16 * h, table + KT_COLS * (g - 2), g - 2, mg);
        }
        if (ng > 1) KT_(fold_group)(acch, ng % 2 ? odd : even, hrows, cols, a, m0 + 16 * h, table + KT_COLS * (ng - 2), ng - 2, mg);
        if (ng % 2) KT_GROUP_STORE(0, 1, even);
        else KT_GROUP_STORE(2, 3, odd);
        KT_(fold_group)(acch, ng % 2 ? even : odd, hrows, cols, a, m0 + 16 * h, table + KT_COLS * (ng - 1), ng - 1, mg);
    }
}
#undef KT_GROUP_TDPS
#undef KT_GROUP_STORE
#undef KT_DP

/* Rows [m0, m1) of the activations (m0 a multiple of 32) copied into tile order: per 32-row
 * block, per K step, its two A tiles of 16 rows x rb bytes back to back.  Loaded in place, the
 * rows sit a row stride (a power of two: 2-4 KiB) apart and fall into the same L1 sets, and the
 * A loads stalled the TDPs (a BF16 GEMM of 128 rows from the L3: 1.5x the time on a Xeon). */
KT_AI void KT_(pack_a)(uint8_t *restrict dst, const uint8_t *restrict rows, int64_t lda, int64_t m0, int64_t m1,
                       int64_t steps, int64_t rb /* 64, or 32 / 16 for 32-K / 16-K groups of int8 */) {
    for (int64_t b = m0; b < m1; b += 32) {
        const int64_t tiles = m1 - b > 16 ? 2 : 1; /* rows past m up to m_pad are present */
        for (int64_t r = 0; r < 16 * tiles; ++r)
            for (int64_t s = 0; s < steps; ++s) {
                uint8_t *to = dst + (((b - m0) / 32 * steps + s) * 32 + r) * rb;
                const uint8_t *from = rows + (b + r) * lda + s * rb;
                if (rb == 64) memcpy(to, from, 64); /* constant sizes: inline vector moves */
                else if (rb == 32) memcpy(to, from, 32);
                else memcpy(to, from, 16);
            }
    }
}

KT_TARGET static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
    const int64_t nkb = w->k_pad / KT_BK, lda = a->k_pad * KT_ASIZE;
    const int64_t glen = KT_(group_len)(w), kstep = glen < KT_BK ? glen : KT_BK;
    const int64_t rb = kstep * KT_ASIZE, steps = w->k_pad / kstep;
    const uint8_t *arows = KT_INT_ACT ? (const uint8_t *)a->q : (const uint8_t *)a->bf16;
    KT_C_T *c = (KT_C_T *)ktcy_align64(scratch);
    float *acc = (float *)(c + 32 * 32);
    uint8_t *buf = (uint8_t *)(acc + 32 * 32), *apack = buf + 2 * nkb * 1024;
    float *table = (float *)ktcy_align64(apack + KTCY_AMX_A_ROWS * w->k_pad * KT_ASIZE);
    const int64_t groups = (w->k_pad + glen - 1) / glen;
    const int one_step = glen == kstep && glen < w->k_pad;
    const int in_loop = KT_AMX_DECODE_IN_LOOP && !one_step; /* decode_b */
    KT_(configure)((int)rb);
    for (int64_t mc = 0; mc < a->m; mc += KTCY_AMX_A_ROWS) {
        const int64_t mce = a->m - mc < KTCY_AMX_A_ROWS ? a->m : mc + KTCY_AMX_A_ROWS;
        /* gate then up over the same rows: the up call finds them packed (one chunk only) */
        if (!(a->rows_in_scratch && mc == 0 && mce == a->m)) KT_(pack_a)(apack, arows, lda, mc, mce, steps, rb);
        for (int64_t p = pb; p < pe; p += 2) {
            const int np = pe - p >= 2 ? 2 : 1;
#if KT_AMX_DECODE_B
            const uint8_t *b0 = buf, *b1 = b0 + nkb * 1024;
            if (!in_loop)
                for (int64_t kb = 0; kb < nkb; ++kb) KT_(decode_b)(w, p, np, kb, nkb, buf);
#else
            const uint8_t *b0 = KT_(prepare_b)(w, p, np, buf), *b1 = b0 + nkb * 1024;
#endif
            KT_(cols_table)(table, w, p, np, groups);
            const int cols = 16 * np < w->n - p * 16 ? 16 * np : (int)(w->n - p * 16);
            float t[32];
            KT_(final_cols)(w, p, np, t);
            for (int64_t m0 = mc; m0 < mce; m0 += 32) {
                const int mt = a->m - m0 > 16 ? 2 : 1, rows = a->m - m0 < 32 ? (int)(a->m - m0) : 32;
                const uint8_t *ab = apack + (m0 - mc) / 32 * steps * 32 * rb;
                const int decoding = in_loop && m0 == mc; /* decode_b */
                if (decoding)
                    for (int64_t kb = 0; kb < KT_DECODE_AHEAD; ++kb) KT_(decode_b)(w, p, np, kb, nkb, buf);
                if (one_step) KT_(one_step_groups)(acc, c, ab, rb, b0, b1, np, rows, cols, a, m0, w, table, kstep);
                else for (int64_t k0 = 0; k0 < w->k_pad; k0 += glen) {
                    KT_(zero_c)();
                    for (int64_t k = k0; k < k0 + glen && k < w->k_pad; k += kstep) {
                        /* B rows for K offset k: block k / KT_BK, row (k % KT_BK) / KT_KPR, 64 bytes a row */
                        const int64_t boff = (k / KT_BK) * 1024 + (k % KT_BK) / KT_KPR * 64;
                        KT_(step)(ab + k / kstep * 32 * rb, rb, b0 + boff, b1 + boff, mt, np);
                        if (decoding && k % KT_BK == 0) KT_(decode_b)(w, p, np, k / KT_BK + KT_DECODE_AHEAD, nkb, buf);
                    }
                    KT_(store_c)(c, mt, np);
                    KT_(fold_group)(acc, c, rows, cols, a, m0, table + KT_COLS * (k0 / glen), k0 / glen,
                                    KT_(mins_groups)(w, groups));
                }
                for (int i = 0; i < rows; ++i) {
                    const float r = KT_(final_row)(a, m0 + i);
                    const float *restrict ar = acc + i * 32;
                    float *restrict yr = y + (m0 + i) * ldy + p * 16;
                    for (int j = 0; j < cols; ++j) yr[j] = KT_(tile_final)(ar[j], r, t[j]);
                }
            }
        }
    }
    const int status = KT_TILE_FAILED() ? KTCY_ERR_TILE : KTCY_OK;
    KT_TILE_RELEASE(); /* nothing of ours left for a context switch to save or others to trip on */
    return status;
}

#undef KT_C_T
#undef KT_AMX_DECODE_B
#undef KT_AMX_DECODE_IN_LOOP
#undef KT_DECODE_AHEAD
#undef KT_B_AHEAD
#undef KT_AMX_GROUP_MINS
#undef KT_AMX_CODE_BIAS
#undef KT_AMX_MIN_COLS
#undef KT_COLS
#include "traits_end.h"
