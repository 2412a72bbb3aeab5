/* AVX-512 GEMM kernels: each format gets a fast variant (VNNI vpdpbusd, AVX512-BF16
 * vdpbf16ps, VBMI vpermi2b FP8 decode) and an F+BW variant for CPUs without those extensions.
 * Every function carries exactly the target features it may execute. */
#ifndef KTCY_GEMM_AVX512_H
#define KTCY_GEMM_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"
#include "types.h"


typedef struct { __m512i v0, v1; } kt_vec2;

#define KTCY_AVX512_BASE "avx512f,avx512bw,avx512vl,avx512dq"

#define KT_FMT KT_INT8
#define KT_FAST 1
#define KT_NAME(x) ktcy_int8_avx512_vnni_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#include "gemm_avx512_tpl.h"
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET
#define KT_FAST 0
#define KT_NAME(x) ktcy_int8_avx512bw_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#include "gemm_avx512_tpl.h"
#undef KT_FMT
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET

#define KT_FMT KT_INT4
#define KT_FAST 1
#define KT_NAME(x) ktcy_int4_avx512_vnni_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#include "gemm_avx512_tpl.h"
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET
#define KT_FAST 0
#define KT_NAME(x) ktcy_int4_avx512bw_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#include "gemm_avx512_tpl.h"
#undef KT_FMT
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET

#define KT_FMT KT_BF16
#if KTCY_ENABLE_AVX512_BF16
#define KT_FAST 1
#define KT_NAME(x) ktcy_bf16_avx512_bf16_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16")))
#include "gemm_avx512_tpl.h"
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET
#endif
#define KT_FAST 0
#define KT_NAME(x) ktcy_bf16_avx512f_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#include "gemm_avx512_tpl.h"
#undef KT_FMT
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET

#define KT_FMT KT_FP8
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KT_FAST 1
#define KT_NAME(x) ktcy_fp8_avx512_vbmi_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16,avx512vbmi")))
#include "gemm_avx512_tpl.h"
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET
#endif
#define KT_FAST 0
#define KT_NAME(x) ktcy_fp8_avx512f_##x
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#include "gemm_avx512_tpl.h"
#undef KT_FMT
#undef KT_FAST
#undef KT_NAME
#undef KT_TARGET

#endif
