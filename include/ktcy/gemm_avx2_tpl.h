/* AVX2 + FMA GEMM skeleton, format-agnostic; kernels.h instantiates it once per format with
 * KT_GEMM (entry point name), KT_TRAITS (fmt_*.h, included with KT_SKEL == KT_SKEL_AVX2) and
 * KT_TARGET.  A 64-byte packed row is two 256-bit halves (channels 0-7 and 8-15).  Integer
 * products use the exact |w| * (a * sign w) vpmaddubsw form (or unsigned code x signed
 * activation); bf16 uses even/odd FMAs.  No include guard.
 *
 * The traits header gives (see gemm_avx512_tpl.h for the common ones):
 *   KT_WKIND, KT_PREDECODE, KT_REG_DECODE, KT_(has_groups), KT_(group_at)(w, kb, r, nkb) for any row r,
 *   KT_(half)(blk, r, h) -> kt_w256    half h of row r of a packed block (.i: int8 lanes; .e/.o:
 *                                      the even/odd K element of 8 channels as floats)
 *   or KT_(wrow)(blk, r, out[2]) with KT_HAS_WROW 1: both halves at once (shared decode work)
 *   with KT_CHECKED_ROWS 1, also KT_(checked_rows)(w) and KT_(wrow_checked)(blk, r, out[2]): a weight
 *                                      whose codes the fast wrow gets wrong (FP8 NaN) is decoded
 *                                      by the checked version, through the float GEMM at any M
 *   KT_(decode_panels)(src, dst, blocks)                     KT_PREDECODE only (integer formats):
 *                                                            1024-byte blocks of 8-bit codes
 *   KT_(group_scale)(w, p, g, h) -> __m256                   bf16-activation formats with groups: the
 *                                                            multipliers of group g, channels p*16+8h..
 *                                                            (the skeleton scales their float sums)
 *   or, with KT_UNIFORM_GROUP_SCALE 1, KT_(group_scale1)(w, p, g) -> float: one multiplier for
 *                                                            the panel's 16 channels (kt_scale_row)
 *   KT_(group_epilogue)(acc[4][2], facc[4][2], MB, NP, a, w, m0, p, g)   integer formats with groups
 *                                                            (panel p of a tile of NP)
 *   KT_(final)(acc, facc, a, w, m, n0)                       8 outputs of one row
 * and may set KT_WIDE_TILE 1: tiles of 3 rows x 2 panels, 12 integer accumulators sharing each
 * activation broadcast (formats without groups only), for prefill (more than 4 rows) where the
 * CPU prefers them (a->tiles.wide_tiles) and for calls of 2 or 3 rows; KT_LANE_SPLIT 1:
 * the halves of a decoded row (and group_scale's h) hold channels 0-3, 8-11 and 4-7, 12-15, as
 * in-lane unpacks leave them; the outputs are put in order when stored (store16);
 * KT_ROW_PRESCALE E: the decoded weights are their values times 2^-E, so the activation rows are
 * widened times 2^k (per row, f32_rows) and KT_(final_scaled)(acc, facc, f, a, w, m, n0) replaces
 * final(), f the row's factor 2^(E-k);
 * rows with an exponent field above KT_WIDE_FIELD (a range the 2^-E weights cannot serve) make the
 * call (its chunk of KTCY_AVX2_F32_ROWS rows) take the float GEMM with KT_(wrow_wide), whose
 * values are times 1/KT_WIDE_FACTOR, the rows scaled to a largest value near 2^100;
 * KT_PANEL_LIFT L (with KT_ROW_PRESCALE): where a->tiles.fp8_normal_panels, the float GEMM multiplies its
 * fast and checked panel decodes by 2^L and widens the rows times 2^(k-L): the same products;
 * KT_FETCH_L2(a): 1 where a streaming tile prefetches into L2 rather than L1 (a per-CPU choice);
 * KT_CLEAR_DAZ 1: the decode makes subnormal floats, which MXCSR.DAZ would read as zeros: the GEMM
 * clears it while it runs;
 * KT_PARITY_WROW 1: KT_(wrow_parity)(blk, r, out[2]) decodes row r for the decode tiles with half 0
 * holding the panel's even channels and half 1 its odd ones (the skeleton interleaves the sums
 * into the lane-split halves at the end; the format's group_scale must not depend on h);
 * KT_ONE_ROW_PANELS 4: one-row calls of a bf16-activation format take 4 panels per tile, not 2;
 * KT_ONE_ROW_TWO_PANELS 1: one-row calls of an integer format take 2 panels per tile on every CPU
 * (not only where ktcy_one_panel_rows says so);
 * KT_FEW_ROWS 1: KT_(few_rows)(a, w, y, ldy, pb, pe, scratch) serves calls of at most
 * KT_FEW_ROWS_CHOICE(a) rows (a per-CPU choice) its own way (with MXCSR.DAZ cleared), or returns
 * 0 to leave them here;
 * KT_PREDECODE_ABOVE n: with KT_PREDECODE and KT_REG_DECODE, calls of more than n rows (default 4,
 * one row tile) decode each panel once into scratch; fewer decode in registers in every row tile;
 * KT_ACC16_ROWS n: unsigned codes up to c add n rows of vpmaddubsw pairs in int16 (n x 2 x c x 127
 * must stay below 32768 without KT_ACC16_START; default 8, for 4-bit codes); KT_ACC16_ONE_ROW 1: one-row tiles add them
 * in int16 too; KT_ACC16_START 1: each run of n rows starts its int16 sums from
 * KT_(acc16_start)(a, m, kb, r) (row m, first row r of the run), a centring that leaves every final
 * sum within int16 however far the wrapping adds went past it.
 */

#define KT_CAT_(a, b) a##_##b
#define KT_CAT(a, b) KT_CAT_(a, b)
#define KT_(x) KT_CAT(KT_GEMM, x)
#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_SKEL KT_SKEL_AVX2
#define KT_AHEAD 8 /* blocks of software prefetch ahead of the decode stream */
/* An empty asm on an integer accumulator: GCC would otherwise re-associate the unrolled
 * vpaddd chains of a wide tile into trees and spill them to the stack (the traits' own tiles
 * use it too). */
#define KT_KEEP(v) __asm__("" : "+x"(v))

#include KT_TRAITS

