/* AVX-512 GEMM skeleton, format-agnostic.  kernels.h instantiates it once per variant with
 *   KT_GEMM    the entry point's name (ktcy_gemm_<variant>)
 *   KT_TRAITS  the format's traits header (fmt_*.h), included below with KT_SKEL == KT_SKEL_AVX512
 *   KT_TARGET  __attribute__((target(...))) with exactly the features the variant executes
 *   KT_FAST    1: the fast dot product of the format's activation kind (VNNI vpdpbusd for int8,
 *              AVX512-BF16 vdpbf16ps for bf16); 0: the F+BW path for CPUs without it
 *   KT_VBMI    1 when AVX512-VBMI may be used (byte permutes for decoding)
 * No include guard: included once per variant.
 *
 * The traits header gives, for one format (with the geometry of traits_begin.h: KT_ACT, KT_BB, ...):
 *   KT_WKIND            what a weight row holds once loaded: KT_W_S8, KT_W_U8 (unsigned code) or KT_W_BF16
 *   KT_PREDECODE        1: panels may be decoded to blocks in scratch once per call: bf16 rows
 *                       (KT_W_BF16 after) for bf16 activations, rows as KT_(rows) gives them for int8
 *   KT_REG_DECODE       1: rows are decoded in registers with tables that occupy registers
 *   KT_(ctx), KT_(make_ctx)()                     decode constants
 *   KT_(rows)(ctx, blk, r, out[2])                rows r, r+1 of a packed block (64 bytes each, in .v0)
 *   KT_(decode_panels)(ctx, src, dst, blocks)     KT_PREDECODE without a fused one: blocks -> 1024-byte decoded blocks
 *   KT_(has_groups)(w)                            1 when partial sums are scaled per group (float accumulators)
 *   KT_(group_at)(w, kb, r, nkb)                  group index ending after row r of block kb, or -1
 *                                                 (asked after every KT_GROUP_ROWS rows)
 *   KT_(group_epilogue)(acc, facc, MB, NP, a, w, m0, p0, g)
 *   KT_(final)(acc, facc, a, w, m, n0)            the 16 outputs of one row and panel
 * and may set KT_ONE_PANEL_ROWS(a): calls of at most that many rows (a per-CPU choice,
 *   ktcy_act.one_panel_rows or .e2m1_panel_rows) take one panel per tile, not four;
 * KT_PRE_SCALED 1: decode_panels folds the group scales in (predecoded tiles skip the epilogue).
 * KT_FETCH_L2(a): 1 where a streaming tile prefetches into L2 rather than L1 (a per-CPU choice);
 * KT_FUSED_PREDECODE 1: rows() yields the predecoded bytes, so a group's first row tile decodes
 *   in registers and keeps the rows for the others instead of a separate decode pass.
 * KT_SHARED_ROW_BYTES 1: rows r and r + 8 of a block come from the same 64 bytes (4-bit codes),
 *   and KT_(rows_reloaded)(ctx, blk, r, out[2]) is rows() loading them again for the high rows,
 *   which the tiles of 4-6 rows take, except one-panel streaming tiles (a decode call's, or the
 *   last panels of a call of 3-6 rows).
 * KT_FEW_ROWS 1: KT_(few_rows)(a, w, y, ldy, pb, pe, scratch) serves calls of at most
 *   KT_FEW_ROWS_CHOICE(a) rows (a per-CPU choice: FP8's float path a->tiles.f32_rows, MXFP4's 16-bit
 *   integer path a->tiles.i16_rows) its own way, without vdpbf16ps (with MXCSR.DAZ cleared), or returns
 *   0 to leave the call to the tiles below.
 * KT_GROUP_ROWS n: a group may end every n block rows (default 8: groups of 32 K or more; 4
 *   for 16-K groups: INT8_GROUP).
 * KT_MAX_ROWS n: prefill tiles of at most n rows (4 or 6) instead of the skeleton's choice below.
 *
 * Every packed block has 16 rows of 64 bytes once loaded; row r pairs with the activation dword
 * at k0 + r * KT_KPR.  A micro-tile keeps MB x NP accumulators of 16 channels in registers: large
 * M reuses each weight row across MB rows, while M = 1 streams every weight byte once. */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_SKEL KT_SKEL_AVX512
#define KT_AHEAD 8 /* blocks of software prefetch ahead of the decode stream */

#include KT_TRAITS

static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

/* Formats whose panels are always decoded to scratch first (no in-register decode). */
#define KT_ALWAYS_PRE (KT_PREDECODE && !KT_REG_DECODE)

