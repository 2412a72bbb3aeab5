/* AVX2 + FMA GEMM skeleton, instantiated per format family by gemm_avx2.h (KT_NAME, KT_FMT).
 * A 64-byte packed row is two 256-bit halves (channels 0-7 and 8-15).  Integer products use
 * the exact |a| * (w * sign a) vpmaddubsw form; bf16 uses even/odd FMAs.  No include guard. */

#define KT_AI static inline __attribute__((always_inline)) KTCY_AVX2_TARGET
#define KT_KPR ((KT_FMT == KT_INT8 || KT_FMT == KT_INT4) ? 4 : 2)
#define KT_BK (KT_KPR * 16)
#define KT_BB ((KT_FMT == KT_INT8 || KT_FMT == KT_BF16) ? 1024 : 512)

KT_AI __m256i KT_NAME(load_w)(const uint8_t *blk, int r, int h) {
#if KT_FMT == KT_INT4
    __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (r & 7) * 64 + h * 32));
    return _mm256_and_si256(r < 8 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
#else
    return _mm256_loadu_si256((const __m256i *)(blk + r * 64 + h * 32));
#endif
}

KT_AI __m256i KT_NAME(dp)(__m256i acc, __m256i a, __m256i w) {
#if KT_FMT == KT_INT8
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#elif KT_FMT == KT_INT4
    __m256i pairs = _mm256_maddubs_epi16(w, a);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 f = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                               _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), _mm256_castsi256_ps(acc));
    f = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, odd)), _mm256_castsi256_ps(_mm256_and_si256(w, odd)), f);
    return _mm256_castps_si256(f);
#endif
}

/* FP8: `decoded` holds panel p already decoded to bf16 blocks (1024 bytes each). */
KT_AI void KT_NAME(micro)(const int MB, const ktcy_act *a, const ktcy_weight *w, int64_t m0, int64_t p,
                          float *y, int64_t ldy, const uint8_t *decoded) {
    const int64_t nkb = w->k_pad / KT_BK;
    const int64_t fp8_kblocks = (w->k + KTCY_FP8_SCALE_BLOCK - 1) / KTCY_FP8_SCALE_BLOCK;
    const uint8_t *panel = KT_FMT == KT_FP8 ? decoded : w->data + p * nkb * KT_BB;
    const int isz = (KT_FMT == KT_INT8 || KT_FMT == KT_INT4) ? 1 : 2;
    const uint8_t *arow[4];
    __m256i acc[4][2];
    __m256 facc[4][2];
    (void)decoded; (void)fp8_kblocks; (void)facc;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) {
        arow[m] = (isz == 1 ? (const uint8_t *)a->q : (const uint8_t *)a->bf16) + (m0 + m) * a->k_pad * isz;
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; ++h) { acc[m][h] = _mm256_setzero_si256(); facc[m][h] = _mm256_setzero_ps(); }
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint8_t *blk = panel + kb * (KT_FMT == KT_FP8 ? 1024 : KT_BB);
        const uint8_t *ak[4]; /* this block's activations of each row: row offsets below are immediates */
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) ak[m] = arow[m] + kb * KT_BK * isz;
        _Pragma("GCC unroll 16")
        for (int r = 0; r < 16; ++r) {
            __m256i w0 = KT_NAME(load_w)(blk, r, 0), w1 = KT_NAME(load_w)(blk, r, 1);
            _Pragma("GCC unroll 8")
            for (int m = 0; m < MB; ++m) {
                int32_t dword;
                memcpy(&dword, ak[m] + r * KT_KPR * isz, 4);
                __m256i av = _mm256_set1_epi32(dword);
                acc[m][0] = KT_NAME(dp)(acc[m][0], av, w0);
                acc[m][1] = KT_NAME(dp)(acc[m][1], av, w1);
            }
#if KT_FMT == KT_INT4
            if (r == 15 || (r == 7 && w->group == 32)) {
                int64_t g = (kb * 64 + r * 4) / w->group;
                if (w->group == 128 && !(kb & 1)) g = -1; /* group 128 spans two blocks */
                _Pragma("GCC unroll 8")
                for (int m = 0; m < MB && g >= 0; ++m) {
                    __m256i bias = _mm256_set1_epi32(8 * a->group_sum[(m0 + m) * (a->k_pad / a->group) + g]);
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; ++h) {
                        __m256 s = _mm256_loadu_ps(w->scale + g * w->n_pad + p * 16 + h * 8);
                        __m256 part = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][h], bias));
                        facc[m][h] = _mm256_add_ps(facc[m][h], _mm256_mul_ps(part, s));
                        acc[m][h] = _mm256_setzero_si256();
                    }
                }
            }
