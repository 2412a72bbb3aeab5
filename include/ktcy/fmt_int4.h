/* 4-bit traits, for the descriptor rows INT4 (symmetric: code c in [-8, 7] stored as the nibble
 * c + 8, so w = s * (nibble - 8)), INT4_ZP (w = s * (nibble - z) with a zero point z per (K group,
 * channel), as GPTQ/AWQ/compressed-tensors store them) and INT4_MIN (w = s * nibble + min with a
 * float min per (K group, channel), as llama.cpp's Q4_K and Q4_1).  Scales, mins and zero points
 * are panel-major (ktcy_group_index: each panel's groups in a row of 16-channel vectors; INT4_MIN's
 * group holds 16 scales, then 16 mins); activations int8.
 *   y[m][n] = (sum over groups g in order of acc + (float)sum_{k in g}(q_x * (nibble - z)) * s[g][n]
 *              [then fused: + (float)sum_{k in g} q_x * min[g][n]]) * x_scale[m]
 * (z = 0 for INT4_MIN).  The vector kernels multiply the unsigned nibble and subtract z x the
 * activation group sum (an exact int32); AMX unpacks nibble - z to int8.  Every kernel adds the
 * same float terms in the same order (the min term in one fused multiply-add, one operation
 * less in the AVX2 tiles, whose sums fill the 16 registers), so all ISAs give the same bits.
 * Included by a skeleton instantiation; no include guard. */
#define KT_ROW KTCY_ROW_INT4
#define KT_FORMATS ((1 << KTCY_FMT_INT4) | (1 << KTCY_FMT_INT4_ZP) | (1 << KTCY_FMT_INT4_MIN))
#include "traits_begin.h"

/* Groups per channel (group: 32, 64 or 128); where (group g, channel n) keeps its scale and zero
 * point; the zero point, stored or the symmetric format's fixed 8. */
#define KT_INT4_GROUPS(w) ((w)->k_pad >> __builtin_ctz((unsigned)(w)->group))
#define KT_INT4_AT(w, g, n) ktcy_group_index(KT_INT4_GROUPS(w), (g), (n))
#define KT_INT4_MINS(w) ((w)->format == KTCY_FMT_INT4_MIN)
#define KT_INT4_ZERO(w, g, n) ((w)->zero ? (int32_t)(w)->zero[KT_INT4_AT(w, g, n)] : KT_INT4_MINS(w) ? 0 : 8)
/* Where (group g, channel n)'s scale sits; INT4_MIN's min is 16 floats on. */
#define KT_INT4_SAT(w, g, n) (KT_INT4_MINS(w) ? 2 * KT_INT4_AT(w, g, n) - (n) % KTCY_PANEL : KT_INT4_AT(w, g, n))
/* How far ahead the scale and zero-point streams are fetched, in groups.  Panel-major rows
 * follow each other, so past a panel's last group this is the next panel's first: the one a
 * one-panel tile reads next (a tile of NP panels adds (NP - 1) rows to reach its slot's next
 * one).  `at` is group g's place in its panel's row (zat: in the zero points', sat: in the
 * scales', whose groups are twice as wide with mins).  Addresses are integers: past the arrays'
 * end a prefetch is harmless, a C pointer is not. */
#define KT_INT4_AHEAD 16
/* The vector epilogues take z x the group sum as a 16-bit product (vpmaddwd / vpdpwssd): a group
 * of int8 codes sums to at most 128 x group in magnitude, which must fit a signed word. */
