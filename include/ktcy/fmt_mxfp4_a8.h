/* MXFP4_A8 traits: MXFP4's codes and E8M0 exponents (the same bytes, pack.h) multiplied by int8
 * activations instead of bf16.  Twice an E2M1 value is an integer in [-12, 12], so the codes are
 * exact int8 weights: each 32-K block's dot product is an exact int32, taken to the true partial
 * sum's size by the row's activation scale and the 1/2 first, then by its channel's 2^(e - 127):
 *   t[m] = x_scale[m] * 0.5;   y[m][n] = sum over blocks g in order of
 *          fma((float)sum_{k in g}(q_x * 2 e2m1) * t[m], 2^(e[g][n] - 127), acc)
 * (in that order: |sum| <= 32 x 127 x 12 < 2^16, so times 2^(e - 127) first it would overflow
 * float for e above about 240, and 2^(e - 127) * t near E8M0's bottom would fall below float's
 * normal range.  A product by a power of two is exact, so the fused multiply-add rounds as a
 * multiply and an add would wherever that product is a normal float (below, it rounds once
 * where they would twice; past float's top it keeps a finite sum they would make infinite), and
 * saves an operation per 8 sums.)  Integer kernels, so every ISA gives the same bits.
 * Why a second MXFP4 format: AVX2 has no bf16 dot product, and
 * MXFP4 with bf16 activations spends about 13 vector operations per 32 weights there (lookup,
 * widening, two FMAs per pair); vpmaddubsw multiplies 32 byte pairs in one.  What it costs: the
 * activations' int8 rounding (per row, as INT8 and INT4): a MoE output 1.5-2.5% from float64 on
 * the same weights with Gaussian activations, more with outlier channels, where bf16 activations
 * keep 0.3%.  Included by a skeleton instantiation; no include guard. */
#include <math.h>

#define KT_ROW KTCY_ROW_MXFP4_A8
#define KT_FORMATS (1 << KTCY_FMT_MXFP4_A8)
#include "traits_begin.h"

/* Sub-block (32 K) s of panel p. */
#define KT_A8_SUB(w, p, s) ((w)->data + ((p) * ((w)->k_pad / KTCY_E2M1_SUB_K) + (s)) * KTCY_E2M1_SUB_BYTES)

#if KT_SKEL == KT_SKEL_REF || KT_SKEL == KT_SKEL_AMX
/* 2^(e - 127) of channel nn in sub-block s, e clamped as MXFP4's is (a block of zeros may carry
 * any exponent; scaling its zero sum by 2^128 would make NaN). */
KT_AI float KT_(block_scale)(const ktcy_weight *w, int64_t p, int64_t s, int64_t nn) {
    const uint32_t e = KT_A8_SUB(w, p, s)[256 + nn];
    return ktcy_bits_f32((e > 254 ? 254 : e) << 23);
}
/* 2 e2m1 + 12 of code c: the lookup table of every path (the vector ones keep the + 12). */
static const int8_t KT_(biased)[16] = {KTCY_E2M1_TWICE_BIASED};
KT_AI int32_t KT_(code2)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    const uint8_t *sub = KT_A8_SUB(w, p, k / KTCY_E2M1_SUB_K);
    const int64_t ks = k % KTCY_E2M1_SUB_K, r = ks >> 1;
    const uint8_t byte = sub[(r >> 1) * 32 + nn * 2 + (ks & 1)];
    return KT_(biased)[(r & 1) ? byte >> 4 : byte & 15] - 12; /* twice the E2M1 value, exact */
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { (void)w; return KTCY_E2M1_SUB_K; }
/* A block's int32 sum c of output (m, n) folded into acc, as every ISA does it (see the top). */
KT_AI float KT_(fold)(float acc, int32_t c, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n, int64_t g) {
    return fmaf((float)c * (a->scale[m] * 0.5f), KT_(block_scale)(w, n / KTCY_PANEL, g, n % KTCY_PANEL), acc);
}
#endif

#if KT_SKEL == KT_SKEL_REF
KT_AI int32_t KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) { return KT_(code2)(w, p, nn, k); }
KT_AI float KT_(group)(float acc, int32_t part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    return KT_(fold)(acc, part, a, m, w, n, g);
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)a; (void)w; (void)m; (void)n;
    return acc;
}

