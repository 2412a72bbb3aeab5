/* AVX-512 GEMM skeleton, instantiated once per (format family, variant) by gemm_avx512.h.
 * Parameters: KT_NAME(x) (symbol prefix), KT_TARGET (the exact target features), KT_FMT
 * (KT_INT8, KT_INT4, KT_BF16, KT_FP8) and KT_FAST (1: VNNI / AVX512-BF16 / VBMI+BF16; 0: the
 * F+BW path for CPUs without them).  No include guard: it is meant to be included repeatedly.
 *
 * Every packed block has 16 rows of 64 bytes (after FP8 decode / INT4 unpack); row r pairs
 * with the activation dword at k0 + r * KT_KPR.  A micro-tile keeps MB x NP accumulators of
 * 16 channels in registers: large M reuses each weight row across MB rows, while M = 1 streams
 * every weight byte once. */

#define KT_AI static inline __attribute__((always_inline)) KT_TARGET
#define KT_KPR ((KT_FMT == KT_INT8 || KT_FMT == KT_INT4) ? 4 : 2)
#define KT_BK (KT_KPR * 16)
#define KT_BB ((KT_FMT == KT_INT8 || KT_FMT == KT_BF16) ? 1024 : 512)
#define KT_ASIZE ((KT_FMT == KT_INT8 || KT_FMT == KT_INT4) ? 1 : 2) /* bytes per activation element */

typedef struct { __m512i tab_lo0, tab_lo1, tab_hi0, tab_hi1, arrange; } KT_NAME(ctx);

/* Accumulators stay in their natural register type: casting between the integer and float
 * domains every step makes GCC copy them around. */
#if KT_FMT == KT_BF16 || KT_FMT == KT_FP8
typedef __m512 KT_NAME(acc_t);
#define KT_ACC_ZERO _mm512_setzero_ps()
#else
typedef __m512i KT_NAME(acc_t);
#define KT_ACC_ZERO _mm512_setzero_si512()
#endif

KT_AI KT_NAME(ctx) KT_NAME(make_ctx)(void) {
    KT_NAME(ctx) c;
#if KT_FMT == KT_FP8 && KT_FAST
    uint8_t lo[128], hi[128], arrange[64];
    for (int i = 0; i < 128; ++i) { lo[i] = (uint8_t)KTCY_E4M3_TO_BF16[i]; hi[i] = (uint8_t)(KTCY_E4M3_TO_BF16[i] >> 8); }
    /* codes 8q..8q+7 into the low half of 128-bit lane q and codes 32+8q.. into its high half:
     * the in-lane byte unpacks then yield codes 0..31 and 32..63 in order */
    for (int j = 0; j < 64; ++j) arrange[j] = (uint8_t)((j & 8 ? 32 : 0) + (j / 16) * 8 + (j & 7));
    c.tab_lo0 = _mm512_loadu_si512(lo); c.tab_lo1 = _mm512_loadu_si512(lo + 64);
    c.tab_hi0 = _mm512_loadu_si512(hi); c.tab_hi1 = _mm512_loadu_si512(hi + 64);
    c.arrange = _mm512_loadu_si512(arrange);
#else
    c.tab_lo0 = c.tab_lo1 = c.tab_hi0 = c.tab_hi1 = c.arrange = _mm512_setzero_si512();
#endif
    return c;
}

#if KT_FMT == KT_FP8 && KT_FAST
/* Rows r, r+1 of an FP8 block (64 codes) -> two bf16 vectors: the codes are arranged so that
 * in-lane byte unpacks interleave in order, the low and high bytes of every code's bf16 value
 * come from two 128-entry vpermi2b lookups on the 7 magnitude bits, and the sign bit is merged
 * into the high bytes. */
