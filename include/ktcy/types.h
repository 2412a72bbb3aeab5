/* Shared vocabulary of the kernels: ISAs, status codes, the packed-weight and activation
 * descriptors and the GEMM entry point.  Formats are described in formats.h. */
#ifndef KTCY_TYPES_H
#define KTCY_TYPES_H

#include <stdint.h>

#include "formats.h"

enum ktcy_isa { KTCY_REF = 0, KTCY_AVX2 = 1, KTCY_AVX512 = 2, KTCY_AMX = 3, KTCY_AMX_EMU = 4, KTCY_NUM_ISAS = 5 };

/* KTCY_ERR_FORMAT: a kernel was handed a format it does not serve (a dispatch bug, reported
 * loudly instead of computing nothing). */
enum ktcy_status { KTCY_OK = 0, KTCY_ERR_TILE = 1, KTCY_ERR_SCRATCH = 2, KTCY_ERR_FORMAT = 3 };

typedef struct {
    int32_t format;          /* enum ktcy_format */
    int32_t group;           /* GROUP scales: K elements per group; else 0 */
    int64_t n, k;            /* logical W[N][K] */
    int64_t n_pad, k_pad;
    const uint8_t *data;     /* blocks in [n_pad/16][k_pad/block_k] order, K inner (pack.h) */
    const float *scale;      /* shaped by ktcy_scale_shape(); NULL when the format has none */
    const int32_t *colsum;   /* formats with colsum: sum over K of each channel's codes, [n_pad] */
    const uint8_t *zero;     /* formats with zero points: laid out like GROUP scales; else NULL */
    int32_t nan_codes;       /* FP8: 1 when some code is NaN (0x7F/0xFF); decodes made of bit
                                moves alone (AVX2) then take their checked version */
} ktcy_weight;

/* The tile choices made per CPU (registry.h, ktcy_cpu_tiles), which KTCY_TILES may replace for
 * measurements; every ktcy_act carries them. */
typedef struct {
    int32_t one_panel_rows;    /* calls of at most this many rows take one panel per tile where a */
                               /* skeleton offers more (ktcy_one_panel_rows); 0: never            */
    int32_t f32_rows;          /* calls of at most this many rows take FP8's float path           */
                               /* (KT_FEW_ROWS, ktcy_f32_rows); 0: never                          */
    int32_t i16_rows;          /* ... and AVX-512 MXFP4's 16-bit integer path (ktcy_i16_rows);    */
                               /* 0: never                                                        */
    int32_t avx2_i16_rows;     /* ... and AVX2 MXFP4's (ktcy_avx2_i16_rows); 0: never             */
    int32_t e2m1_panel_rows;   /* calls of at most this many rows take one panel per tile in     */
                               /* AVX-512 MXFP4 and MXFP4_A8 (ktcy_e2m1_panel_rows); 0: never     */
    int32_t fp8_fetch_l2;      /* 1: AVX-512 FP8's decode streams prefetch into L2 (prefetcht1),  */
                               /* 0: into L1 (ktcy_fp8_fetch_l2)                                  */
    int32_t wide_tiles;        /* 1: prefill takes AVX2 INT8's 3-row x 2-panel tiles (KT_WIDE_TILE,*/
                               /* ktcy_wide_tiles); 0: its 4-row tiles                            */
    int32_t fp8_normal_panels; /* 1: AVX2 FP8's float prefill decodes its panels times 2^8, its   */
                               /* subnormal codes to normal floats (ktcy_fp8_normal_panels)       */
    int32_t plain_fetch_l2;    /* 1: AVX2 BF16's and INT8's decode streams (calls of up to 4 rows) */
                               /* prefetch into L2, 0: into L1 (ktcy_plain_fetch_l2)              */
} ktcy_tiles;

typedef struct {
    int64_t m;               /* valid rows */
    int64_t m_pad;           /* rows present in the buffers (a multiple of 16); rows past m are */
                             /* zeros (Activations) or an earlier call's (the MoE engine): a    */
                             /* kernel may compute them, drops their results, decides nothing  */
                             /* for the valid rows by them                                      */
    int64_t k_pad;           /* row stride in elements */
    const int8_t *q;         /* INT8 activations: symmetric int8 codes, [m_pad][k_pad] */
    const uint16_t *bf16;    /* BF16 activations: bf16 bits, [m_pad][k_pad] */
    const float *scale;      /* INT8 activations: per-row scale, [m_pad] */
    const int32_t *group_sum;/* GROUP formats: sum of codes per group, [m_pad][k_pad/group]; */
                             /* MXFP4_A8: ktcy_act_e2m1_starts' words per 32-K block        */
    int32_t group;           /* group size the sums were taken over (0: none) */
    const ktcy_weight *next_w; /* optional hint (NULL: none): the weight, same format, whose */
    int64_t next_pb, next_pe;  /* panels [next_pb, next_pe) this thread multiplies next       */
    int32_t rows_in_scratch;   /* 1: the call before on this scratch, same variant and these rows,  */
                               /* left them in the kernel's own form there (AMX tile order, MXFP4's */
                               /* 16-bit rows): reuse                                              */
    ktcy_tiles tiles;          /* this CPU's tile choices (registry.h)                             */
} ktcy_act;