/* Accumulators stay in their natural register type: casting between the integer and float
 * domains every step makes GCC copy them around. */
#if KT_INT_ACT
#define KT_ACC_ZERO _mm512_setzero_si512()
#define KT_ACC_ADD(x, y) _mm512_add_epi32(x, y)
#else
#define KT_ACC_ZERO _mm512_setzero_ps()
#define KT_ACC_ADD(x, y) _mm512_add_ps(x, y)
#endif

/* The F-path bf16 product splits every dword into its even (low) and odd (high) bf16 as floats. */
KT_AI kt_vec2 KT_(split_bf16)(__m512i v) {
    kt_vec2 s;
    s.v1 = _mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u));
    s.v0 = _mm512_slli_epi32(v, 16);
    return s;
}

/* Predecoded rows keep the weight kind: bf16 for the bf16-activation formats, bytes for MXFP4_A8. */
KT_AI kt_vec2 KT_(prep_w)(kt_vec2 w) {
    if (KT_WKIND == KT_W_BF16 && !KT_FAST) return KT_(split_bf16)(w.v0);
    w.v1 = w.v0;
    return w;
}

KT_AI kt_vec2 KT_(load_a)(const uint8_t *row, int64_t k) {
    int32_t dword;
    memcpy(&dword, row + k * KT_ASIZE, 4);
    kt_vec2 a;
    a.v0 = a.v1 = _mm512_set1_epi32(dword);
#if KT_INT_ACT && KT_FAST
    if (KT_WKIND == KT_W_S8) a.v0 = a.v1 = _mm512_xor_si512(a.v0, _mm512_set1_epi8((char)0x80)); /* s8 -> u8 + 128 */
#elif !KT_INT_ACT && !KT_FAST
    a = KT_(split_bf16)(a.v0);
#endif
    return a;
}

/* One multiply-add step of 16 channels by the compute kind (activation kind x weight kind). */
KT_AI KT_(acc_t) KT_(dp)(KT_(acc_t) acc, kt_vec2 a, kt_vec2 w) {
#if KT_INT_ACT
    if (KT_WKIND == KT_W_S8) {
#if KT_FAST
        return _mm512_dpbusd_epi32(acc, a.v0, w.v0); /* (a + 128) * w; the skeleton subtracts 128 * colsum */
#else
        /* |w| * (a * sign w), as AVX2 does: exact for code -128 too (|-128| is 128 as vpmaddubsw's
         * unsigned operand; activations lie in [-127, 127]), pairs within int16 (2 * 128 * 127).
         * |a| * (w * sign a), whose |a| and sign mask serve all 4 panels, took the same time on
         * Zen 4 (INT8, M = 1-512, 0.98-1.02x) but cannot hold -128. */
        __m512i as = _mm512_mask_sub_epi8(a.v0, _mm512_movepi8_mask(w.v0), _mm512_setzero_si512(), a.v0);
        __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w.v0), as);
        return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
    }
#if KT_FAST
    return _mm512_dpbusd_epi32(acc, w.v0, a.v0); /* unsigned code x signed activation */
#else
    __m512i pairs = _mm512_maddubs_epi16(w.v0, a.v0); /* at most 2 * 24 * 127 (MXFP4_A8): no saturation */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
#elif KT_FAST
    return _mm512_dpbf16_ps(acc, (__m512bh)a.v0, (__m512bh)w.v0);
#else
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(a.v0), _mm512_castsi512_ps(w.v0), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a.v1), _mm512_castsi512_ps(w.v1), acc);
#endif
}

/* Folds the odd-row accumulators of a one-row tile into the even ones. */
KT_AI void KT_(merge_split)(KT_(acc_t) acc[6][4], const int NP) {
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) { acc[0][p] = KT_ACC_ADD(acc[0][p], acc[1][p]); acc[1][p] = KT_ACC_ZERO; }
}

#ifndef KT_ONE_PANEL_ROWS
#define KT_ONE_PANEL_ROWS(a) 0
#endif
#ifndef KT_FETCH_L2
#define KT_FETCH_L2(a) 0
#endif
#ifndef KT_PRE_SCALED
#define KT_PRE_SCALED 0
#endif
#ifndef KT_PLAIN_ROWS
#define KT_PLAIN_ROWS 0
#endif
#ifndef KT_FUSED_PREDECODE
#define KT_FUSED_PREDECODE 0
#endif
#ifndef KT_SHARED_ROW_BYTES
#define KT_SHARED_ROW_BYTES 0
#endif
#ifndef KT_FEW_ROWS
#define KT_FEW_ROWS 0
#endif
#ifndef KT_GROUP_ROWS
#define KT_GROUP_ROWS 8 /* block rows between the places a group may end (groups of 32 K or more) */
#endif

