/* Weight quantization (float32 rows -> codes + scales; activations: act_quant.h).  One portable
 * definition each: every ISA reads what these write, so the numbers a kernel sees do not depend
 * on the machine that packed them. */
#ifndef KTCY_QUANTIZE_H
#define KTCY_QUANTIZE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "formats.h"
#include "numeric.h"

/* INT8 per output channel: scale = amax/127, q = rint(w/scale) (half to even), saturated.
 * Returns the first row in [n0, n1) that is not finite, or -1. */
static inline int64_t ktcy_quantize_int8_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                              int8_t *q, int64_t ldq, float *scale) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        float s = ktcy_row_amax(row, k) / 127.0f;
        scale[n] = s;
        for (int64_t i = 0; i < k; ++i) {
            float v = s > 0.0f ? ktcy_rint_small(row[i] / s) : 0.0f;
            q[n * ldq + i] = (int8_t)fminf(127.0f, fmaxf(-127.0f, v));
        }
    }
    return -1;
}

static inline float ktcy_int4_clamp(float v) { return v < -8.0f ? -8.0f : v > 7.0f ? 7.0f : v; }

/* INT4 group-wise, symmetric codes in [-8, 7].  amax/7 wastes the -8 code and rounds the
 * largest weight of every group exactly; a least-squares search over candidate scales that
 * map the largest-magnitude weight near -8 or +7 cuts the error by ~15% (see the tests).
 * For codes q the best scale is d = <x,q>/<q,q> and the squared error |x|^2 - <x,q>^2/<q,q>, so
 * each candidate costs one pass.  The stored scale may be negative. */
static inline void ktcy_int4_group(const float *x, int g, int8_t *q, float *scale) {
    float vmax = 0.0f;
    for (int i = 0; i < g; ++i) if (fabsf(x[i]) > fabsf(vmax)) vmax = x[i];
    if (vmax == 0.0f) { memset(q, 0, (size_t)g); *scale = 0.0f; return; }
    double best_gain = -1.0;
    float best_d = 0.0f, best_inv = 0.0f;
    for (int side = 0; side < 2; ++side) {
        for (int step = -10; step <= 10; ++step) {
            /* side 0 sends vmax towards -8 (negative scale), side 1 towards +7 */
            float target = side == 0 ? -8.0f + 0.1f * step : 7.0f + 0.1f * step;
            float inv = target / vmax, sxq = 0.0f, sqq = 0.0f;
            for (int i = 0; i < g; ++i) {
                float c = ktcy_int4_clamp(ktcy_rint_small(x[i] * inv));
                sxq += x[i] * c;
                sqq += c * c;
            }
            if (sqq <= 0.0f) continue;
            double gain = (double)sxq * sxq / sqq; /* error = |x|^2 - gain */
            if (gain > best_gain) { best_gain = gain; best_d = sxq / sqq; best_inv = inv; }
        }
    }
    for (int i = 0; i < g; ++i) q[i] = (int8_t)ktcy_int4_clamp(ktcy_rint_small(x[i] * best_inv));
    *scale = best_d;
}

/* scale is [k_pad/group][ld_scale], group-major as quantize() returns it (packing rearranges it
 * panel-major for the kernels: kernels.panel_major). */
static inline int64_t ktcy_quantize_int4_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                              int64_t n1, int8_t *q, int64_t ldq, float *scale,
                                              int64_t ld_scale) {
    float tail[128];
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, ++g) {
            int64_t len = k - k0 < group ? k - k0 : group;
            const float *src = row + k0;
            if (len < group) { /* the last group is zero-padded, exactly as the kernels see it */
                memset(tail, 0, sizeof tail);
                memcpy(tail, src, (size_t)len * sizeof(float));
                src = tail;
            }
            ktcy_int4_group(src, group, q + n * ldq + k0, scale + g * ld_scale + n);
        }
    }
    return -1;
}

