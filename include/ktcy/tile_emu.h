/* Plain-C model of the AMX tile unit (palette 1: 8 tiles of up to 16 rows x 64 bytes),
 * following the Intel SDM pseudocode of LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBSSD and
 * TDPBF16PS.  Where hardware would fault (#GP/#UD), the model records an error and ignores the
 * instruction, so the caller can report it instead of computing garbage.
 * The register file is per thread, like the hardware's; it is the only mutable state here. */
#ifndef KTCY_TILE_EMU_H
#define KTCY_TILE_EMU_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "numeric.h"

typedef struct {
    uint8_t cfg[64];            /* the configuration as last loaded (all zero: released) */
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
    int error;
    char message[160];
} ktcy_emu_tiles;

static _Thread_local ktcy_emu_tiles ktcy_emu;

static inline void ktcy_emu_fail(const char *message) {
    if (ktcy_emu.error) return; /* keep the first fault: later ones follow from it */
    ktcy_emu.error = 1;
    snprintf(ktcy_emu.message, sizeof ktcy_emu.message, "%s", message);
}

static inline void ktcy_emu_clear_error(void) { ktcy_emu.error = 0; ktcy_emu.message[0] = 0; }

static inline void ktcy_emu_tilerelease(void) {
    memset(ktcy_emu.cfg, 0, sizeof ktcy_emu.cfg);
    memset(ktcy_emu.rows, 0, sizeof ktcy_emu.rows);
    memset(ktcy_emu.colsb, 0, sizeof ktcy_emu.colsb);
    memset(ktcy_emu.data, 0, sizeof ktcy_emu.data);
}

/* Layout: byte 0 palette, byte 1 start_row, 2..15 reserved, 16..47 colsb[16] (u16), 48..63 rows[16]. */
static inline void ktcy_emu_ldtilecfg(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    char msg[160];
    if (c[0] == 0) { ktcy_emu_tilerelease(); return; }
    if (c[0] != 1) { snprintf(msg, sizeof msg, "LDTILECFG: palette %u is not supported (only 0 and 1)", c[0]); ktcy_emu_fail(msg); return; }
    for (int i = 1; i < 16; ++i)
        if (c[i]) { snprintf(msg, sizeof msg, "LDTILECFG: byte %d (start_row/reserved) must be zero, is %u", i, c[i]); ktcy_emu_fail(msg); return; }
    for (int t = 0; t < 16; ++t) {
        uint16_t colsb = (uint16_t)(c[16 + 2 * t] | (c[17 + 2 * t] << 8));
        uint8_t rows = c[48 + t];
        if (t >= 8 && (colsb || rows)) { snprintf(msg, sizeof msg, "LDTILECFG: tile %d does not exist in palette 1 but is configured", t); ktcy_emu_fail(msg); return; }
        if (t < 8 && (rows > 16 || colsb > 64)) { snprintf(msg, sizeof msg, "LDTILECFG: tile %d is %u rows x %u bytes; the limit is 16 x 64", t, rows, colsb); ktcy_emu_fail(msg); return; }
        if (t < 8 && (rows == 0) != (colsb == 0)) { snprintf(msg, sizeof msg, "LDTILECFG: tile %d has %u rows but %u bytes per row", t, rows, colsb); ktcy_emu_fail(msg); return; }
    }
    memcpy(ktcy_emu.cfg, c, 64);
    for (int t = 0; t < 8; ++t) {
        ktcy_emu.rows[t] = c[48 + t];
        ktcy_emu.colsb[t] = (uint16_t)(c[16 + 2 * t] | (c[17 + 2 * t] << 8));
    }
    memset(ktcy_emu.data, 0, sizeof ktcy_emu.data);
}

static inline int ktcy_emu_usable(int t, const char *op) {
    char msg[160];
    if (t < 0 || t > 7) { snprintf(msg, sizeof msg, "%s: tmm%d does not exist", op, t); ktcy_emu_fail(msg); return 0; }
    if (!ktcy_emu.cfg[0]) { snprintf(msg, sizeof msg, "%s: tiles are not configured (LDTILECFG first)", op); ktcy_emu_fail(msg); return 0; }
    if (!ktcy_emu.rows[t]) { snprintf(msg, sizeof msg, "%s: tmm%d is not configured", op, t); ktcy_emu_fail(msg); return 0; }
    return !ktcy_emu.error;
}

static inline void ktcy_emu_tileloadd(int t, const void *base, int64_t stride) {
    if (!ktcy_emu_usable(t, "TILELOADD")) return;
    memset(ktcy_emu.data[t], 0, sizeof ktcy_emu.data[t]);
    for (int r = 0; r < ktcy_emu.rows[t]; ++r)
        memcpy(ktcy_emu.data[t][r], (const uint8_t *)base + r * stride, ktcy_emu.colsb[t]);
}

static inline void ktcy_emu_tilestored(int t, void *base, int64_t stride) {
    if (!ktcy_emu_usable(t, "TILESTORED")) return;
    for (int r = 0; r < ktcy_emu.rows[t]; ++r)
        memcpy((uint8_t *)base + r * stride, ktcy_emu.data[t][r], ktcy_emu.colsb[t]);
}

