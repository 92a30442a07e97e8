/* Polling copies on an in-order stream (see spice-fifo-poll.h). */
#include "spice-fifo-poll.h"

int32_t spice_fifo_poll(const int32_t * slots, int32_t n, const uint64_t * seq, uint64_t * done_seq, int32_t * order,
                        uint8_t * landed, spice_fifo_query query, void * ctx) {
    /* oldest first: insertion sort (a poll holds at most the copies in flight) */
    for (int32_t i = 0; i < n; ++i) {
        int32_t j = i;
        while (j > 0 && seq[slots[order[j - 1]]] > seq[slots[i]]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    int32_t queries = 0;
    int unfinished = 0; /* an older copy is still on its way: so is every later one */
    for (int32_t r = 0; r < n; ++r) {
        const int32_t i = order[r];
        const uint64_t s = seq[slots[i]];
        if (unfinished) {
            landed[i] = 0;
            continue;
        }
        if (s <= *done_seq) {
            landed[i] = 1;
            continue;
        }
        const int rc = query(ctx, slots[i]);
        queries++;
        if (rc < 0) {
            return -1;
        }
        landed[i] = (uint8_t) (rc > 0);
        if (rc > 0) {
            *done_seq = s;
        } else {
            unfinished = 1;
        }
    }
    return queries;
}
