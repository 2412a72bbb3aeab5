/* Every compiled GEMM variant with the CPU features it needs, best first within an ISA: one
 * X(name, isa, needs) line each.  ktcy_gemm_<name> and the formats it serves
 * (ktcy_gemm_<name>_formats, from its traits header) come from the block of that name in
 * kernels.h; the Python name is <name>.  The table is constant; the dispatcher (Cython, at
 * import) picks from it per format. */
#ifndef KTCY_REGISTRY_H
#define KTCY_REGISTRY_H

#include "cpu.h"
#include "kernels.h"
#include "types.h"

enum ktcy_need {
    KTCY_NEED_AVX2 = 1 << 0,     /* AVX2 + FMA + F16C + OS YMM state */
    KTCY_NEED_AVX512 = 1 << 1,   /* AVX-512 F/BW/VL/DQ + OS ZMM state */
    KTCY_NEED_VNNI = 1 << 2,
    KTCY_NEED_BF16 = 1 << 3,
    KTCY_NEED_VBMI = 1 << 4,
    KTCY_NEED_AMX_INT8 = 1 << 5, /* amx-tile + amx-int8 + OS tile state + Linux permission */
    KTCY_NEED_AMX_BF16 = 1 << 6,
};

#if KTCY_ENABLE_AMX
#define KTCY_IF_AMX(x) x
#else
#define KTCY_IF_AMX(x)
#endif
#if KTCY_ENABLE_AVX512_BF16
#define KTCY_IF_AVX512_BF16(x) x
#else
#define KTCY_IF_AVX512_BF16(x)
#endif
#if KTCY_ENABLE_AVX512_VBMI
#define KTCY_IF_AVX512_VBMI(x) x
#else
#define KTCY_IF_AVX512_VBMI(x)
#endif
#if KTCY_ENABLE_AVX512_BF16 && KTCY_ENABLE_AVX512_VBMI
#define KTCY_IF_AVX512_BF16_VBMI(x) x
#else
#define KTCY_IF_AVX512_BF16_VBMI(x)
#endif

#define KTCY_NEED_AMX_I8 (KTCY_NEED_AMX_INT8 | KTCY_NEED_AVX512)
#define KTCY_NEED_AMX_B16 (KTCY_NEED_AMX_BF16 | KTCY_NEED_AVX512)

