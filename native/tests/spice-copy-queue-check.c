/* spice-copy-queue-check: the copier thread and its queue (src/spice-copy-queue.c)
 * with a stand-in for the CUDA calls. The hook's side queues copies into free
 * slots and now and then waits for one (which issues it and everything before
 * it on the waiting thread if the copier has not yet); the copier issues the
 * rest. Checks: copies are issued exactly once each and in queue order, a wait
 * returns only once its copy is issued, and a failed issue is reported. Prints
 * one line and exits 0, or names the first failure and exits 1.
 *
 *   spice-copy-queue-check [copies] [seed] */
#include "spice-copy-queue.h"
#include "spice.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include "check-rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_SLOTS = 32 };

typedef struct fake_stream {
    uint64_t seq_of[N_SLOTS];   /* the queued copy's number, per slot (set before the push) */
    atomic_uint_fast64_t last;  /* the last number issued */
    atomic_int out_of_order;
    uint64_t fail_at;           /* issue number that fails (0: none) */
    int spin;                   /* busy work per issue, so both threads issue at times */
    pthread_t producer;
    atomic_long by_copier, by_producer;
} fake_stream;

static int fake_issue(void * ctx, int32_t slot) {
    fake_stream * fs = (fake_stream *) ctx;
    const uint64_t seq = fs->seq_of[slot];
    if (seq != (uint64_t) atomic_load(&fs->last) + 1) {
        atomic_store(&fs->out_of_order, 1);
    }
    for (volatile int i = 0; i < fs->spin; ++i) {
    }
    if (pthread_equal(pthread_self(), fs->producer)) {
        atomic_fetch_add(&fs->by_producer, 1);
    } else {
        atomic_fetch_add(&fs->by_copier, 1);
    }
    atomic_store(&fs->last, seq);
    return seq == fs->fail_at;
}

static int run(check_rng * rng, long n_copies, uint64_t fail_at, long * waits_out, long * issued_by_waits) {
    fake_stream * fs = (fake_stream *) calloc(1, sizeof(*fs));
    atomic_init(&fs->last, 0);
    atomic_init(&fs->out_of_order, 0);
    fs->fail_at = fail_at;
    fs->spin = 2000;
    fs->producer = pthread_self();
    atomic_init(&fs->by_copier, 0);
    atomic_init(&fs->by_producer, 0);
    spice_copy_queue * q = NULL;
    if (spice_copy_queue_create(N_SLOTS, fake_issue, fs, &q) != SPICE_OK) {
        fprintf(stderr, "spice-copy-queue-check: could not start the copier\n");
        return 1;
    }
    uint64_t next = 0;
    long waits = 0;
    int failed_seen = 0;
    /* the copier alone: a queued copy is issued with no one waiting for it */
    fs->seq_of[0] = ++next;
    spice_copy_queue_push(q, 0, next);
    for (int i = 0; i < 1000 && spice_copy_queue_issued(q) < next; ++i) {
        nanosleep(&(struct timespec) { 0, 1000000 }, NULL);
    }
    if (spice_copy_queue_issued(q) < next) {
        fprintf(stderr, "spice-copy-queue-check: the copier did not issue a queued copy within a second\n");
        return 1;
    }
    while ((long) next < n_copies) {
        /* free slots: those whose copy is issued (the stand-in lands at once) */
        const uint64_t issued = spice_copy_queue_issued(q);
        int32_t free_slots[N_SLOTS], n_free = 0;
        for (int32_t s = 0; s < N_SLOTS; ++s) {
            if (fs->seq_of[s] <= issued) {
                free_slots[n_free++] = s;
            }
        }
        for (uint32_t c = check_rng_below(rng, 4); c > 0 && n_free > 0 && (long) next < n_copies; --c) {
            const int32_t k = (int32_t) check_rng_below(rng, (uint32_t) n_free);
            const int32_t slot = free_slots[k];
            free_slots[k] = free_slots[--n_free];
            fs->seq_of[slot] = ++next;
            if (spice_copy_queue_push(q, slot, next) != SPICE_OK) {
                fprintf(stderr, "spice-copy-queue-check: push %llu refused\n", (unsigned long long) next);
                return 1;
            }
        }
        if (check_rng_below(rng, 3) == 0 && next > 0) { /* a wait, as a demand fetch or a launch does */
            const uint64_t want = next - check_rng_below(rng, (uint32_t) (next < 4 ? next : 4));
            const int rc = spice_copy_queue_issue_through(q, want);
            waits++;
            if (spice_copy_queue_issued(q) < want) {
                fprintf(stderr, "spice-copy-queue-check: a wait for copy %llu returned before it was issued\n",
                        (unsigned long long) want);
                return 1;
            }
            if (rc != SPICE_OK) {
                failed_seen = 1;
                /* a failure is sticky (spice-copy-queue.h): the wait may report one the copier
                 * made on a later copy meanwhile (CI, 2026-12-04: a wait for copy 2504 while
                 * 2505 failed), but none before the failing copy was issued */
                if (fail_at == 0 || (uint64_t) atomic_load(&fs->last) < fail_at) {
                    fprintf(stderr, "spice-copy-queue-check: a wait for copy %llu failed with no failure due\n",
                            (unsigned long long) want);
                    return 1;
                }
            }
        }
    }
    spice_copy_queue_issue_through(q, next);
    const int failed = spice_copy_queue_failed(q);
    spice_copy_queue_free(q);
    if (atomic_load(&fs->out_of_order) || (uint64_t) atomic_load(&fs->last) != next) {
        fprintf(stderr, "spice-copy-queue-check: copies issued out of order or not all (%llu of %llu)\n",
                (unsigned long long) atomic_load(&fs->last), (unsigned long long) next);
        return 1;
    }
    if (failed != (fail_at != 0)) {
        fprintf(stderr, "spice-copy-queue-check: failure %s\n", failed ? "reported with none made" : "not reported");
        return 1;
    }
    (void) failed_seen;
    if (atomic_load(&fs->by_copier) == 0) {
        fprintf(stderr, "spice-copy-queue-check: the copier issued nothing\n");
        return 1;
    }
    *issued_by_waits += atomic_load(&fs->by_producer);
    free(fs);
    *waits_out += waits;
    return 0;
}

int main(int argc, char ** argv) {
    const long n_copies = argc > 1 ? atol(argv[1]) : 20000;
    check_rng rng = check_rng_from(argc > 2 ? argv[2] : NULL);
    long waits = 0, by_waits = 0;
    if (run(&rng, n_copies, 0, &waits, &by_waits) != 0 ||
        run(&rng, n_copies / 4 + 10, (uint64_t) (n_copies / 8 + 5), &waits, &by_waits) != 0) {
        return 1;
    }
    printf("spice-copy-queue-check: %ld copies, %ld waits (which issued %ld copies themselves), issued once each "
           "in order; a failed issue reported; all checks passed\n", n_copies + n_copies / 4 + 10, waits, by_waits);
    return 0;
}
