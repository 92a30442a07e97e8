/* spice-pool-ids-check: spice_pool_fill_ids (src/spice-pool-ids.c) over random
 * calls. For each: device pairs keep their slots; every id is a slot or the
 * zero slot; in a launch of several tokens no token repeats an id (what
 * ggml-cuda's batched MUL_MAT_ID needs); a one-token launch sends every other
 * pair to the zero slot; the scratch comes back zeroed; and the call is refused
 * exactly when the slots are too few. Prints one line and exits 0, or names the
 * first failing call and exits 1.
 *
 *   spice-pool-ids-check [calls] [seed] */
#include "spice-pool-ids.h"

#include "check-rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(long call, const char * what, int32_t t, int32_t k) {
    fprintf(stderr, "spice-pool-ids-check: call %ld: %s (token %d, pair %d)\n", call, what, t, k);
    return 1;
}

int main(int argc, char ** argv) {
    const long n_calls = argc > 1 ? atol(argv[1]) : 20000;
    check_rng rng = check_rng_from(argc > 2 ? argv[2] : NULL);
    enum { MAX_USED = 10, MAX_BUCKET = 32, MAX_SLOTS = 64 };
    int32_t sid[MAX_BUCKET * MAX_USED], want[MAX_BUCKET * MAX_USED], listed[MAX_BUCKET * MAX_USED];
    uint8_t mark[MAX_SLOTS];
    memset(mark, 0, sizeof(mark));
    long refused = 0, fillers = 0;
    for (long call = 0; call < n_calls; ++call) {
        const int32_t n_used = 1 + (int32_t) check_rng_below(&rng, MAX_USED);
        const int32_t n_slots = 1 + (int32_t) check_rng_below(&rng, MAX_SLOTS);
        const int32_t bucket = 1 << check_rng_below(&rng, 6); /* 1 .. 32 */
        const int32_t n_tokens = 1 + (int32_t) check_rng_below(&rng, (uint32_t) bucket);
        const int32_t p_device = (int32_t) check_rng_below(&rng, 101);
        for (int32_t t = 0; t < n_tokens; ++t) { /* distinct device slots per token, as distinct experts give */
            for (int32_t k = 0; k < n_used; ++k) {
                int32_t s = -1;
                if ((int32_t) check_rng_below(&rng, 100) < p_device) {
                    s = (int32_t) check_rng_below(&rng, (uint32_t) n_slots);
                    for (int32_t j = 0; j < k; ++j) {
                        if (want[t * n_used + j] == s) {
                            s = -1;
                        }
                    }
                }
                want[t * n_used + k] = s;
            }
        }
        const int rc = spice_pool_fill_ids(sid, want, n_tokens, bucket, n_used, n_slots, mark, listed);
        const int too_few = bucket > 1 && n_slots + 1 < n_used;
        if ((rc != 0) != too_few) {
            return fail(call, rc != 0 ? "refused with enough slots" : "accepted with too few slots", -1, -1);
        }
        if (rc != 0) {
            refused++;
            continue;
        }
        for (int32_t s = 0; s < n_slots; ++s) {
            if (mark[s] != 0) {
                return fail(call, "scratch not cleared", -1, s);
            }
        }
        for (int32_t t = 0; t < bucket; ++t) {
            for (int32_t k = 0; k < n_used; ++k) {
                const int32_t id = sid[t * n_used + k];
                const int32_t w = t < n_tokens ? want[t * n_used + k] : -1;
                if (id < 0 || id > n_slots) {
                    return fail(call, "id outside the slots and the zero slot", t, k);
                }
                if (w >= 0 && id != w) {
                    return fail(call, "a device pair moved off its slot", t, k);
                }
                if (w < 0 && bucket == 1 && id != n_slots) {
                    return fail(call, "a one-token launch read a real slot for a pair not on the device", t, k);
                }
                fillers += w < 0 && id != n_slots;
                for (int32_t j = 0; bucket > 1 && j < k; ++j) {
                    if (sid[t * n_used + j] == id) {
                        return fail(call, "a token repeats an id", t, k);
                    }
                }
            }
        }
    }
    printf("spice-pool-ids-check: %ld calls, %ld refused (too few slots), %ld filler ids, all checks passed\n",
           n_calls, refused, fillers);
    return 0;
}
