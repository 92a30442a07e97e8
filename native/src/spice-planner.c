/* The planner thread and its ring of snapshots (spice-planner.h). */
#include "spice-planner.h"
#include "spice-clock.h"
#include "spice-grow.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__linux__) && defined(__has_include)
#    if __has_include(<linux/membarrier.h>)
#        include <linux/membarrier.h>
#        include <sys/syscall.h>
#        include <unistd.h>
#        define SPICE_HAVE_MEMBARRIER 1
#    endif
#endif

/* How an idle planner waits for the next snapshot. Parked on the condition
 * variable, it costs the hook's thread a futex wake at the next post --
 * microseconds in a VM, and the woken planner may preempt the hook's thread
 * on a shared core. With params.idle_poll it first busy-waits a little, then
 * sleeps in short steps, and parks only after a while with no work, so a
 * steady decode never makes the hook's thread wake anyone. That is for a
 * planner with a core of its own. Where the graph's threads take every core,
 * the polling (a spin, then a wake-up every few tens of microseconds) takes
 * their time instead: on 2 cores at -t 2, spice:exact decoded at 14.1
 * ms/token polling and 11.4 parked at once on the emulated tier, 26.5 and
 * 22.8 in edge mode (docs/results/planning.md), so without
 * idle_poll the planner parks as soon as it has nothing to do.
 *
 * How long "a while" is follows the decode: the longest gap between posts
 * is the one across a token's end (the output layer and sampling), 5-10 ms
 * for smolmoe-b at -t 1 and more for a large vocabulary on a slow host.
 * A fixed 5 ms parked the planner there about once per token, and that
 * token's first post paid a futex wake: 2-3 us on average over the posts at
 * plan_every 4 (docs/results/planning.md). So the planner polls for twice the longest gap
 * it waited through in the last one to two seconds (two one-second
 * windows), within 5 ms .. 250 ms: a pause in the decode (a user reading)
 * keeps it polling for at most a quarter second, and only for the next two
 * seconds. */
#ifndef SPICE_PLANNER_SPIN_NS /* spice-planner-check shrinks these three, so its planner parks often */
#    define SPICE_PLANNER_SPIN_NS 50000ull         /* busy-wait this long: a post usually follows soon */
#    define SPICE_PLANNER_IDLE_MIN_NS 5000000ull   /* then short sleeps for at least this long, then park */
#    define SPICE_PLANNER_IDLE_MAX_NS 250000000ull /* ... and for at most this long */
#endif
#define SPICE_PLANNER_WINDOW_NS 1000000000ull  /* the gaps remembered: this window and the last */

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

void spice_idle_budget_init(spice_idle_budget * b, uint64_t now_ns) {
    memset(b, 0, sizeof(*b));
    b->budget_ns = SPICE_PLANNER_IDLE_MIN_NS;
    b->window_start_ns = now_ns;
}

void spice_idle_budget_note(spice_idle_budget * b, uint64_t now_ns, uint64_t gap_ns) {
    if (now_ns - b->window_start_ns > SPICE_PLANNER_WINDOW_NS) {
        b->prev_max_ns = b->cur_max_ns;
        b->cur_max_ns = 0;
        b->window_start_ns = now_ns;
    }
    b->cur_max_ns = gap_ns > b->cur_max_ns ? gap_ns : b->cur_max_ns;
    const uint64_t longest = b->cur_max_ns > b->prev_max_ns ? b->cur_max_ns : b->prev_max_ns;
    const uint64_t want = longest < SPICE_PLANNER_IDLE_MAX_NS / 2 ? 2 * longest : SPICE_PLANNER_IDLE_MAX_NS;
    b->budget_ns = want > SPICE_PLANNER_IDLE_MIN_NS ? want : SPICE_PLANNER_IDLE_MIN_NS;
}