KT_AI void KT_NAME(decode_fp8_rows)(const KT_NAME(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    __m512i codes = _mm512_permutexvar_epi8(c->arrange, _mm512_loadu_si512(blk + r * 32));
    __m512i lo = _mm512_permutex2var_epi8(c->tab_lo0, codes, c->tab_lo1);
    __m512i hi = _mm512_permutex2var_epi8(c->tab_hi0, codes, c->tab_hi1);
    hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (codes & 0x80) */
    out[0].v0 = out[0].v1 = _mm512_unpacklo_epi8(lo, hi);
    out[1].v0 = out[1].v1 = _mm512_unpackhi_epi8(lo, hi);
}
#endif

/* Weight row r of a block: 16 lanes x (4 int8 | 2 bf16).  v1 is the odd bf16 half as float for
 * the FMA path. */
KT_AI kt_vec2 KT_NAME(load_w)(const KT_NAME(ctx) *c, const uint8_t *blk, int r, const int PRE) {
    kt_vec2 w;
    (void)c;
    (void)PRE;
#if KT_FMT == KT_INT4
    __m512i raw = _mm512_loadu_si512(blk + (r & 7) * 64);
    w.v0 = _mm512_and_si512(r < 8 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
#elif KT_FMT == KT_FP8 && KT_FAST
    if (!PRE) { /* single-row decode; the micro-kernel uses load_w2 for row pairs */
        kt_vec2 pair[2];
        KT_NAME(decode_fp8_rows)(c, blk, r & ~1, pair);
        return pair[r & 1];
    }
    w.v0 = _mm512_loadu_si512(blk + r * 64);
#else /* INT8, BF16, and FP8 already decoded to bf16 in a scratch block */
    w.v0 = _mm512_loadu_si512(blk + r * 64);
#endif
#if (KT_FMT == KT_BF16 || KT_FMT == KT_FP8) && !KT_FAST
    w.v1 = _mm512_and_si512(w.v0, _mm512_set1_epi32((int)0xFFFF0000u));
    w.v0 = _mm512_slli_epi32(w.v0, 16);
#else
    w.v1 = w.v0;
#endif
    return w;
}

KT_AI kt_vec2 KT_NAME(load_a)(const void *row, int64_t k) {
    int32_t dword;
    memcpy(&dword, (const uint8_t *)row + k * KT_ASIZE, 4);
    kt_vec2 a;
    a.v0 = _mm512_set1_epi32(dword);
#if KT_FMT == KT_INT8 && KT_FAST
    a.v0 = _mm512_xor_si512(a.v0, _mm512_set1_epi8((char)0x80)); /* s8 -> u8 = s8 + 128 */
#endif
#if (KT_FMT == KT_BF16 || KT_FMT == KT_FP8) && !KT_FAST
    a.v1 = _mm512_and_si512(a.v0, _mm512_set1_epi32((int)0xFFFF0000u));
    a.v0 = _mm512_slli_epi32(a.v0, 16);
#else
    a.v1 = a.v0;
#endif
    return a;
}

KT_AI KT_NAME(acc_t) KT_NAME(dp)(KT_NAME(acc_t) acc, kt_vec2 a, kt_vec2 w) {
#if KT_FMT == KT_INT8 && KT_FAST
    return _mm512_dpbusd_epi32(acc, a.v0, w.v0);
#elif KT_FMT == KT_INT8
    /* |a| * (w * sign a): pairs stay within int16 (2 * 127 * 127), so this is exact */
    __m512i ws = _mm512_mask_sub_epi8(w.v0, _mm512_movepi8_mask(a.v0), _mm512_setzero_si512(), w.v0);
    __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(a.v0), ws);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif KT_FMT == KT_INT4 && KT_FAST
    return _mm512_dpbusd_epi32(acc, w.v0, a.v0); /* unsigned nibble (code + 8) x signed activation */
#elif KT_FMT == KT_INT4
    __m512i pairs = _mm512_maddubs_epi16(w.v0, a.v0); /* at most 2 * 15 * 127: no saturation */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif KT_FAST
    return _mm512_dpbf16_ps(acc, (__m512bh)a.v0, (__m512bh)w.v0);
#else
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(a.v0), _mm512_castsi512_ps(w.v0), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a.v1), _mm512_castsi512_ps(w.v1), acc);
#endif
}

#if KT_FMT == KT_BF16 || KT_FMT == KT_FP8
#define KT_ACC_ADD(x, y) _mm512_add_ps(x, y)
#else
#define KT_ACC_ADD(x, y) _mm512_add_epi32(x, y)
#endif
/* Folds the odd-row accumulators of a one-row tile into the even ones. */
KT_AI void KT_NAME(merge_split)(KT_NAME(acc_t) acc[6][4], const int NP) {
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) { acc[0][p] = KT_ACC_ADD(acc[0][p], acc[1][p]); acc[1][p] = KT_ACC_ZERO; }
}

/* MB rows from m0, NP panels from p0.  PRE: the panels were decoded to bf16 blocks beforehand
 * (FP8 prefill), starting at `decoded`; otherwise `decoded` is a 4 KiB per-block scratch. */
KT_AI void KT_NAME(micro)(const int MB, const int NP, const int PRE, const KT_NAME(ctx) *c, const ktcy_act *a,
                          const ktcy_weight *w, int64_t m0, int64_t p0, float *y, int64_t ldy, uint8_t *decoded) {
    const int64_t nkb = w->k_pad / KT_BK;
    const int64_t fp8_kblocks = (w->k + KTCY_FP8_SCALE_BLOCK - 1) / KTCY_FP8_SCALE_BLOCK;
    KT_NAME(acc_t) acc[6][4];
    __m512 facc[6][4];
    const uint8_t *panel[4];
    const void *arow[6];
    const int64_t block_bytes = PRE ? 1024 : KT_BB;
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) panel[p] = PRE ? decoded + p * nkb * 1024 : w->data + (p0 + p) * nkb * KT_BB;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
#if KT_FMT == KT_INT8 || KT_FMT == KT_INT4
        arow[m] = a->q + (m0 + m) * a->k_pad;
