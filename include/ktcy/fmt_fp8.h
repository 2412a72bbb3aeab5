/* FP8 E4M3 traits, for both descriptor rows FP8_PERCHANNEL (one scale per output channel,
 * applied at the end) and FP8_BLOCK (one scale per 128 x 128 block of W, DeepSeek-V3's
 * weight_scale_inv, applied to each 128-wide K group's partial sum).  Codes decode exactly to
 * bf16 (numeric.h), or, on AVX2 and in AVX-512 one-row calls, by bit moves to floats worth the
 * value x 2^-120; activations are bf16, sums float.
 * Included by a skeleton instantiation; no include guard. */
#define KT_ROW KTCY_ROW_FP8_PERCHANNEL
#define KT_FORMATS ((1 << KTCY_FMT_FP8_PERCHANNEL) | (1 << KTCY_FMT_FP8_BLOCK))
#include "traits_begin.h"

#define KT_FP8_BLOCKWISE(w) ((w)->format == KTCY_FMT_FP8_BLOCK)
#define KT_FP8_KBLOCKS(w) (((w)->k + KTCY_SCALE_BLOCK - 1) / KTCY_SCALE_BLOCK)
/* The block scale of channel n (every panel lies inside one 128-channel block row). */
#define KT_FP8_BLOCK_SCALE(w, n, g) ((w)->scale[((n) / KTCY_SCALE_BLOCK) * KT_FP8_KBLOCKS(w) + (g)])

#if KT_SKEL == KT_SKEL_REF
KT_AI float KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    const uint8_t *blk = w->data + (p * (w->k_pad / 32) + k / 32) * 512;
    return ktcy_bf16_to_f32(ktcy_e4m3_to_bf16(blk[ktcy_pair_offset(nn, k % 32)]));
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return KT_FP8_BLOCKWISE(w) ? KTCY_SCALE_BLOCK : w->k_pad; }
KT_AI float KT_(group)(float acc, float part, const ktcy_act *a, int64_t m, const ktcy_weight *w, int64_t n,
                       int64_t g) {
    (void)a; (void)m;
    return KT_FP8_BLOCKWISE(w) ? acc + part * KT_FP8_BLOCK_SCALE(w, n, g) : acc + part;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)a; (void)m;
    return KT_FP8_BLOCKWISE(w) ? acc : acc * w->scale[n];
}

#elif KT_SKEL == KT_SKEL_AVX2 || KT_SKEL == KT_SKEL_AVX512
KT_AI int KT_(has_groups)(const ktcy_weight *w) { return KT_FP8_BLOCKWISE(w); }
/* a 128-wide K group is 4 blocks; the last group may be shorter */
KT_AI int64_t KT_(group_at)(const ktcy_weight *w, int64_t kb, int r, int64_t nkb) {
    (void)w;
    return r == 15 && ((kb + 1) % 4 == 0 || kb + 1 == nkb) ? kb / 4 : -1;
}

#if KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0 /* prefill decodes each panel to floats once (the skeleton's float path) */
#define KT_REG_DECODE 1
/* Row r (16 channels' even and odd codes) -> floats by bit moves alone: a code's 7 magnitude
 * bits at float bits 20..26 and its sign at bit 31 make the float worth the code's value times
 * 2^-120, exactly (E4M3's subnormals become float subnormals).  The skeleton widens each
 * activation row times 2^k, k from the row's largest exponent (KT_ROW_PRESCALE: k = 120 up to
 * |x| < 2^6, so products are as exact as the true products; the sums cannot overflow), and the
 * row factor 2^(120-k) multiplies the scales (final_scaled).  Rows reaching 2^15 (KT_WIDE_FIELD)
 * would push the products of their small values with small codes below the normal range: a call
 * holding one decodes with wrow_wide instead (fp16 patterns worth the value x 2^-8, widened by
 * vcvtph2ps, as before the bit-move decode).  A byte shuffle first puts channels j and j+4 of
 * each 128-bit lane into dword j, so the four byte positions are the even and odd K element of
 * the lane-split halves (KT_LANE_SPLIT).  10 operations per 32
 * codes and no conversions (one 16-bit shift serves two codes of a dword): a one-thread
 * 768 x 2048 GEMM reads 27-28 GB/s from cache, where 32-bit shifts per code (12 operations) read
 * 25.5 and the fp16 + vcvtph2ps decode 21 (its conversions and lane extracts bounded it).  Subnormal
 * inputs must not count as zero here: the GEMM clears MXCSR.DAZ for its duration.  NaN codes
 * (0x7F/0xFF) would come out finite: a weight holding one (w->nan_codes, found once when its
 * descriptor is made) is decoded by wrow_checked, which mends the lanes of a row holding one. */