/* INT8 group-wise, symmetric: per group scale = amax/127, q = rint(w/scale) (half to even),
 * saturated at +-127 (symmetric: the kernels take -128 too, as released codes hold it); the zero-padded tail of
 * the last group gets code 0.  scale is [k_pad/group][ld_scale], group-major as INT4's.
 * Returns the first row in [n0, n1) that is not finite, or -1. */
static inline int64_t ktcy_quantize_int8_group_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                                    int64_t n1, int8_t *q, int64_t ldq, float *scale,
                                                    int64_t ld_scale) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, ++g) {
            const int64_t len = k - k0 < group ? k - k0 : group;
            const float s = ktcy_row_amax(row + k0, len) / 127.0f;
            for (int64_t i = 0; i < group && k0 + i < ldq; ++i) {
                const float v = i < len && s > 0.0f ? ktcy_rint_small(row[k0 + i] / s) : 0.0f;
                q[n * ldq + k0 + i] = (int8_t)fminf(127.0f, fmaxf(-127.0f, v));
            }
            scale[g * ld_scale + n] = s;
        }
    }
    return -1;
}

/* Asymmetric, per group, codes 0..top (top 15: INT4_ZP, INT4_MIN; 255: INT8_MIN), with zero
 * points (zero != NULL) or with float mins (mins != NULL).
 *   zero points: the range [min, max] widened to contain 0 (so 0 is exact), s = (max - min) / top,
 *     z = rint(-min / s) in [0, top], q = clamp(rint(w / s) + z, 0, top); the zero-padded tail of
 *     the last group is quantized as the kernels see it (code z).
 *   mins (llama.cpp's Q4_1 and Q5_1 rule): min = the group's least value, s = (max - min) / top,
 *     q = clamp(rint((w - min) / s), 0, top), so w ~ s * q + min with both ends exact; a constant
 *     group is s = 0, q = 0, exactly min; the padded tail gets code 0 (activations are zero there).
 * Writes q - (top + 1) / 2 (the layout's signed convention: the nibble or byte stored is q), and
 * scale and zero or min [k_pad/group][ld_scale].  Returns the first row in [n0, n1) that is not
 * finite, or -1. */
static inline int64_t ktcy_quantize_asym_rows(const float *w, int64_t ldw, int64_t k, int group, int64_t n0,
                                              int64_t n1, int8_t *q, int64_t ldq, float *scale, uint8_t *zero,
                                              float *mins, int64_t ld_scale, int top) {
    const float levels = (float)top, offset = (float)((top + 1) / 2);
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, ++g) {
            const int64_t len = k - k0 < group ? k - k0 : group;
            float lo = zero ? 0.0f : row[k0], hi = lo;
            for (int64_t i = 0; i < len; ++i) { lo = fminf(lo, row[k0 + i]); hi = fmaxf(hi, row[k0 + i]); }
            const float s = (hi - lo) / levels;
            const float z = !zero ? 0.0f : s > 0.0f ? fminf(levels, fmaxf(0.0f, ktcy_rint_small(-lo / s))) : offset;
            for (int64_t i = 0; i < group && k0 + i < ldq; ++i) {
                const float v = !(i < len && s > 0.0f) ? z
                                : zero ? ktcy_rint_small(row[k0 + i] / s) + z : ktcy_rint_small((row[k0 + i] - lo) / s);
                q[n * ldq + k0 + i] = (int8_t)(fminf(levels, fmaxf(0.0f, v)) - offset);
            }
            scale[g * ld_scale + n] = s;
            if (zero) zero[g * ld_scale + n] = (uint8_t)z;
            else mins[g * ld_scale + n] = lo;
        }
    }
    return -1;
}

/* |v| -> E2M1 magnitude code (0..7), round to nearest with ties to the even code, saturating at 6. */
static inline uint8_t ktcy_e2m1_magnitude(float a) {
    return a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3 : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
}

