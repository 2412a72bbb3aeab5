/* Binds the tile API twice and compiles gemm_amx_body.h under each binding: the same kernel
 * source runs on real AMX (ktcy_amx_*) and on the SDM model in tile_emu.h (ktcy_amx_emu_*). */
#ifndef KTCY_GEMM_AMX_H
#define KTCY_GEMM_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"
#include "tile_emu.h"
#include "types.h"

/* ---- emulated tiles: always built, never picked automatically ---- */
#define KT_AMX_NAME(x) ktcy_amx_emu_##x
#define KT_AMX_TARGET
#define KT_TILE_CONFIG(cfg) ktcy_emu_ldtilecfg(cfg)
#define KT_TILE_LOADED(cfg) (memcmp(ktcy_emu.cfg, (cfg), 64) == 0)
#define KT_TILE_LOAD(t, p, stride) ktcy_emu_tileloadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) ktcy_emu_tilestored(t, p, stride)
#define KT_TILE_ZERO(t) ktcy_emu_tilezero(t)
#define KT_TILE_DP_I8(c, a, b) ktcy_emu_tdpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) ktcy_emu_tdpbf16ps(c, a, b)
#define KT_TILE_FAILED() (ktcy_emu.error)
#include "gemm_amx_body.h"
#undef KT_AMX_NAME
#undef KT_AMX_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_LOADED
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED

/* ---- real tiles ---- */
#if KTCY_ENABLE_AMX
/* The configuration this thread last loaded (tile state is per thread, like the registers). */
static _Thread_local uint8_t ktcy_amx_loaded_cfg[64];

/* Anything else that loads a tile configuration on this thread (the roofline probe) must call
 * this afterwards, or the next kernel would trust a configuration that is no longer there. */
static inline void ktcy_amx_forget_config(void) { memset(ktcy_amx_loaded_cfg, 0, sizeof ktcy_amx_loaded_cfg); }

#define KT_AMX_NAME(x) ktcy_amx_##x
#define KT_AMX_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl")))
#define KT_TILE_CONFIG(cfg) (_tile_loadconfig(cfg), memcpy(ktcy_amx_loaded_cfg, (cfg), 64))
#define KT_TILE_LOADED(cfg) (memcmp(ktcy_amx_loaded_cfg, (cfg), 64) == 0)
#define KT_TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define KT_TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_DP_I8(c, a, b) _tile_dpbssd(c, a, b)
#define KT_TILE_DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define KT_TILE_FAILED() 0
#include "gemm_amx_body.h"
#undef KT_AMX_NAME
#undef KT_AMX_TARGET
#undef KT_TILE_CONFIG
#undef KT_TILE_LOADED
#undef KT_TILE_LOAD
#undef KT_TILE_STORE
#undef KT_TILE_ZERO
#undef KT_TILE_DP_I8
#undef KT_TILE_DP_BF16
#undef KT_TILE_FAILED
#endif

#endif