/* MB rows from m0, NP panels from p0.  PRE: the panels were decoded to blocks beforehand,
 * starting at `decoded` (block j of panel p at decoded + (p * nkb + j) * 1024).  STREAM: the
 * tile reads its packed panels from memory and prefetches them (a compile-time flag: the
 * prefetch addresses, kept live in a tile that does not use them, slowed prefill's tiles). */
KT_AI void KT_(micro)(const int MB, const int NP, const int PRE, const int KEEP, const int STREAM, const KT_(ctx) *c,
                      const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, float *y, int64_t ldy,
                      uint8_t *decoded, ktcy_ahead ahead, ktcy_span cont) {
    (void)KEEP; (void)c; /* unread in the variants that always predecode */
    const int64_t nkb = w->k_pad / KT_BK;
    const int64_t block_bytes = PRE ? 1024 : KT_BB;
    const int groups = KT_(has_groups)(w) && !(PRE && KT_PRE_SCALED);
    const int to_l2 = KT_FETCH_L2(a);
    KT_(acc_t) acc[6][4];
    __m512 facc[6][4];
    const uint8_t *panel[4];
    const uint8_t *arow[6];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) panel[p] = PRE ? decoded + p * nkb * 1024 : w->data + (p0 + p) * nkb * KT_BB;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        arow[m] = (KT_INT_ACT ? (const uint8_t *)a->q : (const uint8_t *)a->bf16) + (m0 + m) * a->k_pad * KT_ASIZE;
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) { acc[m][p] = KT_ACC_ZERO; facc[m][p] = _mm512_setzero_ps(); }
    }
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) acc[1][p] = KT_ACC_ZERO; /* the odd-row half when MB == 1 */
    for (int64_t kb = 0; kb < nkb; ++kb) {
        ktcy_ahead_block(ahead, kb);
        const uint8_t *blk[4];
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) blk[p] = panel[p] + kb * block_bytes;
        uintptr_t fetch[4]; /* a decode stream's prefetch address per panel (prefetch.h) */
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) fetch[p] = ktcy_stream_ahead(cont, p, panel[p], kb, nkb, KT_AHEAD, block_bytes);
        const uint8_t *ak[6]; /* this block's activations of each row: row offsets below are immediates */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) ak[m] = arow[m] + kb * KT_BK * KT_ASIZE;
        _Pragma("GCC unroll 8")
        for (int r2 = 0; r2 < 16; r2 += 2) {
            /* a streaming tile reads the weights at memory speed: fetch KT_AHEAD blocks ahead, an
             * eighth of a block per row pair, so the loads find the bytes in cache */
            if (!PRE && STREAM)
                _Pragma("GCC unroll 8")
                for (int p = 0; p < NP; ++p)
                    ktcy_fetch_stream(fetch[p] + (uintptr_t)(r2 * (KT_BB / 16)), to_l2);
            kt_vec2 wv2[4][2];
            _Pragma("GCC unroll 8")
            for (int p = 0; p < NP; ++p) {
                if (PRE || KT_ALWAYS_PRE) {
                    wv2[p][0].v0 = _mm512_loadu_si512(blk[p] + r2 * 64);
                    wv2[p][1].v0 = _mm512_loadu_si512(blk[p] + r2 * 64 + 64);
                }
#if !KT_ALWAYS_PRE
                else {
                    /* tiles of 4-6 rows load the high rows' shared bytes again
                     * (KT_SHARED_ROW_BYTES), except one-panel streaming tiles */
#if KT_SHARED_ROW_BYTES
                    if (MB >= 4 && (NP == 4 || !STREAM))
                        KT_(rows_reloaded)(c, blk[p], r2, wv2[p]);
                    else
#endif
                        KT_(rows)(c, blk[p], r2, wv2[p]);
                    if (KEEP) { /* the fused predecode: these rows serve the group's later tiles */
                        uint8_t *kept = decoded + (p * nkb + kb) * 1024 + r2 * 64;
                        _mm512_storeu_si512(kept, wv2[p][0].v0);
                        _mm512_storeu_si512(kept + 64, wv2[p][1].v0);
                    }
                }
#endif
                wv2[p][0] = KT_(prep_w)(wv2[p][0]);
                wv2[p][1] = KT_(prep_w)(wv2[p][1]);
            }
          _Pragma("GCC unroll 2")
          for (int u = 0; u < 2; ++u) {
            const int r = r2 + u;
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
                kt_vec2 av = KT_(load_a)(ak[m], r * KT_KPR);
                /* one row: even and odd block rows go to two accumulators (twice the independent
                 * chains for the latency of the dot products); they are added before any use */
                const int slot = MB == 1 ? u : m;
                _Pragma("GCC unroll 8")
                for (int p = 0; p < NP; ++p) acc[slot][p] = KT_(dp)(acc[slot][p], av, wv2[p][u]);
            }
            if (MB == 1 && u == 1 && (r + 1) % KT_GROUP_ROWS == 0) KT_(merge_split)(acc, NP);
            if (groups && u == 1 && (r + 1) % KT_GROUP_ROWS == 0) {
                const int64_t g = KT_(group_at)(w, kb, r, nkb);
                if (g >= 0) KT_(group_epilogue)(acc, facc, MB, NP, a, w, m0, p0, g);
            }
          }
        }
    }
    /* constant trip counts, the row test inside: the annotation then applies (GCC ignored it on
     * a loop with an early exit) */
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
            if (m0 + m >= a->m) continue;
            const int64_t n0 = (p0 + p) * 16;
            const int64_t valid = w->n - n0 < 16 ? w->n - n0 : 16;
            KT_(acc_t) exact = acc[m][p];
