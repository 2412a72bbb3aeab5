/* Every GEMM kernel variant: a format's traits header (fmt_*.h) compiled into an ISA skeleton
 * (gemm_*_tpl.h), one block per variant, each defining the entry point ktcy_gemm_<variant>
 * that registry.h lists with the CPU features it needs.  The target attribute of a block is
 * exactly the set of features the variant executes. */
#ifndef KTCY_KERNELS_H
#define KTCY_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "decode_avx512.h"
#include "fp_env.h"
#include "mxfp4_i16_rows.h"
#include "numeric.h"
#include "pack.h"
#include "prefetch.h"
#include "skeleton.h"
#include "tile_emu.h"
#include "types.h"
#include "vec_avx2.h"

/* ---- portable C ---- */
#define KT_GEMM ktcy_gemm_int8_ref
#define KT_TRAITS "fmt_int8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_int4_ref
#define KT_TRAITS "fmt_int4.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_int8_group_ref
#define KT_TRAITS "fmt_int8_group.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_int8_min_ref
#define KT_TRAITS "fmt_int8_min.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_bf16_ref
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_fp8_ref
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_mxfp4_ref
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_mxfp4_a8_ref
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_ref_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS

/* ---- AVX2 + FMA ---- */
#define KT_GEMM ktcy_gemm_int8_avx2
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_int4_avx2
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_int8_group_avx2
#define KT_TRAITS "fmt_int8_group.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_int8_min_avx2
#define KT_TRAITS "fmt_int8_min.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_bf16_avx2
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_fp8_avx2
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_mxfp4_avx2
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx2
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX2_BASE)))
#include "gemm_avx2_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET

/* ---- AVX-512: a fast variant per format (VNNI, AVX512-BF16, VBMI) and an F+BW one ---- */
#define KT_GEMM ktcy_gemm_int8_avx512_vnni
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_avx512bw
#define KT_TRAITS "fmt_int8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int4_avx512_vnni
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_group_avx512_vnni
#define KT_TRAITS "fmt_int8_group.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_min_avx512_vnni
#define KT_TRAITS "fmt_int8_min.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int4_avx512bw
#define KT_TRAITS "fmt_int4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_group_avx512bw
#define KT_TRAITS "fmt_int8_group.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_int8_min_avx512bw
#define KT_TRAITS "fmt_int8_min.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16
#define KT_GEMM ktcy_gemm_bf16_avx512_bf16
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_bf16_avx512f
#define KT_TRAITS "fmt_bf16.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_fp8_avx512_vbmi
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_fp8_avx512f
#define KT_TRAITS "fmt_fp8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_avx512_vbmi
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16,avx512vnni,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#if KTCY_ENABLE_AVX512_BF16
#define KT_GEMM ktcy_gemm_mxfp4_avx512_bf16
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512bf16")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_mxfp4_avx512f
#define KT_TRAITS "fmt_mxfp4.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#if KTCY_ENABLE_AVX512_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512_vbmi
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni,avx512vbmi")))
#define KT_FAST 1
#define KT_VBMI 1
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#endif
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512_vnni
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE ",avx512vnni")))
#define KT_FAST 1
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI
#define KT_GEMM ktcy_gemm_mxfp4_a8_avx512bw
#define KT_TRAITS "fmt_mxfp4_a8.h"
#define KT_TARGET __attribute__((target(KTCY_AVX512_BASE)))
#define KT_FAST 0
#define KT_VBMI 0
#include "gemm_avx512_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_FAST
#undef KT_VBMI

/* ---- AMX over the emulated tile unit: always built, never picked automatically ---- */
#define KT_TARGET
/* a GEMM reports its own faults: one left on this thread by an earlier use of the emulator
 * (the instruction-level helpers) must not fail it */
#define KT_TILE_CONFIG(cfg) (ktcy_emu_clear_error(), ktcy_emu_ldtilecfg(cfg))
#define KT_TILE_RELEASE() ktcy_emu_tilerelease()
#define KT_TILE_LOAD(t, p, stride) ktcy_emu_tileloadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) ktcy_emu_tilestored(t, p, stride)
#define KT_TILE_ZERO(t) ktcy_emu_tilezero(t)
#define KT_TILE_DP_I8(c, a, b) ktcy_emu_tdpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) ktcy_emu_tdpbf16ps(c, a, b)
#define KT_TILE_FAILED() (ktcy_emu.error)
#define KT_AMX_REAL 0
#define KT_GEMM ktcy_gemm_amx_emu_int8
#define KT_TRAITS "fmt_int8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_int4
#define KT_TRAITS "fmt_int4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_int8_group
#define KT_TRAITS "fmt_int8_group.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_int8_min
#define KT_TRAITS "fmt_int8_min.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_bf16
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_fp8
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_mxfp4
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_emu_mxfp4_a8
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_RELEASE
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED
#undef KT_AMX_REAL

/* ---- real AMX tiles ---- */
#if KTCY_ENABLE_AMX
#define KT_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl")))
#define KT_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define KT_TILE_RELEASE() _tile_release()
#define KT_TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_DP_I8(c, a, b) _tile_dpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define KT_TILE_FAILED() 0
#define KT_AMX_REAL 1 /* real tiles: the traits may use AVX-512 F/BW/VL beside them */
#define KT_GEMM ktcy_gemm_amx_int8
#define KT_TRAITS "fmt_int8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_int4
#define KT_TRAITS "fmt_int4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_int8_group
#define KT_TRAITS "fmt_int8_group.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_int8_min
#define KT_TRAITS "fmt_int8_min.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_bf16
#define KT_TRAITS "fmt_bf16.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_fp8
#define KT_TRAITS "fmt_fp8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_mxfp4
#define KT_TRAITS "fmt_mxfp4.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#define KT_GEMM ktcy_gemm_amx_mxfp4_a8
#define KT_TRAITS "fmt_mxfp4_a8.h"
#include "gemm_amx_tpl.h"
#undef KT_GEMM
#undef KT_TRAITS
#undef KT_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_RELEASE
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED
#undef KT_AMX_REAL

/* TILERELEASE on the calling thread: the tests' stand-in for other code on ktcy's threads
 * (oneDNN under torch) that releases the tiles between two ktcy calls.  -1: AMX not built. */
__attribute__((target("amx-tile"))) static inline int ktcy_amx_release_tiles(void) { _tile_release(); return 0; }
#else
static inline int ktcy_amx_release_tiles(void) { return -1; }
#endif

#endif