#define KTCY_VARIANT_LIST(X)                                                                   \
    KTCY_IF_AMX(X(amx_int8, KTCY_AMX, KTCY_NEED_AMX_I8))                                       \
    KTCY_IF_AMX(X(amx_int4, KTCY_AMX, KTCY_NEED_AMX_I8))                                       \
    KTCY_IF_AMX(X(amx_int8_group, KTCY_AMX, KTCY_NEED_AMX_I8))                                 \
    KTCY_IF_AMX(X(amx_int8_min, KTCY_AMX, KTCY_NEED_AMX_I8))                                   \
    KTCY_IF_AMX(X(amx_bf16, KTCY_AMX, KTCY_NEED_AMX_B16))                                      \
    KTCY_IF_AMX(X(amx_fp8, KTCY_AMX, KTCY_NEED_AMX_B16))                                       \
    KTCY_IF_AMX(X(amx_mxfp4, KTCY_AMX, KTCY_NEED_AMX_B16))                                     \
    KTCY_IF_AMX(X(amx_mxfp4_a8, KTCY_AMX, KTCY_NEED_AMX_I8))                                   \
    X(int8_avx512_vnni, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI)                        \
    X(int8_avx512bw, KTCY_AVX512, KTCY_NEED_AVX512)                                            \
    X(int4_avx512_vnni, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI)                        \
    X(int4_avx512bw, KTCY_AVX512, KTCY_NEED_AVX512)                                            \
    X(int8_group_avx512_vnni, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI)                  \
    X(int8_min_avx512_vnni, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI)                    \
    X(int8_group_avx512bw, KTCY_AVX512, KTCY_NEED_AVX512)                                      \
    X(int8_min_avx512bw, KTCY_AVX512, KTCY_NEED_AVX512)                                        \
    KTCY_IF_AVX512_BF16(X(bf16_avx512_bf16, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_BF16))   \
    X(bf16_avx512f, KTCY_AVX512, KTCY_NEED_AVX512)                                             \
    KTCY_IF_AVX512_BF16_VBMI(X(fp8_avx512_vbmi, KTCY_AVX512,                                   \
                               KTCY_NEED_AVX512 | KTCY_NEED_BF16 | KTCY_NEED_VBMI))            \
    X(fp8_avx512f, KTCY_AVX512, KTCY_NEED_AVX512)                                              \
    KTCY_IF_AVX512_BF16_VBMI(X(mxfp4_avx512_vbmi, KTCY_AVX512,                                 \
                               KTCY_NEED_AVX512 | KTCY_NEED_BF16 | KTCY_NEED_VNNI | KTCY_NEED_VBMI)) \
    KTCY_IF_AVX512_BF16(X(mxfp4_avx512_bf16, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_BF16))  \
    X(mxfp4_avx512f, KTCY_AVX512, KTCY_NEED_AVX512)                                            \
    KTCY_IF_AVX512_VBMI(X(mxfp4_a8_avx512_vbmi, KTCY_AVX512,                                   \
                          KTCY_NEED_AVX512 | KTCY_NEED_VNNI | KTCY_NEED_VBMI))                 \
    X(mxfp4_a8_avx512_vnni, KTCY_AVX512, KTCY_NEED_AVX512 | KTCY_NEED_VNNI)                    \
    X(mxfp4_a8_avx512bw, KTCY_AVX512, KTCY_NEED_AVX512)                                        \
    X(int8_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                    \
    X(int4_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                    \
    X(int8_group_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                              \
    X(int8_min_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                \
    X(bf16_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                    \
    X(fp8_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                     \
    X(mxfp4_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                   \
    X(mxfp4_a8_avx2, KTCY_AVX2, KTCY_NEED_AVX2)                                                \
    X(int8_ref, KTCY_REF, 0)                                                                   \
    X(int4_ref, KTCY_REF, 0)                                                                   \
    X(int8_group_ref, KTCY_REF, 0)                                                             \
    X(int8_min_ref, KTCY_REF, 0)                                                               \
    X(bf16_ref, KTCY_REF, 0)                                                                   \
    X(fp8_ref, KTCY_REF, 0)                                                                    \
    X(mxfp4_ref, KTCY_REF, 0)                                                                  \
    X(mxfp4_a8_ref, KTCY_REF, 0)                                                               \
    X(amx_emu_int8, KTCY_AMX_EMU, 0)                                                           \
    X(amx_emu_int4, KTCY_AMX_EMU, 0)                                                           \
    X(amx_emu_int8_group, KTCY_AMX_EMU, 0)                                                     \
    X(amx_emu_int8_min, KTCY_AMX_EMU, 0)                                                       \
    X(amx_emu_bf16, KTCY_AMX_EMU, 0)                                                           \
    X(amx_emu_fp8, KTCY_AMX_EMU, 0)                                                            \
    X(amx_emu_mxfp4, KTCY_AMX_EMU, 0)                                                          \
    X(amx_emu_mxfp4_a8, KTCY_AMX_EMU, 0)

typedef struct {
    const char *name;
    int formats;  /* bit f set: serves format f (enum ktcy_format) */
    int isa;
    int needs;    /* KTCY_NEED_* mask */
    ktcy_gemm_fn fn;
} ktcy_variant;

#define KTCY_VARIANT_ROW(name, isa, needs) {#name, ktcy_gemm_##name##_formats, isa, needs, ktcy_gemm_##name},
static const ktcy_variant KTCY_VARIANTS[] = {KTCY_VARIANT_LIST(KTCY_VARIANT_ROW)};
#undef KTCY_VARIANT_ROW

#define KTCY_NUM_VARIANTS ((int)(sizeof KTCY_VARIANTS / sizeof KTCY_VARIANTS[0]))

/* The KTCY_NEED_* bits this CPU and OS satisfy. */
static inline int ktcy_satisfied_needs(const ktcy_cpu *c) {
    int s = 0;
    if (c->avx2 && c->fma && c->f16c && c->os_avx) s |= KTCY_NEED_AVX2;
    if (c->avx512f && c->avx512bw && c->avx512vl && c->avx512dq && c->os_avx512) s |= KTCY_NEED_AVX512;
    if (c->avx512_vnni) s |= KTCY_NEED_VNNI;
    if (c->avx512_bf16) s |= KTCY_NEED_BF16;
    if (c->avx512_vbmi) s |= KTCY_NEED_VBMI;
    int tiles = c->amx_tile && c->os_amx && c->amx_permitted;
    if (tiles && c->amx_int8) s |= KTCY_NEED_AMX_INT8;
    if (tiles && c->amx_bf16) s |= KTCY_NEED_AMX_BF16;
    return s;
}

/* ktcy_act.one_panel_rows for this CPU: calls of at most this many rows stream one panel per
 * tile in AVX-512 INT4 (KT_ONE_PANEL_ROWS) and AVX2's integer formats, where they would otherwise
 * take four (AVX-512) or two (AVX2, one row).  Measured per vendor, MoE layer: a Zen 5 ran
 * AVX-512 INT4 at T = 1/4/32 with one-panel tiles in 0.88-0.94x the time of four-panel ones; a
 * Xeon (Sapphire Rapids class) ran it with four-panel tiles in 0.76-0.87x the time of one-panel
 * ones, and AVX2 INT8/INT4/INT4_ZP/MXFP4_A8 at T = 1 and 2 with two-panel tiles in 0.79-0.97x; a
 * Zen 3 (AVX2 only) ran AVX2 INT8 at T = 1, 2 and 4 with two-panel tiles in 0.85-0.88x the time
 * but INT4, INT4_ZP and MXFP4_A8 in 1.01-1.21x (four panels: 1.05-1.20x); a Zen 4 ran AVX-512
 * INT4 and INT4_ZP with four-panel tiles in 1.26-1.40x (T = 1, 4) and 1.13-1.16x (T = 32) the
 * time of one-panel ones.  AMD keeps the one-panel tiles it was tuned with, but for AVX2 INT8's
 * one-row calls, which take two on every CPU (fmt_int8.h); AVX2 INT8's 2- and 3-row calls take
 * the 2-panel tiles where this is below their rows (gemm_avx2_tpl.h: Intel faster so, a Zen 4
 * forced to AVX2 slower). */
static inline int32_t ktcy_one_panel_rows(const ktcy_cpu *c) { return c->amd ? 4 : 0; }

/* ktcy_act.f32_rows for this CPU: calls of at most this many rows take AVX-512 FP8's float path
 * (bit-move decode and FMAs) instead of the bf16 decode and vdpbf16ps.  On a Xeon (Sapphire
 * Rapids class, where vdpbf16ps costs about four FMAs) one projection of 2/3/4 rows took
 * 0.80/0.73/0.77x the time that way, and MoE T = 32 (3-6 rows an expert) 0.91x (per-channel)
 * and 0.94x (block).  On AMD cores (Zen 4 and 5, where vdpbf16ps is cheaper) only one-row
 * calls were measured this way: AMD keeps those. */
static inline int32_t ktcy_f32_rows(const ktcy_cpu *c) { return c->amd ? 1 : 4; }

/* ktcy_act.i16_rows for this CPU: calls of at most this many rows take AVX-512 MXFP4's 16-bit
 * integer path (MXFP4_A8's decode, vpdpbusd) instead of the bf16 decode and vdpbf16ps.  On a Xeon
 * (Sapphire Rapids class) one projection of one row took 0.67x the time that way, and MoE T = 1
 * and T = 32 0.73x and 0.59x.  AMD cores with AVX-512 BF16 (Zen 4 and 5, where vdpbf16ps is
 * cheaper) keep bf16: a Zen 4 ran one projection of 1, 2, 3 and 4 rows on the 16-bit path in
 * 1.09x, 1.04x, 1.00x and 1.17x the time (vpdpbusd makes no more products per instruction there). */
static inline int32_t ktcy_i16_rows(const ktcy_cpu *c) { return c->amd && c->avx512_bf16 ? 0 : 4; }

/* ktcy_act.avx2_i16_rows for this CPU: the same for AVX2 MXFP4, whose bf16 path is float FMAs (no
 * vdpbf16ps), against vpmaddwd on the codes widened to words: faster on every CPU measured.  MoE
 * layer, T = 1, 4 and 32: a Zen 3 (AVX2 only) 0.57x, 0.62x and 0.96x the time; a Xeon forced to
 * AVX2 T = 1 0.75x, T = 32 0.8-0.9x; a Zen 4 forced to AVX2 0.69-0.73x, 0.78-0.84x and
 * 0.89-0.92x (two sessions). */
static inline int32_t ktcy_avx2_i16_rows(const ktcy_cpu *c) { (void)c; return 4; }

/* A Zen 4: AMD family 0x19 (Zen 3 and Zen 4) with AVX-512 (Zen 4 only). */
static inline int ktcy_zen4(const ktcy_cpu *c) { return c->amd && c->family == 0x19 && c->avx512f; }

/* ktcy_act.e2m1_panel_rows for this CPU: calls of at most this many rows stream one panel per tile
 * in AVX-512 MXFP4 and MXFP4_A8 (each format caps it: KT_ONE_PANEL_ROWS), where they would
 * otherwise take four.  A Zen 4 ran a MoE layer that way at T = 1,
 * 2, 4 and 8 in 0.81-0.85x (MXFP4_A8) and 0.82-0.89x (MXFP4) the time, one projection from
 * memory at M = 1 in 0.82-0.88x and 0.91x: four panels are four streams, and there fewer streams
 * read faster.  A Zen 5 ran MXFP4 (an earlier decode) 1.5x slower one panel wide, and a Xeon's
 * INT4 preferred four panels: both keep four. */
static inline int32_t ktcy_e2m1_panel_rows(const ktcy_cpu *c) { return ktcy_zen4(c) ? 2 : 0; }

/* ktcy_act.fp8_fetch_l2 for this CPU: AVX-512 FP8's tiles that stream their panels from memory
 * (decode: the float path's and the bf16 path's) prefetch 8 blocks ahead into L2 (prefetcht1)
 * instead of L1.  On a Zen 4 a MoE layer ran that way at T = 1, 8 and 32 in 0.90x, 0.87-0.90x
 * and 0.78-0.80x the time (per channel and block alike; T = 128 0.97-0.99x), where INT4, MXFP4
 * and MXFP4_A8 ran 1.05x, 1.18x and 1.59x slower at T = 1 (they keep L1).  A Zen 5 ran FP8 T = 1
 * 1.07x slower so and a Xeon the same: they keep L1. */
static inline int32_t ktcy_fp8_fetch_l2(const ktcy_cpu *c) { return ktcy_zen4(c); }

/* ktcy_act.wide_tiles for this CPU: AVX2 INT8 prefill (more than 4 rows) in 3-row x 2-panel tiles
 * (12 accumulators share each broadcast and each |w|) or in 4-row x 1-panel tiles (8, no spills).
 * A Zen 5 ran the wide tiles in 0.59-0.85x the time of the 4-row tiles of the day (single GEMM,
 * M = 32 and 512); a Zen 3 (AVX2 only) ran the 4-row tiles in 0.74-0.76x the time of the wide
 * ones (single GEMM) and MoE T = 32/128/512 in 0.79-0.81x/0.79x/0.76x, where the wide tiles keep
 * four of their sums on the stack; a Xeon (Sapphire Rapids class, forced to AVX2) ran the 4-row
 * tiles in 0.73-0.85x the time at M = 5-32 and 0.93-1.0x at 64 and 512 (single GEMM, one thread),
 * MoE T = 32, 128 and 512 in 0.94x, 0.92x and 0.96x.
 * So only AMD cores with AVX-512 (Zen 4, 5) take the wide tiles. */
static inline int32_t ktcy_wide_tiles(const ktcy_cpu *c) { return c->amd && c->avx512f; }

/* ktcy_act.fp8_normal_panels for this CPU: AVX2 FP8's float prefill multiplies each decoded panel
 * vector by 2^8 (and widens the rows times 2^-8 less), so that E4M3's subnormal codes, which the
 * bit-move decode leaves as subnormal floats, become normal ones; the products, and so every bit,
 * stay the same.  An Intel core takes a microcode assist for each FMA with a subnormal operand: on
 * a Xeon (forced to AVX2) a 1536 x 2048 projection of Gaussian weights (a 1e-4 share of subnormal
 * codes) at M = 32 ran 1.15x slower than one of the same weights without small values.  AMD cores
 * handle subnormal operands in hardware (a Zen 4 forced to AVX2 ran a 768 x 2048 projection of
 * Gaussian weights at M = 32 with the multiplies in 0.99-1.01x the time): they skip them. */
static inline int32_t ktcy_fp8_normal_panels(const ktcy_cpu *c) { return !c->amd; }

/* ktcy_act.plain_fetch_l2 for this CPU: AVX2 BF16's and INT8's decode tiles (calls of up to 4
 * rows), which read the packed rows as they are, prefetch their streams into L2 (prefetcht1)
 * instead of L1.  On a Xeon forced to AVX2 a MoE layer ran that way at T = 1, 2, 4 and 8 in
 * 0.91-0.94x the time (BF16 and INT8 alike, interleaved rounds), where the decoding formats (FP8,
 * INT4_ZP, MXFP4, MXFP4_A8) ran 0.99-1.06x, prefill (T = 128, 512) 0.99-1.03x, and the AVX-512
 * BF16 and INT8 tiles 1.0-1.03x.  A Zen 4 forced to AVX2 ran the MoE layer so at T = 1, 4 and 32
 * in 0.89x, 0.88x and 0.97x the time (BF16) and 0.88x, 0.92x and 0.95x (INT8; FP8, unchanged,
 * 0.98-1.07x).  AMD cores without AVX-512 (Zen 2, Zen 3), the AVX2 hosts that matter, are not
 * measured so: they keep L1. */
static inline int32_t ktcy_plain_fetch_l2(const ktcy_cpu *c) { return !c->amd || c->avx512f; }

/* Every tile choice above for this CPU, as each ktcy_act carries them. */
static inline ktcy_tiles ktcy_cpu_tiles(const ktcy_cpu *c) {
    ktcy_tiles t;
    t.one_panel_rows = ktcy_one_panel_rows(c);
    t.f32_rows = ktcy_f32_rows(c);
    t.i16_rows = ktcy_i16_rows(c);
    t.avx2_i16_rows = ktcy_avx2_i16_rows(c);
    t.e2m1_panel_rows = ktcy_e2m1_panel_rows(c);
    t.fp8_fetch_l2 = ktcy_fp8_fetch_l2(c);
    t.wide_tiles = ktcy_wide_tiles(c);
    t.fp8_normal_panels = ktcy_fp8_normal_panels(c);
    t.plain_fetch_l2 = ktcy_plain_fetch_l2(c);
    return t;
}

#endif