#if KT_INT_ACT && KT_FAST
            if (KT_WKIND == KT_W_S8) /* undo the +128 of the unsigned activations */
                exact = _mm512_sub_epi32(exact, _mm512_slli_epi32(_mm512_loadu_si512(w->colsum + n0), 7));
#endif
            _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, (__mmask16)((1u << valid) - 1u),
                                  KT_(final)(exact, facc[m][p], a, w, m0 + m, n0));
        }
    }
}

#define KT_CALL(mb, np, pre, st) KT_(micro)(mb, np, pre, 0, st, &c, a, w, m0, p, y, ldy, pre_buf, ahead, next)
/* The fused predecode's first tile of a group: 4 rows, decoding in registers and keeping the rows. */
#define KT_FUSED(st)                                                                                \
    do {                                                                                            \
        if (np == 4) KT_(micro)(4, 4, 0, 1, st, &c, a, w, m0, p, y, ldy, pre_buf, ahead, next);      \
        else KT_(micro)(4, 1, 0, 1, st, &c, a, w, m0, p, y, ldy, pre_buf, ahead, next);             \
    } while (0)
/* Tile shapes are compile-time constants in every call, so each one is fully unrolled. */
#define KT_DISPATCH(pre, st)                                                              \
    switch (mb * 8 + np) {                                                                \
    case 1 * 8 + 4: KT_CALL(1, 4, pre, st); break;                                        \
    case 2 * 8 + 4: KT_CALL(2, 4, pre, st); break;                                        \
    case 4 * 8 + 4: KT_CALL(4, 4, pre, st); break;                                        \
    case 6 * 8 + 4: KT_CALL(6, 4, pre, st); break;                                        \
    case 1 * 8 + 1: KT_CALL(1, 1, pre, st); break;                                        \
    case 2 * 8 + 1: KT_CALL(2, 1, pre, st); break;                                        \
    case 4 * 8 + 1: KT_CALL(4, 1, pre, st); break;                                        \
    default: KT_CALL(6, 1, pre, st); break;                                               \
    }

KT_TARGET static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
#if KT_FEW_ROWS
    if (a->m >= 1 && a->m <= KT_FEW_ROWS_CHOICE(a)) {
        const unsigned int csr = ktcy_clear_daz(); /* subnormal activations count */
        const int done = KT_(few_rows)(a, w, y, ldy, pb, pe, scratch);
        ktcy_restore_daz(csr);
        if (done) return KTCY_OK;
    }
#endif
    const KT_(ctx) c = KT_(make_ctx)();
    /* The F paths and in-register decoding get fewer rows per micro-tile: their extra registers
     * (split halves, tables) would spill in the inner loop.  Formats with group scales keep the
     * full height: their float accumulators are touched only at group ends, so the compiler
     * keeps them in the stack frame without slowing the inner loop (INT4 +10%, FP8 blocks +35%
     * at M = 512 against 2-row tiles). */
    /* Decode each group of panels once into scratch (L2 resident) instead of once per row
     * tile when several row tiles share it, or when the format has no in-register decode. */
    const int pre = KT_PREDECODE && (a->m > 4 || !KT_REG_DECODE);
