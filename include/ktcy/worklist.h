/* Work items taken one at a time by the threads of a team, each thread holding its next item
 * while it works on the current one: a dynamic schedule whose threads know what they do next,
 * so a GEMM can fetch the next item's weights as it finishes (prefetch.h, ktcy_act.next_w). */
#ifndef KTCY_WORKLIST_H
#define KTCY_WORKLIST_H

#include <stdint.h>

/* The next unclaimed item index (may be >= the item count: then there is none). */
static inline int64_t ktcy_take(int64_t *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

#endif