#elif KT_FMT == KT_FP8
            if (w->format == KTCY_FP8_BLOCK && r == 15 && ((kb + 1) % 4 == 0 || kb + 1 == nkb)) {
                __m256 s = _mm256_set1_ps(w->scale[(p * 16 / KTCY_FP8_SCALE_BLOCK) * fp8_kblocks + kb / 4]);
                _Pragma("GCC unroll 8")
                for (int m = 0; m < MB; ++m)
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; ++h) {
                        facc[m][h] = _mm256_add_ps(facc[m][h], _mm256_mul_ps(_mm256_castsi256_ps(acc[m][h]), s));
                        acc[m][h] = _mm256_setzero_si256();
                    }
            }
#endif
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB && m0 + m < a->m; ++m) {
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; ++h) {
            int64_t n0 = p * 16 + h * 8;
            int64_t valid = w->n - n0;
            if (valid <= 0) break;
            __m256 out;
#if KT_FMT == KT_INT8
            out = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][h]), _mm256_set1_ps(a->scale[m0 + m]));
            out = _mm256_mul_ps(out, _mm256_loadu_ps(w->scale + n0));
#elif KT_FMT == KT_INT4
            out = _mm256_mul_ps(facc[m][h], _mm256_set1_ps(a->scale[m0 + m]));
#elif KT_FMT == KT_BF16
            out = _mm256_castsi256_ps(acc[m][h]);
#else
            out = w->format == KTCY_FP8_BLOCK ? facc[m][h]
                : _mm256_mul_ps(_mm256_castsi256_ps(acc[m][h]), _mm256_loadu_ps(w->scale + n0));
#endif
            __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 8 ? valid : 8)), lanes);
            _mm256_maskstore_ps(y + (m0 + m) * ldy + n0, mask, out);
        }
    }
}

KTCY_AVX2_TARGET static int KT_NAME(gemm)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                          int64_t pb, int64_t pe, void *scratch) {
    const int max_rows = (KT_FMT == KT_INT4 || w->format == KTCY_FP8_BLOCK) ? 2 : 4;
    const int64_t nkb = w->k_pad / KT_BK;
    uint8_t *decoded = (uint8_t *)scratch;
    (void)nkb;
    for (int64_t p = pb; p < pe; ++p) {
#if KT_FMT == KT_FP8
        /* decode the panel once (E4M3 -> bf16 is a table lookup), not once per row tile */
        const uint8_t *src = w->data + p * nkb * 512;
        for (int64_t i = 0; i < nkb * 512; ++i) ((uint16_t *)decoded)[i] = ktcy_e4m3_to_bf16(src[i]);
#endif
        for (int64_t m0 = 0; m0 < a->m;) {
            int64_t left = a->m - m0;
            int mb = left >= max_rows ? max_rows : left <= 1 ? 1 : left <= 2 ? 2 : 4;
            if (mb == 1) KT_NAME(micro)(1, a, w, m0, p, y, ldy, decoded);
            else if (mb == 2) KT_NAME(micro)(2, a, w, m0, p, y, ldy, decoded);
            else KT_NAME(micro)(4, a, w, m0, p, y, ldy, decoded);
            m0 += mb;
        }
    }
    return KTCY_OK;
}

#undef KT_AI
#undef KT_KPR
#undef KT_BK
#undef KT_BB