#ifdef KT_MAX_ROWS
    const int max_rows = KT_MAX_ROWS;
#else
    const int max_rows = (KT_FAST && !(KT_REG_DECODE && !pre)) ? 6 : 4;
#endif
    uint8_t *pre_buf = ktcy_align64(scratch);
    const int64_t nkb = w->k_pad / KT_BK;
    /* KT_FUSED_PREDECODE: a group's first row tile (4 rows) decodes in registers and keeps the
     * decoded rows for the group's other tiles, so the decode's shuffles overlap its dot products
     * instead of running as a pass of their own */
    const int fused = KT_FUSED_PREDECODE && KT_REG_DECODE && pre; /* pre: more than 4 rows here */
    for (int64_t p = pb; p < pe;) {
        const int np = pe - p >= 4 && a->m > KT_ONE_PANEL_ROWS(a) ? 4 : 1;
#if KT_PREDECODE && !(KT_FUSED_PREDECODE && KT_REG_DECODE) /* else every predecode is fused */
        if (pre && !fused) { /* block by block, fetching KT_AHEAD blocks ahead: the panels come from memory */
            const uint8_t *src = w->data + p * nkb * KT_BB;
            for (int64_t b = 0; b < np * nkb; ++b) {
                _Pragma("GCC unroll 8")
                for (int l = 0; l < KT_BB; l += 64) _mm_prefetch((const char *)src + (b + KT_AHEAD) * KT_BB + l, _MM_HINT_T0);
                KT_(decode_panels)(&c, src + b * KT_BB, pre_buf + b * 1024, 1);
            }
        }
#endif
        /* several row tiles share the group: they fetch the next one as they go (prefetch.h) */
        const int64_t tiles = (a->m + max_rows - 1) / max_rows;
        const ktcy_span next = ktcy_next_group(a, w, p + np, pe, np, KT_BK, KT_BB);
        for (int64_t m0 = 0, tile = 0; m0 < a->m; ++tile) {
            const ktcy_ahead ahead = ktcy_ahead_share(next, tile, tiles, nkb);
            int64_t left = a->m - m0;
            /* rows past a->m are present (m_pad) and their results dropped, so rounding a tile
             * up to 2/4/6 rows is safe */
            int mb = max_rows;
            if (left < max_rows) mb = left <= 1 ? 1 : left <= 2 ? 2 : left <= 4 ? 4 : max_rows;
            /* 7 or 8 rows left: 4 + 4, not 6 + a 1- or 2-row tile that reads the whole panels
             * again for a row or two at a fraction of the dot-product rate */
            else if (max_rows == 6 && (left == 7 || left == 8)) mb = 4;
#if KT_ALWAYS_PRE
            KT_DISPATCH(1, 0)
#else
            /* Tiles that read packed panels from memory prefetch them (STREAM): tiles of 1-2 rows,
             * a call's only tile, and a fused group's first tile where at most one tile follows
             * (with more, the others fetch this group ahead of time and the prefetches only cost:
             * FP8 T=128 1.04x the time).  Plain rows need none: the hardware prefetcher keeps up.
             * MoE T=32 (3-6 rows an expert) FP8/MXFP4/INT4 0.79-0.90x the time with them. */
            if (fused && m0 == 0) {
                mb = 4;
                if (a->m <= 4 + max_rows) KT_FUSED(1); else KT_FUSED(0);
            } else if (pre) {
                KT_DISPATCH(1, 0)
            } else if (!KT_PLAIN_ROWS && (mb <= 2 || a->m <= mb)) {
                KT_DISPATCH(0, 1)
            } else {
                KT_DISPATCH(0, 0)
            }
#endif
            m0 += mb;
        }
        p += np;
    }
    return KTCY_OK;
}

#undef KT_CALL
#undef KT_FUSED
#undef KT_DISPATCH
#undef KT_ACC_ZERO
#undef KT_ACC_ADD
#undef KT_ALWAYS_PRE
#undef KT_AHEAD
#undef KT_ONE_PANEL_ROWS
#undef KT_FETCH_L2
#undef KT_PRE_SCALED
#undef KT_FUSED_PREDECODE
#undef KT_SHARED_ROW_BYTES
#undef KT_FEW_ROWS
#undef KT_GROUP_ROWS
#undef KT_MAX_ROWS
#undef KT_FEW_ROWS_MAX
#undef KT_FEW_ROWS_CHOICE
#include "traits_end.h"
