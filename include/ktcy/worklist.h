/* Work items taken one at a time by the threads of a team, each thread holding its next item
 * while it works on the current one: a dynamic schedule whose threads know what they do next,
 * so a GEMM can fetch the next item's weights as it finishes (prefetch.h, ktcy_act.next_w).
 * Items of a second phase may depend on a group of first-phase items (an expert's down
 * projection on its gate and up items): the thread finishing a group's last item readies its
 * input and publishes it, and a dependent item waits for that instead of the whole team waiting
 * at a barrier between the phases. */
#ifndef KTCY_WORKLIST_H
#define KTCY_WORKLIST_H

#include <sched.h>
#include <stdint.h>
#include <immintrin.h>

/* The next unclaimed item index (may be >= the item count: then there is none). */
static inline int64_t ktcy_take(int64_t *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

/* One item of a group done; the group's items still to finish (0: this thread finished it last,
 * and sees every other item's writes). */
static inline int64_t ktcy_finish_item(int64_t *pending) { return __atomic_sub_fetch(pending, 1, __ATOMIC_ACQ_REL); }

/* The group's input is ready: what this thread wrote before is visible to ktcy_wait_published. */
static inline void ktcy_publish(int32_t *flag) { __atomic_store_n(flag, 1, __ATOMIC_RELEASE); }

/* Until the group is published.  Items are taken in index order and first-phase items come
 * first, so a thread holds a later item than its current one: a first-phase item a waiter
 * needs is some thread's current item, or the next of a thread whose current item is also
 * first-phase, and first-phase items never wait, so the wait ends.  After a short spin it
 * yields the core, in case the thread it waits on shares it (other processes' threads). */
static inline void ktcy_wait_published(const int32_t *flag) {
    for (int spins = 0; !__atomic_load_n(flag, __ATOMIC_ACQUIRE); ++spins) {
        if (spins < 4096)
            _mm_pause();
        else
            sched_yield();
    }
}

#endif
