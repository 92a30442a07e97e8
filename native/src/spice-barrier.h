/* A spinning barrier for the graph threads inside one hook call.
 *
 * ggml runs a custom op on every graph thread and only synchronizes between
 * graph nodes, so the phases of one call (plan, quantize, up/gate, down,
 * combine) need their own barrier. It spins like ggml's own (the threads are
 * already spinning between nodes, and sleeping would cost more than a phase),
 * but only for a bounded number of rounds: after that it yields the CPU, so
 * that when another process shares the cores, the thread everyone waits for
 * gets scheduled instead of being starved by spinners. */
#ifndef SPICE_BARRIER_H
#define SPICE_BARRIER_H

#include <sched.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPICE_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define SPICE_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define SPICE_CPU_RELAX() ((void) 0)
#endif

/* ~50-100 us of pausing before yielding: longer than any phase on an idle
 * machine, short against a scheduler time slice. */
#define SPICE_SPIN_ROUNDS 20000

typedef struct spice_barrier {
    atomic_int arrived;
    atomic_int generation;
} spice_barrier;

static inline void spice_barrier_init(spice_barrier * b) {
    atomic_init(&b->arrived, 0);
    atomic_init(&b->generation, 0);
}

/* All nth threads must call it the same number of times. */
static inline void spice_barrier_wait(spice_barrier * b, int nth) {
    if (nth <= 1) {
        return;
    }
    const int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_acq_rel);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == gen; ++spins) {
        if (spins < SPICE_SPIN_ROUNDS) {
            SPICE_CPU_RELAX();
        } else {
            sched_yield();
        }
    }
}

#endif /* SPICE_BARRIER_H */
