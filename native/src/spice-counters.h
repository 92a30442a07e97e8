/* Summing spice_counters: every field is a uint64_t count or nanoseconds, so
 * per-layer records, the store's and the runtime's add up field by field. */
#ifndef SPICE_COUNTERS_H
#define SPICE_COUNTERS_H

#include "spice.h"

#include <stddef.h>
#include <stdint.h>

static inline void spice_counters_accumulate(spice_counters * dst, const spice_counters * src) {
    uint64_t * d = (uint64_t *) dst;
    const uint64_t * s = (const uint64_t *) src;
    for (size_t i = 0; i < sizeof(spice_counters) / sizeof(uint64_t); ++i) {
        d[i] += s[i];
    }
}

#endif /* SPICE_COUNTERS_H */
