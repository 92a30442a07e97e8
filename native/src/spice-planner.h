/* The planner thread of asynchronous planning (spice_runtime_enable_async)
 * and the ring of snapshots it plans.
 *
 * An entry goes FREE -> WRITING (the hook's thread copies a call into it) ->
 * QUEUED -> PLANNING (the planner thread calls the policy on it) -> DONE ->
 * HELD (the hook's thread applies or drops its plan) -> FREE. The planner
 * takes queued entries oldest first, so plans finish in the order their
 * calls came. Neither thread holds a lock while copying, planning or
 * applying, so the hook's thread never waits for the policy except when it
 * asks to (spice_planner_wait).
 *
 * The hook's thread takes no lock on its usual path. Only it moves an entry
 * out of FREE, WRITING, DONE and HELD, so it keeps its own list of the free
 * entries and of those it posted, in order (plans finish in that order): a
 * call reads the planner's `n_planned` count against its own `n_taken`, and a
 * post writes the entry's state and reads `sleeping`. Before, it took the
 * planner's mutex three times a call and read every entry's state, each a
 * line the planner's core also writes: 1.4 us of a decode call's 4.7-6.0 on
 * DeepSeek-V2-Lite's shape (docs/results/cpu-overhead.md). The planner's
 * own scan stays under the mutex, and takes an entry QUEUED -> PLANNING by
 * compare-and-swap, as the hook's thread takes back the newest queued one to
 * write a newer snapshot over it; the planner parks only after announcing it
 * (`sleeping`) and finding nothing queued, and a post that then sees it
 * parked wakes it under the mutex.
 *
 * No locked instruction on the hook's usual path either. Every count has one
 * writer, and the hook's stores are plain (release) stores: on x86 a locked
 * instruction or a sequentially consistent store waits until every earlier
 * store has reached the cache, and the entry's lines were last written by the
 * planner's core, so each such store waited for those lines to come over.
 * The one order that needs a full fence -- a post's QUEUED before its read of
 * `sleeping`, against the planner's `sleeping` before its look for QUEUED --
 * gets it from the planner's side where the planner polls before it parks
 * (params.idle_poll, so parking is rare): membarrier(2) makes every thread of
 * the process pass a full fence at that point. Where the planner parks
 * whenever it runs out of work, or membarrier is not available, the hook's
 * thread fences itself (`hook_fences`).
 *
 * The planner thread also checks each plan (spice_plan_check) against its
 * own copy of the limits, taken at start: the check is the plan's, not the
 * call's, and on the hook's thread it cost 0.3-0.5 us per plan
 * (docs/results/planning.md).
 * A surrogate loaded after the start is one the planner's checks do not
 * know of; an asynchronous plan's actions are for a call the rule already
 * ran, and the engine loads its surrogates before it starts a planner. */
#ifndef SPICE_PLANNER_H
#define SPICE_PLANNER_H

#include "spice.h"
#include "spice-row-snapshot.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

enum { SPICE_ENTRY_FREE, SPICE_ENTRY_WRITING, SPICE_ENTRY_QUEUED, SPICE_ENTRY_PLANNING, SPICE_ENTRY_DONE,
       SPICE_ENTRY_HELD };

/* An entry's hidden rows (and shared-expert rows). A post only lends them:
 * the hook's call keeps reading them while its experts run, so the planner,
 * if it takes the entry meanwhile, copies them on its own core, and the
 * hook's thread copies them itself only if the planner has not started by
 * the time the call returns (spice_planner_settle). Whoever moves LENT ->
 * COPYING first copies; the other waits for OWN (or FAILED: no memory).
 * Copied on the hook's thread, the rows were most of a post: 1.2-1.3 us of
 * 2.2 for DeepSeek-V2-Lite's 8 KiB row (docs/results/cpu-overhead.md). */
enum { SPICE_ROWS_OWN, SPICE_ROWS_LENT, SPICE_ROWS_COPYING, SPICE_ROWS_FAILED };

/* What the hook's thread writes of a call besides its arrays: the planner
 * builds the policy's spice_policy_call from it (spice_planner_post). */
typedef struct spice_async_shape {
    int32_t il, n_tokens, n_embd, n_expert, n_expert_used;
    int32_t res_layers, res_width; /* 0 x 0: no residency table */
    int has_probs, has_shexp;
} spice_async_shape;

typedef struct spice_async_entry {
    atomic_int state;
    _Atomic uint64_t seq;    /* the hook call it was posted at (the planner reads it while choosing) */
    spice_async_shape shape; /* written with the arrays by the hook's thread */
    atomic_int rows;         /* SPICE_ROWS_*: whether inp and shexp below hold the call's rows yet */
    const void * lent_inp;   size_t lent_inp_nb1;   /* while LENT: the call's own rows */
    const void * lent_shexp; size_t lent_shexp_nb1;
    spice_policy_call call;  /* the planner thread's: pointers into the arrays below */
    /* the snapshot's own arrays (grown as calls need, kept between uses) */
    float * inp;        size_t cap_inp;
    float * probs;      size_t cap_probs;
    int32_t * ids;      size_t cap_ids;
    float * weights;    size_t cap_weights;
    float * shexp;      size_t cap_shexp;
    spice_row_snapshot residency; /* rows taken again only where they changed since this entry held them */
    /* the plan the policy writes */
    int32_t * actions;  size_t cap_actions;
    int32_t * fetch;    size_t cap_fetch;
    int32_t * prefetch; size_t cap_prefetch;
    int32_t * evict;    size_t cap_evict;
    int32_t * evict_from; size_t cap_evict_from;
    int rc;           /* the policy's SPICE_POLICY_* */
    int valid;        /* rc OK: the plan passed spice_plan_check, else `err` says why not */
    uint64_t plan_ns; /* the planner's time in the policy */
    char err[512];
} spice_async_entry;

