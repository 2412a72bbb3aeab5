/* Fetching the next panels while the current ones compute.  A call walks its panels in groups,
 * and a group's row tiles run from cache, so the memory would sit idle while they compute and
 * the next group's first pass would then wait on it.  Each row tile therefore takes a share of
 * the next group's packed bytes and fetches it into L2 a few lines per K block, spread over its
 * work (a burst would stall the core on the miss queue).  After a call's last group, "next" is
 * the caller's hint (ktcy_act.next_w: the panels this thread multiplies next), if any. */
#ifndef KTCY_PREFETCH_H
#define KTCY_PREFETCH_H

#include <stdint.h>
#include <xmmintrin.h>

#include "types.h"

typedef struct {
    const char *at;   /* this tile's first line */
    int64_t lines;    /* lines per K block; 0: nothing to fetch */
} ktcy_ahead;

static inline ktcy_ahead ktcy_no_ahead(void) {
    ktcy_ahead s = {0, 0};
    return s;
}

/* The packed bytes that follow a group of np panels ending before panel `next` of w (panels
 * [pb, pe) are this call's): the next group of this call, else the hint's first np panels. */
static inline void ktcy_next_group(const ktcy_act *a, const ktcy_weight *w, int64_t next, int64_t pe, int64_t np,
                                   int64_t block_k, int64_t block_bytes, const uint8_t **at, int64_t *bytes) {
    const ktcy_weight *nw = w;
    int64_t count = pe - next;
    if (count <= 0) {
        nw = a->next_w;
        if (nw == 0 || nw->format != w->format || a->next_pe <= a->next_pb) {
            *at = 0;
            *bytes = 0;
            return;
        }
        next = a->next_pb;
        count = a->next_pe - a->next_pb;
    }
    const int64_t panel_bytes = nw->k_pad / block_k * block_bytes;
    *at = nw->data + next * panel_bytes;
    *bytes = (count < np ? count : np) * panel_bytes;
}

/* Tile `tile` of `tiles` over nkb K blocks: its share of the `bytes` at `next`. */
static inline ktcy_ahead ktcy_ahead_share(const uint8_t *next, int64_t bytes, int64_t tile, int64_t tiles,
                                          int64_t nkb) {
    ktcy_ahead s = {(const char *)next, 0};
    if (next == 0 || bytes <= 0 || tiles < 1 || nkb < 1) return s;
    const int64_t lines = (bytes + 63) / 64, per_tile = (lines + tiles - 1) / tiles;
    s.lines = (per_tile + nkb - 1) / nkb;
    s.at += tile * s.lines * nkb * 64;
    if (s.at >= (const char *)next + bytes) s.lines = 0; /* the earlier tiles covered it all */
    return s;
}

/* Block kb's lines of the share (prefetches never fault, so the last share may run past the end). */
static inline __attribute__((always_inline)) void ktcy_ahead_block(ktcy_ahead s, int64_t kb) {
    for (int64_t l = 0; l < s.lines; ++l) _mm_prefetch(s.at + (kb * s.lines + l) * 64, _MM_HINT_T1);
}

#endif
