/* Every compiled GEMM variant with the CPU features it needs, best first within an ISA.
 * This table is constant; the dispatcher (Cython, at import) picks from it per format. */
#ifndef KTCY_REGISTRY_H
#define KTCY_REGISTRY_H

#include "cpu.h"
#include "gemm_amx.h"
#include "gemm_avx2.h"
#include "gemm_avx512.h"
#include "gemm_ref.h"
#include "types.h"

enum ktcy_need {
    KTCY_NEED_AVX2 = 1 << 0,     /* AVX2 + FMA + OS YMM state */
    KTCY_NEED_AVX512 = 1 << 1,   /* AVX-512 F/BW/VL/DQ + OS ZMM state */
    KTCY_NEED_VNNI = 1 << 2,
    KTCY_NEED_BF16 = 1 << 3,
    KTCY_NEED_VBMI = 1 << 4,
    KTCY_NEED_AMX_INT8 = 1 << 5, /* amx-tile + amx-int8 + OS tile state + Linux permission */
    KTCY_NEED_AMX_BF16 = 1 << 6,
};

#define KTCY_FMT_BIT(f) (1 << (f))
#define KTCY_FP8_BITS (KTCY_FMT_BIT(KTCY_FP8_PERCHANNEL) | KTCY_FMT_BIT(KTCY_FP8_BLOCK))
#define KTCY_BF16_FAMILY (KTCY_FMT_BIT(KTCY_BF16) | KTCY_FP8_BITS)

typedef struct {
    const char *name;
    int formats;  /* KTCY_FMT_BIT mask */
    int isa;
    int needs;    /* KTCY_NEED_* mask */
    ktcy_gemm_fn fn;
} ktcy_variant;

static const ktcy_variant KTCY_VARIANTS[] = {
#if KTCY_ENABLE_AMX
    {"amx_int8", KTCY_FMT_BIT(KTCY_INT8), KTCY_AMX, KTCY_NEED_AMX_INT8 | KTCY_NEED_AVX512, ktcy_amx_int8_gemm},
    {"amx_int4", KTCY_FMT_BIT(KTCY_INT4), KTCY_AMX, KTCY_NEED_AMX_INT8 | KTCY_NEED_AVX512, ktcy_amx_int4_gemm},
    {"amx_bf16", KTCY_BF16_FAMILY, KTCY_AMX, KTCY_NEED_AMX_BF16 | KTCY_NEED_AVX512, ktcy_amx_bf16_gemm},
#endif
    {"int8_avx512_vnni", KTCY_FMT_BIT(KTCY_INT8), KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI, ktcy_int8_avx512_vnni_gemm},
    {"int8_avx512bw", KTCY_FMT_BIT(KTCY_INT8), KTCY_AVX512, KTCY_NEED_AVX512, ktcy_int8_avx512bw_gemm},
    {"int4_avx512_vnni", KTCY_FMT_BIT(KTCY_INT4), KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI, ktcy_int4_avx512_vnni_gemm},
    {"int4_avx512bw", KTCY_FMT_BIT(KTCY_INT4), KTCY_AVX512, KTCY_NEED_AVX512, ktcy_int4_avx512bw_gemm},
#if KTCY_ENABLE_AVX512_BF16
    {"bf16_avx512_bf16", KTCY_FMT_BIT(KTCY_BF16), KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_BF16, ktcy_bf16_avx512_bf16_gemm},
#endif
    {"bf16_avx512f", KTCY_FMT_BIT(KTCY_BF16), KTCY_AVX512, KTCY_NEED_AVX512, ktcy_bf16_avx512f_gemm},
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
    {"fp8_avx512_vbmi", KTCY_FP8_BITS, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_BF16 | KTCY_NEED_VBMI, ktcy_fp8_avx512_vbmi_gemm},
#endif
    {"fp8_avx512f", KTCY_FP8_BITS, KTCY_AVX512, KTCY_NEED_AVX512, ktcy_fp8_avx512f_gemm},
    {"int8_avx2", KTCY_FMT_BIT(KTCY_INT8), KTCY_AVX2, KTCY_NEED_AVX2, ktcy_int8_avx2_gemm},
    {"int4_avx2", KTCY_FMT_BIT(KTCY_INT4), KTCY_AVX2, KTCY_NEED_AVX2, ktcy_int4_avx2_gemm},
    {"bf16_avx2", KTCY_FMT_BIT(KTCY_BF16), KTCY_AVX2, KTCY_NEED_AVX2, ktcy_bf16_avx2_gemm},
    {"fp8_avx2", KTCY_FP8_BITS, KTCY_AVX2, KTCY_NEED_AVX2, ktcy_fp8_avx2_gemm},
    {"int8_ref", KTCY_FMT_BIT(KTCY_INT8), KTCY_REF, 0, ktcy_gemm_int8_ref},
    {"int4_ref", KTCY_FMT_BIT(KTCY_INT4), KTCY_REF, 0, ktcy_gemm_int4_ref},
    {"bf16_family_ref", KTCY_BF16_FAMILY, KTCY_REF, 0, ktcy_gemm_bf16_family_ref},
    {"amx_emu_int8", KTCY_FMT_BIT(KTCY_INT8), KTCY_AMX_EMU, 0, ktcy_amx_emu_int8_gemm},
    {"amx_emu_int4", KTCY_FMT_BIT(KTCY_INT4), KTCY_AMX_EMU, 0, ktcy_amx_emu_int4_gemm},
    {"amx_emu_bf16", KTCY_BF16_FAMILY, KTCY_AMX_EMU, 0, ktcy_amx_emu_bf16_gemm},
};

#define KTCY_NUM_VARIANTS ((int)(sizeof KTCY_VARIANTS / sizeof KTCY_VARIANTS[0]))

/* The KTCY_NEED_* bits this CPU and OS satisfy. */
static inline int ktcy_satisfied_needs(const ktcy_cpu *c) {
    int s = 0;
    if (c->avx2 && c->fma && c->os_avx) s |= KTCY_NEED_AVX2;
    if (c->avx512f && c->avx512bw && c->avx512vl && c->avx512dq && c->os_avx512) s |= KTCY_NEED_AVX512;
    if (c->avx512_vnni) s |= KTCY_NEED_VNNI;
    if (c->avx512_bf16) s |= KTCY_NEED_BF16;
    if (c->avx512_vbmi) s |= KTCY_NEED_VBMI;
    int tiles = c->amx_tile && c->os_amx && c->amx_permitted;
    if (tiles && c->amx_int8) s |= KTCY_NEED_AMX_INT8;
    if (tiles && c->amx_bf16) s |= KTCY_NEED_AMX_BF16;
    return s;
}

#endif