#elif KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_U8
/* Many rows: each panel unpacked once to bytes (the INT8 block order, halves as wrow leaves
 * them); a few rows unpack each weight row in registers. */
#define KT_PREDECODE 1
#define KT_REG_DECODE 1
#define KT_HAS_WROW 1
#define KT_LANE_SPLIT 1
/* The weights are 2 e2m1 + 12 in [0, 24]: a vpmaddubsw pair is up to 2 x 24 x 127, and a block's
 * 8 rows add up past what int16 holds (to 48768).  Each word's sums start from -12 x the activations it
 * meets (ktcy_act_e2m1_starts, in a->group_sum), so a block's sums end as those of 2 e2m1 alone,
 * at most 16 x 12 x 127 = 24384 in size: the wrapping int16 adds give them exactly, one widening
 * and no bias per block (the + 12 bias widened twice per block before: MoE T = 512 0.92x the time). */
#define KT_ACC16_ROWS 8
#define KT_ACC16_START 1 /* needs KT_ACC16_ONE_ROW below: every tile on the centred int16 sums */
KT_AI __m256i KT_(acc16_start)(const ktcy_act *a, int64_t m, int64_t kb, int r) {
    return _mm256_set1_epi32(a->group_sum[m * (a->k_pad / KTCY_E2M1_SUB_K) + 2 * kb + (r >> 3)]);
}
/* and one-row tiles add them in int16 too (single GEMM M=1 from cache 1.07-1.09x the rate; INT4,
 * whose rows decode in 2 operations, measured 2-7% slower that way) */
#define KT_ACC16_ONE_ROW 1
/* Row r (K 4r'..4r'+3 of sub-block r >> 3, r' = r & 7): 32 bytes hold K pair (0, 1) of each
 * channel in the low nibbles and (2, 3) in the high ones.  vpshufb looks both up as 2 e2m1 + 12
 * (the zero point folds into the activation block sums, as INT4's 8 does), and a word unpack
 * joins each channel's two pairs into the dword vpmaddubsw + vpmaddwd sum: channels 0-3, 8-11
 * in half 0 and 4-7, 12-15 in half 1 (KT_LANE_SPLIT). */
KT_AI void KT_(wrow)(const uint8_t *blk, int r, kt_w256 out[2]) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + (r >> 3) * KTCY_E2M1_SUB_BYTES + (r & 7) * 32));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i lut = _mm256_setr_epi8(KTCY_E2M1_TWICE_BIASED, KTCY_E2M1_TWICE_BIASED);
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, nib));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib));
    out[0] = kt_int_half(_mm256_unpacklo_epi16(lo, hi));
    out[1] = kt_int_half(_mm256_unpackhi_epi16(lo, hi));
}
KT_AI void KT_(decode_panels)(const uint8_t *src, uint8_t *dst, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b, src += KT_BB, dst += 1024)
        _Pragma("GCC unroll 16")
        for (int r = 0; r < 16; ++r) {
            kt_w256 v[2];
            KT_(wrow)(src, r, v);
            _mm256_storeu_si256((__m256i *)(dst + r * 64), v[0].i);
            _mm256_storeu_si256((__m256i *)(dst + r * 64 + 32), v[1].i);
        }
}
/* A group (an E8M0 block) ends after rows 7 and 15. */
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w; (void)nkb;
    return r == 7 ? 2 * kb : r == 15 ? 2 * kb + 1 : -1;
}
KT_AI void KT_(group_epilogue)(__m256i acc[4][2], __m256 facc[4][2], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p, int64_t g) {
    (void)NP; /* the exponents lie in the code stream */
    const __m256 s[2] = {kt_e8m0_half(KT_A8_SUB(w, p, g) + 256, 0), kt_e8m0_half(KT_A8_SUB(w, p, g) + 256, 1)};
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        const __m256 t = _mm256_set1_ps(a->scale[m0 + m] * 0.5f);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; ++h) {
            const __m256 part = _mm256_cvtepi32_ps(acc[m][h]); /* centred by the int16 starts */
            facc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(part, t), s[h], facc[m][h]);
            acc[m][h] = _mm256_setzero_si256();
        }
    }
}
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)a; (void)w; (void)m; (void)n0;
    return facc;
}