#if KT_PREDECODE && !KT_INT_ACT
#error "bf16-activation formats decode for prefill through the float path, not KT_PREDECODE"
#endif

#ifndef KT_WIDE_TILE
#define KT_WIDE_TILE 0
#endif
#ifndef KT_PLAIN_ROWS
#define KT_PLAIN_ROWS 0
#endif
#ifndef KT_LANE_SPLIT
#define KT_LANE_SPLIT 0
#endif
#ifndef KT_ROW_PRESCALE
#define KT_ROW_PRESCALE 0
#define KT_WIDE_FIELD 255
#define KT_WIDE_FACTOR 1.0f
#endif
#ifndef KT_FEW_ROWS
#define KT_FEW_ROWS 0
#endif
#ifndef KT_ONE_ROW_PANELS
#define KT_ONE_ROW_PANELS 2
#endif
#ifndef KT_ONE_ROW_TWO_PANELS
#define KT_ONE_ROW_TWO_PANELS 0
#endif
#ifndef KT_CLEAR_DAZ
#define KT_CLEAR_DAZ 0
#endif
#ifndef KT_PARITY_WROW
#define KT_PARITY_WROW 0
#endif
#ifndef KT_PREDECODE_ABOVE
#define KT_PREDECODE_ABOVE 4
#endif
#ifndef KT_UNIFORM_GROUP_SCALE
#define KT_UNIFORM_GROUP_SCALE 0
#endif
#ifndef KT_PANEL_LIFT
#define KT_PANEL_LIFT 0
#endif
#ifndef KT_FETCH_L2
#define KT_FETCH_L2(a) 0
#endif


static const int KT_(formats) = KT_FORMATS; /* the descriptor rows this variant serves, for registry.h */

/* Formats whose panels are always decoded to bf16 scratch first (no in-register decode). */
#define KT_ALWAYS_PRE (KT_PREDECODE && !KT_REG_DECODE)

#ifndef KT_HAS_WROW
/* Row r of a packed block, both halves (channels 0-7 and 8-15). */
KT_AI void KT_(wrow)(const uint8_t *blk, int r, kt_w256 out[2]) {
    out[0] = KT_(half)(blk, r, 0);
    out[1] = KT_(half)(blk, r, 1);
}
#endif
#if !KT_ROW_PRESCALE
KT_AI void KT_(wrow_wide)(const uint8_t *blk, int r, kt_w256 out[2]) { KT_(wrow)(blk, r, out); }
#endif
#if !KT_PARITY_WROW
KT_AI void KT_(wrow_parity)(const uint8_t *blk, int r, kt_w256 out[2]) { KT_(wrow)(blk, r, out); }
#endif
#ifndef KT_CHECKED_ROWS
KT_AI int KT_(checked_rows)(const ktcy_weight *w) { (void)w; return 0; }
KT_AI void KT_(wrow_checked)(const uint8_t *blk, int r, kt_w256 out[2]) { KT_(wrow)(blk, r, out); }
#endif

/* Bytes per activation element as the tiles read them: int8 codes, or the bf16 activations
 * widened to floats beforehand (a broadcast load then takes no ALU work: at a few rows the
 * shift and mask of every bf16 pair competed with the weight decode for the vector ports). */
#define KT_XSIZE (KT_INT_ACT ? KT_ASIZE : 4)

/* One activation dword broadcast (int8 codes as they are), or the even and odd element of a
 * pair of float activations (shared by both weight halves). */
typedef struct { __m256i i; __m256 e, o; } KT_(avec);

KT_AI KT_(avec) KT_(load_a)(const uint8_t *ak, int r) {
    KT_(avec) av;
#if KT_INT_ACT
    int32_t dword;
    memcpy(&dword, ak + r * KT_KPR * KT_ASIZE, 4);
    av.i = _mm256_set1_epi32(dword);
    av.e = av.o = _mm256_setzero_ps();
#else
    const float *x = (const float *)ak + r * KT_KPR;
    av.i = _mm256_setzero_si256();
    av.e = _mm256_broadcast_ss(x);
    av.o = _mm256_broadcast_ss(x + 1);
#endif
    return av;
}

/* Half h of block row r from a predecoded 1024-byte block: 8-bit codes in the INT8 block order
 * (only integer formats predecode; bf16-activation prefill takes the float path below). */
KT_AI kt_w256 KT_(pre_half)(const uint8_t *blk, int r, int h) {
    return kt_int_half(_mm256_loadu_si256((const __m256i *)(blk + r * 64 + h * 32)));
}

KT_AI __m256i KT_(dp)(__m256i acc, KT_(avec) a, kt_w256 w) {
#if KT_INT_ACT
    if (KT_WKIND == KT_W_S8) {
        /* |w| * (a * sign w): activations lie in [-127, 127], so negating them never wraps, and
         * code -128 stays exact (|-128| is 128 unsigned); pairs fit int16 (2 * 128 * 127) */
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w.i), _mm256_sign_epi8(a.i, w.i));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    __m256i pairs = _mm256_maddubs_epi16(w.i, a.i); /* unsigned code x signed activation, no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
    __m256 f = _mm256_fmadd_ps(a.e, w.e, _mm256_castsi256_ps(acc));
    return _mm256_castps_si256(_mm256_fmadd_ps(a.o, w.o, f));
#endif
}

/* Unsigned 4-bit codes x int8 activations: a vpmaddubsw pair is at most 2 x 15 x 127, so 8 rows
 * of pairs add up in int16 (at most 30480) and one vpmaddwd per 8 rows widens them, instead of
 * one per row.  The integer sums are the same.  Tiles of 2 or more rows: with it prefill's INT4
 * T=512 took 0.86x the time and 2-4 row decode tiles 0.90x (single GEMM), while one-row decode
 * measured 2-7% slower with it. */
#ifndef KT_ACC16_ROWS
#define KT_ACC16_ROWS 8 /* rows of pairs the int16 sums hold (traits with larger codes set fewer) */
#endif
#ifndef KT_ACC16_START
#define KT_ACC16_START 0 /* 1: each run of KT_ACC16_ROWS rows starts from KT_(acc16_start) */
#endif
#ifndef KT_ACC16_ONE_ROW
#define KT_ACC16_ONE_ROW 0 /* one-row tiles too (formats whose row decode is long: MXFP4_A8) */
#endif
#if KT_ACC16_START && !KT_ACC16_ONE_ROW
#error "KT_ACC16_START: the traits' sums are centred only on the int16 path, so every tile must take it"
#endif
#define KT_ACC16(PRE, MB) (KT_INT_ACT && KT_WKIND == KT_W_U8 && ((PRE) || (MB) >= 2 || KT_ACC16_ONE_ROW))

