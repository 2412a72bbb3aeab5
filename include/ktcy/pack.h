/* Packed weight layouts (DESIGN.md): W[N][K] padded to whole blocks, blocks stored in
 * [N/16][K/block_k] order with K inner.  Within a block, row r holds the next group of K
 * values of all 16 channels side by side:
 *   INT8  16n x 64k, 1024 B: byte r*64 + n*4 + j = W[n][4r+j]   (AMX TDPBSSD B tile, one vpdpbusd operand)
 *   BF16  16n x 32k, 1024 B: half r*32 + n*2 + j = W[n][2r+j]   (TDPBF16PS B tile, one vdpbf16ps operand)
 *   FP8   16n x 32k,  512 B: byte r*32 + n*2 + j = W[n][2r+j]   (the BF16 order, one byte each)
 *   INT4  16n x 64k,  512 B: the INT8 order of 1024 codes; code e sits in byte e%512, low nibble
 *         for e < 512 and high nibble otherwise, stored as code+8 (0..15).  So one 64-byte load
 *         gives INT8 rows r and r+8 by a mask and a shift. */
#ifndef KTCY_PACK_H
#define KTCY_PACK_H

#include <stdint.h>
#include <string.h>

#include "types.h"

static inline int64_t ktcy_int8_offset(int64_t nn, int64_t kk) { return (kk >> 2) * 64 + nn * 4 + (kk & 3); }
static inline int64_t ktcy_pair_offset(int64_t nn, int64_t kk) { return (kk >> 1) * 32 + nn * 2 + (kk & 1); }

/* Lays out panels [p0, p1) of an [n][k] code matrix (1 or 2 bytes per element, row stride ld
 * elements) into dst; padding is written as zero.  INT8 also gets its per-channel code sums. */
static inline void ktcy_layout_panels(int format, const void *codes, int64_t ld, int64_t n, int64_t k,
                                      int64_t k_pad, int64_t p0, int64_t p1, uint8_t *dst, int32_t *colsum) {
    const int bk = ktcy_block_k(format), bb = ktcy_block_bytes(format);
    const int64_t nkb = k_pad / bk;
    for (int64_t p = p0; p < p1; ++p) {
        uint8_t *panel = dst + p * nkb * bb;
        memset(panel, 0, (size_t)(nkb * bb));
        for (int64_t nn = 0; nn < KTCY_PANEL; ++nn) {
            int64_t row = p * KTCY_PANEL + nn;
            int32_t sum = 0;
            for (int64_t kk = 0; row < n && kk < k; ++kk) {
                uint8_t *blk = panel + (kk / bk) * bb;
                int64_t kin = kk % bk;
                if (format == KTCY_BF16) {
                    ((uint16_t *)blk)[ktcy_pair_offset(nn, kin)] = ((const uint16_t *)codes)[row * ld + kk];
                } else if (format == KTCY_FP8_PERCHANNEL || format == KTCY_FP8_BLOCK) {
                    blk[ktcy_pair_offset(nn, kin)] = ((const uint8_t *)codes)[row * ld + kk];
                } else {
                    int8_t c = ((const int8_t *)codes)[row * ld + kk];
                    int64_t e = ktcy_int8_offset(nn, kin);
                    if (format == KTCY_INT8) {
                        blk[e] = (uint8_t)c;
                        sum += c;
                    } else {
                        uint8_t nib = (uint8_t)(c + 8) & 0x0F;
                        blk[e & 511] |= e < 512 ? nib : (uint8_t)(nib << 4);
                    }
                }
            }
            if (format == KTCY_INT4) /* padding codes are 0, i.e. nibble 8 */
                for (int64_t kk = (row < n ? k : 0); kk < k_pad; ++kk) {
                    int64_t e = ktcy_int8_offset(nn, kk % bk);
                    uint8_t *blk = panel + (kk / bk) * bb;
                    blk[e & 511] |= e < 512 ? 8 : 0x80;
                }
            if (colsum) colsum[row] = sum;
        }
    }
}

#endif