#define KT_HAS_WROW 1
#define KT_CHECKED_ROWS 1
#define KT_LANE_SPLIT 1
#define KT_ROW_PRESCALE KTCY_E4M3_BITMOVE_SHIFT
/* Subnormal codes (values below 2^-6) come out as subnormal floats, which Intel cores multiply
 * through a microcode assist: the float prefill may decode times 2^8 instead (ktcy_fp8_normal_panels),
 * which leaves every float normal (the least code, 2^-9, at 2^-121). */
#define KT_PANEL_LIFT 8
#define KT_WIDE_FIELD KTCY_E4M3_WIDE_FIELD
#define KT_WIDE_FACTOR 256.0f
#define KT_CLEAR_DAZ 1
/* The 32 codes of w to floats: the even and odd K element of dword lanes' low words (out[0]) and
 * high words (out[1]).  A 16-bit arithmetic shift by 4 leaves the code in a word's high byte at its
 * bits 4..11 and its sign in bits 12..15: in the high word those are float bits 20..27 and 28..31,
 * which the mask trims to the sign and 7 bits; the low word's code gets there by a dword shift by
 * 16.  odd: bytes 1 and 3 as they lie; even: bytes 0 and 2 moved up to the high bytes first. */
KT_AI void KT_(bitmove)(__m256i w, kt_w256 out[2]) {
    const __m256i keep = _mm256_set1_epi32((int)0x87F00000u); /* sign, 7 magnitude bits */
    const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 4);
    out[0].e = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(even, 16), keep));
    out[1].e = _mm256_castsi256_ps(_mm256_and_si256(even, keep));
    const __m256i odd = _mm256_srai_epi16(w, 4);
    out[0].o = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(odd, 16), keep));
    out[1].o = _mm256_castsi256_ps(_mm256_and_si256(odd, keep));
    out[0].i = out[1].i = _mm256_setzero_si256();
}
KT_AI void KT_(wrow)(const uint8_t *blk, int r, kt_w256 out[2]) {
    const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                           0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    KT_(bitmove)(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(blk + r * 32)), pairs), out);
}
/* Row r in channel-parity order for the decode tiles (KT_PARITY_WROW): as it lies, dword d holds
 * channels 2d and 2d+1, each's even and odd K element, so the same shifts without the byte
 * shuffle give half 0 the even channels and half 1 the odd ones (the skeleton interleaves the sums
 * once at the end).  The shuffle was one of the six shuffle-port operations of the decode, the port
 * Zen 3's few-row FP8 tiles wait on. */
#define KT_PARITY_WROW 1
KT_AI void KT_(wrow_parity)(const uint8_t *blk, int r, kt_w256 out[2]) {
    KT_(bitmove)(_mm256_loadu_si256((const __m256i *)(blk + r * 32)), out);
}
KT_AI int KT_(checked_rows)(const ktcy_weight *w) { return w->nan_codes; }
/* A NaN code's magnitude bits are all ones: those lanes become the quiet NaN of the code's sign
 * that the table (and so the wide decode and the portable path) gives. */
KT_AI __m256 KT_(mend_nan)(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v), ones = _mm256_set1_epi32(0x07F00000);
    const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(bits, ones), ones);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u)), _mm256_set1_epi32(0x7FC00000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(bits, quiet, nan));
}
KT_AI void KT_(wrow_checked)(const uint8_t *blk, int r, kt_w256 out[2]) {
    KT_(wrow)(blk, r, out);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
        out[h].e = KT_(mend_nan)(out[h].e);
        out[h].o = KT_(mend_nan)(out[h].o);
    }
}
/* Row r for calls holding a wide row: with the sign at bit 15 and the 7 magnitude bits at bits
 * 7..13, a code is the fp16 worth its value x 2^-8 (fp16 subnormals cover E4M3's, and vcvtph2ps
 * widens them to normal floats).  vpermq first puts channels 0-3, 8-11 in the low lane (the
 * lane split).  A row holding a NaN code is decoded from the table. */