/* The 16 outputs of one row and panel, v[h] from final() of half h (kt_store16). */
KT_AI void KT_(store16)(float *dst, int64_t valid, __m256 v[2]) { kt_store16(dst, valid, v, KT_LANE_SPLIT); }

/* Float sums v times a group's multipliers s for row m, and times the row's factor (KT_ROW_PRESCALE;
 * rowf from f32_rows), so the float sums hold the true values, as final_scaled() does for the
 * channel scales. */
KT_AI __m256 KT_(times_group_scale)(__m256 v, __m256 s, const float *rowf, int64_t m) {
    (void)rowf; (void)m;
#if KT_ROW_PRESCALE
    return kt_times_scale_row(v, s, rowf[m]);
#else
    return _mm256_mul_ps(v, s);
#endif
}

/* Half h of row m's outputs; KT_ROW_PRESCALE: the traits' final_scaled() takes the row's factor
 * (rowf from f32_rows) too. */
KT_AI __m256 KT_(final_row)(__m256i acc, __m256 facc, const float *rowf, int64_t mi, const ktcy_act *a,
                            const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)rowf; (void)mi;
#if KT_ROW_PRESCALE
    return KT_(final_scaled)(acc, facc, rowf[mi], a, w, m, n0);
#else
    return KT_(final)(acc, facc, a, w, m, n0);
#endif
}

/* One weight row r of NP packed panels (block offset off) into the float sums of MB rows, bf16-
 * activation formats, several rows or more than two panels: panel by panel, every row's FMAs take
 * a panel's decoded row before the next panel's is decoded, and an empty asm on the sums keeps
 * GCC from hoisting that decode (it decoded both panels first and spilled: 2-row tiles over two
 * panels ran no faster than over one).  Plain bf16 rows keep the plain loop for one-row tiles of
 * two panels (2-3% faster); the decoding formats' one-row tiles spilled a sum in it. */
KT_AI void KT_(float_rows_by_panel)(const int MB, const int NP, const uint8_t *const panel[KT_ONE_ROW_PANELS],
                                    int64_t off, int r, const uint8_t *const ak[4],
                                    __m256i acc[KT_ONE_ROW_PANELS][4][2]) {
#if KT_INT_ACT
    (void)MB; (void)NP; (void)panel; (void)off; (void)r; (void)ak; (void)acc;
#else
    _Pragma("GCC unroll 4")
    for (int q = 0; q < NP; ++q) {
        /* decoding formats broadcast the activations again for each panel: held from the
         * first, they took registers of the sums (plain bf16 rows have none to spare) */
        if (!KT_PLAIN_ROWS && MB > 1) __asm__("" ::: "memory");
        kt_w256 wq[2];
        KT_(wrow_parity)(panel[q] + off, r, wq);
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            const KT_(avec) av = KT_(load_a)(ak[m], r);
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                acc[q][m][h] = KT_(dp)(acc[q][m][h], av, wq[h]);
                KT_KEEP(acc[q][m][h]);
            }
        }
    }
#endif
}

/* MB rows x NP adjacent panels from p (more than 2 for one row only, up to KT_ONE_ROW_PANELS).
 * PRE: panel p was decoded to 1024-byte bf16 blocks at `decoded` (NP == 1); else the packed
 * panels are read and each row decoded in registers.
 * x: the activation rows, int8 codes (a->q) or floats widened from a->bf16, row stride k_pad. */