#elif KT_SKEL == KT_SKEL_AVX512
#define KT_WKIND KT_W_U8
/* Calls of 1-2 rows stream one panel at a time where the CPU prefers it (registry.h).  A Zen 4,
 * one projection from memory, one thread: M = 1 0.82-0.88x the time of four panels, M = 2 0.93x,
 * M = 4 1.02x (from cache M = 1 1.06x: four panels' independent chains help only there). */
#define KT_ONE_PANEL_ROWS(a) ((a)->tiles.e2m1_panel_rows < 2 ? (a)->tiles.e2m1_panel_rows : 2)
/* Many rows: a group's first row tile keeps the rows it decodes and the others load them (the
 * decode is 4 operations per row of a panel, against 4 dot products in a 4-row tile; with the
 * decode before this one, 7 per row pair: one projection at M = 512 0.70x the time, MoE T = 512
 * 0.76x).  Always fused: no decode_panels. */
#define KT_PREDECODE 1
#define KT_REG_DECODE 1
#define KT_FUSED_PREDECODE 1
/* Prefill tiles of 4 rows x 4 panels, not 6: the 6-row tile's 24 sums, 4 weight rows, the
 * broadcast and GCC's zero register passed the 32 vector registers, and 4-5 sums went through
 * the stack at every dot product.  A Xeon with AMX, one 1536 x 2048 projection (VBMI, one
 * thread): M = 32 0.92x the time, M = 512 0.92-0.94x, M = 1-7 the same; MoE T = 512 (128
 * experts, about 32 rows each, all on AVX-512) 0.93x.  Same bits.  INT4's 6-row tiles (which
 * reload their shared bytes) took 1.09-1.10x the time with 4 rows, so they stay.  (The VNNI variant
 * without VBMI runs the same tile, not measured apart; the F/BW one had 4 rows already.) */
#define KT_MAX_ROWS 4
typedef kt_e2m1_vbmi KT_(ctx); /* the table; the byte picks serve VBMI only */
KT_AI KT_(ctx) KT_(make_ctx)(void) { return kt_e2m1_vbmi_make(); }
/* Row r (quad r & 7 of sub-block r >> 3, 32 bytes: channel j's bytes 2j, 2j + 1 hold K 0, 1 in
 * their low nibbles and K 2, 3 in their high ones) as 16 dwords of 2 e2m1 + 12, channels in
 * order: each byte pair widened to a dword, the pair again 12 bits up puts the high nibbles at
 * bytes 2 and 3, and one table lookup finishes.  A widening per row costs port 5 less than the
 * two-source word permute it replaced (one projection from cache: M = 1 0.92x the time, M = 4
 * 0.89x, M = 8 0.79x). */
KT_AI __m512i KT_(row)(const KT_(ctx) *c, const uint8_t *blk, int r) {
    const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + (r >> 3) * KTCY_E2M1_SUB_BYTES + (r & 7) * 32)));
    const __m512i nibbles = _mm512_ternarylogic_epi32(pairs, _mm512_slli_epi32(pairs, 12), _mm512_set1_epi8(0x0F), 0xA8); /* (a | b) & c */
    return _mm512_shuffle_epi8(c->lut, nibbles);
}
/* With VBMI, one operation fewer per row (kt_e2m1_quad_vbmi).  One projection from cache: M = 1
 * 0.84x the time, M = 2 0.80x, M = 4-8 the same; MoE T = 1 0.92x, T = 512 0.93x. */
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
#if KT_VBMI
    _Pragma("GCC unroll 2")
    for (int u = 0; u < 2; ++u) out[u].v0 = kt_e2m1_quad_vbmi(c, blk + (r >> 3) * KTCY_E2M1_SUB_BYTES + ((r + u) & 7) * 32);
#else
    out[0].v0 = KT_(row)(c, blk, r);
    out[1].v0 = KT_(row)(c, blk, r + 1);