KT_AI void KT_(wrow_wide)(const uint8_t *blk, int r, kt_w256 out[2]) {
    const uint8_t *src = blk + r * 32;
    const __m256i w = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)src), 0xD8);
    const __m256i nan = _mm256_cmpeq_epi8(_mm256_or_si256(w, _mm256_set1_epi8((char)0x80)), _mm256_set1_epi8((char)-1));
    if (_mm256_movemask_epi8(nan)) {
        uint16_t bf[32]; /* channels 0-3, 8-11, 4-7, 12-15: the lane split */
        for (int i = 0; i < 32; ++i) bf[i] = ktcy_e4m3_to_bf16(src[((i >> 3) & 1) * 16 + ((i >> 4) & 1) * 8 + (i & 7)]);
        const __m256 unit = _mm256_set1_ps(1.0f / 256.0f);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; ++h) {
            out[h] = kt_bf16_split(_mm256_loadu_si256((const __m256i *)(bf + 16 * h)));
            out[h].e = _mm256_mul_ps(out[h].e, unit);
            out[h].o = _mm256_mul_ps(out[h].o, unit);
        }
        return;
    }
    const __m256i keep = _mm256_set1_epi16((short)0xBF80);
    const __m256i e = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), keep);
    const __m256i o = _mm256_and_si256(_mm256_srai_epi16(w, 1), keep);
    out[0].i = out[1].i = _mm256_setzero_si256();
    out[0].e = _mm256_cvtph_ps(_mm256_castsi256_si128(e));
    out[0].o = _mm256_cvtph_ps(_mm256_castsi256_si128(o));
    out[1].e = _mm256_cvtph_ps(_mm256_extracti128_si256(e, 1));
    out[1].o = _mm256_cvtph_ps(_mm256_extracti128_si256(o, 1));
}
/* The group multiplier of panel p, the same for its 16 channels: the block scale. */
#define KT_UNIFORM_GROUP_SCALE 1
KT_AI float KT_(group_scale1)(const ktcy_weight *w, int64_t p, int64_t g) { return KT_FP8_BLOCK_SCALE(w, p * 16, g); }
/* Half h (n0 = panel start + 8h) in the lane-split order: channels 0-3, 8-11 or 4-7, 12-15.  The
 * row factor f (a power of two, 1 for rows below 2^6) meets the scales as kt_times_scale_row
 * orders it, the block scales too (kt_scale_row, the same rule): one rounding where the
 * scale times f is a normal float, and nothing through subnormals or inf where the true sum
 * times the scale is normal. */
KT_AI __m256 KT_(final_scaled)(__m256i acc, __m256 facc, float f, const ktcy_act *a, const ktcy_weight *w,
                               int64_t m, int64_t n0) {
    (void)a; (void)m;
    if (KT_FP8_BLOCKWISE(w)) return facc;
    const float *s = w->scale + (n0 & ~(int64_t)15);
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 half = (n0 & 8) ? _mm256_permute2f128_ps(s0, s1, 0x31) : _mm256_permute2f128_ps(s0, s1, 0x20);
    return kt_times_scale_row(_mm256_castsi256_ps(acc), half, f);
}