KT_AI void KT_(micro)(const int MB, const int NP, const int PRE, const ktcy_act *a, const uint8_t *x,
                      const float *rowf, const ktcy_weight *w, int64_t m0, int64_t p, float *y, int64_t ldy,
                      const uint8_t *decoded, ktcy_ahead ahead, ktcy_span cont) {
    const int64_t nkb = w->k_pad / KT_BK;
    const int64_t block_bytes = PRE ? 1024 : KT_BB;
    const uint8_t *panel[KT_ONE_ROW_PANELS];
    panel[0] = PRE ? decoded : w->data + p * nkb * KT_BB;
    for (int q = 1; q < KT_ONE_ROW_PANELS; ++q) panel[q] = panel[0] + q * nkb * KT_BB; /* NP > 1 only (never PRE) */
    const int groups = KT_(has_groups)(w);
    const int to_l2 = KT_FETCH_L2(a);
    const uint8_t *arow[4];
    __m256i acc[KT_ONE_ROW_PANELS][4][2], acc16[KT_ONE_ROW_PANELS][4][2];
    __m256 facc[KT_ONE_ROW_PANELS][4][2];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        arow[m] = x + (m0 + m) * a->k_pad * KT_XSIZE;
        _Pragma("GCC unroll 8")
        for (int q = 0; q < NP; ++q)
            _Pragma("GCC unroll 8")
            for (int h = 0; h < 2; ++h) {
                acc[q][m][h] = acc16[q][m][h] = _mm256_setzero_si256();
                facc[q][m][h] = _mm256_setzero_ps();
            }
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
        ktcy_ahead_block(ahead, kb);
        const uint8_t *ak[4]; /* this block's activations of each row: row offsets below are immediates */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) ak[m] = arow[m] + kb * KT_BK * KT_XSIZE;
        uintptr_t fetch[KT_ONE_ROW_PANELS]; /* a streaming tile's prefetch address per panel (prefetch.h) */
        _Pragma("GCC unroll 4")
        for (int q = 0; q < NP; ++q) fetch[q] = ktcy_stream_ahead(cont, q, panel[q], kb, nkb, KT_AHEAD, block_bytes);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < 16; ++r) {
#if KT_ACC16_START
            if (KT_ACC16(PRE, MB) && r % KT_ACC16_ROWS == 0)
                _Pragma("GCC unroll 8")
                for (int m = 0; m < MB; ++m) {
                    const __m256i start = KT_(acc16_start)(a, m0 + m, kb, r);
                    _Pragma("GCC unroll 4")
                    for (int q = 0; q < NP; ++q)
                        _Pragma("GCC unroll 2")
                        for (int h = 0; h < 2; ++h) acc16[q][m][h] = start;
                }
#endif
            /* tiles that read packed panels stream them from memory: fetch KT_AHEAD blocks
             * ahead, a line per row while the block has lines left, so the loads find the bytes
             * in cache (4-row tiles too: their activation loads crowd the load queue, and
             * without it BF16 read 3-4 rows at 14 GB/s from memory against 22 with it) */
            if (!PRE && r * 64 < KT_BB)
                _Pragma("GCC unroll 4")
                for (int q = 0; q < NP; ++q)
                    ktcy_fetch_stream(fetch[q] + (uintptr_t)(r * 64), to_l2);
            if (!KT_INT_ACT && (MB > 1 || NP > (KT_PLAIN_ROWS ? 2 : 1))) {
                KT_(float_rows_by_panel)(MB, NP, panel, kb * block_bytes, r, ak, acc);
            } else {
                kt_w256 wv[KT_ONE_ROW_PANELS][2];
                _Pragma("GCC unroll 4")
                for (int q = 0; q < NP; ++q) {
                    const uint8_t *blk = panel[q] + kb * block_bytes;
                    if (PRE || KT_ALWAYS_PRE) {
                        wv[q][0] = KT_(pre_half)(blk, r, 0);
                        wv[q][1] = KT_(pre_half)(blk, r, 1);
                    }
#if !KT_ALWAYS_PRE
                    else {
                        KT_(wrow_parity)(blk, r, wv[q]);
                    }
#endif
                }
                _Pragma("GCC unroll 8")
                for (int m = 0; m < MB; ++m) {
                    const KT_(avec) av = KT_(load_a)(ak[m], r);
                    _Pragma("GCC unroll 4")
                    for (int q = 0; q < NP; ++q)
                        _Pragma("GCC unroll 2")
                        for (int h = 0; h < 2; ++h) {
                            if (KT_ACC16(PRE, MB)) {
                                acc16[q][m][h] = _mm256_add_epi16(acc16[q][m][h], _mm256_maddubs_epi16(wv[q][h].i, av.i));
                                KT_KEEP(acc16[q][m][h]);
                            } else {
                                acc[q][m][h] = KT_(dp)(acc[q][m][h], av, wv[q][h]);
                                if (KT_INT_ACT) KT_KEEP(acc[q][m][h]);
                            }
                        }
                }
            }
            if (KT_ACC16(PRE, MB) && (r + 1) % KT_ACC16_ROWS == 0) /* before any group epilogue: groups end there */
                _Pragma("GCC unroll 4")
                for (int q = 0; q < NP; ++q)
                    _Pragma("GCC unroll 8")
                    for (int m = 0; m < MB; ++m)
                        _Pragma("GCC unroll 2")
                        for (int h = 0; h < 2; ++h) {
                            acc[q][m][h] = _mm256_add_epi32(acc[q][m][h], _mm256_madd_epi16(acc16[q][m][h], _mm256_set1_epi16(1)));
                            acc16[q][m][h] = _mm256_setzero_si256();
                        }
            if (groups) {
                const int64_t g = KT_(group_at)(w, kb, r, nkb);
                if (g >= 0)
                    _Pragma("GCC unroll 4")
                    for (int q = 0; q < NP; ++q) {
#if KT_INT_ACT
                        KT_(group_epilogue)(acc[q], facc[q], MB, NP, a, w, m0, p + q, g);
#elif KT_UNIFORM_GROUP_SCALE
                        const float s = KT_(group_scale1)(w, p + q, g);
                        _Pragma("GCC unroll 8")
                        for (int m = 0; m < MB; ++m) { /* as the float prefill's tiles do */
                            const kt_scale_row rs = kt_scale_row_make(s, KT_ROW_PRESCALE ? rowf[m0 + m] : 1.0f);
                            _Pragma("GCC unroll 2")
                            for (int h = 0; h < 2; ++h) {
                                facc[q][m][h] = _mm256_add_ps(facc[q][m][h], kt_scale_row_apply(_mm256_castsi256_ps(acc[q][m][h]), rs));
                                acc[q][m][h] = _mm256_setzero_si256();
                            }
                        }
#else
                        _Pragma("GCC unroll 2")
                        for (int h = 0; h < 2; ++h) {
                            const __m256 s = KT_(group_scale)(w, p + q, g, h);
                            _Pragma("GCC unroll 8")
                            for (int m = 0; m < MB; ++m) { /* as the float prefill's tiles do */
                                facc[q][m][h] = _mm256_add_ps(facc[q][m][h], KT_(times_group_scale)(_mm256_castsi256_ps(acc[q][m][h]),
                                                                                                    s, rowf, m0 + m));
                                acc[q][m][h] = _mm256_setzero_si256();
                            }
                        }
#endif
                    }
            }
        }
    }
    /* constant trip counts with the tests inside: fully unrolled, the accumulators stay
     * registers (a loop that exits early indexes them, and GCC then keeps the arrays on the
     * stack and stores every FMA's result there in the hot loop) */
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        _Pragma("GCC unroll 4")
        for (int q = 0; q < NP; ++q) {
            const int64_t n0 = (p + q) * 16, valid = w->n - n0;
            if (valid <= 0 || m0 + m >= a->m) continue;
            __m256 v[2];
            if (KT_PARITY_WROW && !PRE) { /* the even and odd channels' sums -> the lane-split halves */
                const __m256 even = _mm256_castsi256_ps(acc[q][m][0]), odd = _mm256_castsi256_ps(acc[q][m][1]);
                const __m256 feven = facc[q][m][0], fodd = facc[q][m][1];
                acc[q][m][0] = _mm256_castps_si256(_mm256_unpacklo_ps(even, odd));
                acc[q][m][1] = _mm256_castps_si256(_mm256_unpackhi_ps(even, odd));
                facc[q][m][0] = _mm256_unpacklo_ps(feven, fodd);
                facc[q][m][1] = _mm256_unpackhi_ps(feven, fodd);
            }
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) v[h] = KT_(final_row)(acc[q][m][h], facc[q][m][h], rowf, m0 + m, a, w, m0 + m, n0 + 8 * h);
            KT_(store16)(y + (m0 + m) * ldy + n0, valid, v);
        }
    }
}

