/* Growing a buffer that is kept between uses (the planner's snapshot arrays,
 * spice-row-snapshot.c, the runtime's plan lists). */
#ifndef SPICE_GROW_H
#define SPICE_GROW_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* *buf to at least `need` bytes, contents kept (*cap: what it holds): 0, or -1
 * with *buf and *cap untouched when it cannot grow. */
static inline int spice_grow_bytes(void ** buf, size_t * cap, size_t need) {
    if (need <= *cap) {
        return 0;
    }
    void * nbuf = realloc(*buf, need);
    if (nbuf == NULL) {
        return -1;
    }
    *buf = nbuf;
    *cap = need;
    return 0;
}

/* *buf to at least `need` int32 values (*cap: what it holds), as spice_grow_bytes. */
static inline int spice_grow_i32(int32_t ** buf, int32_t * cap, int32_t need) {
    if (need <= *cap) {
        return 0;
    }
    int32_t * nbuf = (int32_t *) realloc(*buf, (size_t) need * sizeof(int32_t));
    if (nbuf == NULL) {
        return -1;
    }
    *buf = nbuf;
    *cap = need;
    return 0;
}

#endif /* SPICE_GROW_H */