#else /* AVX-512 */
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 1
#define KT_REG_DECODE KT_VBMI
#define KT_FETCH_L2(a) ((a)->tiles.fp8_fetch_l2) /* registry.h: a Zen 4's streams read faster so */
#define KT_FUSED_PREDECODE 1 /* rows() gives decode_panels' bytes: a first tile can keep them */
#if KT_VBMI
typedef struct { __m512i tab_lo0, tab_lo1, tab_hi0, tab_hi1, arrange; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) {
    KT_(ctx) c;
    uint8_t lo[128], hi[128], arrange[64];
    for (int i = 0; i < 128; ++i) { lo[i] = (uint8_t)KTCY_E4M3_TO_BF16[i]; hi[i] = (uint8_t)(KTCY_E4M3_TO_BF16[i] >> 8); }
    /* codes 8q..8q+7 into the low half of 128-bit lane q and codes 32+8q.. into its high half:
     * the in-lane byte unpacks then yield codes 0..31 and 32..63 in order */
    for (int j = 0; j < 64; ++j) arrange[j] = (uint8_t)((j & 8 ? 32 : 0) + (j / 16) * 8 + (j & 7));
    c.tab_lo0 = _mm512_loadu_si512(lo); c.tab_lo1 = _mm512_loadu_si512(lo + 64);
    c.tab_hi0 = _mm512_loadu_si512(hi); c.tab_hi1 = _mm512_loadu_si512(hi + 64);
    c.arrange = _mm512_loadu_si512(arrange);
    return c;
}
#else /* F and BW only: the word lookups of kt_e4m3_to_bf16_bw */
typedef struct { kt_e4m3_bw bw; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) {
    KT_(ctx) c = {kt_e4m3_bw_make()};
    return c;
}
#endif
#if KT_VBMI
/* Rows r, r+1 of an FP8 block (64 codes) -> two bf16 vectors: the codes are arranged so that
 * in-lane byte unpacks interleave in order, the low and high bytes of every code's bf16 value
 * come from two 128-entry vpermi2b lookups on the 7 magnitude bits, and the sign bit is merged
 * into the high bytes. */
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    __m512i codes = _mm512_permutexvar_epi8(c->arrange, _mm512_loadu_si512(blk + r * 32));
    __m512i lo = _mm512_permutex2var_epi8(c->tab_lo0, codes, c->tab_lo1);
    __m512i hi = _mm512_permutex2var_epi8(c->tab_hi0, codes, c->tab_hi1);
    hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (codes & 0x80) */
    out[0].v0 = _mm512_unpacklo_epi8(lo, hi);
    out[1].v0 = _mm512_unpackhi_epi8(lo, hi);
}
#endif
KT_AI void KT_(decode_panels)(const KT_(ctx) *c, const uint8_t *src, uint8_t *dst, int64_t blocks) {
    for (int64_t i = 0; i < blocks * 512; i += 64) {
#if KT_VBMI
        kt_vec2 rows[2];
        KT_(rows)(c, src + i, 0, rows);
        _mm512_storeu_si512(dst + 2 * i, rows[0].v0);
        _mm512_storeu_si512(dst + 2 * i + 64, rows[1].v0);
#else
        kt_e4m3_to_bf16_bw(&c->bw, src + i, (uint16_t *)dst + i, 64);
#endif
    }
}
/* Calls of a few rows (decode) on floats: the AVX2 bit-move decode, 64 codes per 10 integer
 * operations and 4 FMAs, in place of the bf16 decode (5 byte permutes) and vdpbf16ps.  A 64-byte
 * load holds block rows r and r+1; its dword d has channels 2(d%8) and 2(d%8)+1 of row r + d/8,
 * even and odd K element each, so byte j of every dword is one float vector whose lanes d < 8
 * and d >= 8 take the activations of two K elements (a broadcast pair per vector), and the sums'
 * halves are added at the end.  The weights come out times 2^-120 and the activation row times
 * 2^k (ktcy_prescale_shift, the AVX2 path's rule): the products are exact and normal.  Subnormal codes
 * would make subnormal floats, which cost Intel cores a microcode assist per FMA (a weight with
 * 5e-4 of them ran 20% slower): a row pair holding one takes them apart into sums of their own,
 * 8 times larger (byte_lane).  Calls holding a NaN code or a row of 2^15 or more keep the bf16
 * path.  How many rows go this way is a per-CPU choice (a->tiles.f32_rows, registry.h): each row keeps
 * its own factor and sums, so on this path a row's bits do not depend on the rows beside it. */
#define KT_FEW_ROWS 1
#define KT_FEW_ROWS_CHOICE(a) ((a)->tiles.f32_rows)
KT_AI __m512 KT_(fold_halves)(__m512 even, __m512 odd) {
    const __m512i interleave = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    even = _mm512_add_ps(even, _mm512_shuffle_f32x4(even, even, 0x4E));
    odd = _mm512_add_ps(odd, _mm512_shuffle_f32x4(odd, odd, 0x4E));
    return _mm512_permutex2var_ps(even, interleave, odd);
}
/* Byte j of every dword of the signed int8 lanes v, times 2^-126: a subnormal code's value times
 * 2^-117, 8 times the fast decode's scale and a normal float. */