#if !KT_INT_ACT
/* Prefill (6 rows and more but for 7-8, split_calls) of the bf16-activation formats is a float
 * GEMM: the rows' activations are widened to floats (KTCY_AVX2_F32_ROWS at a time), each panel is
 * decoded once per chunk of rows to floats [k][16 channels], a slice of KTCY_F32_SLICE K values at
 * a time that every tile then reads from L1 (the whole panel, 128 KiB at K = 2048, was read from
 * L2 by each tile), and a tile of 6 rows x 16 channels (12 accumulators) takes per k two weight
 * loads, six broadcasts and twelve FMAs.  The bf16-pair tiles spent a shift and a mask per pair of
 * every weight half and activation, which compete with the FMAs for ports.  Each output is still
 * one FMA chain in K order (a tile's sums wait in scratch between slices), so the sums are those
 * of the decode tiles. */
_Static_assert(KTCY_F32_SLICE % KT_BK == 0, "slices of whole K blocks");
enum { KT_(FAST), KT_(CHECKED), KT_(WIDE) }; /* the panel decodes of f32_panel */
KT_AI void KT_(f32_panel_rows)(const int MODE, const int lift_rows, const ktcy_weight *w, int64_t p, int64_t kb0,
                               int64_t kb1, float *dst) {
    const __m256 lift = _mm256_set1_ps(ktcy_pow2(KT_PANEL_LIFT));
    const int64_t nkb = w->k_pad / KT_BK;
    const uint8_t *src = w->data + (p * nkb + kb0) * KT_BB;
    for (int64_t kb = kb0; kb < kb1; ++kb, src += KT_BB, dst += KT_BK * 16) {
        _Pragma("GCC unroll 16") /* the panel comes from memory: fetch KT_AHEAD blocks ahead */
        for (int l = 0; l < KT_BB; l += 64) _mm_prefetch((const char *)src + KT_AHEAD * KT_BB + l, _MM_HINT_T0);
        _Pragma("GCC unroll 2")
        for (int r = 0; r < 16; ++r) {
            kt_w256 v[2];
            if (MODE == KT_(WIDE)) KT_(wrow_wide)(src, r, v);
            else if (MODE == KT_(CHECKED)) KT_(wrow_checked)(src, r, v);
            else KT_(wrow)(src, r, v);
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                if (KT_PANEL_LIFT && lift_rows) { /* exact: the results are normal floats */
                    v[h].e = _mm256_mul_ps(v[h].e, lift);
                    v[h].o = _mm256_mul_ps(v[h].o, lift);
                }
                _mm256_store_ps(dst + (2 * r) * 16 + 8 * h, v[h].e);
                _mm256_store_ps(dst + (2 * r + 1) * 16 + 8 * h, v[h].o);
            }
        }
    }
}

KT_AI void KT_(f32_panel)(const ktcy_weight *w, int64_t p, int64_t kb0, int64_t kb1, float *dst, int wide, int lift) {
    if (KT_ROW_PRESCALE && wide) KT_(f32_panel_rows)(KT_(WIDE), 0, w, p, kb0, kb1, dst);
    else if (KT_(checked_rows)(w)) KT_(f32_panel_rows)(KT_(CHECKED), lift, w, p, kb0, kb1, dst);
    else KT_(f32_panel_rows)(KT_(FAST), lift, w, p, kb0, kb1, dst);
}

/* The largest exponent field of the bf16 row (k_pad elements, a multiple of 16). */
KT_AI int KT_(top_field)(const uint16_t *src, int64_t k_pad) {
    __m256i top = _mm256_setzero_si256();
    for (int64_t k = 0; k < k_pad; k += 16)
        top = _mm256_max_epu16(top, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(src + k)), _mm256_set1_epi16(0x7F80)));
    uint16_t tops[16];
    _mm256_storeu_si256((__m256i *)tops, top);
    int field = 0;
    for (int j = 0; j < 16; ++j) field = tops[j] >> 7 > field ? tops[j] >> 7 : field;
    return field;
}

/* Rows [m0, m0 + rows) of the bf16 activations as floats (rows <= KTCY_AVX2_F32_ROWS); rows past
 * a->m are zeros (the MoE engine's padding rows may hold an earlier call's, which must not choose
 * the decode for this one).  KT_ROW_PRESCALE E: each row times 2^k, rowf[i] its factor for
 * final_scaled(), and the return value says whether a row's exponent field passes KT_WIDE_FIELD
 * (the call then takes the wide decode).  With the 2^-E weights k = min(E, 252 - field), field
 * the row's largest exponent field: |x| 2^k < 2^126, so no product (below 2^-111) nor K of them
 * can overflow, and rows up to KT_WIDE_FIELD keep k >= E - 9: a product is exact down to 2^-117
 * of its true size.  Wide (the weights times 1/KT_WIDE_FACTOR): k = min(120, 227 - field), every
 * row's largest value brought to 2^100 (or times 2^120), so K products cannot overflow and small
 * values keep the most room below.  lift: the panels are decoded times 2^KT_PANEL_LIFT unless wide,
 * and the rows then times 2^(k - KT_PANEL_LIFT), normal floats still (k >= 111), so each product
 * is the same number; rowf is unchanged. */
KT_AI int KT_(f32_rows)(const ktcy_act *a, int64_t m0, int64_t rows, float *dst, int64_t stride, float *rowf, int lift) {
    int wide = 0, field[KTCY_AVX2_F32_ROWS];
    (void)rowf; (void)field; (void)lift;
#if KT_ROW_PRESCALE
    for (int64_t i = 0; i < rows; ++i) {
        field[i] = m0 + i < a->m ? KT_(top_field)(a->bf16 + (m0 + i) * a->k_pad, a->k_pad) : 0;
        wide |= field[i] > KT_WIDE_FIELD;
    }
#endif
    for (int64_t i = 0; i < rows; ++i, dst += stride) {
        if (KT_ROW_PRESCALE) rowf[i] = 1.0f;
        if (m0 + i >= a->m) {
            memset(dst, 0, (size_t)a->k_pad * sizeof(float));
            continue;
        }
        const uint16_t *src = a->bf16 + (m0 + i) * a->k_pad;
        __m256 times = _mm256_set1_ps(1.0f);
#if KT_ROW_PRESCALE
        const int k = wide ? (field[i] < 107 ? 120 : 227 - field[i])
                           : ktcy_prescale_shift(field[i]);
        times = _mm256_castsi256_ps(_mm256_set1_epi32((127 + k - (lift && !wide ? KT_PANEL_LIFT : 0)) << 23));
        rowf[i] = (wide ? KT_WIDE_FACTOR : ktcy_pow2(KT_ROW_PRESCALE)) * ktcy_pow2(-k);
#endif
        for (int64_t k = 0; k < a->k_pad; k += 8) {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + k)));
            __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            if (KT_ROW_PRESCALE) x = _mm256_mul_ps(x, times);
            _mm256_store_ps(dst + k, x);
        }
    }
    return wide;
}

