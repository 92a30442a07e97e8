/* Copies handed from the hook's thread to a copier thread that issues them.
 *
 * On an H200 in this project's VMs (2026-12-04) issuing one expert's copy --
 * an event, three cudaMemcpyAsync, an event -- took the hook's thread 9-18 us,
 * and the policies that copy spent 23-70 us of every decode call's hook time
 * on the store (per_call_decode.store_us), against about 1 us for one that
 * copies nothing: 0.2-0.5 ms a token of the critical path. Here the hook's
 * thread only queues a copy (a slot and its issue number); the copier thread
 * issues queued copies in order. A wait for a copy still queued issues it and
 * everything queued before it on the waiting thread, so a demand fetch does
 * not wait for the copier to wake. Issuing is serialized, so copies reach the
 * stream in issue-number order (what spice-fifo-poll.h relies on).
 *
 * Threads: one producer (the hook's thread, which also waits and polls), the
 * copier. The issue function runs on either, never on both at once.
 *
 * The CUDA tier uses it unless SPICE_CUDA_COPY_THREAD=0 (spice-cuda.c has the
 * measurement behind that default). */
#ifndef SPICE_COPY_QUEUE_H
#define SPICE_COPY_QUEUE_H

#include <stdint.h>

/* Put the copy into `slot` on the stream; 0, or nonzero when it failed. */
typedef int (*spice_copy_issue_fn)(void * ctx, int32_t slot);

typedef struct spice_copy_queue spice_copy_queue;

/* A queue of up to cap copies and its copier thread. SPICE_OK, or an error
 * (no memory, no thread): then copies are to be issued inline. */
int spice_copy_queue_create(int32_t cap, spice_copy_issue_fn issue, void * ctx, spice_copy_queue ** out);
/* Issues what is still queued, stops the copier. */
void spice_copy_queue_free(spice_copy_queue * q);

/* Queue the copy into slot with issue number seq (1, 2, ... in order).
 * SPICE_ERR_STATE when the queue is full (a caller error: one copy per slot). */
int spice_copy_queue_push(spice_copy_queue * q, int32_t slot, uint64_t seq);
/* Every copy numbered up to this is on the stream (or failed to get there). */
uint64_t spice_copy_queue_issued(spice_copy_queue * q);
/* Issue, on the calling thread, every queued copy up to number seq (the
 * copier may take some); returns once seq is issued. SPICE_OK, or
 * SPICE_ERR_INTERNAL when seq was never queued or any copy failed to issue so
 * far (sticky: one the copier issued after seq included). */
int spice_copy_queue_issue_through(spice_copy_queue * q, uint64_t seq);
/* Whether any copy failed to issue. */
int spice_copy_queue_failed(spice_copy_queue * q);

#endif /* SPICE_COPY_QUEUE_H */