KT_AI __m512 KT_(byte_lane)(__m512i v, const int j) {
    const __m512 ints = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24));
    return _mm512_mul_ps(ints, _mm512_set1_ps(0x1p-126f));
}
/* One row's products with a 64-byte load's four weight vectors (byte_lane j, or the even and
 * odd K elements' halves): even-channel sums in sums[0], odd in sums[1]; a0, a1 the row's two
 * K elements of each half. */
KT_AI void KT_(pair_fma)(__m512 a0, __m512 a1, const __m512 w[4], __m512 sums[2]) {
    sums[0] = _mm512_fmadd_ps(a1, w[1], _mm512_fmadd_ps(a0, w[0], sums[0]));
    sums[1] = _mm512_fmadd_ps(a1, w[3], _mm512_fmadd_ps(a0, w[2], sums[1]));
}
/* The sums of NP panels from p0 for MB float activation rows (x, rows xs floats apart; row
 * factors f), into y (rows ldy apart); the panels are fetched into L2 when to_l2 (registry.h). */
KT_AI void KT_(f32_tile)(const int MB, const int NP, int64_t p0, ktcy_span cont, const ktcy_weight *w, float *y,
                         int64_t ldy, const float *x, int64_t xs, const float *f, int to_l2) {
    const int64_t nkb = w->k_pad / 32;
    const __m512i keep = _mm512_set1_epi32((int)0x87F00000u);
    __m512 acc[4][4][2], sub[4][4][2], facc[4][4]; /* facc: block-scaled sums, channel order */
    const uint8_t *panel[4];
    _Pragma("GCC unroll 4")
    for (int p = 0; p < NP; ++p) {
        panel[p] = w->data + (p0 + p) * nkb * 512;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m)
            acc[m][p][0] = acc[m][p][1] = sub[m][p][0] = sub[m][p][1] = facc[m][p] = _mm512_setzero_ps();
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
        uintptr_t fetch[4];
        _Pragma("GCC unroll 4")
        for (int p = 0; p < NP; ++p) fetch[p] = ktcy_stream_ahead(cont, p, panel[p], kb, nkb, KT_AHEAD, 512);
        _Pragma("GCC unroll 8")
        for (int r2 = 0; r2 < 16; r2 += 2) {
            __m512 a0[4], a1[4];
            _Pragma("GCC unroll 4")
            for (int m = 0; m < MB; ++m) {
                const float *xk = x + m * xs + kb * 32;
                a0[m] = _mm512_mask_broadcastss_ps(_mm512_set1_ps(xk[2 * r2]), 0xFF00, _mm_load_ss(xk + 2 * r2 + 2));
                a1[m] = _mm512_mask_broadcastss_ps(_mm512_set1_ps(xk[2 * r2 + 1]), 0xFF00, _mm_load_ss(xk + 2 * r2 + 3));
            }
            _Pragma("GCC unroll 4")
            for (int p = 0; p < NP; ++p) {
                ktcy_fetch_stream(fetch[p] + (uintptr_t)(r2 * 32), to_l2);
                __m512i v = _mm512_loadu_si512(panel[p] + kb * 512 + r2 * 32);
                const __mmask64 small = _mm512_mask_test_epi8_mask(_mm512_testn_epi8_mask(v, _mm512_set1_epi8(0x78)), v,
                                                                  _mm512_set1_epi8(0x07));
                if (__builtin_expect(small != 0, 0)) {
                    const __m512i mag = _mm512_and_si512(_mm512_maskz_mov_epi8(small, v), _mm512_set1_epi8(0x07));
                    const __m512i sv = _mm512_mask_sub_epi8(mag, _mm512_movepi8_mask(v), _mm512_setzero_si512(), mag);
                    const __m512 s[4] = {KT_(byte_lane)(sv, 0), KT_(byte_lane)(sv, 1), KT_(byte_lane)(sv, 2),
                                         KT_(byte_lane)(sv, 3)};
                    _Pragma("GCC unroll 4")
                    for (int m = 0; m < MB; ++m) KT_(pair_fma)(a0[m], a1[m], s, sub[m][p]);
                    v = _mm512_maskz_mov_epi8(~small, v);
                }
                const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 4), odd = _mm512_srai_epi16(v, 4);
                const __m512 wv[4] = {_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(even, 16), keep)),
                                      _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(odd, 16), keep)),
                                      _mm512_castsi512_ps(_mm512_and_si512(even, keep)),
                                      _mm512_castsi512_ps(_mm512_and_si512(odd, keep))};
                _Pragma("GCC unroll 4")
                for (int m = 0; m < MB; ++m) KT_(pair_fma)(a0[m], a1[m], wv, acc[m][p]);
            }
        }
        /* The sums times the row factor f first (a power of two of at least 1: exact, and the
         * true sums of rows below 2^15 cannot overflow), the K halves folded, then the scale: no
         * output passes through subnormals where the true one would not, a scale near the float
         * maximum does not overflow times f, and halves that cancel are not scaled apart (each
         * could overflow where the block's sum does not). */
        if (KT_FP8_BLOCKWISE(w) && ((kb + 1) % 4 == 0 || kb + 1 == nkb)) {
            _Pragma("GCC unroll 4")
            for (int p = 0; p < NP; ++p) {
                const __m512 s = _mm512_set1_ps(KT_FP8_BLOCK_SCALE(w, (p0 + p) * 16, kb / 4));
                _Pragma("GCC unroll 4")
                for (int m = 0; m < MB; ++m) {
                    const __m512 fv = _mm512_set1_ps(f[m]);
                    const __m512 e = _mm512_fmadd_ps(sub[m][p][0], _mm512_set1_ps(0.125f), acc[m][p][0]);
                    const __m512 o = _mm512_fmadd_ps(sub[m][p][1], _mm512_set1_ps(0.125f), acc[m][p][1]);
                    facc[m][p] = _mm512_fmadd_ps(KT_(fold_halves)(_mm512_mul_ps(e, fv), _mm512_mul_ps(o, fv)), s, facc[m][p]);
                    acc[m][p][0] = acc[m][p][1] = sub[m][p][0] = sub[m][p][1] = _mm512_setzero_ps();
                }
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int p = 0; p < NP; ++p) {
        const int64_t n0 = (p0 + p) * 16, valid = w->n - n0 < 16 ? w->n - n0 : 16;
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MB; ++m) {
            __m512 out;
            if (KT_FP8_BLOCKWISE(w)) {
                out = facc[m][p];
            } else {
                const __m512 e = _mm512_fmadd_ps(sub[m][p][0], _mm512_set1_ps(0.125f), acc[m][p][0]);
                const __m512 o = _mm512_fmadd_ps(sub[m][p][1], _mm512_set1_ps(0.125f), acc[m][p][1]);
                const __m512 fv = _mm512_set1_ps(f[m]);
                out = _mm512_mul_ps(KT_(fold_halves)(_mm512_mul_ps(e, fv), _mm512_mul_ps(o, fv)), _mm512_loadu_ps(w->scale + n0));
            }
            _mm512_mask_storeu_ps(y + m * ldy + n0, (__mmask16)((1u << valid) - 1u), out);
        }
    }
}
/* Calls of up to KT_FEW_ROWS_MAX rows (the accumulators' limit; the skeleton applies the CPU's
 * a->tiles.f32_rows).  0: the call keeps the bf16 path (a NaN code, or a row too wide for the 2^-120
 * weights). */