/* MB rows (floats at x, row stride xs) x K blocks [kb0, kb1) of one panel (that slice as floats
 * at wp).  The sums of a slice that does not start the row come from sums (MB rows of acc and
 * facc, 16 floats each), and go back there unless the slice ends the row: each output stays one
 * FMA chain in K order. */
KT_AI void KT_(f32_micro)(const int MB, const ktcy_act *a, const ktcy_weight *w, const float *wp, const float *x,
                          const int64_t xs, const float *rowf, int64_t m0, int64_t p, float *y, int64_t ldy,
                          ktcy_ahead ahead, int64_t kb0, int64_t kb1, float *sums) {
    const int64_t nkb = w->k_pad / KT_BK;
    const int groups = KT_(has_groups)(w);
    __m256 acc[6][2], facc[6][2];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m)
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; ++h) {
            acc[m][h] = kb0 ? _mm256_load_ps(sums + m * 32 + 8 * h) : _mm256_setzero_ps();
            facc[m][h] = kb0 ? _mm256_load_ps(sums + m * 32 + 16 + 8 * h) : _mm256_setzero_ps();
        }
    for (int64_t kb = kb0; kb < kb1; ++kb) {
        ktcy_ahead_block(ahead, kb);
        const float *wb = wp + (kb - kb0) * KT_BK * 16;
        _Pragma("GCC unroll 4")
        for (int64_t k = kb * KT_BK; k < (kb + 1) * KT_BK; ++k, wb += 16) {
            const __m256 w0 = _mm256_load_ps(wb), w1 = _mm256_load_ps(wb + 8);
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
                const __m256 xv = _mm256_broadcast_ss(x + m * xs + k);
                acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
            }
        }
        const int64_t g = groups ? KT_(group_at)(w, kb, 15, nkb) : -1;
        if (g >= 0) {
#if KT_UNIFORM_GROUP_SCALE
            const float s = KT_(group_scale1)(w, p, g);
#endif
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
#if KT_UNIFORM_GROUP_SCALE
                const kt_scale_row rs = kt_scale_row_make(s, KT_ROW_PRESCALE ? rowf[m] : 1.0f);
#endif
                _Pragma("GCC unroll 2")
                for (int h = 0; h < 2; ++h) {
#if KT_UNIFORM_GROUP_SCALE
                    facc[m][h] = _mm256_add_ps(facc[m][h], kt_scale_row_apply(acc[m][h], rs));
#else
                    facc[m][h] = _mm256_add_ps(facc[m][h], KT_(times_group_scale)(acc[m][h], KT_(group_scale)(w, p, g, h), rowf, m));
#endif
                    acc[m][h] = _mm256_setzero_ps();
                }
            }
        }
    }
    if (kb1 < nkb) {
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m)
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                _mm256_store_ps(sums + m * 32 + 8 * h, acc[m][h]);
                _mm256_store_ps(sums + m * 32 + 16 + 8 * h, facc[m][h]);
            }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) { /* constant trip counts: see micro */
        const int64_t n0 = p * 16, valid = w->n - n0;
        if (valid <= 0 || m0 + m >= a->m) continue;
        __m256 v[2];
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; ++h)
            v[h] = KT_(final_row)(_mm256_castps_si256(acc[m][h]), facc[m][h], rowf, m, a, w, m0 + m, n0 + 8 * h);
        KT_(store16)(y + (m0 + m) * ldy + n0, valid, v);
    }
}

/* Whether every call of m rows to this variant takes the float GEMM whatever its weight: m is not
 * one of split_calls' counts, nor one few_rows may take, nor below run()'s bound (fewer rows come
 * here only for a wide row or NaN codes, which differ between weights). */
KT_AI int KT_(f32_always)(const ktcy_act *a) {
#if KT_FEW_ROWS
    if (a->m <= KT_FEW_ROWS_CHOICE(a)) return 0;
#endif
    if (KT_PLAIN_ROWS) return a->m >= 20;
    return a->m == 6 || a->m >= 9;
}