/* Whether an entry is QUEUED: the ring is a few entries, and only this thread polls it. */
static int any_queued(spice_planner * p) {
    for (int32_t i = 0; i < p->n_ring; ++i) {
        if (atomic_load_explicit(&p->ring[i].state, memory_order_acquire) == SPICE_ENTRY_QUEUED) {
            return 1;
        }
    }
    return 0;
}

/* Whether a post must fence before it reads `sleeping` (spice-planner.h): not
 * where the planner parks rarely and can fence every thread of the process
 * when it does. */
static int hook_must_fence(const spice_async_params * params) {
#ifdef SPICE_HAVE_MEMBARRIER
    if (params->idle_poll && syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0) {
        return 0;
    }
#else
    (void) params;
#endif
    return 1;
}

/* The planner's side of a post's unfenced QUEUED-then-`sleeping`: after it
 * announced `sleeping`, a full fence on every thread of the process, so a
 * post either has its QUEUED seen by the look that follows, or sees
 * `sleeping`. 0 when that could not be done (then the park is a short one). */
static int fence_every_thread(const spice_planner * p) {
    if (p->hook_fences) {
        return 1; /* the posts fence themselves */
    }
#ifdef SPICE_HAVE_MEMBARRIER
    return syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
    return 0;
#endif
}

/* Unlocked: until an entry is queued, stop is asked, or the idle budget since t0 runs out. */
static void idle_wait(spice_planner * p, uint64_t t0) {
    for (;;) {
        if (any_queued(p) || atomic_load(&p->stopping)) {
            return;
        }
        const uint64_t idle = spice_monotonic_ns() - t0;
        if (idle > p->idle.budget_ns) {
            return;
        }
        if (idle < SPICE_PLANNER_SPIN_NS) {
            cpu_relax();
        } else {
            const struct timespec step = { 0, 20000 };
            nanosleep(&step, NULL);
        }
    }
}

/* rows of `width` 4-byte values from a strided source into a compact array */
static int copy_rows(void ** dst, size_t * cap, const void * src, size_t nb1, int32_t rows, int32_t width) {
    const size_t row = (size_t) (width > 0 ? width : 0) * 4;
    if (spice_grow_bytes(dst, cap, row * (size_t) (rows > 0 ? rows : 0) + 4) != SPICE_OK) {
        return SPICE_ERR_NO_MEMORY;
    }
    for (int32_t t = 0; t < rows; ++t) {
        memcpy((char *) *dst + (size_t) t * row, (const char *) src + (size_t) t * nb1, row);
    }
    return SPICE_OK;
}

/* The lent rows into the entry's own arrays, by the thread that claimed them. */
static void copy_lent_rows(spice_async_entry * e) {
    const spice_async_shape * sh = &e->shape;
    int status = copy_rows((void **) &e->inp, &e->cap_inp, e->lent_inp, e->lent_inp_nb1, sh->n_tokens, sh->n_embd);
    if (sh->has_shexp) {
        status |= copy_rows((void **) &e->shexp, &e->cap_shexp, e->lent_shexp, e->lent_shexp_nb1, sh->n_tokens,
                            sh->n_embd);
    }
    e->lent_inp = e->lent_shexp = NULL; /* the call's buffers are not ours past its return */
    atomic_store_explicit(&e->rows, status == SPICE_OK ? SPICE_ROWS_OWN : SPICE_ROWS_FAILED, memory_order_release);
}

/* Either thread: copy the rows if they are still lent (1), else wait for the
 * other's copy, a few microseconds at most (0). */
static int settle_rows(spice_async_entry * e) {
    int lent = SPICE_ROWS_LENT;
    /* looked at first: the hook's thread usually finds them taken, and a failed
     * compare-and-swap is a locked instruction all the same */
    if (atomic_load_explicit(&e->rows, memory_order_acquire) == SPICE_ROWS_LENT &&
        atomic_compare_exchange_strong(&e->rows, &lent, SPICE_ROWS_COPYING)) {
        copy_lent_rows(e);
        return 1;
    }
    while (atomic_load(&e->rows) == SPICE_ROWS_COPYING) {
        cpu_relax();
    }
    return 0;
}

