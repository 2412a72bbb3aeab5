/* MXFP4 traits (OCP microscaling, as GPT-OSS stores its experts): E2M1 codes with one E8M0
 * power-of-two scale per channel and 32 K values, kept inside each packed block (pack.h).
 * A code times its scale is exactly a bf16 value (packing guarantees the exponent range), so
 * the AMX and portable paths and AVX-512 prefill decode to bf16 with the scale folded in - a
 * table lookup and an add to the exponent field - and multiply bf16 activations with float
 * sums, as for BF16: no group epilogue, and the only rounding is the activations' (why bf16 and
 * not int8 activations: the weights are exact this way, and int8 activations would add their
 * ~1-3% error on top).  AVX2, and AVX-512 decode with AVX512-BF16 (up to 4 rows), decode the
 * unscaled codes and scale each 32-K block's float partial sums by the power of two instead:
 * exact too, and two operations fewer per 32 values (AVX-512 T=1 0.85x the time).  The sums then
 * round in another order than prefill's, as BF16's and FP8's paths may (docs/scaling.md).
 * Packing checks the exponents of blocks holding a non-zero code only, so a block of zeros may
 * carry any, 255 included: scaling its zero sum by 2^128 = inf would make NaN, hence the
 * exponent is clamped to 254 where sums are scaled (no exponent in use is above 252).
 * Included by a skeleton instantiation; no include guard. */
#define KT_ROW KTCY_ROW_MXFP4
#define KT_FORMATS (1 << KTCY_FMT_MXFP4)
#include "traits_begin.h"

/* Code and scale of K offset kin (0..31) of channel nn in one block. */
static inline uint16_t KT_(value)(const uint8_t *blk, int64_t nn, int64_t kin) {
    const int64_t r = kin >> 1;
    const uint8_t byte = blk[(r >> 1) * 32 + nn * 2 + (kin & 1)];
    return ktcy_mxfp4_to_bf16((r & 1) ? byte >> 4 : byte & 15, blk[256 + nn]);
}

/* One block -> a 1024-byte bf16 block (the BF16 pair order), one value at a time. */
static inline void KT_(decode_scalar)(const uint8_t *blk, uint8_t *dst) {
    uint16_t *out = (uint16_t *)dst;
    for (int64_t r = 0; r < 16; ++r)
        for (int64_t j = 0; j < 32; ++j) out[r * 32 + j] = KT_(value)(blk, j >> 1, 2 * r + (j & 1));
}

#if KT_SKEL == KT_SKEL_REF
KT_AI float KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    return ktcy_bf16_to_f32(KT_(value)(w->data + (p * (w->k_pad / 32) + k / 32) * 272, nn, k % 32));
}

#elif KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0 /* prefill decodes each panel to floats once (the skeleton's float path) */
#define KT_REG_DECODE 1
/* Row r in registers: the row's nibble of every byte (low for even r, high for odd) is looked
 * up twice by vpshufb, as the low and as the high byte of the E2M1 value's bf16, and in-lane
 * byte unpacks join them into bf16 pairs (even K element low), which a shift and a mask widen to
 * floats exactly.  The unpacks leave channels 0-3, 8-11 in half 0 and 4-7, 12-15 in half 1
 * (KT_LANE_SPLIT: the skeleton restores the order at the store, group_scale follows it).  No
 * vcvtph2ps and no lane extracts: 9 operations per 32 values instead of 13.  The channel's
 * power-of-two scale multiplies each block's partial sums instead (group_scale below). */
#define KT_HAS_WROW 1
#define KT_LANE_SPLIT 1
/* One row: 4 panels per tile, 8 FMA chains (a one-thread 768 x 2048 GEMM reads 14.2 GB/s where 2
 * panels read 11.5; FP8 and BF16 measured no faster with 4). */
