/* Packed weight layouts: W[N][K] padded to whole blocks, blocks stored in
 * [N/16][K/block_k] order with K inner, so one panel of 16 output channels is contiguous.
 * Within a block, row r holds the next few K values of all 16 channels side by side:
 *
 *   int8 activations (S8, U4 codes): 4 K values per channel per row, 16 rows = 64 K
 *        byte: 0   1   2   3   4   5   6   7  ...  60  61  62  63
 *   row 0:  n0k0 n0k1 n0k2 n0k3 n1k0 n1k1 n1k2 n1k3 ... n15k0 .. n15k3      <- one vpdpbusd operand,
 *   row 1:  n0k4 n0k5 n0k6 n0k7 n1k4 ...                                       one TDPBSSD B-tile row
 *   ...
 *   row 15: n0k60 ..                                                  n15k63
 *
 *   bf16 activations (BF16, E4M3 codes): 2 K values per channel per row, 16 rows = 32 K
 *   row r:  n0k(2r) n0k(2r+1) n1k(2r) n1k(2r+1) ... n15k(2r+1)   (2 bytes each for BF16 = 64 B,
 *                                                                   1 byte each for E4M3 = 32 B)
 *
 *   U4 (INT4): the 1024 codes of the S8 order, code e in byte e % 512: low nibble for e < 512,
 *   high nibble otherwise, stored as code + 8 (0..15).  One 64-byte load gives rows r and r + 8
 *   by a mask and a shift.
 *
 *   E2M1 (MXFP4): the bf16 pair order at 4 bits, then the block's 16 E8M0 scales (272 B):
 *   bytes 32q .. 32q+31 hold rows 2q (low nibbles) and 2q+1 (high nibbles), q = 0..7
 *        byte:   0          1          2        ...  31
 *   low  nib: n0k(4q)   n0k(4q+1)  n1k(4q)   ...  n15k(4q+1)        <- row 2q
 *   high nib: n0k(4q+2) n0k(4q+3)  n1k(4q+2) ...  n15k(4q+3)        <- row 2q+1
 *   bytes 256 .. 271: the scale exponent of channels 0..15 for these 32 K values.
 *   One 32-byte load gives two rows by a mask and a shift.  MXFP4_A8's 64-K block is two such
 *   sub-blocks of 272 bytes, one after the other. */
#ifndef KTCY_PACK_H
#define KTCY_PACK_H

#include <stdint.h>
#include <string.h>

#include "formats.h"

static inline int64_t ktcy_int8_offset(int64_t nn, int64_t kk) { return (kk >> 2) * 64 + nn * 4 + (kk & 3); }
/* The s8 code of channel p * 16 + nn at K offset k of INT8-order blocks (INT8, INT8_GROUP) with
 * k_pad columns: what the portable kernels read. */
static inline int32_t ktcy_int8_block_code(const uint8_t *data, int64_t k_pad, int64_t p, int64_t nn, int64_t k) {
    return ((const int8_t *)data)[(p * (k_pad / 64) + k / 64) * 1024 + ktcy_int8_offset(nn, k % 64)];
}
static inline int64_t ktcy_pair_offset(int64_t nn, int64_t kk) { return (kk >> 1) * 32 + nn * 2 + (kk & 1); }

/* Lays out panels [p0, p1) of an [n][k] code matrix (int8 for S8/U4, bf16 bits, E4M3 bytes;
 * row stride ld elements) into dst; padding is written as code zero.  Formats with colsum also
 * get each channel's code sum. */
static inline void ktcy_layout_panels(int format, const void *codes, int64_t ld, int64_t n, int64_t k,
                                      int64_t k_pad, int64_t p0, int64_t p1, uint8_t *dst, int32_t *colsum) {
    const ktcy_format_desc *d = ktcy_format(format);
    const int bk = d->block_k, bb = d->block_bytes, kind = d->code;
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
                if (kind == KTCY_CODE_BF16) {
                    ((uint16_t *)blk)[ktcy_pair_offset(nn, kin)] = ((const uint16_t *)codes)[row * ld + kk];
                } else if (kind == KTCY_CODE_E4M3) {
                    blk[ktcy_pair_offset(nn, kin)] = ((const uint8_t *)codes)[row * ld + kk];
                } else if (kind == KTCY_CODE_E2M1) {
                    uint8_t *sub = panel + (kk / KTCY_E2M1_SUB_K) * KTCY_E2M1_SUB_BYTES;
                    const int64_t ks = kk % KTCY_E2M1_SUB_K, r = ks >> 1, byte = (r >> 1) * 32 + nn * 2 + (ks & 1);
                    const uint8_t code = ((const uint8_t *)codes)[row * ld + kk] & 15;
                    sub[byte] |= (r & 1) ? (uint8_t)(code << 4) : code;
                } else {
                    int8_t c = ((const int8_t *)codes)[row * ld + kk];
                    int64_t e = ktcy_int8_offset(nn, kin);
                    sum += c;
                    if (kind == KTCY_CODE_S8) {
                        blk[e] = (uint8_t)c;
                    } else {
                        uint8_t nib = (uint8_t)(c + 8) & 0x0F;
                        blk[e & 511] |= e < 512 ? nib : (uint8_t)(nib << 4);
                    }
                }
            }
            if (kind == KTCY_CODE_U4) /* padding codes are 0, i.e. nibble 8 */
                for (int64_t kk = (row < n ? k : 0); kk < k_pad; ++kk) {
                    int64_t e = ktcy_int8_offset(nn, kk % bk);
                    uint8_t *blk = panel + (kk / bk) * bb;
                    blk[e & 511] |= e < 512 ? 8 : 0x80;
                }
            if (colsum && d->colsum) colsum[row] = sum;
        }
    }
}

/* E2M1 formats: writes each 32-K sub-block's 16 E8M0 exponents (from exps [n][k_pad/32], row
 * stride ld) after its codes; padding channels and sub-blocks get 127 (a scale of 1: their codes
 * are zero anyway). */
static inline void ktcy_layout_block_scales(const uint8_t *exps, int64_t ld, int64_t n, int64_t k_pad, int64_t p0,
                                            int64_t p1, uint8_t *dst) {
    const int64_t nkb = k_pad / KTCY_E2M1_SUB_K, code_bytes = KTCY_E2M1_SUB_BYTES - KTCY_PANEL;
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t kb = 0; kb < nkb; ++kb) {
            uint8_t *tail = dst + (p * nkb + kb) * KTCY_E2M1_SUB_BYTES + code_bytes;
            for (int64_t nn = 0; nn < KTCY_PANEL; ++nn) {
                const int64_t row = p * KTCY_PANEL + nn;
                tail[nn] = row < n && kb < ld ? exps[row * ld + kb] : 127;
            }
        }
}

#endif
