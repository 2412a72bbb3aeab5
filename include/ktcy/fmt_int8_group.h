/* 8-bit grouped traits, for the descriptor rows INT8_GROUP (s8 codes, w = s * q, one symmetric
 * scale per (K group, channel): llama.cpp's Q8_0 and Q5_0 are group 32, Q6_K group 16, GPTQ's
 * 8-bit symmetric group 128) and INT8_MIN (unsigned codes u in 0..255 stored as u - 128, w = s * u
 * + min with a float min per (K group, channel): llama.cpp's Q5_K and Q5_1, group 32).  Groups
 * 16, 32, 64 or 128; the INT8 block order; scales (INT8_MIN: each panel's group holds its 16
 * scales, then its 16 mins) panel-major like INT4's (ktcy_group_index); activations int8.
 *   y[m][n] = (sum over groups g in order of acc + (float)sum_{k in g}(q_x * q_w) * s[g][n]
 *              [INT8_MIN then fused: + (float)sum_{k in g} q_x * min[g][n]]) * x_scale[m]
 * with q_w = q or u, in this order on every ISA, so all give the same bits.  Codes take the whole
 * int8 range (GPTQ's symmetric 8-bit codes reach -128).  AVX-512 VNNI multiplies the stored byte
 * plus 128 (an xor: u itself for INT8_MIN) as vpdpbusd's unsigned operand and, for INT8_GROUP,
 * takes 128 x the activation group sum off; AVX2, AVX-512 BW and AMX multiply the signed byte
 * (|w| * (a * sign w) on the vector units) and, for INT8_MIN, add 128 x the group sum.  Those are
 * exact int32 corrections.  Each row is its own variant (fmt_int8_min.h sets KT_I8G_MINS_ROW):
 * one variant serving both, with the row chosen per weight, took INT8_GROUP's M = 512 tiles on
 * AVX-512 to 2-2.5x the time (Zen 4).  Included by a skeleton instantiation; no include guard. */
#ifndef KT_I8G_MINS_ROW
#define KT_I8G_MINS_ROW 0 /* 1: the INT8_MIN row (fmt_int8_min.h) */
#endif
#if KT_I8G_MINS_ROW
#define KT_ROW KTCY_ROW_INT8_MIN
#define KT_FORMATS (1 << KTCY_FMT_INT8_MIN)
#else
#define KT_ROW KTCY_ROW_INT8_GROUP
#define KT_FORMATS (1 << KTCY_FMT_INT8_GROUP)
#endif
#include "traits_begin.h"

#define KT_I8G_GROUPS(w) ((w)->k_pad >> __builtin_ctz((unsigned)(w)->group))
#define KT_I8G_AT(w, g, n) ktcy_group_index(KT_I8G_GROUPS(w), (g), (n))
#define KT_I8G_MINS(w) ((void)(w), KT_I8G_MINS_ROW)
/* Where (group g, channel n)'s scale sits; INT8_MIN's min is 16 floats on. */
#define KT_I8G_SAT(w, g, n) (KT_I8G_MINS(w) ? 2 * KT_I8G_AT(w, g, n) - (n) % KTCY_PANEL : KT_I8G_AT(w, g, n))
/* The group sums are those of int8 codes: at most 127 x 128 in magnitude, so 128 x one fits int32. */
#define KT_I8G_SUM(a, m, w, g) ((a)->group_sum[(m) * KT_I8G_GROUPS(w) + (g)])

#if KT_SKEL == KT_SKEL_REF
KT_AI int32_t KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    return ktcy_int8_block_code(w->data, w->k_pad, p, nn, k) + (KT_I8G_MINS(w) ? 128 : 0);
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->group; }
KT_AI float KT_(group)(float acc, int32_t part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    const int64_t sat = KT_I8G_SAT(w, g, n);
    acc = acc + (float)part * w->scale[sat];
    if (KT_I8G_MINS(w)) acc = fmaf((float)KT_I8G_SUM(a, m, w, g), w->scale[sat + KTCY_PANEL], acc);
    return acc;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)w; (void)n;
    return acc * a->scale[m];
}

#elif KT_SKEL == KT_SKEL_AVX2 || KT_SKEL == KT_SKEL_AVX512
/* How far ahead the scale stream is fetched, in groups (as INT4's: past a panel's last group,
 * the next panel's first, NP - 1 rows on for a tile of NP panels).  At group 16 the scales are a
 * quarter of the code bytes: a stream of their own. */