#define KT_ONE_ROW_PANELS 4
KT_AI void KT_(wrow)(const uint8_t *blk, int r, kt_w256 out[2]) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + (r >> 1) * 32));
    const __m256i codes = _mm256_and_si256((r & 1) ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
    /* KTCY_E2M1_TO_BF16 split into its low and high bytes, once per 128-bit lane */
    const __m256i bf16_lo = _mm256_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                             0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                             0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                             0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0);
    const __m256i bf16_hi = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                             (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0,
                                             (char)0xC0, (char)0xC0,
                                             0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                             (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0,
                                             (char)0xC0, (char)0xC0);
    const __m256i lo = _mm256_shuffle_epi8(bf16_lo, codes), hi = _mm256_shuffle_epi8(bf16_hi, codes);
    out[0] = kt_bf16_split(_mm256_unpacklo_epi8(lo, hi)); /* channels 0-3 | 8-11 */
    out[1] = kt_bf16_split(_mm256_unpackhi_epi8(lo, hi)); /* channels 4-7 | 12-15 */
}
/* Every block is a group: 2^(e - 127) of 8 channels (half h of panel p, block g), exact (the
 * packing keeps e in the normal range where a code is non-zero; clamped for blocks of zeros). */
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w; (void)nkb;
    return r == 15 ? kb : -1;
}
KT_AI __m256 KT_(group_scale)(const ktcy_weight *w, int64_t p, int64_t g, int h) {
    return kt_e8m0_half(w->data + (p * (w->k_pad / 32) + g) * 272 + 256, h);
}
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)acc; (void)a; (void)w; (void)m; (void)n0;
    return facc;
}
/* Calls of a few rows (decode) on 16-bit integers (a->tiles.avx2_i16_rows, registry.h), as
 * AVX-512's path below computes them, bit for bit: MXFP4_A8's row decode (vpshufb lookups of
 * 2 e2m1 + 12, channels split as KT_LANE_SPLIT), the codes widened to words, and vpmaddwd of each
 * word pair (one channel, two K elements) with the pair of the row's q (kt_mxfp4_i16_rows, words):
 * the block's exact sum of code x q in int32 (at most 32 x 24 x 32640).  Per K quad and row that
 * is 4 multiplies and 4 adds where the high and low bytes of q took 4 vpmaddubsw, 2 vpmaddwd and 5
 * adds, for 2 more unpacks per quad shared by the rows: one projection 768 x 2048 on a Zen 4 forced
 * to AVX2, one thread, from L3 and from memory, M = 1 0.93-0.95x, 2 0.95-0.97x, 3 0.87x, 4 0.88-0.89x
 * the time; a MoE layer T = 1, 4, 16, 32 0.95x, 0.98x, 0.92x, 0.95x. */
#define KT_FEW_ROWS 1
#define KT_FEW_ROWS_CHOICE(a) ((a)->tiles.avx2_i16_rows)
/* NP panels (1-2) from p0 for MB rows of r, into y (rows ldy apart). */
KT_AI void KT_(i16_tile)(const int MB, const int NP, int64_t p0, ktcy_span cont, const ktcy_weight *w, float *y,
                         int64_t ldy, kt_i16_rows r) {
    const int64_t nkb = w->k_pad / 32, k_pad = w->k_pad;
    const __m256i nib = _mm256_set1_epi8(0x0F), lut = _mm256_setr_epi8(KTCY_E2M1_TWICE_BIASED, KTCY_E2M1_TWICE_BIASED);
    __m256i acc[4][2][2];
    __m256 facc[4][2][2];
    const uint8_t *panel[2];
    _Pragma("GCC unroll 2")
    for (int p = 0; p < NP; ++p) {
        panel[p] = w->data + (p0 + p) * nkb * KT_BB;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m)
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                acc[m][p][h] = _mm256_setzero_si256();
                facc[m][p][h] = _mm256_setzero_ps();
            }
    }
    for (int64_t g = 0; g < nkb; ++g) {
        uintptr_t fetch[2];
        _Pragma("GCC unroll 2")
        for (int p = 0; p < NP; ++p) fetch[p] = ktcy_stream_ahead(cont, p, panel[p], g, nkb, KT_AHEAD, KT_BB);
        _Pragma("GCC unroll 8")
        for (int j = 0; j < 8; ++j) {
            _Pragma("GCC unroll 2")
            for (int p = 0; p < NP; ++p) {
                _mm_prefetch((const char *)(fetch[p] + (uintptr_t)(j * (KT_BB / 8))), _MM_HINT_T0);
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(panel[p] + g * KT_BB + j * 32));
                /* the low nibbles: each channel's K elements 0, 1 of the quad; the high ones 2, 3 */
                const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, nib));
                const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib));
                const __m256i zero = _mm256_setzero_si256();
                const __m256i wv[2][2] = {{_mm256_unpacklo_epi8(lo, zero), _mm256_unpacklo_epi8(hi, zero)},
                                          {_mm256_unpackhi_epi8(lo, zero), _mm256_unpackhi_epi8(hi, zero)}};
                _Pragma("GCC unroll 4")
                for (int m = 0; m < MB; ++m) {
                    int32_t q2[2];
                    memcpy(q2, r.rows + m * 2 * k_pad + (g * 32 + 4 * j) * 2, 8);
                    const __m256i a01 = _mm256_set1_epi32(q2[0]), a23 = _mm256_set1_epi32(q2[1]);
                    _Pragma("GCC unroll 2")
                    for (int h = 0; h < 2; ++h) {
                        acc[m][p][h] = _mm256_add_epi32(acc[m][p][h], _mm256_add_epi32(_mm256_madd_epi16(wv[h][0], a01),
                                                                                        _mm256_madd_epi16(wv[h][1], a23)));
                        KT_KEEP(acc[m][p][h]); /* one chain per sum: no tree of partial sums to spill */
                    }
                }
            }
        }
        _Pragma("GCC unroll 2")
        for (int p = 0; p < NP; ++p)
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                const __m256 s = kt_e8m0_half(panel[p] + g * KT_BB + 256, h);
                _Pragma("GCC unroll 4")
                for (int m = 0; m < MB; ++m) {
                    const __m256i dot = _mm256_sub_epi32(acc[m][p][h], _mm256_set1_epi32(r.bias[m * nkb + g]));
                    facc[m][p][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(r.t[m * nkb + g])),
                                                    s, facc[m][p][h]);
                    acc[m][p][h] = _mm256_setzero_si256();
                }
            }
    }
    _Pragma("GCC unroll 2")
    for (int p = 0; p < NP; ++p) {
        const int64_t n0 = (p0 + p) * 16;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m) kt_store16(y + m * ldy + n0, w->n - n0, facc[m][p], 1);
    }
}
/* One or two rows take two panels per tile (twice the streams and chains), more one. */
KT_AI int KT_(few_rows)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb, int64_t pe,
                        void *scratch) {
    const kt_i16_rows r = kt_mxfp4_i16_rows(a, w->k_pad, 1, scratch);
    if (!*r.made) return 0;
    KT_FEW_ROWS_SWEEP(KT_(i16_tile), 2, 1, a, w, pb, pe, w, y, ldy, r)
    return 1;
}

