/* spice-fifo-poll-check: spice_fifo_poll (src/spice-fifo-poll.c) against a
 * simulated in-order stream. Copies are issued into random free slots, the
 * stream finishes them in issue order at a random pace, and every poll must
 * report exactly the copies finished so far while asking about no more than
 * those newly finished plus one. Prints one line and exits 0, or names the
 * first wrong poll and exits 1.
 *
 *   spice-fifo-poll-check [polls] [seed] */
#include "spice-fifo-poll.h"

#include "check-rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_SLOTS = 48 };

typedef struct stream {
    uint64_t finished_seq; /* every copy issued with a number up to this has landed */
    const uint64_t * seq;
    int32_t asked;
} stream;

static int query(void * ctx, int32_t slot) {
    stream * st = (stream *) ctx;
    st->asked++;
    return st->seq[slot] <= st->finished_seq;
}

int main(int argc, char ** argv) {
    const long n_polls = argc > 1 ? atol(argv[1]) : 20000;
    check_rng rng = check_rng_from(argc > 2 ? argv[2] : NULL);
    uint64_t seq[N_SLOTS];
    int in_flight[N_SLOTS]; /* issued and not yet seen landed */
    memset(seq, 0, sizeof(seq));
    memset(in_flight, 0, sizeof(in_flight));
    uint64_t next_seq = 0, done_seq = 0;
    stream st = { 0, seq, 0 };
    long queries = 0, polled = 0;
    for (long p = 0; p < n_polls; ++p) {
        /* issue a few copies into free slots */
        for (uint32_t c = check_rng_below(&rng, 4); c > 0; --c) {
            const int32_t slot = (int32_t) check_rng_below(&rng, N_SLOTS);
            if (!in_flight[slot]) {
                in_flight[slot] = 1;
                seq[slot] = ++next_seq;
            }
        }
        /* the stream finishes some, in order */
        const uint64_t ahead = next_seq - st.finished_seq;
        st.finished_seq += ahead > 0 ? check_rng_below(&rng, (uint32_t) ahead + 1) : 0;
        int32_t slots[N_SLOTS], order[N_SLOTS];
        uint8_t landed[N_SLOTS];
        int32_t n = 0, newly = 0;
        for (int32_t s = 0; s < N_SLOTS; ++s) {
            if (in_flight[s]) {
                slots[n++] = s;
                newly += seq[s] <= st.finished_seq && seq[s] > done_seq;
            }
        }
        for (int32_t i = n - 1; i > 0; --i) { /* the store lists them in its own order */
            const int32_t j = (int32_t) check_rng_below(&rng, (uint32_t) i + 1), t = slots[i];
            slots[i] = slots[j];
            slots[j] = t;
        }
        st.asked = 0;
        const int32_t q = spice_fifo_poll(slots, n, seq, &done_seq, order, landed, query, &st);
        if (q != st.asked || q > newly + 1) {
            fprintf(stderr, "spice-fifo-poll-check: poll %ld asked %d times for %d newly landed\n", p, st.asked, newly);
            return 1;
        }
        for (int32_t i = 0; i < n; ++i) {
            if (landed[i] != (seq[slots[i]] <= st.finished_seq)) {
                fprintf(stderr, "spice-fifo-poll-check: poll %ld: slot %d (copy %llu, stream at %llu) reported %s\n",
                        p, slots[i], (unsigned long long) seq[slots[i]], (unsigned long long) st.finished_seq,
                        landed[i] ? "landed" : "not landed");
                return 1;
            }
            if (landed[i]) {
                in_flight[slots[i]] = 0;
            }
        }
        queries += q;
        polled += n;
    }
    printf("spice-fifo-poll-check: %ld polls of %ld copies in flight, %ld queries, all checks passed\n", n_polls,
           polled, queries);
    return 0;
}