_Static_assert(KTCY_GROUPS_32_64_128 < 256, "INT4 group sums must fit 16 bits");
#define KT_INT4_FETCH_SIDE(w, zat, sat, g, NP)                                                               \
    do {                                                                                                     \
        const int64_t groups_ = KT_INT4_GROUPS(w);                                                           \
        const uintptr_t ahead_ = (uintptr_t)(KT_INT4_AHEAD * 16 +                                            \
                                             ((g) + KT_INT4_AHEAD >= groups_ ? ((NP) - 1) * groups_ * 16 : 0)); \
        const uintptr_t sahead_ = ahead_ * sizeof(float) * (KT_INT4_MINS(w) ? 2 : 1);                        \
        _mm_prefetch((const char *)((uintptr_t)((w)->scale + (sat)) + sahead_), _MM_HINT_T0);                \
        if (KT_INT4_MINS(w)) _mm_prefetch((const char *)((uintptr_t)((w)->scale + (sat)) + sahead_ + 64), _MM_HINT_T0); \
        if ((w)->zero) _mm_prefetch((const char *)((uintptr_t)((w)->zero + (zat)) + ahead_), _MM_HINT_T0);   \
    } while (0)

#if KT_SKEL == KT_SKEL_REF
KT_AI int32_t KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    const int64_t e = ktcy_int8_offset(nn, k % 64);
    const uint8_t byte = w->data[(p * (w->k_pad / 64) + k / 64) * 512 + (e & 511)];
    return (e < 512 ? byte & 0x0F : byte >> 4) - KT_INT4_ZERO(w, k / w->group, p * KTCY_PANEL + nn);
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->group; }
KT_AI float KT_(group)(float acc, int32_t part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    const int64_t sat = KT_INT4_SAT(w, g, n);
    acc = acc + (float)part * w->scale[sat];
    if (KT_INT4_MINS(w)) acc = fmaf((float)a->group_sum[m * KT_INT4_GROUPS(w) + g], w->scale[sat + KTCY_PANEL], acc);
    return acc;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)w; (void)n;
    return acc * a->scale[m];
}

#elif KT_SKEL == KT_SKEL_AVX2 || KT_SKEL == KT_SKEL_AVX512
/* A group ends after row 15 of a block, or after row 7 too for group 32; group 128 spans two blocks. */
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)nkb;
    if (!(r == 15 || (r == 7 && w->group == 32))) return -1;
    if (w->group == 128 && !(kb & 1)) return -1;
    return (kb * 64 + r * 4) >> __builtin_ctz((unsigned)w->group); /* a power of two: no division */
}

#if KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_U8
/* More than 12 rows: each panel's nibbles are unpacked once to bytes (the INT8 block order), so
 * the row tiles only load.  Up to 12 rows (3 row tiles) unpack each weight row in registers, in
 * every tile: 3 operations per 64 codes, and no separate pass that waits on memory while it writes
 * a 16 x K byte panel as large as L1 at K = 2048.  One projection from memory, 2 threads, Zen
 * 3, against unpacking once above 4 rows: K = 2048 M = 6-12 0.85-0.94x the time, K = 4096 and
 * 14336 M = 8 0.91 and 0.80x; M = 16 0.91-0.98x at K >= 2048 but 0.96-1.07x at K = 768. */