#else
        arow[m] = a->bf16 + (m0 + m) * a->k_pad;
#endif
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) { acc[m][p] = KT_ACC_ZERO; facc[m][p] = _mm512_setzero_ps(); }
    }
    _Pragma("GCC unroll 8")
    for (int p = 0; p < NP; ++p) acc[1][p] = KT_ACC_ZERO; /* the odd-row half when MB == 1 */
    (void)decoded; (void)fp8_kblocks; (void)facc;
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint8_t *blk[4];
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP; ++p) {
            blk[p] = panel[p] + kb * block_bytes;
#if KT_FMT == KT_FP8 && !KT_FAST
            if (PRE) continue;
            uint16_t *dst = (uint16_t *)(decoded + p * 1024);
            for (int i = 0; i < 512; ++i) dst[i] = ktcy_e4m3_to_bf16(blk[p][i]);
            blk[p] = decoded + p * 1024;
#endif
        }
        const uint8_t *ak[6]; /* this block's activations of each row: row offsets below are immediates */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) ak[m] = (const uint8_t *)arow[m] + kb * KT_BK * KT_ASIZE;
        _Pragma("GCC unroll 8")
        for (int r2 = 0; r2 < 16; r2 += 2) {
            kt_vec2 wv2[4][2];
            _Pragma("GCC unroll 8")
            for (int p = 0; p < NP; ++p) {
#if KT_FMT == KT_FP8 && KT_FAST
                if (!PRE) { KT_NAME(decode_fp8_rows)(c, blk[p], r2, wv2[p]); continue; }
#endif
                wv2[p][0] = KT_NAME(load_w)(c, blk[p], r2, PRE);
                wv2[p][1] = KT_NAME(load_w)(c, blk[p], r2 + 1, PRE);
            }
          _Pragma("GCC unroll 2")
          for (int u = 0; u < 2; ++u) {
            const int r = r2 + u;
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
                kt_vec2 av = KT_NAME(load_a)(ak[m], r * KT_KPR);
                /* one row: even and odd block rows go to two accumulators (twice the independent
                 * chains for the latency of the dot products); they are added before any use */
                const int slot = MB == 1 ? u : m;
                _Pragma("GCC unroll 8")
                for (int p = 0; p < NP; ++p) acc[slot][p] = KT_NAME(dp)(acc[slot][p], av, wv2[p][u]);
            }
            if (MB == 1 && u == 1 && (r == 7 || r == 15)) KT_NAME(merge_split)(acc, NP);
#if KT_FMT == KT_INT4
            if (r == 15 || (r == 7 && w->group == 32)) {
                int64_t g = (kb * 64 + r * 4) / w->group;
                if (w->group == 128 && !(kb & 1)) g = -1;
                _Pragma("GCC unroll 8")
                for (int m = 0; m < MB && g >= 0; ++m) {
                    __m512i bias = _mm512_set1_epi32(8 * a->group_sum[(m0 + m) * (a->k_pad / a->group) + g]);
                    _Pragma("GCC unroll 8")
                    for (int p = 0; p < NP; ++p) {
                        __m512 s = _mm512_loadu_ps(w->scale + g * w->n_pad + (p0 + p) * 16);
                        __m512 part = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][p], bias));
                        facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(part, s));
                        acc[m][p] = KT_ACC_ZERO;
                    }
                }
            }
#elif KT_FMT == KT_FP8
            if (w->format == KTCY_FP8_BLOCK && r == 15 && ((kb + 1) % 4 == 0 || kb + 1 == nkb)) {
                _Pragma("GCC unroll 8")
                for (int p = 0; p < NP; ++p) {
                    int64_t n0 = (p0 + p) * 16;
                    __m512 s = _mm512_set1_ps(w->scale[(n0 / KTCY_FP8_SCALE_BLOCK) * fp8_kblocks + kb / 4]);
                    _Pragma("GCC unroll 8")
                    for (int m = 0; m < MB; ++m) {
                        facc[m][p] = _mm512_add_ps(facc[m][p], _mm512_mul_ps(acc[m][p], s));
                        acc[m][p] = KT_ACC_ZERO;
                    }
                }
            }
