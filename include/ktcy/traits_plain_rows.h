/* Weight rows of a format whose packed block is already what the dot product takes (INT8, BF16):
 * plain loads, no decode state.  Included by such a traits header for the vector skeletons; no
 * include guard. */
#define KT_PLAIN_ROWS 1
#if KT_SKEL == KT_SKEL_AVX2
#define KT_FETCH_L2(a) ((a)->tiles.plain_fetch_l2 && (a)->m <= 4) /* decode calls: registry.h */
KT_AI kt_w256 KT_(half)(const uint8_t *blk, int r, int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + r * 64 + h * 32));
    return KT_WKIND == KT_W_BF16 ? kt_bf16_split(v) : kt_int_half(v);
}
#elif KT_SKEL == KT_SKEL_AVX512
typedef struct { int unused; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) { KT_(ctx) c = {0}; return c; }
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    out[0].v0 = _mm512_loadu_si512(blk + r * 64);
    out[1].v0 = _mm512_loadu_si512(blk + r * 64 + 64);
}
#endif
