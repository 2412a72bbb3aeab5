/* The weight formats: one descriptor row each.  Everything that depends on a format's geometry
 * (padding, block bytes, scale shapes, which activations it multiplies) reads this table; the
 * Cython layer exports it to Python (ktcy._native.format_descriptors()).
 *
 * Columns of a row (KTCY_ROW_<id>; <id> is the enum suffix KTCY_FMT_<id> and the Python name):
 *   code          how one weight is stored:  S8 int8 (with mins: the unsigned code u as u - 128) |
 *                 U4 4-bit code (+8 when symmetric) | BF16 bits |
 *                 E4M3 byte | E2M1 4-bit float (MXFP4, OCP microscaling)
 *   block_k       K values of one channel in a packed block (16 channels per block)
 *   block_bytes   bytes of one packed block
 *   act           activations the kernels multiply by: INT8 (per-row symmetric) | BF16
 *   scale         NONE | CHANNEL [n_pad] | GROUP panel-major [n_pad/16][k_pad/group * 16] (ktcy_group_index) |
 *                 BLOCK128 [ceil(n/128)][ceil(k/128)] |
 *                 IN_BLOCK: E8M0 power-of-two exponents stored inside each block (MXFP4: one per
 *                 channel and 32 K values, the 16 bytes after the block's 256 code bytes)
 *   groups        allowed group sizes (bit mask of 16/32/64/128) for GROUP scales; for an IN_BLOCK format
 *                 with int8 activations the one group its activation sums are taken over (the
 *                 E8M0 block, 32); else 0
 *   zero_points   1: each (K group, channel) has a zero point z, w = s * (code - z), stored uint8
 *                 laid out like the GROUP scales; 0: the code's fixed bias (INT4: z = 8)
 *   colsum        1 when the packed weight keeps each channel's code sum [n_pad] (s8 codes on VNNI)
 *   mins          1: each (K group, channel) also has a float offset, w = s * code + min (the value of
 *                 code 0: llama.cpp's Q4_K and Q4_1 (U4), Q5_K and Q5_1 (S8: codes 0..255)), kept in
 *                 the GROUP scale array beside the scales
 *                 (each panel's group holds its 16 scales, then its 16 mins: ktcy_side_width 2)
 *
 * Adding a format: a row and a KTCY_FORMAT_LIST entry here, one traits header fmt_<id>.h, its
 * instantiation lines in kernels.h/registry.h, its quantizer/packer, tests (README: how to add a format). */
#ifndef KTCY_FORMATS_H
#define KTCY_FORMATS_H

#include <stdint.h>

/* Kinds are macros, not enums, so the kernel skeletons can test them in #if. */
#define KTCY_CODE_S8 0
#define KTCY_CODE_U4 1
#define KTCY_CODE_BF16 2
#define KTCY_CODE_E4M3 3
#define KTCY_CODE_E2M1 4
#define KTCY_ACT_INT8 0
#define KTCY_ACT_BF16 1
#define KTCY_SCALE_NONE 0
#define KTCY_SCALE_CHANNEL 1
#define KTCY_SCALE_GROUP 2
#define KTCY_SCALE_BLOCK128 3
#define KTCY_SCALE_IN_BLOCK 4
#define KTCY_GROUPS_32_64_128 (32 | 64 | 128)
#define KTCY_GROUPS_16_TO_128 (16 | 32 | 64 | 128)