#define KT_I8G_AHEAD 16
#define KT_I8G_FETCH_SCALES(w, sat, g, NP)                                                                   \
    do {                                                                                                     \
        const int64_t groups_ = KT_I8G_GROUPS(w);                                                            \
        const uintptr_t ahead_ = (uintptr_t)(KT_I8G_AHEAD * 16 +                                             \
                                             ((g) + KT_I8G_AHEAD >= groups_ ? ((NP) - 1) * groups_ * 16 : 0)); \
        const uintptr_t sahead_ = ahead_ * sizeof(float) * (KT_I8G_MINS(w) ? 2 : 1);                         \
        _mm_prefetch((const char *)((uintptr_t)((w)->scale + (sat)) + sahead_), _MM_HINT_T0);                \
        if (KT_I8G_MINS(w)) _mm_prefetch((const char *)((uintptr_t)((w)->scale + (sat)) + sahead_ + 64), _MM_HINT_T0); \
    } while (0)
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
/* The group ending after row r of block kb (rows hold 4 K values), or -1. */
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)nkb;
    const int64_t end = kb * 64 + (r + 1) * 4;
    if (end & (w->group - 1)) return -1;
    return (end >> __builtin_ctz((unsigned)w->group)) - 1;
}

#if KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_S8
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#include "traits_plain_rows.h"
KT_AI void KT_(group_epilogue)(__m256i acc[4][2], __m256 facc[4][2], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p, int64_t g) {
    const int mins = KT_I8G_MINS(w);
    const int64_t sat = KT_I8G_SAT(w, g, p * 16);
    KT_I8G_FETCH_SCALES(w, sat, g, NP);
    const __m256 s0 = _mm256_loadu_ps(w->scale + sat), s1 = _mm256_loadu_ps(w->scale + sat + 8);
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        if (mins) { /* sum(a * (u - 128)) + 128 x the group sum: sum(a * u), exact */
            const __m256i bias = _mm256_set1_epi32(KT_I8G_SUM(a, m0 + m, w, g) * 128);
            acc[m][0] = _mm256_add_epi32(acc[m][0], bias);
            acc[m][1] = _mm256_add_epi32(acc[m][1], bias);
        }
        facc[m][0] = _mm256_add_ps(facc[m][0], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][0]), s0));
        facc[m][1] = _mm256_add_ps(facc[m][1], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][1]), s1));
        acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    }
    if (mins) { /* the min term after the group's product, as the reference adds it */
        const __m256 n0 = _mm256_loadu_ps(w->scale + sat + 16), n1 = _mm256_loadu_ps(w->scale + sat + 24);
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            const __m256 gs = _mm256_set1_ps((float)KT_I8G_SUM(a, m0 + m, w, g));
            facc[m][0] = _mm256_fmadd_ps(gs, n0, facc[m][0]);
            facc[m][1] = _mm256_fmadd_ps(gs, n1, facc[m][1]);
        }
    }
}
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)w; (void)n0;
    return _mm256_mul_ps(facc, _mm256_set1_ps(a->scale[m]));
}

#else /* AVX-512 */
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#define KT_PLAIN_ROWS 1
#define KT_GROUP_ROWS 4 /* a group may end every 4 block rows (16 K values) */
typedef struct { int unused; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) { KT_(ctx) c = {0}; return c; }
#if KT_FAST
/* code + 128 as vpdpbusd's unsigned operand (an xor per row); the activations stay signed */
#define KT_WKIND KT_W_U8
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    out[0].v0 = _mm512_xor_si512(_mm512_loadu_si512(blk + r * 64), bias);
    out[1].v0 = _mm512_xor_si512(_mm512_loadu_si512(blk + r * 64 + 64), bias);
}
#else
#define KT_WKIND KT_W_S8
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    out[0].v0 = _mm512_loadu_si512(blk + r * 64);
    out[1].v0 = _mm512_loadu_si512(blk + r * 64 + 64);
}
#endif
/* INT8_MIN's epilogue: the exact sum(a * u) from what was multiplied (VNNI: the stored byte +
 * 128, u itself; BW: the stored byte, plus 128 x the group sum), then the min term. */