KT_AI void KT_(f32_gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb, int64_t pe,
                         void *scratch) {
    const int64_t xs = KTCY_F32_ROW_STRIDE(w->k_pad), nkb = w->k_pad / KT_BK, slice = KTCY_F32_SLICE / KT_BK;
    float *panel = (float *)ktcy_align64(scratch);
    float *rows = panel + KTCY_F32_SLICE * KTCY_PANEL, *rowf = rows + KTCY_AVX2_F32_ROWS * xs;
    float *wide_flag = rowf + KTCY_AVX2_F32_ROWS; /* 1.0f: the rows' chunk holds a wide row */
    float *sums = (float *)ktcy_align64(wide_flag + 1);
    /* The up projection after its gate on the same rows (a->rows_in_scratch) finds them widened
     * here, with their factors and wide flag, when the gate took this path in one chunk too:
     * widening them again cost the MoE's gate and up items a few percent */
    const int reuse = a->rows_in_scratch && a->m <= KTCY_AVX2_F32_ROWS && KT_(f32_always)(a);
    const int lift = KT_PANEL_LIFT && a->tiles.fp8_normal_panels;
    for (int64_t c0 = 0; c0 < a->m; c0 += KTCY_AVX2_F32_ROWS) {
        const int64_t chunk = a->m - c0 < KTCY_AVX2_F32_ROWS ? a->m - c0 : KTCY_AVX2_F32_ROWS;
        int wide;
        if (reuse) {
            wide = *wide_flag != 0.0f;
        } else {
            wide = KT_(f32_rows)(a, c0, (chunk + 5) / 6 * 6, rows, xs, rowf, lift); /* tiles read whole rows */
            *wide_flag = wide ? 1.0f : 0.0f;
        }
        for (int64_t p = pb; p < pe; ++p) {
            /* the tiles fetch the panel that comes next: this sweep's next one, else the next
             * chunk's first, else the caller's hint */
            const int64_t tiles = (chunk + 5) / 6, following = p + 1 < pe || c0 + chunk >= a->m ? p + 1 : pb;
            const ktcy_span next = ktcy_next_group(a, w, following, pe, 1, KT_BK, KT_BB);
            for (int64_t kb0 = 0; kb0 < nkb; kb0 += slice) {
                const int64_t kb1 = kb0 + slice < nkb ? kb0 + slice : nkb;
                KT_(f32_panel)(w, p, kb0, kb1, panel, wide, lift);
                for (int64_t i = 0, tile = 0; i < chunk; ++tile) {
                    const int64_t left = chunk - i;
                    const float *x = rows + i * xs, *xf = rowf + i;
                    float *sm = sums + i * 32;
                    const ktcy_ahead ahead = ktcy_ahead_share(next, tile, tiles, nkb);
                    /* 6-row tiles, but 4 + 4 for 8 rows left (and 4 + 4 for 7): a 2-row tile's 4 FMA
                     * chains run at half speed */
                    if (left >= 5 && left % 6 != 1 && left % 6 != 2) { KT_(f32_micro)(6, a, w, panel, x, xs, xf, c0 + i, p, y, ldy, ahead, kb0, kb1, sm); i += 6; }
                    else if (left >= 3) { KT_(f32_micro)(4, a, w, panel, x, xs, xf, c0 + i, p, y, ldy, ahead, kb0, kb1, sm); i += 4; }
                    else { KT_(f32_micro)(2, a, w, panel, x, xs, xf, c0 + i, p, y, ldy, ahead, kb0, kb1, sm); i += 2; }
                }
            }
        }
    }
}
#endif

#define KT_TILE(pre)                                                                    \
    do {                                                                                \
        if (mb == 1) KT_(micro)(1, 1, pre, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);       \
        else if (mb == 2) KT_(micro)(2, 1, pre, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);  \
        else if (mb == 3) KT_(micro)(3, 1, pre, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);  \
        else KT_(micro)(4, 1, pre, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);               \
    } while (0)

KT_TARGET static int KT_(run)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
#if !KT_INT_ACT
    /* plain bf16 rows have no decode to save: widening a panel pays off from about 20 rows; the
     * decoding formats' from 5 (calls of 5, 7 and 8 rows arrive split in two, split_calls) */
    if (a->m >= (KT_PLAIN_ROWS ? 20 : 5) || KT_(checked_rows)(w)) {
        KT_(f32_gemm)(a, w, y, ldy, pb, pe, scratch);
        return KTCY_OK;
    }
#endif
    /* 4-row tiles for the group formats too: their float sums are touched only at group ends
     * and wait in the stack frame, while the int16 sums (KT_ACC16) keep the inner loop short
     * (INT4 M=4 0.88x the time of two 2-row tiles) */
    const int max_rows = 4;
    /* decode a panel once into scratch when enough row tiles share it (or the format has no
     * in-register decode); fewer rows decode each weight row in registers in every tile */
    const int pre = KT_PREDECODE && (a->m > KT_PREDECODE_ABOVE || !KT_REG_DECODE);
    /* calls of 2 or 3 rows take them where the CPU streams more than one panel (one_panel_rows
     * below 2: not AMD): two panel streams keep more misses in flight (INT8 single GEMM with the
     * weights in memory, Xeon forced to AVX2: 2 rows 0.91x the time, 3 rows 0.95-0.97x; 1.06x with
     * the weights in cache, which a MoE call never finds), where a Zen 4 forced to AVX2 with the
     * Zen 3's L1 prefetch ran the 4-row tiles in 0.87x (2 rows) and 0.93x (3 rows) the time, and a
     * MoE layer at T = 8, 16 and 32 in 0.96x, 0.93x and 0.96x */
    const int few_wide = (a->m == 2 || a->m == 3) && a->m > a->tiles.one_panel_rows;
    const int wide = KT_WIDE_TILE && ((a->tiles.wide_tiles && a->m > 4) || few_wide) && !KT_(has_groups)(w);
    const int64_t nkb = w->k_pad / KT_BK;
    uint8_t *decoded = ktcy_align64(scratch);
#if KT_INT_ACT
    const uint8_t *x = (const uint8_t *)a->q;
    const float *rowf = NULL;
#else
    /* the rows as floats (tiles round up to 4 rows; fewer than KTCY_AVX2_F32_ROWS come here) */
    float *xf = (float *)decoded, *rowf = xf + (a->m + 3) / 4 * 4 * a->k_pad;
    if (KT_(f32_rows)(a, 0, (a->m + 3) / 4 * 4, xf, a->k_pad, rowf, 0)) { /* a wide row: the float GEMM's wide decode */
        KT_(f32_gemm)(a, w, y, ldy, pb, pe, scratch);
        return KTCY_OK;
    }
    const uint8_t *x = (const uint8_t *)xf;
