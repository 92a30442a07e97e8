/* Which of n copies on one in-order stream have landed, asking the device
 * about as few of them as possible.
 *
 * Copies issued on one CUDA stream finish in the order they were issued. So,
 * taken oldest first, once one copy is found unfinished every later one is
 * unfinished too, and every copy no later than one found finished is done.
 * Asking each copy instead (cudaEventQuery, plus cudaGetLastError after each
 * "not ready") put one to two CUDA calls per copy in flight on the hook's
 * thread at every poll: on an H200 the rows that copy most (adapmoe about 7
 * copies per decode call) spent 3.4-4.6 us deciding per call against 1.5 on
 * the emulated tier. */
#ifndef SPICE_FIFO_POLL_H
#define SPICE_FIFO_POLL_H

#include <stdint.h>

/* 1: the copy into `slot` has landed; 0: not yet; < 0: the device failed. */
typedef int (*spice_fifo_query)(void * ctx, int32_t slot);

/* landed[i] for slots[0..n): seq[slot] is each copy's issue number (1, 2, ...
 * on the stream, in issue order); *done_seq the latest issue number known
 * landed, raised here. order: scratch of n. Returns the number of queries
 * made (>= 0), or -1 when one failed (landed is then incomplete). */
int32_t spice_fifo_poll(const int32_t * slots, int32_t n, const uint64_t * seq, uint64_t * done_seq, int32_t * order,
                        uint8_t * landed, spice_fifo_query query, void * ctx);

#endif /* SPICE_FIFO_POLL_H */
