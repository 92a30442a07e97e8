/* What the tools that drive libspice with made-up calls share (the benchmarks here,
 * and native/tests/spice-planner-check.c): a clock, a sort key for
 * percentiles, and a one-token hook call over the caller's arrays. */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include "spice.h"

#include <stdint.h>
#include <string.h>
#include <time.h>

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static inline int cmp_u64(const void * a, const void * b) {
    const uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;
    return x < y ? -1 : x > y;
}

/* A decode call of layer il: one token's hidden row, ids and gate weights, compact;
 * every plan list empty (the caller lends the ones it needs). */
static inline void bench_one_token_call(spice_policy_call * call, int32_t il, int32_t n_embd, int32_t n_expert,
                                        int32_t n_used, const float * inp, const int32_t * ids,
                                        const float * weights) {
    memset(call, 0, sizeof(*call));
    call->il = il;
    call->n_tokens = 1;
    call->n_embd = n_embd;
    call->n_expert = n_expert;
    call->n_expert_used = n_used;
    call->inp = inp;
    call->inp_nb1 = (size_t) n_embd * sizeof(float);
    call->ids = ids;
    call->ids_nb1 = (size_t) n_used * sizeof(int32_t);
    call->weights = weights;
    call->weights_nb1 = (size_t) n_used * sizeof(float);
}

#endif /* BENCH_UTIL_H */