/* How long an idle planner polls before it parks (params.idle_poll): twice
 * the longest gap between snapshots it waited through in this window and
 * the last (one second each), within 5 ms .. 250 ms. */
typedef struct spice_idle_budget {
    uint64_t budget_ns;
    uint64_t window_start_ns;
    uint64_t cur_max_ns;  /* the longest gap in this window */
    uint64_t prev_max_ns; /* ... in the one before */
} spice_idle_budget;

void spice_idle_budget_init(spice_idle_budget * b, uint64_t now_ns);

/* A snapshot came after the planner waited gap_ns for it. */
void spice_idle_budget_note(spice_idle_budget * b, uint64_t now_ns, uint64_t gap_ns);

typedef struct spice_planner {
    int running;
    spice_async_params params;
    spice_policy_fn fn;
    void * user_data;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work; /* an entry was queued, or stop */
    pthread_cond_t planned; /* an entry was planned */
    int stop;
    int hook_fences; /* a post fences before it reads `sleeping` (see above) */
    /* written by the planner's thread (stopping: by the one that stops it; sleeping cleared
     * too by a post that wakes the planner, under the mutex), read without the mutex; a line
     * apart from the hook's own fields, so neither thread's usual writes move the other's */
    char pad_before[64];
    atomic_int sleeping;           /* the planner parks on `work` (or is about to): a post must signal it */
    atomic_int stopping;           /* stop, as the idle planner reads it */
    atomic_uint_least64_t n_planned; /* entries the planner has made DONE, ever */
    char pad_after[64];
    spice_idle_budget idle; /* how long an idle planner polls before it parks (planner thread only) */
    spice_async_entry * ring;
    int32_t n_ring;
    /* the hook's thread's own: which entries are free, and those posted and not taken back
     * (their ring indices, oldest first) */
    uint8_t * hook_free;   /* [n_ring] */
    int32_t * posted;      /* [n_ring] a circular list */
    int32_t posted_head, n_posted;
    uint64_t n_taken; /* entries taken DONE -> HELD, ever: `n_planned` - `n_taken` are waiting */
    spice_async_entry * lent; /* posted by the call in progress, its rows still lent (settle before return) */
    /* list capacities of every plan: the runtime's */
    int32_t cap_fetch, cap_pairs, cap_layers;
    spice_plan_limits limits; /* pointing at the planner's own copies: */
    int32_t * limit_n_expert;
    uint8_t * limit_has_surrogate;
} spice_planner;

/* Start the thread with an empty ring sized for the params. */
int spice_planner_start(spice_planner * p, spice_policy_fn fn, void * user_data, const spice_async_params * params,
                        int32_t cap_fetch, int32_t cap_pairs, int32_t cap_layers, const spice_plan_limits * limits);

/* Join the thread (after the policy call in progress, if any) and free the ring. No-op when not running. */
void spice_planner_stop(spice_planner * p);

/* An entry to post call `seq` into: a free one, else (free-running) the newest
 * queued one not started yet, whose snapshot it replaces (*replaced = 1). NULL
 * when every entry is busy. The entry is the caller's until spice_planner_queue. */
spice_async_entry * spice_planner_acquire(spice_planner * p, int * replaced);

/* Copy the call (its input arrays, residency table of res_layers x res_width:
 * the rows whose res_version changed since the entry last held them, all of
 * them for another res_epoch or res_version NULL) into the entry, with the
 * default actions, and hand it to the planner; the hidden and shared-expert
 * rows are lent, not copied: spice_planner_settle before the call returns;
 * *woke = 1 where the planner was parked and had to be woken (a futex wake on
 * the caller's thread). SPICE_ERR_NO_MEMORY (the entry is freed again) when
 * its arrays cannot grow. */
int spice_planner_post(spice_planner * p, spice_async_entry * e, uint64_t seq, const spice_policy_call * call,
                       const int32_t * default_actions, const uint32_t * res_version, uint64_t res_epoch,
                       int * woke);

/* Before the hook call that posted returns: the posted entry's rows copied,
 * on this thread unless the planner has taken them (then waiting for the
 * copy it started). 1 when this thread copied them, else 0 (nothing lent,
 * or the planner copied). */
int spice_planner_settle(spice_planner * p);

/* The oldest planned entry, now the caller's (HELD), or NULL. */
spice_async_entry * spice_planner_take_done(spice_planner * p);

/* The entry posted at call seq once it is planned (HELD), waiting for it; NULL
 * when no entry holds that call. */
spice_async_entry * spice_planner_wait(spice_planner * p, uint64_t seq);

/* Give a held entry back. */
void spice_planner_release(spice_planner * p, spice_async_entry * e);

#endif /* SPICE_PLANNER_H */