/* On the planner thread, for an entry it took: the policy's call over the
 * snapshot's arrays, with room for every list a plan may write. */
static int prepare_call(spice_planner * p, spice_async_entry * e) {
    int status = spice_grow_bytes((void **) &e->fetch, &e->cap_fetch, (size_t) p->cap_fetch * 4 + 4);
    status |= spice_grow_bytes((void **) &e->prefetch, &e->cap_prefetch, (size_t) p->cap_pairs * 4 + 4);
    status |= spice_grow_bytes((void **) &e->evict, &e->cap_evict, (size_t) p->cap_pairs * 4 + 4);
    status |= spice_grow_bytes((void **) &e->evict_from, &e->cap_evict_from, (size_t) p->cap_layers * 4 + 4);
    if (status != SPICE_OK) {
        return SPICE_ERR_NO_MEMORY;
    }
    const spice_async_shape * sh = &e->shape;
    const int32_t n_pairs = sh->n_tokens * sh->n_expert_used;
    spice_policy_call * c = &e->call;
    memset(c, 0, sizeof(*c));
    c->il = sh->il;
    c->n_tokens = sh->n_tokens;
    c->n_embd = sh->n_embd;
    c->n_expert = sh->n_expert;
    c->n_expert_used = sh->n_expert_used;
    c->inp = e->inp;         c->inp_nb1 = (size_t) sh->n_embd * 4;
    c->ids = e->ids;         c->ids_nb1 = (size_t) sh->n_expert_used * 4;
    c->weights = e->weights; c->weights_nb1 = (size_t) sh->n_expert_used * 4;
    if (sh->has_probs) {
        c->probs = e->probs; c->probs_nb1 = (size_t) sh->n_expert * 4;
    }
    if (sh->has_shexp) {
        c->shexp = e->shexp; c->shexp_nb1 = (size_t) sh->n_embd * 4;
    }
    if (sh->res_layers > 0) {
        c->residency = e->residency.rows;
        c->res_layers = sh->res_layers;
        c->res_width = sh->res_width;
    }
    c->il_next = -1; /* the graph's next-layer logits stay with the hook's thread */
    c->actions = e->actions;       c->n_actions = n_pairs;  c->cap_actions = n_pairs;
    c->fetch = e->fetch;           c->cap_fetch = p->cap_fetch;
    c->prefetch = e->prefetch;     c->cap_prefetch = p->cap_pairs;
    c->evict = e->evict;           c->cap_evict = p->cap_pairs;
    c->evict_from = e->evict_from; c->cap_evict_from = p->cap_layers;
    c->resume_il = -1;
    return SPICE_OK;
}