#elif KT_SKEL == KT_SKEL_AVX512
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 1
#define KT_REG_DECODE KT_FAST
/* One-row calls of the in-register decode stream one panel at a time where the CPU prefers it
 * (registry.h).  A Zen 4, one projection from memory, one thread: M = 1 0.91x the time of four
 * panels, M = 2 1.17x (from cache M = 1 1.08x). */
#define KT_ONE_PANEL_ROWS(a) (KT_REG_DECODE && (a)->tiles.e2m1_panel_rows ? 1 : 0)
typedef struct { __m512i lut, pairs; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) {
    KT_(ctx) c;
    uint16_t lut[32], pairs[32];
    for (int i = 0; i < 32; ++i) { lut[i] = KTCY_E2M1_TO_BF16[i & 15]; pairs[i] = (uint16_t)(i >> 1); }
    c.lut = _mm512_loadu_si512(lut);
    c.pairs = _mm512_loadu_si512(pairs);
    return c;
}
/* Rows r, r+1 (r even): 32 bytes widened to words once, each nibble looked up as bf16 by
 * vpermw, which reads only an index's low 5 bits: the 32-entry table repeats the 16 values, so
 * the low nibble needs no mask and the high one only the word shift.  The channel's
 * power-of-two scale multiplies each block's partial sums (group_epilogue). */
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + (r >> 1) * 32)));
    out[0].v0 = _mm512_permutexvar_epi16(words, c->lut);
    out[1].v0 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), c->lut);
}
/* Prefill's predecoded blocks carry the scales instead: each channel's exponent added to the
 * exponent field of its non-zero values.  (Per-block scaling there cost T=512 1.15x the time:
 * a 6 x 4 tile's 24 float sums go through the stack at every block end.) */
