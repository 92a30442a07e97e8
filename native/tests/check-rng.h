/* The check tools' generator (spice-*-check.c): xorshift64*, seeded from the command
 * line so a failing call can be replayed with the same seed. Not for statistics. */
#ifndef CHECK_RNG_H
#define CHECK_RNG_H

#include <stdint.h>
#include <stdlib.h>

typedef struct check_rng {
    uint64_t state;
} check_rng;

/* From the tool's seed argument, or a fixed seed without one. */
static inline check_rng check_rng_from(const char * seed) {
    check_rng r = { seed != NULL ? (uint64_t) atoll(seed) * 0x9E3779B97F4A7C15ULL + 1 : 0x5EED };
    return r;
}

/* Uniform enough in [0, n), n > 0. */
static inline uint32_t check_rng_below(check_rng * r, uint32_t n) {
    r->state ^= r->state >> 12;
    r->state ^= r->state << 25;
    r->state ^= r->state >> 27;
    return (uint32_t) ((r->state * 2685821657736338717ULL) >> 33) % n;
}

#endif /* CHECK_RNG_H */