/*                       code            block_k block_bytes act            scale                groups                 zp colsum mins */
#define KTCY_ROW_BF16           KTCY_CODE_BF16, 32, 1024, KTCY_ACT_BF16, KTCY_SCALE_NONE,     0,                     0, 0, 0
#define KTCY_ROW_INT8           KTCY_CODE_S8,   64, 1024, KTCY_ACT_INT8, KTCY_SCALE_CHANNEL,  0,                     0, 1, 0
#define KTCY_ROW_INT4           KTCY_CODE_U4,   64, 512,  KTCY_ACT_INT8, KTCY_SCALE_GROUP,    KTCY_GROUPS_32_64_128, 0, 0, 0
#define KTCY_ROW_FP8_PERCHANNEL KTCY_CODE_E4M3, 32, 512,  KTCY_ACT_BF16, KTCY_SCALE_CHANNEL,  0,                     0, 0, 0
#define KTCY_ROW_FP8_BLOCK      KTCY_CODE_E4M3, 32, 512,  KTCY_ACT_BF16, KTCY_SCALE_BLOCK128, 0,                     0, 0, 0
#define KTCY_ROW_INT4_ZP        KTCY_CODE_U4,   64, 512,  KTCY_ACT_INT8, KTCY_SCALE_GROUP,    KTCY_GROUPS_32_64_128, 1, 0, 0
#define KTCY_ROW_MXFP4          KTCY_CODE_E2M1, 32, 272,  KTCY_ACT_BF16, KTCY_SCALE_IN_BLOCK, 0,                     0, 0, 0
#define KTCY_ROW_MXFP4_A8       KTCY_CODE_E2M1, 64, 544,  KTCY_ACT_INT8, KTCY_SCALE_IN_BLOCK, 32,                    0, 0, 0
#define KTCY_ROW_INT4_MIN       KTCY_CODE_U4,   64, 512,  KTCY_ACT_INT8, KTCY_SCALE_GROUP,    KTCY_GROUPS_32_64_128, 0, 0, 1
#define KTCY_ROW_INT8_GROUP     KTCY_CODE_S8,   64, 1024, KTCY_ACT_INT8, KTCY_SCALE_GROUP,    KTCY_GROUPS_16_TO_128, 0, 0, 0
#define KTCY_ROW_INT8_MIN       KTCY_CODE_S8,   64, 1024, KTCY_ACT_INT8, KTCY_SCALE_GROUP,    KTCY_GROUPS_16_TO_128, 0, 0, 1

/* Every format, in enum order (the numbers are part of the packed-file metadata: append only). */
#define KTCY_FORMAT_LIST(X) X(BF16) X(INT8) X(INT4) X(FP8_PERCHANNEL) X(FP8_BLOCK) X(INT4_ZP) X(MXFP4) X(MXFP4_A8) X(INT4_MIN) X(INT8_GROUP) X(INT8_MIN)

/* One column of a row, usable in #if: KTCY_ROW_COL(BLOCK_BYTES, KTCY_ROW_INT8) -> 1024 (the
 * columns the skeletons read; add an accessor when another is needed). */
#define KTCY_COL_BLOCK_BYTES(c, bk, bb, act, scale, groups, zp, cs, mins) bb
#define KTCY_COL_ACT(c, bk, bb, act, scale, groups, zp, cs, mins) act
#define KTCY_ROW_COL_(col, ...) KTCY_COL_##col(__VA_ARGS__)
#define KTCY_ROW_COL(col, row) KTCY_ROW_COL_(col, row)

#define KTCY_FMT_ENUM(id) KTCY_FMT_##id,
enum ktcy_format { KTCY_FORMAT_LIST(KTCY_FMT_ENUM) KTCY_NUM_FORMATS };
#undef KTCY_FMT_ENUM

typedef struct {
    const char *name;
    int32_t code, block_k, block_bytes, act, scale, groups, zero_points, colsum, mins;
} ktcy_format_desc;

#define KTCY_DESC_(id, ...) {id, __VA_ARGS__}
#define KTCY_DESC(id, row) KTCY_DESC_(id, row)
#define KTCY_FMT_ROW(id) KTCY_DESC(#id, KTCY_ROW_##id),
static const ktcy_format_desc KTCY_FORMAT_DESCS[KTCY_NUM_FORMATS] = {KTCY_FORMAT_LIST(KTCY_FMT_ROW)};
#undef KTCY_FMT_ROW

/* Every packed block holds 16 output channels ("a panel"). */
#define KTCY_PANEL 16
#define KTCY_SCALE_BLOCK 128
/* E2M1 codes are laid out in sub-blocks of 32 K values (one E8M0 exponent per channel): 256 code
 * bytes and 16 exponents.  MXFP4's block is one; MXFP4_A8's (64 K, the int8 skeletons' block)
 * is two, so both formats hold the same bytes where K is a multiple of 64. */
#define KTCY_E2M1_SUB_K 32
#define KTCY_E2M1_SUB_BYTES 272

static inline const ktcy_format_desc *ktcy_format(int format) {
    return format >= 0 && format < KTCY_NUM_FORMATS ? &KTCY_FORMAT_DESCS[format] : 0;
}