#define KT_PRE_SCALED 1
KT_AI void KT_(rows_scaled)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    const __m512i e16 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 256))));
    const __m512i shift = _mm512_slli_epi16(_mm512_sub_epi16(_mm512_permutexvar_epi16(c->pairs, e16), _mm512_set1_epi16(127)), 7);
    KT_(rows)(c, blk, r, out);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h)
        out[h].v0 = _mm512_mask_add_epi16(out[h].v0, _mm512_test_epi16_mask(out[h].v0, _mm512_set1_epi16(0x7FFF)),
                                          out[h].v0, shift);
}
KT_AI int KT_(has_groups)(const ktcy_weight *w) { (void)w; return 1; }
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w; (void)nkb;
    return r == 15 ? kb : -1;
}
/* Block g's sums times 2^(e - 127) of each channel: exact (packing keeps e in the normal range
 * where a code is non-zero; clamped for blocks of zeros, see the top of this file). */
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    (void)a; (void)m0;
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) {
        const uint8_t *e8 = w->data + ((p0 + p) * (w->k_pad / 32) + g) * 272 + 256;
        const __m512i e = _mm512_min_epu32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e8)), _mm512_set1_epi32(254));
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(acc[m][p], s));
            acc[m][p] = _mm512_setzero_ps();
        }
    }
}
/* Decode tiles end with their sums in facc (acc zero), prefill's in acc (facc zero). */
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)a; (void)w; (void)m; (void)n0;
    return _mm512_add_ps(acc, facc);
}
KT_AI void KT_(decode_panels)(const KT_(ctx) *c, const uint8_t *src, uint8_t *dst, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b)
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 16; r += 2) {
            kt_vec2 rows[2];
            KT_(rows_scaled)(c, src + b * 272, r, rows);
            _mm512_storeu_si512(dst + b * 1024 + r * 64, rows[0].v0);
            _mm512_storeu_si512(dst + b * 1024 + r * 64 + 64, rows[1].v0);
        }
}

#if KT_VBMI
/* Calls of a few rows (decode) on 16-bit integers where vdpbf16ps is dear (a->tiles.i16_rows, a per-CPU
 * choice, registry.h): the same bf16 activations, each 32-K block of a row as the integers q of
 * kt_mxfp4_i16_rows, whose high and low bytes meet the codes as 2 e2m1 + 12 in one vpdpbusd each
 * (the codes are the unsigned operand for the high byte, the signed one for the low: [0, 24] is
 * both).  A block's dot product with twice the E2M1 values is then the exact int32
 * 256 hi + lo - 12 sum(q), below 2^24 in size (32 x 32640 x 12), so exact as a float too, and it
 * is folded as MXFP4_A8 folds its blocks: times 2^(F - 142), then a multiply-add by 2^(e - 127).
 * The decode is MXFP4_A8's (kt_e2m1_quad_vbmi): 2 byte permutes and a shift per 64 codes, where
 * the bf16 tiles take a widening, 2 word permutes and 2 vdpbf16ps of 4 FMAs each on a Xeon. */
