/* Fetching the next panels while the current ones compute.  A call walks its panels in groups,
 * and a group's row tiles run from cache, so the memory would sit idle while they compute and
 * the next group's first pass would then wait on it.  Each row tile therefore takes a share of
 * the next group's packed bytes and fetches it into L2 a few lines per K block, spread over its
 * work (a burst would stall the core on the miss queue).  A decode call's one tile streams its
 * panels instead, and near a panel's end its prefetches run on into the panel that slot reads
 * next.  After a call's last group, "next" is the caller's hint (ktcy_act.next_w: the panels
 * this thread multiplies next), if any. */
#ifndef KTCY_PREFETCH_H
#define KTCY_PREFETCH_H

#include <stdint.h>
#include <xmmintrin.h>

#include "types.h"

typedef struct {
    const uint8_t *at; /* packed bytes to fetch ahead; NULL: none */
    int64_t bytes;
    int64_t panel_bytes; /* one panel of them */
} ktcy_span;

typedef struct {
    uintptr_t at;      /* this tile's first line */
    int64_t lines;     /* lines per K block; 0: nothing to fetch */
} ktcy_ahead;

static inline ktcy_ahead ktcy_no_ahead(void) {
    ktcy_ahead s = {0, 0};
    return s;
}

/* The packed bytes after a group of np panels that ends before panel `next_panel` of w (this
 * call's panels end at pe): the next group of this call, else the hint's first np panels. */
static inline ktcy_span ktcy_next_group(const ktcy_act *a, const ktcy_weight *w, int64_t next_panel, int64_t pe,
                                        int64_t np, int64_t block_k, int64_t block_bytes) {
    ktcy_span none = {0, 0, 0};
    const ktcy_weight *nw = w;
    int64_t count = pe - next_panel;
    if (count <= 0) {
        nw = a->next_w;
        if (nw == 0 || nw->format != w->format || a->next_pe <= a->next_pb) return none;
        next_panel = a->next_pb;
        count = a->next_pe - a->next_pb;
    }
    const int64_t panel_bytes = nw->k_pad / block_k * block_bytes;
    ktcy_span s = {nw->data + next_panel * panel_bytes, (count < np ? count : np) * panel_bytes, panel_bytes};
    return s;
}

/* Tile `tile` of `tiles` over nkb K blocks: its share of `next`; nothing for a single tile (a
 * decode tile streams its panels and runs on into the next ones at its own pace,
 * ktcy_stream_ahead: fetching the next group apart from that stream made FP8 T=4 1.4x slower).
 * Addresses are integers: the last share may reach past the end, which a prefetch tolerates and
 * a C pointer may not. */
static inline ktcy_ahead ktcy_ahead_share(ktcy_span next, int64_t tile, int64_t tiles, int64_t nkb) {
    ktcy_ahead s = ktcy_no_ahead();
    if (next.at == 0 || next.bytes <= 0 || tiles < 2 || nkb < 1) return s;
    const int64_t lines = (next.bytes + 63) / 64, per_tile = (lines + tiles - 1) / tiles;
    const int64_t per_block = (per_tile + nkb - 1) / nkb, first = tile * per_block * nkb * 64;
    if (first >= next.bytes) return s; /* the earlier tiles covered it all */
    s.at = (uintptr_t)next.at + (uintptr_t)first;
    s.lines = per_block;
    return s;
}

/* Where a tile streaming its panels from memory (decode: one tile per group) prefetches for
 * block kb of panel slot `slot` (which starts at `panel`), `ahead` blocks on: inside the panel,
 * or in its last blocks the first blocks of the panel this slot streams next (`cont`: the next
 * group of the call, or the caller's hint), so the streams run on across groups and calls
 * instead of each group starting cold (MoE T=1 AVX-512 MXFP4 0.80-0.94x, FP8 0.90-0.98x the time).
 * With no next panel for the slot the address runs past the panel's end, as it always did. */
static inline uintptr_t ktcy_stream_ahead(ktcy_span cont, int slot, const uint8_t *panel, int64_t kb,
                                          int64_t nkb, int64_t ahead, int64_t block_bytes) {
    const int64_t into = kb + ahead - nkb;
    if (into >= 0 && slot * cont.panel_bytes < cont.bytes)
        return (uintptr_t)cont.at + (uintptr_t)(slot * cont.panel_bytes + into * block_bytes);
    return (uintptr_t)panel + (uintptr_t)((kb + ahead) * block_bytes);
}

/* A decode stream's prefetch of the line at `at`: into L1, or into L2 where the CPU's streams of
 * that format read faster so (ktcy_act.fp8_fetch_l2, plain_fetch_l2).  The hint is an immediate, hence the branch
 * (on a flag fixed per call: predicted). */
static inline __attribute__((always_inline)) void ktcy_fetch_stream(uintptr_t at, int to_l2) {
    if (to_l2)
        _mm_prefetch((const char *)at, _MM_HINT_T1);
    else
        _mm_prefetch((const char *)at, _MM_HINT_T0);
}

/* Block kb's lines of the share. */
static inline __attribute__((always_inline)) void ktcy_ahead_block(ktcy_ahead s, int64_t kb) {
    for (int64_t l = 0; l < s.lines; ++l)
        _mm_prefetch((const char *)(s.at + (uintptr_t)((kb * s.lines + l) * 64)), _MM_HINT_T1);
}

#endif