#endif
          }
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        _Pragma("GCC unroll 8")
        for (int p = 0; p < NP && m0 + m < a->m; ++p) {
            int64_t n0 = (p0 + p) * 16;
            int64_t valid = w->n - n0 < 16 ? w->n - n0 : 16;
            __mmask16 mask = (__mmask16)((1u << valid) - 1u);
            __m512 out;
#if KT_FMT == KT_INT8
            __m512i exact = acc[m][p];
#if KT_FAST
            exact = _mm512_sub_epi32(exact, _mm512_slli_epi32(_mm512_loadu_si512(w->colsum + n0), 7));
#endif
            out = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a->scale[m0 + m]));
            out = _mm512_mul_ps(out, _mm512_loadu_ps(w->scale + n0));
#elif KT_FMT == KT_INT4
            out = _mm512_mul_ps(facc[m][p], _mm512_set1_ps(a->scale[m0 + m]));
#elif KT_FMT == KT_BF16
            out = acc[m][p];
#else
            out = w->format == KTCY_FP8_BLOCK ? facc[m][p] : _mm512_mul_ps(acc[m][p], _mm512_loadu_ps(w->scale + n0));
#endif
            _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, mask, out);
        }
    }
}

#define KT_CALL(mb, np, pre) KT_NAME(micro)(mb, np, pre, &c, a, w, m0, p, y, ldy, pre ? pre_buf : decoded)
/* Tile shapes are compile-time constants in every call, so each one is fully unrolled. */
#define KT_DISPATCH(pre)                                                                  \
    switch (mb * 8 + np) {                                                                \
    case 1 * 8 + 4: KT_CALL(1, 4, pre); break;                                            \
    case 2 * 8 + 4: KT_CALL(2, 4, pre); break;                                            \
    case 4 * 8 + 4: if (wide) KT_CALL(4, 4, pre); break;                                  \
    case 6 * 8 + 4: if (wide) KT_CALL(6, 4, pre); break;                                  \
    case 1 * 8 + 1: KT_CALL(1, 1, pre); break;                                            \
    case 2 * 8 + 1: KT_CALL(2, 1, pre); break;                                            \
    case 4 * 8 + 1: if (wide) KT_CALL(4, 1, pre); break;                                  \
    default: if (wide) KT_CALL(6, 1, pre); break;                                         \
    }

KT_TARGET static int KT_NAME(gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t pb,
                                   int64_t pe, void *scratch) {
    const KT_NAME(ctx) c = KT_NAME(make_ctx)();
    uint8_t decoded[4 * 1024] __attribute__((aligned(64)));
    /* Formats that keep a second set of float accumulators get fewer rows per micro-tile.
     * FP8 decoding in registers keeps four tables there, so it gets 4 rows like the FMA paths. */
    const int wide = (KT_FMT == KT_INT4 || w->format == KTCY_FP8_BLOCK) ? 0 : 1;
    /* FP8 with several row blocks: decode each group of panels once into scratch (bf16, L2
     * resident) instead of once per row block; the tile then gets the BF16 height. */
    const int pre = KT_FMT == KT_FP8 && scratch != NULL && a->m > 4;
    const int max_rows = !wide ? 2 : (KT_FAST && (KT_FMT != KT_FP8 || pre)) ? 6 : 4;
    uint8_t *pre_buf = (uint8_t *)scratch;
    const int64_t nkb = w->k_pad / KT_BK;
    (void)nkb;
    for (int64_t p = pb; p < pe;) {
        const int np = pe - p >= 4 ? 4 : 1;
#if KT_FMT == KT_FP8
        if (pre) {
            const uint8_t *src = w->data + p * nkb * 512;
            uint16_t *dst = (uint16_t *)pre_buf;
            for (int64_t i = 0; i < np * nkb * 512; i += 64) {
#if KT_FAST
                kt_vec2 rows[2];
                KT_NAME(decode_fp8_rows)(&c, src + i, 0, rows);
                _mm512_storeu_si512(dst + i, rows[0].v0);
                _mm512_storeu_si512(dst + i + 32, rows[1].v0);
#else
                for (int j = 0; j < 64; ++j) dst[i + j] = ktcy_e4m3_to_bf16(src[i + j]);
#endif
            }
        }
#endif
        for (int64_t m0 = 0; m0 < a->m;) {
            int64_t left = a->m - m0;
            /* rows past a->m are zero padding (m_pad), so rounding a tile up to 2/4/6 rows is safe */
            int mb = max_rows;
            if (left < max_rows) mb = left <= 1 ? 1 : left <= 2 ? 2 : (wide && left <= 4) ? 4 : max_rows;
            if (pre) { KT_DISPATCH(1) } else { KT_DISPATCH(0) }
            m0 += mb;
        }
        p += np;
    }
    return KTCY_OK;
}

#undef KT_CALL
#undef KT_DISPATCH
#undef KT_ACC_ZERO
#undef KT_ACC_ADD
#undef KT_AI
#undef KT_KPR
#undef KT_BK
#undef KT_BB
#undef KT_ASIZE
