/* What every GEMM skeleton instantiation (kernels.h) shares: the skeleton and weight-row
 * kinds, the vector types that carry a decoded weight row, the target strings of the vector
 * variants, and the sweep of the few-row paths over their panels. */
#ifndef KTCY_SKELETON_H
#define KTCY_SKELETON_H

#include <immintrin.h>
#include <stdint.h>

#include "prefetch.h"
#include "types.h"

/* Skeletons (KT_SKEL) and what a loaded weight row holds (KT_WKIND). */
#define KT_SKEL_REF 0
#define KT_SKEL_AVX2 1
#define KT_SKEL_AVX512 2
#define KT_SKEL_AMX 3
#define KT_W_S8 0
#define KT_W_U8 1
#define KT_W_BF16 2

typedef struct { __m512i v0, v1; } kt_vec2; /* one AVX-512 operand, or its even/odd bf16 halves as floats */
typedef struct { __m256i i; __m256 e, o; } kt_w256; /* half an AVX2 weight row: int8 lanes, or even/odd floats */

#define KTCY_AVX512_BASE "avx512f,avx512bw,avx512vl,avx512dq"
/* F16C (vcvtph2ps, the FP8 decode of rows too wide for the bit-move decode) comes with every AVX2
 * CPU (Intel since Ivy Bridge, AMD since Piledriver); the dispatcher requires it with AVX2. */
#define KTCY_AVX2_BASE "avx2,fma,f16c"

/* A few-row path's sweep over panels [pb, pe) (KT_FEW_ROWS): TILE(MB, NP, p0, next, ...) for the
 * call's a->m rows (1-4) and NP panels from p0 (next: what follows, prefetch.h), W12 panels for
 * 1-2 rows and W34 for 3-4 (the accumulators' limit), one where fewer are left.  Every tile
 * shape is a compile-time constant.  Uses the including skeleton's KT_BK and KT_BB. */
#define KT_FEW_ROWS_SWEEP(TILE, W12, W34, a, w, pb, pe, ...)                                     \
    for (int64_t p_ = (pb); p_ < (pe);) {                                                        \
        const int wide_ = (a)->m > 2 ? (W34) : (W12);                                            \
        const int np_ = (pe) - p_ >= wide_ ? wide_ : 1;                                          \
        const ktcy_span next_ = ktcy_next_group(a, w, p_ + np_, pe, np_, KT_BK, KT_BB);          \
        switch ((a)->m) {                                                                        \
        case 1: if (np_ > 1) TILE(1, W12, p_, next_, __VA_ARGS__); else TILE(1, 1, p_, next_, __VA_ARGS__); break; \
        case 2: if (np_ > 1) TILE(2, W12, p_, next_, __VA_ARGS__); else TILE(2, 1, p_, next_, __VA_ARGS__); break; \
        case 3: if (np_ > 1) TILE(3, W34, p_, next_, __VA_ARGS__); else TILE(3, 1, p_, next_, __VA_ARGS__); break; \
        default: if (np_ > 1) TILE(4, W34, p_, next_, __VA_ARGS__); else TILE(4, 1, p_, next_, __VA_ARGS__); break; \
        }                                                                                        \
        p_ += np_;                                                                               \
    }

#endif
