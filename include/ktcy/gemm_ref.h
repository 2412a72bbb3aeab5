/* Portable C GEMM over the packed layouts: the readable specification every ISA matches.
 * Y[m][n] = sum_k X[m][k] * W[n][k] with the format's scales, for panels [p0, p1).
 * Integer formats fix the float operation order that all ISAs reproduce bit for bit:
 *   INT8: (float)acc * a_scale[m] * w_scale[n]
 *   INT4: acc_f = acc_f + (float)group_acc * w_scale[g][n] over groups in order, then * a_scale[m] */
#ifndef KTCY_GEMM_REF_H
#define KTCY_GEMM_REF_H

#include "numeric.h"
#include "pack.h"
#include "types.h"

static inline int8_t ktcy_int4_code(const uint8_t *blk, int64_t e) {
    uint8_t byte = blk[e & 511];
    return (int8_t)((e < 512 ? byte & 0x0F : byte >> 4) - 8);
}

static inline int ktcy_gemm_int8_ref(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t p0,
                                     int64_t p1, void *scratch) {
    (void)scratch;
    const int64_t nkb = w->k_pad / 64;
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t nn = 0; nn < KTCY_PANEL && p * KTCY_PANEL + nn < w->n; ++nn) {
            int64_t n = p * KTCY_PANEL + nn;
            for (int64_t m = 0; m < a->m; ++m) {
                const int8_t *x = a->q + m * a->k_pad;
                int32_t acc = 0;
                for (int64_t k = 0; k < w->k_pad; ++k) {
                    const int8_t *blk = (const int8_t *)w->data + (p * nkb + k / 64) * 1024;
                    acc += (int32_t)x[k] * blk[ktcy_int8_offset(nn, k % 64)];
                }
                y[m * ldy + n] = (float)acc * a->scale[m] * w->scale[n];
            }
        }
    return KTCY_OK;
}

static inline int ktcy_gemm_int4_ref(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy, int64_t p0,
                                     int64_t p1, void *scratch) {
    (void)scratch;
    const int64_t nkb = w->k_pad / 64;
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t nn = 0; nn < KTCY_PANEL && p * KTCY_PANEL + nn < w->n; ++nn) {
            int64_t n = p * KTCY_PANEL + nn;
            for (int64_t m = 0; m < a->m; ++m) {
                const int8_t *x = a->q + m * a->k_pad;
                float acc = 0.0f;
                for (int64_t k0 = 0; k0 < w->k_pad; k0 += w->group) {
                    int32_t g_acc = 0;
                    for (int64_t k = k0; k < k0 + w->group; ++k) {
                        const uint8_t *blk = w->data + (p * nkb + k / 64) * 512;
                        g_acc += (int32_t)x[k] * ktcy_int4_code(blk, ktcy_int8_offset(nn, k % 64));
                    }
                    acc = acc + (float)g_acc * w->scale[(k0 / w->group) * w->n_pad + n];
                }
                y[m * ldy + n] = acc * a->scale[m];
            }
        }
    return KTCY_OK;
}

static inline float ktcy_ref_weight_bf16(const ktcy_weight *w, int64_t p, int64_t nn, int64_t k) {
    const int64_t nkb = w->k_pad / 32;
    int64_t off = ktcy_pair_offset(nn, k % 32);
    if (w->format == KTCY_BF16)
        return ktcy_bf16_to_f32(((const uint16_t *)(w->data + (p * nkb + k / 32) * 1024))[off]);
    return ktcy_bf16_to_f32(ktcy_e4m3_to_bf16(w->data[(p * nkb + k / 32) * 512 + off]));
}

/* BF16, FP8 per-channel and FP8 128x128-block: bf16 activations, float accumulation. */
static inline int ktcy_gemm_bf16_family_ref(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                                            int64_t p0, int64_t p1, void *scratch) {
    (void)scratch;
    const int64_t B = KTCY_FP8_SCALE_BLOCK, kblocks = (w->k + B - 1) / B;
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t nn = 0; nn < KTCY_PANEL && p * KTCY_PANEL + nn < w->n; ++nn) {
            int64_t n = p * KTCY_PANEL + nn;
            for (int64_t m = 0; m < a->m; ++m) {
                const uint16_t *x = a->bf16 + m * a->k_pad;
                float acc = 0.0f, part = 0.0f;
                for (int64_t k = 0; k < w->k_pad; ++k) {
                    part += ktcy_bf16_to_f32(x[k]) * ktcy_ref_weight_bf16(w, p, nn, k);
                    int group_end = (k + 1) % B == 0 || k + 1 == w->k_pad;
                    if (w->format == KTCY_FP8_BLOCK && group_end) {
                        acc += part * w->scale[(n / B) * kblocks + k / B];
                        part = 0.0f;
                    }
                }
                if (w->format == KTCY_BF16) acc = part;
                if (w->format == KTCY_FP8_PERCHANNEL) acc = part * w->scale[n];
                y[m * ldy + n] = acc;
            }
        }
    return KTCY_OK;
}

#endif