#define KT_FEW_ROWS_MAX 4
KT_AI int KT_(few_rows)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb, int64_t pe,
                        void *scratch) {
    if (w->nan_codes || a->m > KT_FEW_ROWS_MAX) return 0;
    float *x = (float *)ktcy_align64(scratch), f[KT_FEW_ROWS_MAX];
    for (int64_t m = 0; m < a->m; ++m) {
        const uint16_t *src = a->bf16 + m * a->k_pad;
        __m512i top = _mm512_setzero_si512();
        for (int64_t k = 0; k < a->k_pad; k += 32)
            top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(src + k), _mm512_set1_epi16(0x7F80)));
        /* each dword's low word: the larger of its two words */
        const __m512i pairs = _mm512_max_epu16(top, _mm512_srli_epi32(top, 16));
        const int field = _mm512_reduce_max_epi32(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF))) >> 7;
        if (field > KTCY_E4M3_WIDE_FIELD) return 0;
        const int shift = ktcy_prescale_shift(field);
        const __m512 times = _mm512_castsi512_ps(_mm512_set1_epi32((127 + shift) << 23));
        for (int64_t k = 0; k < a->k_pad; k += 16) {
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + k)));
            _mm512_store_ps(x + m * a->k_pad + k, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), times));
        }
        f[m] = ktcy_pow2(KTCY_E4M3_BITMOVE_SHIFT - shift);
    }
    KT_FEW_ROWS_SWEEP(KT_(f32_tile), 4, 2, a, w, pb, pe, w, y, ldy, x, a->k_pad, f, a->tiles.fp8_fetch_l2) /* 4 x 4: 32 accumulators */
    return 1;
}
KT_AI void KT_(group_epilogue)(KT_(acc_t) acc[6][4], __m512 facc[6][4], const int MB, const int NP,
                               const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p0, int64_t g) {
    (void)a; (void)m0;
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) {
        const __m512 s = _mm512_set1_ps(KT_FP8_BLOCK_SCALE(w, (p0 + p) * 16, g));
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
            facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(acc[m][p], s));
            acc[m][p] = _mm512_setzero_ps();
        }
    }
}
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)a; (void)m;
    return KT_FP8_BLOCKWISE(w) ? facc : _mm512_mul_ps(acc, _mm512_loadu_ps(w->scale + n0));
}
#endif