static void * planner_main(void * arg) {
    spice_planner * p = (spice_planner *) arg;
    int waited = 0;          /* idle_wait ran since the last entry: park next time */
    uint64_t idle_since = 0; /* when the planner last ran out of work, 0 while it has some */
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        spice_async_entry * next = NULL;
        for (int32_t i = 0; i < p->n_ring; ++i) {
            spice_async_entry * e = &p->ring[i];
            if (atomic_load(&e->state) == SPICE_ENTRY_QUEUED &&
                (next == NULL || atomic_load_explicit(&e->seq, memory_order_relaxed) <
                                     atomic_load_explicit(&next->seq, memory_order_relaxed))) {
                next = e;
            }
        }
        int queued = SPICE_ENTRY_QUEUED;
        if (next != NULL && !atomic_compare_exchange_strong(&next->state, &queued, SPICE_ENTRY_PLANNING)) {
            continue; /* the hook's thread took it back to write a newer snapshot over it: look again */
        }
        if (next == NULL) {
            if (idle_since == 0) {
                idle_since = spice_monotonic_ns();
            }
            if (!waited && p->params.idle_poll) {
                pthread_mutex_unlock(&p->mu);
                idle_wait(p, idle_since);
                pthread_mutex_lock(&p->mu);
                waited = 1;
            } else {
                /* announced before the last look, so a post either is seen here or sees this */
                atomic_store(&p->sleeping, 1);
                const int fenced = fence_every_thread(p);
                if (!any_queued(p) && !p->stop) {
                    if (fenced) {
                        pthread_cond_wait(&p->work, &p->mu);
                    } else { /* a post may have missed `sleeping`: look again within a millisecond */
                        struct timespec until;
                        clock_gettime(CLOCK_REALTIME, &until);
                        until.tv_nsec += 1000000;
                        until.tv_sec += until.tv_nsec / 1000000000;
                        until.tv_nsec %= 1000000000;
                        pthread_cond_timedwait(&p->work, &p->mu, &until);
                    }
                }
                atomic_store(&p->sleeping, 0);
                waited = 0;
            }
            continue;
        }
        waited = 0;
        if (idle_since != 0) {
            const uint64_t now = spice_monotonic_ns();
            spice_idle_budget_note(&p->idle, now, now - idle_since);
            idle_since = 0;
        }
        pthread_mutex_unlock(&p->mu);
        /* the policy: a Python callback takes the GIL here (cffi), never on the hook's thread */
        const uint64_t t0 = spice_monotonic_ns();
        int rc = SPICE_POLICY_FAILED;
        next->err[0] = '\0';
        settle_rows(next); /* while the posting call's experts run, if it has not returned yet */
        if (atomic_load(&next->rows) == SPICE_ROWS_FAILED) {
            snprintf(next->err, sizeof(next->err), "out of memory for the snapshot's hidden rows");
        } else if (prepare_call(p, next) == SPICE_OK) {
            rc = p->fn(&next->call, p->user_data);
        } else {
            snprintf(next->err, sizeof(next->err), "out of memory for the plan's lists");
        }
        const uint64_t spent = spice_monotonic_ns() - t0;
        next->valid = rc == SPICE_POLICY_OK &&
                      spice_plan_check(&p->limits, &next->call, next->err, sizeof(next->err)) == SPICE_OK;
        pthread_mutex_lock(&p->mu);
        next->rc = rc;
        next->plan_ns = spent;
        atomic_store_explicit(&next->state, SPICE_ENTRY_DONE, memory_order_release);
        /* its only writer: the hook's thread, reading it, finds the state DONE */
        atomic_store_explicit(&p->n_planned, atomic_load_explicit(&p->n_planned, memory_order_relaxed) + 1,
                              memory_order_release);
        pthread_cond_broadcast(&p->planned);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void entry_free(spice_async_entry * e) {
    free(e->inp);
    free(e->probs);
    free(e->ids);
    free(e->weights);
    free(e->shexp);
    spice_row_snapshot_free(&e->residency);
    free(e->actions);
    free(e->fetch);
    free(e->prefetch);
    free(e->evict);
    free(e->evict_from);
    memset(e, 0, sizeof(*e));
}

static void limits_free(spice_planner * p) {
    free(p->limit_n_expert);
    free(p->limit_has_surrogate);
    p->limit_n_expert = NULL;
    p->limit_has_surrogate = NULL;
    memset(&p->limits, 0, sizeof(p->limits));
}

static int limits_copy(spice_planner * p, const spice_plan_limits * src) {
    const size_t n = (size_t) (src->n_layers > 0 ? src->n_layers : 0);
    const size_t cells = n * (size_t) (src->max_expert > 0 ? src->max_expert : 0);
    p->limit_n_expert = (int32_t *) malloc((n > 0 ? n : 1) * sizeof(int32_t));
    if (src->has_surrogate != NULL) {
        p->limit_has_surrogate = (uint8_t *) malloc(cells > 0 ? cells : 1);
    }
    if (p->limit_n_expert == NULL || (src->has_surrogate != NULL && p->limit_has_surrogate == NULL)) {
        limits_free(p);
        return SPICE_ERR_NO_MEMORY;
    }
    if (n > 0) {
        memcpy(p->limit_n_expert, src->n_expert, n * sizeof(int32_t));
    }
    if (p->limit_has_surrogate != NULL && cells > 0) {
        memcpy(p->limit_has_surrogate, src->has_surrogate, cells);
    }
    p->limits.n_layers = src->n_layers;
    p->limits.max_expert = src->max_expert;
    p->limits.n_expert = p->limit_n_expert;
    p->limits.has_surrogate = p->limit_has_surrogate;
    return SPICE_OK;
}

int spice_planner_start(spice_planner * p, spice_policy_fn fn, void * user_data, const spice_async_params * params,
                        int32_t cap_fetch, int32_t cap_pairs, int32_t cap_layers, const spice_plan_limits * limits) {
    memset(p, 0, sizeof(*p));
    atomic_init(&p->n_planned, 0);
    atomic_init(&p->stopping, 0);
    p->params = *params;
    spice_idle_budget_init(&p->idle, spice_monotonic_ns());
    p->fn = fn;
    p->user_data = user_data;
    p->cap_fetch = cap_fetch;
    p->cap_pairs = cap_pairs;
    p->cap_layers = cap_layers;
    /* deterministic: the lag's calls in flight, one being posted, one held; free-running:
     * one planned, one planning, one queued, one being posted */
    p->n_ring = params->deterministic ? params->lag + 2 : 4;
    p->ring = (spice_async_entry *) calloc((size_t) p->n_ring, sizeof(spice_async_entry));
    p->hook_free = (uint8_t *) malloc((size_t) p->n_ring);
    p->posted = (int32_t *) calloc((size_t) p->n_ring, sizeof(int32_t));
    if (p->ring == NULL || p->hook_free == NULL || p->posted == NULL || limits_copy(p, limits) != SPICE_OK) {
        free(p->ring);
        free(p->hook_free);
        free(p->posted);
        memset(p, 0, sizeof(*p));
        return SPICE_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < p->n_ring; ++i) {
        atomic_init(&p->ring[i].state, SPICE_ENTRY_FREE);
        p->hook_free[i] = 1;
    }
    atomic_init(&p->sleeping, 0);
    p->hook_fences = hook_must_fence(params);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->planned, NULL);
    if (pthread_create(&p->thread, NULL, planner_main, p) != 0) {
        pthread_cond_destroy(&p->planned);
        pthread_cond_destroy(&p->work);
        pthread_mutex_destroy(&p->mu);
        free(p->ring);
        free(p->hook_free);
        free(p->posted);
        limits_free(p);
        memset(p, 0, sizeof(*p));
        return SPICE_ERR_NO_MEMORY;
    }
    p->running = 1;
    return SPICE_OK;
}