#define KT_PREDECODE 1
#define KT_REG_DECODE 1
#define KT_PREDECODE_ABOVE 12
KT_AI __m256i KT_(nibbles)(const uint8_t *blk, int r, int h) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (r & 7) * 64 + h * 32));
    return _mm256_and_si256(r < 8 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
}
KT_AI kt_w256 KT_(half)(const uint8_t *blk, int r, int h) {
    /* Rows r and r + 8 share their bytes.  An empty asm makes the high rows load them again (an
     * L1 hit): GCC otherwise keeps the low rows' loads live across the block and, beside the
     * sums of two panels or two rows, spills them to the stack and reloads them (one projection
     * from memory, Zen 3: M = 1 1.01x, M = 2 0.94x and M = 4 0.94x the time with the fresh load;
     * in cache the two-panel one-row tile went from 1.11x to 0.96x the time of the one-panel one). */
    if (r >= 8) __asm__("" : "+r"(blk));
    return kt_int_half(KT_(nibbles)(blk, r, h));
}
KT_AI void KT_(decode_panels)(const uint8_t *src, uint8_t *dst, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b, src += KT_BB, dst += 1024)
        _Pragma("GCC unroll 16")
        for (int r = 0; r < 16; ++r)
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) _mm256_storeu_si256((__m256i *)(dst + r * 64 + h * 32), KT_(nibbles)(src, r, h));
}
KT_AI void KT_(group_epilogue)(__m256i acc[4][2], __m256 facc[4][2], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p, int64_t g) {
    __m256i zero[2];
    const int64_t zat = KT_INT4_AT(w, g, p * 16), sat = KT_INT4_SAT(w, g, p * 16);
    const int mins = KT_INT4_MINS(w);
    /* a slow stream (a line per group, or per four) that the decode stream would outrun: ask
     * for the scales (and zero points) ahead, past the panel's end in the one this slot reads
     * next (NP panels on) */
    KT_INT4_FETCH_SIDE(w, zat, sat, g, NP);
    /* INT4_MIN (z = 0): no bias to take off, the min term instead, in a loop of its own: the
     * test inside the shared loop made that loop's code slower for every row count above a few
     * (one projection, Zen 4 forced to AVX2, M = 32 and 512: 0.83x and 0.79x the time this way) */
    if (mins) {
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            const __m256 gsum = _mm256_set1_ps((float)a->group_sum[(m0 + m) * KT_INT4_GROUPS(w) + g]);
            _Pragma("GCC unroll 8")
            for (int h = 0; h < 2; ++h) {
                __m256 part = _mm256_cvtepi32_ps(acc[m][h]);
                facc[m][h] = _mm256_add_ps(facc[m][h], _mm256_mul_ps(part, _mm256_loadu_ps(w->scale + sat + h * 8)));
                facc[m][h] = _mm256_fmadd_ps(gsum, _mm256_loadu_ps(w->scale + sat + 16 + h * 8), facc[m][h]);
                acc[m][h] = _mm256_setzero_si256();
            }
        }
        return;
    }
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h)
        zero[h] = w->zero ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->zero + zat + h * 8)))
                          : _mm256_set1_epi32(8);
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        const __m256i gsum = _mm256_set1_epi32(a->group_sum[(m0 + m) * KT_INT4_GROUPS(w) + g]);
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; ++h) {
            __m256 s = _mm256_loadu_ps(w->scale + sat + h * 8);
            __m256i bias = _mm256_madd_epi16(zero[h], gsum); /* z x sum as words (see the AVX-512 epilogue) */
            __m256 part = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][h], bias));
            facc[m][h] = _mm256_add_ps(facc[m][h], _mm256_mul_ps(part, s));
            acc[m][h] = _mm256_setzero_si256();
        }
    }
}
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)w; (void)n0;
    return _mm256_mul_ps(facc, _mm256_set1_ps(a->scale[m]));
}

#else /* AVX-512 */
#define KT_WKIND KT_W_U8
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
/* Few-row calls may stream one panel at a time where the CPU prefers it (registry.h); FP8 and
 * MXFP4, whose decode chains need four panels' independent work, were 1.5x slower that way on
 * the Zen 5 that preferred it for INT4, and INT8 gained nothing. */
#define KT_ONE_PANEL_ROWS(a) ((a)->tiles.one_panel_rows)
typedef struct { int unused; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) { KT_(ctx) c = {0}; return c; }
/* Rows r and r + 8 are the low and high nibbles of the same 64 bytes.  RELOAD: an empty asm makes
 * the high rows load them again (an L1 hit; which tiles do: gemm_avx512_tpl.h).  In tiles of 4-6
 * rows GCC otherwise keeps the low rows' loads live across the block and spills them in the
 * inner loop (a 6 x 4 tile made 306 stack accesses, 84-122 with it: the float sums at group
 * ends).  Which tiles reload also moves the others' register allocation: the whole AVX-512 VNNI
 * variant made 1258 stack accesses before, 812 as chosen, 1098 with only prefill's four-panel
 * tiles.  On a Zen 4, one projection at M = 8-512 took 0.83-0.85x the time (INT4 and INT4_ZP),
 * MoE T = 128 and 512 0.78-0.87x.  The one- and two-row tiles keep the reuse: reloading cost
 * them 0.99-1.08x. */
