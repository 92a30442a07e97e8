/* The store's clock: real monotonic time, or a manual clock that moves only
 * when told (tests drive the emulated device's virtual bus with it). One
 * clock is shared by a store and its device, so both read the same "now". */
#ifndef SPICE_CLOCK_H
#define SPICE_CLOCK_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef struct spice_clock {
    int      manual;   /* 1: time moves only through spice_clock_advance_to */
    uint64_t now_ns;   /* the manual clock */
    uint64_t epoch_ns; /* real clock origin */
} spice_clock;

static inline uint64_t spice_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static inline void spice_clock_init(spice_clock * c, int manual) {
    c->manual = manual;
    c->now_ns = 0;
    c->epoch_ns = spice_monotonic_ns();
}

static inline uint64_t spice_clock_now(const spice_clock * c) {
    return c->manual ? c->now_ns : spice_monotonic_ns() - c->epoch_ns;
}

/* Switch between real time and the manual clock, continuing from what the
 * clock reads now (times already handed out stay in the same frame). */
static inline void spice_clock_set_manual(spice_clock * c, int manual) {
    if (manual && !c->manual) {
        c->now_ns = spice_monotonic_ns() - c->epoch_ns;
    } else if (!manual && c->manual) {
        c->epoch_ns = spice_monotonic_ns() - c->now_ns;
    }
    c->manual = manual != 0;
}

/* Block until the clock reads at least t (a manual clock jumps there). */
static inline void spice_clock_sleep_until(spice_clock * c, uint64_t t) {
    if (c->manual) {
        if (t > c->now_ns) {
            c->now_ns = t;
        }
        return;
    }
    for (uint64_t now = spice_clock_now(c); now < t; now = spice_clock_now(c)) {
        const uint64_t left = t - now;
        struct timespec ts = { (time_t) (left / 1000000000ull), (long) (left % 1000000000ull) };
        nanosleep(&ts, NULL);
    }
}

/* spice_clock_sleep_until, watching *cancel between slices of at most
 * slice_ns: returns 1 (the clock short of t) once it reads nonzero, else 0.
 * NULL cancel: the whole sleep. A manual clock never sleeps, so never stops. */
static inline int spice_clock_sleep_until_cancel(spice_clock * c, uint64_t t, atomic_int * cancel,
                                                 uint64_t slice_ns) {
    if (c->manual || cancel == NULL) {
        spice_clock_sleep_until(c, t);
        return 0;
    }
    for (uint64_t now = spice_clock_now(c); now < t; now = spice_clock_now(c)) {
        if (atomic_load(cancel) != 0) {
            return 1;
        }
        spice_clock_sleep_until(c, t - now > slice_ns ? now + slice_ns : t);
    }
    return 0;
}

#endif /* SPICE_CLOCK_H */
