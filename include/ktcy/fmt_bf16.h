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
#elif KT_SKEL == KT_SKEL_AVX2
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#include "traits_plain_rows.h"
#elif KT_SKEL == KT_SKEL_AVX512
#define KT_WKIND KT_W_BF16
#define KT_PREDECODE 0
#define KT_REG_DECODE 0
#include "traits_plain_rows.h"
#elif KT_SKEL == KT_SKEL_AMX
KT_AI const uint8_t *KT_(prepare_b)(const ktcy_weight *w, int64_t p, int np, uint8_t *buf) {
    (void)np; (void)buf;
    return w->data + p * (w->k_pad / 32) * 1024; /* the packed block is the B tile */
}
#else
#error "fmt_bf16.h: no traits for this skeleton"
#endif

#include "traits_unscaled.h"