#define KT_SHARED_ROW_BYTES 1
KT_AI __m512i KT_(row)(const uint8_t *blk, int r, const int RELOAD) {
    if (RELOAD && r >= 8) __asm__("" : "+r"(blk));
    __m512i raw = _mm512_loadu_si512(blk + (r & 7) * 64);
    return _mm512_and_si512(r < 8 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
}
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    out[0].v0 = KT_(row)(blk, r, 0);
    out[1].v0 = KT_(row)(blk, r + 1, 0);
}
KT_AI void KT_(rows_reloaded)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    out[0].v0 = KT_(row)(blk, r, 1);
    out[1].v0 = KT_(row)(blk, r + 1, 1);
}
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    __m512i zero[4];
    const int mins = KT_INT4_MINS(w), width = mins ? 2 : 1;
    const int64_t groups = KT_INT4_GROUPS(w), zat0 = KT_INT4_AT(w, g, p0 * 16), sat0 = KT_INT4_SAT(w, g, p0 * 16);
    int64_t zat[4], sat[4];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) { /* the next panel's row */
        zat[p] = zat0 + p * groups * 16;
        sat[p] = sat0 + p * groups * 16 * width;
    }
    /* slow streams (see the AVX2 epilogue); many-row tiles too: the panels' scale rows lie a
     * row of groups apart, and without it their loads missed L1 (INT4 M=512 +8%) */
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) KT_INT4_FETCH_SIDE(w, zat[p], sat[p], g, NP);
    if (mins) { /* z = 0: no bias to take off; the min term instead (see the AVX2 epilogue) */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            const __m512 gsum = _mm512_set1_ps((float)a->group_sum[(m0 + m) * groups + g]);
            _Pragma("GCC unroll 8")
            for (int p = 0; p < NP; ++p) {
                __m512 part = _mm512_cvtepi32_ps(acc[m][p]);
                facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(part, _mm512_loadu_ps(w->scale + sat[p])));
                facc[m][p] = _mm512_fmadd_ps(gsum, _mm512_loadu_ps(w->scale + sat[p] + 16), facc[m][p]);
                acc[m][p] = _mm512_setzero_si512();
            }
        }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p)
        zero[p] = w->zero ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->zero + zat[p])))
                          : _mm512_set1_epi32(8);
    /* z x the group sum in one 16-bit multiply-add: z (at most 15) sits in each dword's low word
     * above a zero one, and |sum| <= 128 x 128 fits a word (vpmulld costs two operations) */
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        const int32_t gs = a->group_sum[(m0 + m) * groups + g];
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
            __m512 s = _mm512_loadu_ps(w->scale + sat[p]);
#if KT_FAST
            const __m512i exact = _mm512_dpwssd_epi32(acc[m][p], zero[p], _mm512_set1_epi32(-gs));
#else
            const __m512i exact = _mm512_sub_epi32(acc[m][p], _mm512_madd_epi16(zero[p], _mm512_set1_epi32(gs)));
#endif
            __m512 part = _mm512_cvtepi32_ps(exact);
            facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(part, s));
            acc[m][p] = _mm512_setzero_si512();
        }
    }
}
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)w; (void)n0;
    return _mm512_mul_ps(facc, _mm512_set1_ps(a->scale[m]));
}
#endif

#elif KT_SKEL == KT_SKEL_AMX
/* Block kb of panel p unpacked to a signed int8 block nibble - z (the INT8 tile layout).
 * A block's byte e holds code e (low nibble: K 0-31 of the block) and code e + 512 (high: K
 * 32-63); code c sits at tile row c / 64, channel (c / 4) % 16.  So each half of the block is
 * eight tile rows from one K group (groups are >= 32 and aligned), and its zero points repeat
 * every 64 bytes: whole-row loops the compiler vectorizes. */
