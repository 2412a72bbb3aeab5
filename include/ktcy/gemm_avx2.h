/* AVX2 + FMA GEMM kernels for every format (FP8 decodes each block through the E4M3 table). */
#ifndef KTCY_GEMM_AVX2_H
#define KTCY_GEMM_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"
#include "types.h"

#define KTCY_AVX2_TARGET __attribute__((target("avx2,fma")))

#define KT_FMT KT_INT8
#define KT_NAME(x) ktcy_int8_avx2_##x
#include "gemm_avx2_tpl.h"
#undef KT_FMT
#undef KT_NAME
#define KT_FMT KT_INT4
#define KT_NAME(x) ktcy_int4_avx2_##x
#include "gemm_avx2_tpl.h"
#undef KT_FMT
#undef KT_NAME
#define KT_FMT KT_BF16
#define KT_NAME(x) ktcy_bf16_avx2_##x
#include "gemm_avx2_tpl.h"
#undef KT_FMT
#undef KT_NAME
#define KT_FMT KT_FP8
#define KT_NAME(x) ktcy_fp8_avx2_##x
#include "gemm_avx2_tpl.h"
#undef KT_FMT
#undef KT_NAME

#endif
