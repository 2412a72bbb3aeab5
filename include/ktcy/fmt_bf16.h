/* BF16 traits: bf16 weights as stored, bf16 activations, float sums, no scales.
 * Included by a skeleton instantiation; no include guard. */
#define KT_ROW KTCY_ROW_BF16
#define KT_FORMATS (1 << KTCY_FMT_BF16)
#include "traits_begin.h"

#if KT_SKEL == KT_SKEL_REF
KT_AI float KT_(code)(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    const uint16_t *blk = (const uint16_t *)(w->data + (p * (w->k_pad / 32) + k / 32) * 1024);
    return ktcy_bf16_to_f32(blk[ktcy_pair_offset(nn, k % 32)]);
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->k_pad; }
KT_AI float KT_(group)(float acc, float part, const ktcy_weight *w, int64_t n, int64_t g) {
    (void)w; (void)n; (void)g;
    return acc + part;
}
KT_AI float KT_(final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)a; (void)w; (void)m; (void)n;
    return acc;
}

#elif KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0
#include "traits_no_groups.h"
KT_AI __m256i KT_(half)(const uint8_t *blk, int r, int h) { return _mm256_loadu_si256((const __m256i *)(blk + r * 64 + h * 32)); }
KT_AI __m256 KT_(final)(__m256i acc, __m256 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc; (void)a; (void)w; (void)m; (void)n0;
    return _mm256_castsi256_ps(acc);
}

#elif KT_SKEL == KT_SKEL_AVX512
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#include "traits_no_groups.h"
typedef struct { int unused; } KT_(ctx);
KT_AI KT_(ctx) KT_(make_ctx)(void) { KT_(ctx) c = {0}; return c; }
KT_AI void KT_(rows)(const KT_(ctx) *c, const uint8_t *blk, int r, kt_vec2 out[2]) {
    (void)c;
    out[0].v0 = _mm512_loadu_si512(blk + r * 64);
    out[1].v0 = _mm512_loadu_si512(blk + r * 64 + 64);
}
KT_AI __m512 KT_(final)(KT_(acc_t) acc, __m512 facc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n0) {
    (void)facc; (void)a; (void)w; (void)m; (void)n0;
    return acc;
}

#elif KT_SKEL == KT_SKEL_AMX
KT_AI const uint8_t *KT_(prepare_b)(const ktcy_weight *w, int64_t p, int np, uint8_t *buf) {
    (void)np; (void)buf;
    return w->data + p * (w->k_pad / 32) * 1024; /* the packed block is the B tile */
}
KT_AI int64_t KT_(group_len)(const ktcy_weight *w) { return w->k_pad; }
KT_AI float KT_(tile_group)(float acc, float c, const ktcy_weight *w, int64_t n, int64_t g) {
    (void)w; (void)n; (void)g;
    return acc + c;
}
KT_AI float KT_(tile_final)(float acc, const ktcy_act *a, const ktcy_weight *w, int64_t m, int64_t n) {
    (void)a; (void)w; (void)m; (void)n;
    return acc;
}

#else
#error "fmt_bf16.h: no traits for this skeleton"
#endif
