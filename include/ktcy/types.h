/* Shared vocabulary of the kernels: formats, ISAs, packed-weight and activation descriptors. */
#ifndef KTCY_TYPES_H
#define KTCY_TYPES_H

#include <stdint.h>

enum ktcy_format {
    KTCY_BF16 = 0, KTCY_INT8 = 1, KTCY_INT4 = 2, KTCY_FP8_PERCHANNEL = 3, KTCY_FP8_BLOCK = 4,
    KTCY_NUM_FORMATS = 5
};

enum ktcy_isa { KTCY_REF = 0, KTCY_AVX2 = 1, KTCY_AVX512 = 2, KTCY_AMX = 3, KTCY_AMX_EMU = 4, KTCY_NUM_ISAS = 5 };

enum ktcy_status { KTCY_OK = 0, KTCY_ERR_TILE = 1, KTCY_ERR_SCRATCH = 2 };

/* Every packed block holds 16 output channels ("a panel"); its K extent depends on the format. */
#define KTCY_PANEL 16
#define KTCY_FP8_SCALE_BLOCK 128

/* Format families of the vector kernel templates (FP8 covers both scale kinds). */
#define KT_INT8 0
#define KT_INT4 1
#define KT_BF16 2
#define KT_FP8 3

/* K elements in one packed block, and bytes in one packed block. */
static inline int ktcy_block_k(int format) {
    return (format == KTCY_INT8 || format == KTCY_INT4) ? 64 : 32;
}
static inline int ktcy_block_bytes(int format) {
    return (format == KTCY_BF16 || format == KTCY_INT8) ? 1024 : 512;
}
/* K is padded so that a block (and, for INT4, a scale group) never straddles the end. */
static inline int64_t ktcy_k_pad(int format, int64_t k, int group) {
    int64_t unit = ktcy_block_k(format);
    if (format == KTCY_INT4 && group > unit) unit = group;
    return (k + unit - 1) / unit * unit;
}
static inline int64_t ktcy_n_pad(int64_t n) { return (n + KTCY_PANEL - 1) / KTCY_PANEL * KTCY_PANEL; }

typedef struct {
    int32_t format;
    int32_t group;           /* INT4: K elements per scale group (32, 64, 128); else 0 */
    int64_t n, k;            /* logical W[N][K] */
    int64_t n_pad, k_pad;
    const uint8_t *data;     /* blocks in [n_pad/16][k_pad/block_k] order, K inner */
    const float *scale;      /* INT8, FP8 per-channel: [n_pad]; INT4: [n_pad][k_pad/group];
                                FP8 block: [ceil(n/128)][ceil(k/128)] */
    const int32_t *colsum;   /* INT8: sum over K of each channel's int8 codes, [n_pad] */
} ktcy_weight;

typedef struct {
    int64_t m;               /* valid rows */
    int64_t m_pad;           /* rows present in the buffers (multiple of 16, extra rows zero) */
    int64_t k_pad;           /* row stride in elements */
    const int8_t *q;         /* INT8/INT4 formats: symmetric int8 codes, [m_pad][k_pad] */
    const uint16_t *bf16;    /* BF16/FP8 formats: bf16 bits, [m_pad][k_pad] */
    const float *scale;      /* INT8/INT4: per-row scale, [m_pad] */
    const int32_t *group_sum;/* INT4: sum of codes per group, [m_pad][k_pad/group] */
    int32_t group;           /* INT4 group size the sums were taken over */
} ktcy_act;

/* One GEMM entry point per (format, ISA variant): Y[m][n] for every row and for the output
 * channels of panels [panel_begin, panel_end).  Y has row stride ldy; columns >= n untouched.
 * scratch: per-thread bytes, at least ktcy_gemm_scratch_bytes(format, k_pad). */
typedef int (*ktcy_gemm_fn)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                            int64_t panel_begin, int64_t panel_end, void *scratch);

static inline int64_t ktcy_gemm_scratch_bytes(int64_t k_pad) {
    /* Four panels decoded to bf16 (AVX-512 FP8 prefill; AMX uses two), four 1 KiB C tiles, a
     * 32 x 32 float accumulator, and slack for 64-byte alignment. */
    return 4 * KTCY_PANEL * k_pad * 2 + 4 * 1024 + 32 * 32 * 4 + 64;
}

#endif