/* MXFP4 (OCP microscaling): per 32 K values of a row, the shared exponent
 * e = floor(log2(amax)) - 2 (E2M1's largest exponent) + 127, kept inside the range where the
 * kernels decode exactly; codes are E2M1 of w / 2^(e - 127).  Writes codes [n][ldq] (0..15) and
 * exps [n][ld_exp].  Returns the first row in [n0, n1) that is not finite, or -1. */
static inline int64_t ktcy_quantize_mxfp4_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                               uint8_t *q, int64_t ldq, uint8_t *exps, int64_t ld_exp) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        for (int64_t k0 = 0, b = 0; k0 < k; k0 += 32, ++b) {
            const int64_t len = k - k0 < 32 ? k - k0 : 32;
            const float amax = ktcy_row_amax(row + k0, len);
            int e = 127;
            if (amax > 0.0f) {
                int e2;
                frexpf(amax, &e2); /* amax = f * 2^e2, f in [0.5, 1): floor(log2 amax) = e2 - 1 */
                e = e2 - 1 - 2 + 127;
                e = e < KTCY_E8M0_MIN ? KTCY_E8M0_MIN : e > KTCY_E8M0_MAX ? KTCY_E8M0_MAX : e;
            }
            const float inv = ldexpf(1.0f, 127 - e);
            for (int64_t i = 0; i < len; ++i) {
                const float v = row[k0 + i] * inv;
                const uint8_t mag = ktcy_e2m1_magnitude(fabsf(v));
                q[n * ldq + k0 + i] = (uint8_t)(mag | (v < 0.0f && mag ? 8 : 0));
            }
            exps[n * ld_exp + b] = (uint8_t)e;
        }
    }
    return -1;
}

/* FP8 E4M3 per output channel: scale = amax/448, q = e4m3(w/scale). */
static inline int64_t ktcy_quantize_fp8_rows(const float *w, int64_t ldw, int64_t k, int64_t n0, int64_t n1,
                                             uint8_t *q, int64_t ldq, float *scale) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *row = w + n * ldw;
        if (!ktcy_row_finite(row, k)) return n;
        float s = ktcy_row_amax(row, k) / KTCY_E4M3_MAX;
        scale[n] = s;
        for (int64_t i = 0; i < k; ++i) q[n * ldq + i] = s > 0.0f ? ktcy_f32_to_e4m3(row[i] / s) : 0;
    }
    return -1;
}

/* FP8 E4M3 with one scale per 128x128 block (DeepSeek-V3's weight_scale_inv): one block row
 * (128 output channels starting at n0) at a time.  Dequantization multiplies by the scale. */
static inline int64_t ktcy_quantize_fp8_block_rows(const float *w, int64_t ldw, int64_t n, int64_t k, int64_t n0,
                                                   uint8_t *q, int64_t ldq, float *scale_inv) {
    const int64_t B = KTCY_SCALE_BLOCK, kblocks = (k + B - 1) / B;
    int64_t n1 = n0 + B < n ? n0 + B : n;
    for (int64_t r = n0; r < n1; ++r)
        if (!ktcy_row_finite(w + r * ldw, k)) return r;
    for (int64_t j = 0; j < kblocks; ++j) {
        int64_t k0 = j * B, len = k - k0 < B ? k - k0 : B;
        float amax = 0.0f;
        for (int64_t r = n0; r < n1; ++r) amax = fmaxf(amax, ktcy_row_amax(w + r * ldw + k0, len));
        float s = amax / KTCY_E4M3_MAX;
        scale_inv[(n0 / B) * kblocks + j] = s;
        for (int64_t r = n0; r < n1; ++r)
            for (int64_t i = 0; i < len; ++i)
                q[r * ldq + k0 + i] = s > 0.0f ? ktcy_f32_to_e4m3(w[r * ldw + k0 + i] / s) : 0;
    }
    return -1;
}

#endif