#endif
    for (int64_t p = pb; p < pe;) {
#if KT_WIDE_TILE
        if (wide && pe - p >= 2) {
            const int64_t tiles = (a->m + 2) / 3;
            const ktcy_span next = ktcy_next_group(a, w, p + 2, pe, 2, KT_BK, KT_BB);
            for (int64_t m0 = 0, tile = 0; m0 < a->m; m0 += 3, ++tile) {
                const int64_t left = a->m - m0;
                const ktcy_ahead ahead = ktcy_ahead_share(next, tile, tiles, nkb);
                if (left >= 3) KT_(micro)(3, 2, 0, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);
                else if (left == 2) KT_(micro)(2, 2, 0, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);
                else KT_(micro)(1, 2, 0, a, x, rowf, w, m0, p, y, ldy, decoded, ahead, next);
            }
            p += 2;
            continue;
        }
#endif
        (void)wide;
#if !KT_INT_ACT
        /* one or two rows take two panels at once (one row: KT_ONE_ROW_PANELS): the 4 (8) FMA
         * chains hide the FMA latency, which bounded one panel's 2 (4) chains below the decode's
         * throughput */
        if (a->m <= 2 && pe - p >= 2) {
            const int np = a->m == 1 && pe - p >= KT_ONE_ROW_PANELS ? KT_ONE_ROW_PANELS : 2;
            const ktcy_span next = ktcy_next_group(a, w, p + np, pe, np, KT_BK, KT_BB);
            if (np > 2)
                KT_(micro)(1, KT_ONE_ROW_PANELS, 0, a, x, rowf, w, 0, p, y, ldy, decoded, ktcy_no_ahead(), next);
            else if (a->m == 1) KT_(micro)(1, 2, 0, a, x, rowf, w, 0, p, y, ldy, decoded, ktcy_no_ahead(), next);
            else KT_(micro)(2, 2, 0, a, x, rowf, w, 0, p, y, ldy, decoded, ktcy_no_ahead(), next);
            p += np;
            continue;
        }
#else
        /* one row: two panels per tile (twice the streams and chains) where the CPU prefers it
         * (ktcy_one_panel_rows), or always (KT_ONE_ROW_TWO_PANELS): MoE T = 1 and 2 on a Xeon
         * 0.79-0.97x the time.  Register decode only: the tile reads packed panels. */
        if (!KT_ALWAYS_PRE && a->m == 1 && (KT_ONE_ROW_TWO_PANELS || a->m > a->tiles.one_panel_rows) && pe - p >= 2) {
            const ktcy_span next = ktcy_next_group(a, w, p + 2, pe, 2, KT_BK, KT_BB);
            KT_(micro)(1, 2, 0, a, x, rowf, w, 0, p, y, ldy, decoded, ktcy_no_ahead(), next);
            p += 2;
            continue;
        }
#endif
#if KT_PREDECODE
        if (pre) KT_(decode_panels)(w->data + p * nkb * KT_BB, decoded, nkb);
#endif
        /* several row tiles share the panel: they fetch the next one (prefetch.h) */
        const int64_t tiles = (a->m + max_rows - 1) / max_rows;
        const ktcy_span next = ktcy_next_group(a, w, p + 1, pe, 1, KT_BK, KT_BB);
        for (int64_t m0 = 0, tile = 0; m0 < a->m; ++tile) {
            const int64_t left = a->m - m0;
            /* tiles as high as the rows left, up to max_rows: a 3-row call rounded up to a 4-row
             * tile spent a quarter of its dot products on padding (single GEMM M=3 0.81-0.89x
             * the time with a 3-row tile) */
            const int mb = left >= max_rows ? max_rows : (int)left;
            const ktcy_ahead ahead = ktcy_ahead_share(next, tile, tiles, nkb);
#if KT_ALWAYS_PRE
            KT_TILE(1);
#else
            if (pre) KT_TILE(1); else KT_TILE(0);
#endif
            m0 += mb;
        }
        ++p;
    }
    return KTCY_OK;
}

/* Calls of 5, 7 or 8 rows of the decoding formats run as two calls of 4 and 1 or 3-4 rows: their
 * decode tiles beat the float GEMM's panel decode pass plus its tiles there (single GEMM FP8 and
 * MXFP4, 7-8 rows 0.81-0.90x the time; 5 rows, 2 threads, Zen 3: FP8 0.83-0.87x, MXFP4 0.95x; 6
 * rows as 4 + 2 were not faster: FP8 0.98-1.02x).  Split here rather than in run(): taking those
 * rows there changed run()'s code and cost MoE T=1 MXFP4 2-3%.  The first call's hint is the
 * same panels (the second call reads them next); each half holds exactly its rows. */
KT_TARGET static int KT_(split_calls)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                                      int64_t pe, void *scratch) {
#if !KT_INT_ACT
    if (!KT_PLAIN_ROWS && (a->m == 5 || a->m == 7 || a->m == 8) && !KT_(checked_rows)(w)) {
        ktcy_act half = *a;
        half.m = half.m_pad = 4;
        half.next_w = w;
        half.next_pb = pb;
        half.next_pe = pe;
        const int status = KT_(run)(&half, w, y, ldy, pb, pe, scratch);
        if (status != KTCY_OK) return status;
        half = *a;
        half.m = a->m - 4;
        half.m_pad = a->m_pad - 4;
        half.bf16 = a->bf16 + 4 * a->k_pad;
        return KT_(run)(&half, w, y + 4 * ldy, ldy, pb, pe, scratch);
    }
#endif
    return KT_(run)(a, w, y, ldy, pb, pe, scratch);
}

KT_TARGET static int KT_GEMM(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                             int64_t pe, void *scratch) {
    if (!(KT_FORMATS & (1 << w->format))) return KTCY_ERR_FORMAT;
#if KT_FEW_ROWS
    if (a->m >= 1 && a->m <= KT_FEW_ROWS_CHOICE(a)) {
        const unsigned int csr = ktcy_clear_daz(); /* as AVX-512's path: the same bits under any MXCSR.DAZ */
        const int done = KT_(few_rows)(a, w, y, ldy, pb, pe, scratch);
        ktcy_restore_daz(csr);
        if (done) return KTCY_OK;
    }
#endif
    if (!KT_CLEAR_DAZ) return KT_(split_calls)(a, w, y, ldy, pb, pe, scratch);
    const unsigned int csr = ktcy_clear_daz();
    const int status = KT_(split_calls)(a, w, y, ldy, pb, pe, scratch);
    ktcy_restore_daz(csr);
    return status;
}

#undef KT_TILE
#undef KT_ACC16
#undef KT_ACC16_ROWS
#undef KT_ACC16_ONE_ROW
#undef KT_ACC16_START
#undef KT_XSIZE
#undef KT_HAS_WROW
#undef KT_CHECKED_ROWS
#undef KT_ALWAYS_PRE
#undef KT_WIDE_TILE
#undef KT_LANE_SPLIT
#undef KT_ROW_PRESCALE
#undef KT_WIDE_FIELD
#undef KT_WIDE_FACTOR
#undef KT_CLEAR_DAZ
#undef KT_PARITY_WROW
#undef KT_PREDECODE_ABOVE
#undef KT_UNIFORM_GROUP_SCALE
#undef KT_PANEL_LIFT
#undef KT_FETCH_L2
#undef KT_KEEP
#undef KT_AHEAD
#undef KT_ONE_ROW_PANELS
#undef KT_ONE_ROW_TWO_PANELS
#undef KT_FEW_ROWS
#undef KT_FEW_ROWS_CHOICE
#include "traits_end.h"