static inline void ktcy_emu_tilezero(int t) {
    if (!ktcy_emu_usable(t, "TILEZERO")) return;
    memset(ktcy_emu.data[t], 0, sizeof ktcy_emu.data[t]);
}

/* Shape rules shared by the dot-product instructions (C: M x N dwords, A: M x K dwords,
 * B: K rows x N dwords, three distinct tiles). */
static inline int ktcy_emu_dp_shapes(int c, int a, int b, const char *op) {
    char msg[160];
    if (!ktcy_emu_usable(c, op) || !ktcy_emu_usable(a, op) || !ktcy_emu_usable(b, op)) return 0;
    if (c == a || c == b || a == b) { snprintf(msg, sizeof msg, "%s: tiles must differ (tmm%d, tmm%d, tmm%d)", op, c, a, b); ktcy_emu_fail(msg); return 0; }
    if (ktcy_emu.colsb[c] % 4 || ktcy_emu.colsb[a] % 4) { snprintf(msg, sizeof msg, "%s: A and C rows must be whole dwords", op); ktcy_emu_fail(msg); return 0; }
    if (ktcy_emu.rows[a] != ktcy_emu.rows[c]) { snprintf(msg, sizeof msg, "%s: A has %u rows, C has %u", op, ktcy_emu.rows[a], ktcy_emu.rows[c]); ktcy_emu_fail(msg); return 0; }
    if (ktcy_emu.colsb[a] / 4 != ktcy_emu.rows[b]) { snprintf(msg, sizeof msg, "%s: A.colsb/4 = %u but B has %u rows", op, ktcy_emu.colsb[a] / 4, ktcy_emu.rows[b]); ktcy_emu_fail(msg); return 0; }
    if (ktcy_emu.colsb[b] != ktcy_emu.colsb[c]) { snprintf(msg, sizeof msg, "%s: B.colsb = %u but C.colsb = %u", op, ktcy_emu.colsb[b], ktcy_emu.colsb[c]); ktcy_emu_fail(msg); return 0; }
    return 1;
}

/* TDPBSSD: C[m][n] += sum over 4 signed byte products, 32-bit wrap-around. */
static inline void ktcy_emu_tdpbssd(int c, int a, int b) {
    if (!ktcy_emu_dp_shapes(c, a, b, "TDPBSSD")) return;
    for (int m = 0; m < ktcy_emu.rows[c]; ++m)
        for (int k = 0; k < ktcy_emu.colsb[a] / 4; ++k)
            for (int n = 0; n < ktcy_emu.colsb[c] / 4; ++n) {
                const int8_t *x = (const int8_t *)&ktcy_emu.data[a][m][4 * k];
                const int8_t *y = (const int8_t *)&ktcy_emu.data[b][k][4 * n];
                uint32_t acc;
                memcpy(&acc, &ktcy_emu.data[c][m][4 * n], 4);
                for (int i = 0; i < 4; ++i) acc += (uint32_t)((int32_t)x[i] * (int32_t)y[i]);
                memcpy(&ktcy_emu.data[c][m][4 * n], &acc, 4);
            }
}

/* bf16 operand with denormals read as zero (TDPBF16PS ignores MXCSR: DAZ in, FTZ out, RNE). */
static inline float ktcy_emu_bf16_daz(uint16_t h) {
    if ((h & 0x7F80) == 0) h &= 0x8000;
    return ktcy_bf16_to_f32(h);
}

static inline float ktcy_emu_ftz(float f) {
    uint32_t u = ktcy_f32_bits(f);
    return (u & 0x7F800000u) == 0 ? ktcy_bits_f32(u & 0x80000000u) : f;
}

/* TDPBF16PS: C[m][n] += a0*b0, then += a1*b1, each step rounded to fp32 (the bf16 products
 * themselves are exact in fp32). */
static inline void ktcy_emu_tdpbf16ps(int c, int a, int b) {
    if (!ktcy_emu_dp_shapes(c, a, b, "TDPBF16PS")) return;
    for (int m = 0; m < ktcy_emu.rows[c]; ++m)
        for (int k = 0; k < ktcy_emu.colsb[a] / 4; ++k)
            for (int n = 0; n < ktcy_emu.colsb[c] / 4; ++n) {
                uint16_t x[2], y[2];
                float acc;
                memcpy(x, &ktcy_emu.data[a][m][4 * k], 4);
                memcpy(y, &ktcy_emu.data[b][k][4 * n], 4);
                memcpy(&acc, &ktcy_emu.data[c][m][4 * n], 4);
                for (int i = 0; i < 2; ++i)
                    acc = ktcy_emu_ftz(acc + ktcy_emu_bf16_daz(x[i]) * ktcy_emu_bf16_daz(y[i]));
                memcpy(&ktcy_emu.data[c][m][4 * n], &acc, 4);
            }
}

#endif
