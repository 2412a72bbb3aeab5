/* Scalar number formats: bfloat16 and float8 E4M3 (the "fn" variant: no infinities,
 * 0x7F/0xFF are NaN, subnormals kept), and the rounding and row scans that weight and
 * activation quantization share.  These are the bit-exact definitions that every vector path
 * must reproduce. */
#ifndef KTCY_NUMERIC_H
#define KTCY_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t ktcy_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float ktcy_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Round half to even for |v| < 2^22 by adding and removing 1.5 * 2^23 (exact in the default
 * rounding mode; without -ffast-math the compiler may not fold it away): unlike nearbyintf it
 * vectorises with the baseline SSE2 the package is built for. */
static inline float ktcy_rint_small(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

static inline int ktcy_row_finite(const float *x, int64_t k) {
    int finite = 1;
    for (int64_t i = 0; i < k; ++i) finite &= isfinite(x[i]) != 0;
    return finite;
}

/* The largest |x[i]|, for finite rows (every caller checks them, and ignores this otherwise).
 * Taken on the bits: |x| of a finite float orders as its bit pattern does, and an integer max
 * vectorizes where a float one (fmaxf's NaN rule, or a compare whose signed zeros the
 * compiler must respect) does not. */
static inline float ktcy_row_amax(const float *x, int64_t k) {
    int32_t amax = 0;
    for (int64_t i = 0; i < k; ++i) {
        const int32_t a = (int32_t)(ktcy_f32_bits(x[i]) & 0x7FFFFFFFu);
        amax = a > amax ? a : amax;
    }
    return ktcy_bits_f32((uint32_t)amax);
}

/* 2^e as a float, for e in [-126, 127] (a normal number: exponent field e + 127). */
static inline float ktcy_pow2(int e) { return ktcy_bits_f32((uint32_t)(e + 127) << 23); }
static inline float ktcy_bf16_to_f32(uint16_t h) { return ktcy_bits_f32((uint32_t)h << 16); }

/* E4M3 codes placed by bit moves into a float (sign at bit 31, the 7 magnitude bits at 20..26)
 * are worth the value x 2^-KTCY_E4M3_BITMOVE_SHIFT, exactly (E4M3 subnormals become float
 * subnormals).  The float decodes widen each activation row times 2^k with
 * k = ktcy_prescale_shift(field): field the row's largest bf16 exponent field, |x| 2^k < 2^126,
 * so no product (below 2^-111) nor K of them can overflow.  Rows whose field passes
 * KTCY_E4M3_WIDE_FIELD (2^15 and up) would push their small values' products below the normal
 * range: those take another decode. */
#define KTCY_E4M3_BITMOVE_SHIFT 120
#define KTCY_E4M3_WIDE_FIELD 141 /* bf16 exponent field of 2^14 */
static inline int ktcy_prescale_shift(int field) {
    return field > 252 - KTCY_E4M3_BITMOVE_SHIFT ? 252 - field : KTCY_E4M3_BITMOVE_SHIFT;
}

/* Round to nearest even; NaN stays NaN (quieted), infinities stay infinite. */
static inline uint16_t ktcy_f32_to_bf16(float f) {
    uint32_t u = ktcy_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* E4M3 magnitude (low 7 bits) -> bf16 bits, as a constant expression so the table below is
 * read-only data.  Normal: exponent bias 7 -> 127, mantissa 3 -> 7 bits.  Subnormal m*2^-9
 * is renormalised by hand; every E4M3 value is exactly a bf16 value. */
#define KTCY_E4M3_MAG_BF16(b)                                                           \
    ((b) == 0x7F ? 0x7FC0                                                               \
     : ((b) >> 3) ? (((((b) >> 3) + 120) << 7) | (((b) & 7) << 4))                      \
     : ((b) & 7) == 0 ? 0                                                               \
     : ((b) & 7) == 1 ? (118 << 7)                                                      \
     : ((b) & 7) < 4 ? ((119 << 7) | (((b) & 1) << 6))                                  \
                     : ((120 << 7) | (((b) & 3) << 5)))
#define KTCY_E4M3_X4(b) KTCY_E4M3_MAG_BF16(b), KTCY_E4M3_MAG_BF16(b + 1), \
    KTCY_E4M3_MAG_BF16(b + 2), KTCY_E4M3_MAG_BF16(b + 3)
#define KTCY_E4M3_X16(b) KTCY_E4M3_X4(b), KTCY_E4M3_X4(b + 4), KTCY_E4M3_X4(b + 8), KTCY_E4M3_X4(b + 12)

static const uint16_t KTCY_E4M3_TO_BF16[128] = {
    KTCY_E4M3_X16(0), KTCY_E4M3_X16(16), KTCY_E4M3_X16(32), KTCY_E4M3_X16(48),
    KTCY_E4M3_X16(64), KTCY_E4M3_X16(80), KTCY_E4M3_X16(96), KTCY_E4M3_X16(112)};

static inline uint16_t ktcy_e4m3_to_bf16(uint8_t b) {
    return (uint16_t)(((uint16_t)(b & 0x80) << 8) | KTCY_E4M3_TO_BF16[b & 0x7F]);
}

#define KTCY_E4M3_MAX 448.0f

/* 1 when some of the n E4M3 codes is NaN (0x7F or 0xFF).  One pass, branch-free (vectorizes). */
static inline int32_t ktcy_e4m3_any_nan(const uint8_t *codes, int64_t n) {
    uint8_t any = 0;
    for (int64_t i = 0; i < n; ++i) any |= (uint8_t)((codes[i] & 0x7F) == 0x7F);
    return any;
}

/* E2M1 (MXFP4 element: sign, 2 exponent bits, 1 mantissa bit; no inf/NaN) -> bf16 bits.
 * Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; every one is exactly a bf16 value. */
static const uint16_t KTCY_E2M1_TO_BF16[16] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* 2 x E2M1 value + 12 of codes 0..15, in [0, 24] (2 x 0.5 = 1, ..., 2 x -6 = -12): MXFP4's codes
 * as the unsigned bytes of integer dot products (the + 12 folds into the activations' block sums). */
#define KTCY_E2M1_TWICE_BIASED 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* E8M0 exponents e (value 2^(e-127)) for which every E2M1 value times the scale is a normal
 * bf16, so decoding = adding (e - 127) to the bf16 exponent field is exact (0.5 * 2^(e-127)
 * >= 2^-126 and 6 * 2^(e-127) < 2^128).  Packing refuses others on non-zero codes. */
#define KTCY_E8M0_MIN 2
#define KTCY_E8M0_MAX 252

/* One MXFP4 weight as bf16 bits: code (4 bits) scaled by 2^(e - 127). */
static inline uint16_t ktcy_mxfp4_to_bf16(uint8_t code, uint8_t e) {
    const uint16_t v = KTCY_E2M1_TO_BF16[code & 15];
    return (v & 0x7FFF) ? (uint16_t)((int)v + ((int)e - 127) * 128) : v;
}

/* float32 -> E4M3, round to nearest even, saturating to +-448 (no code means infinity). */
static inline uint8_t ktcy_f32_to_e4m3(float f) {
    uint32_t u = ktcy_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(f);
    if (a != a) return sign | 0x7F;
    if (a >= KTCY_E4M3_MAX) return sign | 0x7E;
    if (a < 0.015625f) /* below 2^-6: subnormal grid of step 2^-9; code 8 is the first normal */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    uint32_t v = ktcy_f32_bits(a);
    v += 0x7FFFFu + ((v >> 20) & 1u);           /* round the 23-bit mantissa to 3 bits */
    uint32_t code = (((v >> 23) - 120u) << 3) | ((v >> 20) & 7u);
    return sign | (uint8_t)(code > 0x7E ? 0x7E : code);
}

#endif