#define KT_FEW_ROWS 1
#define KT_FEW_ROWS_CHOICE(a) ((a)->tiles.i16_rows)
/* NP panels from p0 for MB rows of r, into y (rows ldy apart). */
KT_AI void KT_(i16_tile)(const int MB, const int NP, int64_t p0, ktcy_span cont, const ktcy_weight *w, float *y,
                         int64_t ldy, kt_i16_rows r) {
    const int64_t nkb = w->k_pad / 32, k_pad = w->k_pad;
    const kt_e2m1_vbmi c = kt_e2m1_vbmi_make();
    __m512i acc_hi[4][4], acc_lo[4][4];
    __m512 facc[4][4];
    const uint8_t *panel[4];
    _Pragma("GCC unroll 4")
    for (int p = 0; p < NP; ++p) {
        panel[p] = w->data + (p0 + p) * nkb * KT_BB;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m) {
            acc_hi[m][p] = acc_lo[m][p] = _mm512_setzero_si512();
            facc[m][p] = _mm512_setzero_ps();
        }
    }
    for (int64_t g = 0; g < nkb; ++g) {
        uintptr_t fetch[4];
        _Pragma("GCC unroll 4")
        for (int p = 0; p < NP; ++p) fetch[p] = ktcy_stream_ahead(cont, p, panel[p], g, nkb, KT_AHEAD, KT_BB);
        _Pragma("GCC unroll 8")
        for (int j = 0; j < 8; ++j) {
            __m512i wq[4];
            _Pragma("GCC unroll 4")
            for (int p = 0; p < NP; ++p) {
                _mm_prefetch((const char *)(fetch[p] + (uintptr_t)(j * (KT_BB / 8))), _MM_HINT_T0);
                wq[p] = kt_e2m1_quad_vbmi(&c, panel[p] + g * KT_BB + j * 32);
            }
            _Pragma("GCC unroll 4")
            for (int m = 0; m < MB; ++m) {
                int32_t h4, l4;
                memcpy(&h4, r.rows + m * 2 * k_pad + g * 32 + 4 * j, 4);
                memcpy(&l4, r.rows + m * 2 * k_pad + k_pad + g * 32 + 4 * j, 4);
                const __m512i ah = _mm512_set1_epi32(h4), al = _mm512_set1_epi32(l4);
                _Pragma("GCC unroll 4")
                for (int p = 0; p < NP; ++p) {
                    acc_hi[m][p] = _mm512_dpbusd_epi32(acc_hi[m][p], wq[p], ah);
                    acc_lo[m][p] = _mm512_dpbusd_epi32(acc_lo[m][p], al, wq[p]);
                }
            }
        }
        __m512 s[4];
        _Pragma("GCC unroll 4")
        for (int p = 0; p < NP; ++p) {
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(panel[p] + g * KT_BB + 256)));
            s[p] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_min_epu32(e, _mm512_set1_epi32(254)), 23));
        }
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m) {
            const __m512 tm = _mm512_set1_ps(r.t[m * nkb + g]);
            const __m512i bm = _mm512_set1_epi32(r.bias[m * nkb + g]);
            _Pragma("GCC unroll 4")
            for (int p = 0; p < NP; ++p) {
                const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(acc_hi[m][p], 8), acc_lo[m][p]), bm);
                facc[m][p] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), tm), s[p], facc[m][p]);
                acc_hi[m][p] = acc_lo[m][p] = _mm512_setzero_si512();
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int p = 0; p < NP; ++p) {
        const int64_t n0 = (p0 + p) * 16, valid = w->n - n0 < 16 ? w->n - n0 : 16;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + n0, (__mmask16)((1u << valid) - 1u), facc[m][p]);
    }
}
KT_AI int KT_(few_rows)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb, int64_t pe,
                        void *scratch) {
    const kt_i16_rows r = kt_mxfp4_i16_rows(a, w->k_pad, 0, scratch);
    if (!*r.made) return 0;
    KT_FEW_ROWS_SWEEP(KT_(i16_tile), 4, 2, a, w, pb, pe, w, y, ldy, r) /* 4 x 4: 48 accumulators */
    return 1;
}
#endif

#elif KT_SKEL == KT_SKEL_AMX
/* Block kb of panel p decoded to a bf16 tile block (the BF16 tile layout). */
#define KT_AMX_DECODE_B 1
#define KT_AMX_DECODE_IN_LOOP 1 /* bf16 tiles: decoded while the TDPs run (gemm_amx_tpl.h) */
KT_AI void KT_(decode_b_block)(const ktcy_weight *w, int64_t p, int64_t kb, uint8_t *dst) {
    const uint8_t *blk = w->data + (p * (w->k_pad / 32) + kb) * 272;
#if KT_AMX_REAL
    /* Real tiles come with AVX-512 BW: tile row r is the r % 2 nibble of bytes 32 (r / 2) ..
     * + 31 (bf16 pair j is channel j / 2), looked up by vpermw (codes index the table's low 16
     * words) and scaled by adding e - 127 to the exponent field of the non-zero values, as
     * ktcy_mxfp4_to_bf16 does. */
    const __m512i values = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)KTCY_E2M1_TO_BF16));
    const __m512i pair_channel = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
                         8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    uint16_t *out = (uint16_t *)dst;
    const __m512i e = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 256))));
    const __m512i shift = _mm512_slli_epi16(_mm512_sub_epi16(_mm512_permutexvar_epi16(pair_channel, e),
                                                             _mm512_set1_epi16(127)), 7);
    _Pragma("GCC unroll 16")
    for (int r = 0; r < 16; ++r) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + (r >> 1) * 32)));
        const __m512i code = (r & 1) ? _mm512_srli_epi16(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi16(15));
        const __m512i v = _mm512_permutexvar_epi16(code, values);
        _mm512_storeu_si512(out + r * 32, _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)),
                                                                v, shift));
    }
#else
    KT_(decode_scalar)(blk, dst);
#endif
}

#else
#error "fmt_mxfp4.h: no traits for this skeleton"
#endif

#if KT_SKEL == KT_SKEL_REF || KT_SKEL == KT_SKEL_AMX
#include "traits_unscaled.h"
#endif