#elif KT_SKEL == KT_SKEL_AMX
/* Block kb of panel p decoded to a bf16 tile block (the BF16 tile layout).  Real tiles come with
 * AVX-512 BW: the same 128-entry table as ktcy_e4m3_to_bf16, 32 codes per two vpermi2w, since a
 * scalar decode here costs 30x the TDPs that use it. */
#define KT_AMX_DECODE_B 1
#define KT_AMX_DECODE_IN_LOOP 1 /* bf16 tiles: decoded while the TDPs run (gemm_amx_tpl.h) */
KT_AI void KT_(decode_b_block)(const ktcy_weight *w, int64_t p, int64_t kb, uint8_t *dst) {
    const uint8_t *src = w->data + (p * (w->k_pad / 32) + kb) * 512;
#if KT_AMX_REAL
    const kt_e4m3_bw c = kt_e4m3_bw_make();
    kt_e4m3_to_bf16_bw(&c, src, (uint16_t *)dst, 512);
#else
    for (int i = 0; i < 512; ++i) ((uint16_t *)dst)[i] = ktcy_e4m3_to_bf16(src[i]);
#endif
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return KT_FP8_BLOCKWISE(w) ? KTCY_SCALE_BLOCK : w->k_pad; }
/* Per channel: one group, factor 1 (c x 1 is c, bit for bit); block-wise: the block's scale. */
KT_AI void KT_(group_cols)(const ktcy_weight *w, int64_t p, int np, int64_t g, float *s) {
    for (int j = 0; j < 16 * np; ++j) {
        const int64_t n = p * KTCY_PANEL + j;
        s[j] = !KT_FP8_BLOCKWISE(w) ? 1.0f : n < w->n ? KT_FP8_BLOCK_SCALE(w, n, g) : 0.0f;
    }
}
KT_AI float KT_(group_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
KT_AI float KT_(tile_group)(float acc, float c, float r, float s) { (void)r; return acc + c * s; }
KT_AI void KT_(final_cols)(const ktcy_weight *w, int64_t p, int np, float *t) {
    for (int j = 0; j < 16 * np; ++j) t[j] = KT_FP8_BLOCKWISE(w) ? 1.0f : w->scale[p * KTCY_PANEL + j];
}
KT_AI float KT_(final_row)(const ktcy_act *a, int64_t m) { (void)a; (void)m; return 1.0f; }
KT_AI float KT_(tile_final)(float acc, float r, float t) { (void)r; return acc * t; }

#else
#error "fmt_fp8.h: no traits for this skeleton"
#endif

#undef KT_FP8_BLOCKWISE
#undef KT_FP8_KBLOCKS
#undef KT_FP8_BLOCK_SCALE