KT_AI void KT_(min_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                             const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    const int64_t groups = KT_I8G_GROUPS(w), sat0 = KT_I8G_SAT(w, g, p0 * 16);
    __m512 s[4], mn[4];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) { /* the next panel's row */
        KT_I8G_FETCH_SCALES(w, sat0 + p * groups * 32, g, NP);
        s[p] = _mm512_loadu_ps(w->scale + sat0 + p * groups * 32);
        mn[p] = _mm512_loadu_ps(w->scale + sat0 + p * groups * 32 + 16);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        const int32_t sum = KT_I8G_SUM(a, m0 + m, w, g);
        const __m512 gs = _mm512_set1_ps((float)sum);
#if !KT_FAST
        const __m512i bias = _mm512_set1_epi32(sum * 128);
#endif
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
#if KT_FAST
            const __m512i exact = acc[m][p];
#else
            const __m512i exact = _mm512_add_epi32(acc[m][p], bias);
#endif
            const __m512 f = _mm512_add_ps(facc[m][p], _mm512_mul_ps(_mm512_cvtepi32_ps(exact), s[p]));
            facc[m][p] = _mm512_fmadd_ps(gs, mn[p], f);
            acc[m][p] = _mm512_setzero_si512();
        }
    }
}
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
#if KT_I8G_MINS_ROW
    KT_(min_epilogue)(acc, facc, MB, NP, a, w, m0, p0, g);
#else
    const int64_t groups = KT_I8G_GROUPS(w), sat0 = KT_I8G_AT(w, g, p0 * 16);
    (void)a; (void)m0; (void)groups;
    __m512 s[4];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) { /* the next panel's row */
        KT_I8G_FETCH_SCALES(w, sat0 + p * groups * 16, g, NP);
        s[p] = _mm512_loadu_ps(w->scale + sat0 + p * groups * 16);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
#if KT_FAST
        const __m512i bias = _mm512_set1_epi32(KT_I8G_SUM(a, m0 + m, w, g) * 128);
#endif
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
#if KT_FAST
            const __m512i exact = _mm512_sub_epi32(acc[m][p], bias);
#else
            const __m512i exact = acc[m][p];
#endif
            facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(_mm512_cvtepi32_ps(exact), s[p]));
            acc[m][p] = _mm512_setzero_si512();
        }
    }
#endif
}
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)w; (void)n0;
    return _mm512_mul_ps(facc, _mm512_set1_ps(a->scale[m]));
}
#endif
#undef KT_I8G_AHEAD
#undef KT_I8G_FETCH_SCALES

#elif KT_SKEL == KT_SKEL_AMX
KT_AI const uint8_t *KT_(prepare_b)(const ktcy_weight *w, int64_t p, int np, uint8_t *buf) {
    (void)np; (void)buf;
    return w->data + p * (w->k_pad / 64) * 1024; /* the packed block is the B tile */
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->group; }
KT_AI void KT_(group_cols)(const ktcy_weight *w, int64_t p, int np, int64_t g, float *s) {
    for (int q = 0; q < np; ++q) { /* INT8_MIN: a panel's 16 scales lie together, its 16 mins after them */
        const float *from = w->scale + KT_I8G_SAT(w, g, (p + q) * KTCY_PANEL);
        for (int nn = 0; nn < KTCY_PANEL; ++nn) s[q * KTCY_PANEL + nn] = from[nn];
        if (KT_I8G_MINS(w))
            for (int nn = 0; nn < KTCY_PANEL; ++nn) s[KT_AMX_MIN_COLS + q * KTCY_PANEL + nn] = from[KTCY_PANEL + nn];
    }
}
#if KT_I8G_MINS_ROW
/* INT8_MIN: the tiles multiply the stored byte u - 128, so each row adds 128 x its group sum to
 * the group's int32 sums (sum(a * u), exact), then its group sum times each column's min */
#define KT_AMX_GROUP_MINS 1
#define KT_AMX_CODE_BIAS 1
KT_AI int KT_(has_mins)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI float KT_(min_row)(const ktcy_act *a, int64_t m, int64_t g, int64_t groups) {
    return (float)a->group_sum[m * groups + g];
}
KT_AI int32_t KT_(code_bias_row)(const ktcy_act *a, int64_t m, int64_t g, int64_t groups) {
    return a->group_sum[m * groups + g] * 128;
}
#endif
#include "traits_amx_column_groups.h"

#else
#error "fmt_int8_group.h: no traits for this skeleton"
#endif

#undef KT_I8G_MINS_ROW
#undef KT_I8G_SUM
#undef KT_I8G_SAT
#undef KT_I8G_MINS
#undef KT_I8G_AT
#undef KT_I8G_GROUPS