#endif
}
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w; (void)nkb;
    return r == 7 ? 2 * kb : r == 15 ? 2 * kb + 1 : -1;
}
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    __m512 s[4];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) {
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(KT_A8_SUB(w, p0 + p, g) + 256)));
        s[p] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_min_epu32(e, _mm512_set1_epi32(254)), 23));
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        /* -12 x the block's activation sum: the two words of its AVX2 starts, added */
        const __m512i centre = _mm512_madd_epi16(
            _mm512_set1_epi32(a->group_sum[(m0 + m) * (a->k_pad / KTCY_E2M1_SUB_K) + g]), _mm512_set1_epi16(1));
        const __m512 t = _mm512_set1_ps(a->scale[m0 + m] * 0.5f);
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
            const __m512 part = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[m][p], centre));
            facc[m][p] = _mm512_fmadd_ps(_mm512_mul_ps(part, t), s[p], facc[m][p]);
            acc[m][p] = _mm512_setzero_si512();
        }
    }
}
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)a; (void)w; (void)m; (void)n0;
    return facc;
}

#elif KT_SKEL == KT_SKEL_AMX
/* Block kb of panel p as signed int8 blocks of 2 e2m1 (the INT8 tile layout). */
#define KT_AMX_DECODE_B 1
KT_AI void KT_(decode_b_block)(const ktcy_weight *w, int64_t p, int64_t kb, uint8_t *out) {
    int8_t *dst = (int8_t *)out;
#if KT_AMX_REAL
    /* Real tiles come with AVX-512 BW.  Tile row r of a 64-K block is row r % 8 of sub-block
     * r / 8: its 32 bytes hold channel nn's K pair (4 (r % 8), + 1) in the low nibbles of bytes
     * 2 nn, 2 nn + 1 and the next pair in the high ones.  vpshufb looks both nibbles up (2 e2m1),
     * and vpermw interleaves the byte pairs: low pair nn, high pair nn. */
    const __m256i twice = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                           0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _Pragma("GCC unroll 2")
    for (int half = 0; half < 2; ++half) {
        const uint8_t *sub = KT_A8_SUB(w, p, 2 * kb + half);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; ++r) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(sub + r * 32));
            const __m256i low = _mm256_shuffle_epi8(twice, _mm256_and_si256(bytes, _mm256_set1_epi8(15)));
            const __m256i high = _mm256_shuffle_epi8(twice, _mm256_and_si256(_mm256_srli_epi16(bytes, 4),
                                                                             _mm256_set1_epi8(15)));
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
            _mm512_storeu_si512(dst + half * 512 + r * 64, _mm512_permutexvar_epi16(order, both));
        }
    }
#else
    for (int64_t nn = 0; nn < KTCY_PANEL; ++nn)
        for (int64_t kk = 0; kk < KT_BK; ++kk)
            dst[ktcy_int8_offset(nn, kk)] = (int8_t)KT_(code2)(w, p, nn, kb * KT_BK + kk);
#endif
}
/* KT_(fold) split into its column factor (the block's power of two) and row factor. */
KT_AI void KT_(group_cols)(const ktcy_weight *w, int64_t p, int np, int64_t g, float *s) {
    for (int q = 0; q < np; ++q) /* a panel's 16 exponents at a time: one vector */
        for (int nn = 0; nn < KTCY_PANEL; ++nn) s[q * KTCY_PANEL + nn] = KT_(block_scale)(w, p + q, g, nn);
}
KT_AI float KT_(group_row)(const ktcy_act *a, int64_t m) { return a->scale[m] * 0.5f; }
KT_AI float KT_(tile_group)(float acc, int32_t c, float r, float s) { return fmaf((float)c * r, s, acc); }
KT_AI void KT_(final_cols)(const ktcy_weight *w, int64_t p, int np, float *t) {
    (void)w; (void)p;
    for (int j = 0; j < 16 * np; ++j) t[j] = 1.0f;
}
KT_AI float KT_(final_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
KT_AI float KT_(tile_final)(float acc, float r, float t) { (void)r; (void)t; return acc; }

#else
#error "fmt_mxfp4_a8.h: no traits for this skeleton"
#endif

#undef KT_A8_SUB
