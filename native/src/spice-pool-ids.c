/* Expert ids of a pool-graph launch (see spice-pool-ids.h). */
#include "spice-pool-ids.h"

#include <stddef.h>

static int in_row(const int32_t * row, int32_t n, int32_t slot) {
    for (int32_t k = 0; k < n; ++k) {
        if (row[k] == slot) {
            return 1;
        }
    }
    return 0;
}

int spice_pool_fill_ids(int32_t * sid, const int32_t * want, int32_t n_tokens, int32_t bucket, int32_t n_used,
                        int32_t n_slots, uint8_t * mark, int32_t * listed) {
    const int32_t zero_slot = n_slots;
    const int distinct = bucket > 1;
    if (distinct && n_slots + 1 < n_used) {
        return -1;
    }
    /* the chunk's device slots, each once: the fillers tried first */
    int32_t n_listed = 0;
    for (int32_t i = 0; distinct && i < n_tokens * n_used; ++i) {
        if (want[i] >= 0 && want[i] < n_slots && !mark[want[i]]) {
            mark[want[i]] = 1;
            listed[n_listed++] = want[i];
        }
    }
    for (int32_t t = 0; t < bucket; ++t) {
        int32_t * row = sid + (size_t) t * (size_t) n_used;
        const int32_t * w = want + (size_t) t * (size_t) n_used;
        int zero_taken = 0;
        for (int32_t k = 0; k < n_used; ++k) {
            const int32_t s = t < n_tokens && w[k] >= 0 && w[k] < n_slots ? w[k] : -1;
            if (s >= 0) {
                row[k] = s;
            } else if (!distinct || !zero_taken) {
                row[k] = zero_slot;
                zero_taken = 1;
            } else {
                row[k] = -1; /* a filler, chosen below once the row's own slots are known */
            }
        }
        if (!distinct) {
            continue;
        }
        /* fillers: the chunk's slots first, then unlisted ones, lowest first; there are enough
         * (n_slots minus the row's device pairs >= n_used - 1 minus them) */
        int32_t from_list = 0, next = 0;
        for (int32_t k = 0; k < n_used; ++k) {
            if (row[k] != -1) {
                continue;
            }
            while (from_list < n_listed && in_row(row, n_used, listed[from_list])) {
                from_list++;
            }
            if (from_list < n_listed) {
                row[k] = listed[from_list++];
                continue;
            }
            while (next < n_slots && (mark[next] || in_row(row, n_used, next))) {
                next++;
            }
            row[k] = next++; /* next < n_slots: see above */
        }
    }
    for (int32_t i = 0; i < n_listed; ++i) {
        mark[listed[i]] = 0; /* the scratch as it came */
    }
    return 0;
}