/* 1 when `group` is a legal group size of the format (0 for formats without groups). */
static inline int ktcy_group_ok(int format, int group) {
    const ktcy_format_desc *d = ktcy_format(format);
    if (!d) return 0;
    if (d->scale != KTCY_SCALE_GROUP) return group == d->groups;
    return group > 0 && (group & (group - 1)) == 0 && (d->groups & group) != 0;
}

/* K is padded so that a block (and a scale group) never straddles the end. */
static inline int64_t ktcy_k_pad(int format, int64_t k, int group) {
    const ktcy_format_desc *d = ktcy_format(format);
    int64_t unit = d->block_k;
    if (d->scale == KTCY_SCALE_GROUP && group > unit) unit = group;
    return (k + unit - 1) / unit * unit;
}
static inline int64_t ktcy_n_pad(int64_t n) { return (n + KTCY_PANEL - 1) / KTCY_PANEL * KTCY_PANEL; }

static inline int64_t ktcy_data_bytes(int format, int64_t n, int64_t k, int group) {
    const ktcy_format_desc *d = ktcy_format(format);
    return ktcy_n_pad(n) / KTCY_PANEL * (ktcy_k_pad(format, k, group) / d->block_k) * d->block_bytes;
}

/* Where GROUP scales and zero points keep (group g, channel n): panel-major, a 16-channel panel's
 * groups in order, so a panel's K sweep reads its scales as one short forward stream beside its
 * codes.  Group-major rows (one n_pad apart) put every group of a decode sweep on another cache
 * line and often another page: AVX2 INT4 decode took 0.82-0.92x the time without them.  (Quads of
 * 4 panels, the AVX-512 tile width, measured 7-14% slower than this on AVX2's one-panel sweeps.) */
static inline int64_t ktcy_group_index(int64_t groups, int64_t g, int64_t n) {
    return ((n / KTCY_PANEL) * groups + g) * KTCY_PANEL + n % KTCY_PANEL;
}

/* Floats per (group, channel) in a GROUP scale array: 2 when the format keeps mins beside the
 * scales (a panel's group: 16 scales, then 16 mins; both one forward stream with the codes). */
static inline int ktcy_side_width(int format) { return ktcy_format(format)->mins ? 2 : 1; }

/* A panel-major per-(group, channel) array of `width` values each: [panels][groups * 16 * width]. */
static inline void ktcy_group_array_shape(int format, int64_t n, int64_t k, int group, int width, int64_t shape[2]) {
    shape[0] = ktcy_n_pad(n) / KTCY_PANEL;
    shape[1] = ktcy_k_pad(format, k, group) / group * KTCY_PANEL * width;
}

/* The scale array a kernel reads, as [rows][cols] float32 (0 x 0 when the format has none);
 * GROUP scales as [panels][groups * 16 * side width] (Python holds them as [panels][groups][16 or
 * 32]: a shape no group-major [groups][n_pad] array can have, so one is never taken for the other). */
static inline void ktcy_scale_shape(int format, int64_t n, int64_t k, int group, int64_t shape[2]) {
    const ktcy_format_desc *d = ktcy_format(format);
    const int64_t B = KTCY_SCALE_BLOCK;
    shape[0] = shape[1] = 0;
    if (d->scale == KTCY_SCALE_CHANNEL) { shape[0] = 1; shape[1] = ktcy_n_pad(n); }
    if (d->scale == KTCY_SCALE_GROUP) ktcy_group_array_shape(format, n, k, group, ktcy_side_width(format), shape);
    if (d->scale == KTCY_SCALE_BLOCK128) { shape[0] = (n + B - 1) / B; shape[1] = (k + B - 1) / B; }
}

/* Zero points, uint8 [rows][cols] (0 x 0 when the format has none): laid out like GROUP scales
 * of side width 1 (one byte per group and channel, whatever floats the scale array holds). */
static inline void ktcy_zero_shape(int format, int64_t n, int64_t k, int group, int64_t shape[2]) {
    shape[0] = shape[1] = 0;
    if (ktcy_format(format)->zero_points) ktcy_group_array_shape(format, n, k, group, 1, shape);
}

static inline int64_t ktcy_colsum_count(int format, int64_t n) {
    return ktcy_format(format)->colsum ? ktcy_n_pad(n) : 0;
}

#endif