/* One GEMM entry point per kernel variant: Y[m][n] for every row and for the output channels
 * of panels [panel_begin, panel_end).  Y has row stride ldy; columns >= n untouched.
 * scratch: per-thread bytes, at least ktcy_gemm_scratch_bytes(k_pad), 64-byte aligned or not. */
typedef int (*ktcy_gemm_fn)(const ktcy_act *a, const ktcy_weight *w, float *y, int64_t ldy,
                            int64_t panel_begin, int64_t panel_end, void *scratch);

/* Per-thread scratch of one GEMM call (every skeleton uses a prefix of it):
 *
 *   +--------------------------- 64-byte aligned start ---------------------------+
 *   | AVX-512 / AVX2: up to 4 panels decoded to 1024-byte blocks: bf16              |
 *   |       [4][k_pad/32], int8 (MXFP4_A8) [4][k_pad/64]                            |
 *   | AVX2 float prefill: a panel's slice as floats [KTCY_F32_SLICE][16] |         |
 *   |       KTCY_AVX2_F32_ROWS rows of activations as floats, row stride          |
 *   |       KTCY_F32_ROW_STRIDE | a float per row (row factors) | the wide flag  |
 *   |       (a float) | 64-byte aligned: the tiles' sums between slices           |
 *   |       [rows][2][16]                                                         |
 *   | AVX2 bf16-activation decode (fewer rows): the rows as floats [rows][k_pad]   |
 *   |       | a float per row                                                      |
 *   | AMX:  C tiles 32x32 int32/float (4 KiB) | float accumulator 32x32 (4 KiB) |  |
 *   |       2 panels unpacked/decoded to int8/bf16 blocks [2][k_pad/bk][1024 B] |  |
 *   |       KTCY_AMX_A_ROWS activation rows in tile order (bf16: 2 bytes each)     |
 *   |       | the panel pair's column factors per scale group [groups][64] float    |
 *   +--- ktcy_gemm_scratch_shared_bytes(k_pad) from the start, 64-byte aligned ----+
 *   | MXFP4's 16-bit rows (up to KTCY_I16_MAX_ROWS rows, AVX2 and AVX-512): a      |
 *   |       region no other path writes, so the up projection can reuse the rows   |
 *   |       its gate made whatever path the gate took (kt_mxfp4_i16_rows)          |
 *   +------------------------------------------------------------------------------+
 */
#define KTCY_AVX2_F32_ROWS 36 /* activation rows the AVX2 float prefill widens at once (6 tiles) */
/* the float prefill's rows one cache line apart from k_pad: rows k_pad floats apart (a multiple
 * of 4 KiB for common K) would share L1 sets */
#define KTCY_F32_ROW_STRIDE(k_pad) ((k_pad) + 16)
/* K values of a panel the AVX2 float prefill decodes at once: 16 KiB of floats, which stay in L1 */
#define KTCY_F32_SLICE 256
#define KTCY_AMX_A_ROWS 128   /* activation rows AMX packs at once; B is prepared once per 128 */
#define KTCY_I16_MAX_ROWS 4 /* rows MXFP4's 16-bit integer path serves (kt_mxfp4_i16_rows) */
/* The prefix every path but MXFP4's 16-bit rows shares. */
static inline int64_t ktcy_gemm_scratch_shared_bytes(int64_t k_pad) {
    const int64_t bf16_panels = 4 * KTCY_PANEL * k_pad * 2 + 4 * 1024 + 32 * 32 * 4;
    const int64_t f32_prefill = (KTCY_F32_SLICE * KTCY_PANEL + KTCY_AVX2_F32_ROWS * KTCY_F32_ROW_STRIDE(k_pad)) * 4
                                + (KTCY_AVX2_F32_ROWS + 1) * 4 + 64 + KTCY_AVX2_F32_ROWS * 2 * KTCY_PANEL * 4;
    /* ... + the column factors (and mins) of up to k_pad / 16 + 1 groups, 64-byte aligned */
    const int64_t amx = 2 * 32 * 32 * 4 + 2 * KTCY_PANEL * k_pad * 2 + KTCY_AMX_A_ROWS * k_pad * 2 + 64
                        + (k_pad / 16 + 1) * 64 * 4;
    const int64_t most = bf16_panels > f32_prefill ? bf16_panels : f32_prefill;
    return (most > amx ? most : amx) + 64;
}
/* MXFP4's 16-bit rows: a 64-byte header, KTCY_I16_MAX_ROWS rows of high and low bytes (k_pad
 * each), a float factor and an int32 bias sum per row and 32-K block; 64 bytes to align it. */
static inline int64_t ktcy_gemm_scratch_bytes(int64_t k_pad) {
    return ktcy_gemm_scratch_shared_bytes(k_pad) + 64 + 64 + KTCY_I16_MAX_ROWS * (2 * k_pad + k_pad / 32 * 8);
}

/* The one work partition of the GEMM drivers: `panels` output panels in about `parts`
 * contiguous chunks; returns the chunk length, whole 4-panel groups (the AVX-512 tile width)
 * when every chunk gets at least 4, else whole pairs (the AMX tile pair).  The last chunk may
 * be shorter. */
static inline int64_t ktcy_split_panels(int64_t panels, int64_t parts) {
    if (parts < 1) parts = 1;
    const int64_t per = (panels + parts - 1) / parts;
    return panels >= 4 * parts ? (per + 3) / 4 * 4 : (per + 1) / 2 * 2;
}

static inline uint8_t *ktcy_align64(void *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

#endif