#define KT_AMX_DECODE_B 1
KT_AI void KT_(decode_b_block)(const ktcy_weight *w, int64_t p, int64_t kb, uint8_t *out) {
    const uint8_t *restrict src = w->data + (p * (w->k_pad / 64) + kb) * 512;
    int8_t *restrict dst = (int8_t *)out;
    /* symmetric INT4: z = 8 everywhere, INT4_MIN: 0; a constant row (no stores per block) */
    static const int8_t eights[64] = {8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8,
                                      8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8,
                                      8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};
    static const int8_t zeros[64] = {0};
    int8_t zero_rows[2][64];
    const int8_t *zlo = KT_INT4_MINS(w) ? zeros : eights, *zhi = zlo;
    if (w->zero) { /* the panel's 16 zero points of each half's group, 4 bytes each */
        const int64_t n0 = p * KTCY_PANEL;
        const uint8_t *zl = w->zero + KT_INT4_AT(w, kb * 64 / w->group, n0);
        const uint8_t *zh = w->zero + KT_INT4_AT(w, (kb * 64 + 32) / w->group, n0);
#if KT_AMX_REAL
        /* each byte four times: a widening and a multiply (the scalar loop was 1.4-1.5x an
         * INT4_ZP projection's time at 32 rows) */
        const __m512i four = _mm512_set1_epi32(0x01010101);
        _mm512_storeu_si512(zero_rows[0], _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)zl)), four));
        _mm512_storeu_si512(zero_rows[1], _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)zh)), four));
#else
        for (int j = 0; j < 64; ++j) {
            zero_rows[0][j] = (int8_t)zl[j / 4];
            zero_rows[1][j] = (int8_t)zh[j / 4];
        }
#endif
        zlo = zero_rows[0];
        zhi = zero_rows[1];
    }
    for (int r = 0; r < 8; ++r)
        for (int j = 0; j < 64; ++j) {
            const uint8_t byte = src[r * 64 + j];
            dst[r * 64 + j] = (int8_t)((byte & 0x0F) - zlo[j]);
            dst[512 + r * 64 + j] = (int8_t)((byte >> 4) - zhi[j]);
        }
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->group; }
KT_AI void KT_(group_cols)(const ktcy_weight *w, int64_t p, int np, int64_t g, float *s) {
    for (int q = 0; q < np; ++q) { /* a panel's 16 scales lie together, its 16 mins after them */
        const float *from = w->scale + KT_INT4_SAT(w, g, (p + q) * KTCY_PANEL);
        for (int nn = 0; nn < KTCY_PANEL; ++nn) s[q * KTCY_PANEL + nn] = from[nn];
        if (KT_INT4_MINS(w))
            for (int nn = 0; nn < KTCY_PANEL; ++nn) s[KT_AMX_MIN_COLS + q * KTCY_PANEL + nn] = from[KTCY_PANEL + nn];
    }
}
/* INT4_MIN: after group g's fold, row m adds its group sum times each column's min (group_cols
 * put them KT_AMX_MIN_COLS floats after the scales) */
#define KT_AMX_GROUP_MINS 1
KT_AI int KT_(has_mins)(const ktcy_weight *w) { return KT_INT4_MINS(w); }
KT_AI float KT_(min_row)(const ktcy_act *a, int64_t m, int64_t g, int64_t groups) {
    return (float)a->group_sum[m * groups + g];
}
#include "traits_amx_column_groups.h"

#else
#error "fmt_int4.h: no traits for this skeleton"
#endif

#undef KT_INT4_ZERO
#undef KT_INT4_MINS
#undef KT_INT4_SAT
#undef KT_INT4_AHEAD
#undef KT_INT4_FETCH_SIDE
#undef KT_INT4_AT
#undef KT_INT4_GROUPS