void spice_planner_stop(spice_planner * p) {
    if (!p->running) {
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    atomic_store(&p->stopping, 1);
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    for (int32_t i = 0; i < p->n_ring; ++i) {
        entry_free(&p->ring[i]);
    }
    free(p->ring);
    free(p->hook_free);
    free(p->posted);
    limits_free(p);
    pthread_cond_destroy(&p->planned);
    pthread_cond_destroy(&p->work);
    pthread_mutex_destroy(&p->mu);
    memset(p, 0, sizeof(*p));
}

/* The hook's list of posted entries: the i-th oldest, and taking one out. */
static int32_t posted_at(const spice_planner * p, int32_t i) {
    return p->posted[(p->posted_head + i) % p->n_ring];
}

static void posted_remove(spice_planner * p, int32_t i) {
    if (i == 0) {
        p->posted_head = (p->posted_head + 1) % p->n_ring;
    } else {
        for (int32_t j = i; j + 1 < p->n_posted; ++j) {
            p->posted[(p->posted_head + j) % p->n_ring] = p->posted[(p->posted_head + j + 1) % p->n_ring];
        }
    }
    p->n_posted--;
}

/* The i-th oldest posted entry, planned: now the hook's (HELD). */
static spice_async_entry * hold_posted(spice_planner * p, int32_t i) {
    spice_async_entry * e = &p->ring[posted_at(p, i)];
    posted_remove(p, i);
    atomic_store_explicit(&e->state, SPICE_ENTRY_HELD, memory_order_relaxed); /* the planner looks for QUEUED only */
    p->n_taken++;
    return e;
}

spice_async_entry * spice_planner_acquire(spice_planner * p, int * replaced) {
    *replaced = 0;
    for (int32_t i = 0; i < p->n_ring; ++i) {
        if (p->hook_free[i]) {
            p->hook_free[i] = 0;
            atomic_store_explicit(&p->ring[i].state, SPICE_ENTRY_WRITING, memory_order_relaxed);
            return &p->ring[i];
        }
    }
    if (p->params.deterministic || p->n_posted == 0) {
        return NULL;
    }
    /* free-running: the newest posted, unless the planner has started it (then every
     * older one is planned too: it takes them oldest first) */
    spice_async_entry * e = &p->ring[posted_at(p, p->n_posted - 1)];
    int queued = SPICE_ENTRY_QUEUED;
    if (!atomic_compare_exchange_strong(&e->state, &queued, SPICE_ENTRY_WRITING)) {
        return NULL;
    }
    posted_remove(p, p->n_posted - 1);
    *replaced = 1;
    return e;
}

/* The hook's thread writes only the snapshot: the call's small arrays and
 * its shape, and lends the hidden rows (SPICE_ROWS_*). The planner thread
 * builds the policy's call struct and sizes the plan's lists (prepare_call)
 * when it takes the entry. Those are lines the planner wrote last (the
 * policy's counts, its lists): written from the hook's thread they cost a
 * transfer each from the planner's core, timed at 0.29 us of a post's 0.62
 * (-t 1, plan_every 1); moved, spice:exact's deciding time per decode call
 * fell from 1.80 to 1.69 us there (docs/results/planning.md). */
int spice_planner_post(spice_planner * p, spice_async_entry * e, uint64_t seq, const spice_policy_call * call,
                       const int32_t * default_actions, const uint32_t * res_version, uint64_t res_epoch,
                       int * woke) {
    *woke = 0;
    const int32_t n = call->n_tokens, n_pairs = call->n_tokens * call->n_expert_used;
    const int has_probs = call->probs != NULL && p->params.with_probs;
    const int has_shexp = call->shexp != NULL && p->params.with_shexp;
    const int has_res = call->residency != NULL;
    int status = copy_rows((void **) &e->ids, &e->cap_ids, call->ids, call->ids_nb1, n, call->n_expert_used);
    status |= copy_rows((void **) &e->weights, &e->cap_weights, call->weights, call->weights_nb1, n,
                        call->n_expert_used);
    if (has_probs) {
        status |= copy_rows((void **) &e->probs, &e->cap_probs, call->probs, call->probs_nb1, n, call->n_expert);
    }
    if (has_res && spice_row_snapshot_take(&e->residency, call->residency, res_version, res_epoch, call->res_layers,
                                           call->res_width) < 0) {
        status = SPICE_ERR_NO_MEMORY;
    }
    status |= spice_grow_bytes((void **) &e->actions, &e->cap_actions, (size_t) n_pairs * 4 + 4);
    if (status != SPICE_OK) {
        spice_planner_release(p, e);
        return SPICE_ERR_NO_MEMORY;
    }
    memcpy(e->actions, default_actions, (size_t) n_pairs * 4);
    spice_async_shape * sh = &e->shape;
    sh->il = call->il;
    sh->n_tokens = n;
    sh->n_embd = call->n_embd;
    sh->n_expert = call->n_expert;
    sh->n_expert_used = call->n_expert_used;
    sh->res_layers = has_res ? call->res_layers : 0;
    sh->res_width = has_res ? call->res_width : 0;
    sh->has_probs = has_probs;
    sh->has_shexp = has_shexp;
    e->lent_inp = call->inp;
    e->lent_inp_nb1 = call->inp_nb1;
    e->lent_shexp = has_shexp ? call->shexp : NULL;
    e->lent_shexp_nb1 = has_shexp ? call->shexp_nb1 : 0;
    atomic_store_explicit(&e->rows, SPICE_ROWS_LENT, memory_order_relaxed); /* published with the state */
    p->lent = e;
    atomic_store_explicit(&e->seq, seq, memory_order_relaxed); /* published by the state's store below */
    p->posted[(p->posted_head + p->n_posted) % p->n_ring] = (int32_t) (e - p->ring);
    p->n_posted++;

    atomic_store_explicit(&e->state, SPICE_ENTRY_QUEUED, memory_order_release);
    /* QUEUED before `sleeping` is read: a fence here, or the planner's membarrier before it
     * parks (spice-planner.h); the compiler keeps the order either way */
    if (p->hook_fences) {
        atomic_thread_fence(memory_order_seq_cst);
    } else {
        atomic_signal_fence(memory_order_seq_cst);
    }
    /* a polling planner sees the entry: no lock, no wake, no syscall on the hook's thread */
    if (atomic_load_explicit(&p->sleeping, memory_order_relaxed)) {
        pthread_mutex_lock(&p->mu);
        if (atomic_load(&p->sleeping)) {
            pthread_cond_signal(&p->work);
            atomic_store(&p->sleeping, 0); /* one wake is enough: posts until it runs must not signal again */
            *woke = 1;
        }
        pthread_mutex_unlock(&p->mu);
    }
    return SPICE_OK;
}

int spice_planner_settle(spice_planner * p) {
    spice_async_entry * e = p->lent;
    if (e == NULL) {
        return 0;
    }
    p->lent = NULL;
    return settle_rows(e);
}

spice_async_entry * spice_planner_take_done(spice_planner * p) {
    if (atomic_load_explicit(&p->n_planned, memory_order_acquire) == p->n_taken || p->n_posted == 0) {
        /* most calls: nothing finished */
        return NULL;
    }
    /* the oldest planned: plans finish in posting order, so the first posted, but for a
     * planner that chose by a snapshot's number just as the hook's thread wrote a newer
     * snapshot over that entry (then only the compare-and-swap stopped it) */
    for (int32_t i = 0; i < p->n_posted; ++i) {
        spice_async_entry * e = &p->ring[posted_at(p, i)];
        if (atomic_load(&e->state) == SPICE_ENTRY_DONE) {
            return hold_posted(p, i);
        }
    }
    return NULL;
}

spice_async_entry * spice_planner_wait(spice_planner * p, uint64_t seq) {
    int32_t at = -1;
    for (int32_t i = 0; i < p->n_posted && at < 0; ++i) {
        if (atomic_load_explicit(&p->ring[posted_at(p, i)].seq, memory_order_relaxed) == seq) {
            at = i;
        }
    }
    if (at < 0) {
        return NULL;
    }
    spice_async_entry * got = &p->ring[posted_at(p, at)];
    if (atomic_load(&got->state) != SPICE_ENTRY_DONE) {
        pthread_mutex_lock(&p->mu); /* the planner marks it DONE and broadcasts under the mutex */
        while (atomic_load(&got->state) != SPICE_ENTRY_DONE) {
            pthread_cond_wait(&p->planned, &p->mu);
        }
        pthread_mutex_unlock(&p->mu);
    }
    return hold_posted(p, at);
}

void spice_planner_release(spice_planner * p, spice_async_entry * e) {
    atomic_store_explicit(&e->state, SPICE_ENTRY_FREE, memory_order_relaxed); /* the planner looks for QUEUED only */
    p->hook_free[e - p->ring] = 1;
}
