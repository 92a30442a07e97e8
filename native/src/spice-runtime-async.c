/* Asynchronous planning: the policy on the planner thread, its plans applied
 * by the hook's thread at later calls (spice_runtime_enable_async in spice.h).
 *
 * Per hook call of the policy's, on the hook's thread: collect the plans due
 * (deterministic: the one posted `lag` calls ago, waiting for it; else every
 * finished one, dropping those older than max_lag); the rule plans the call
 * and the collected lists join its plan; once the store has applied it, the
 * call's snapshot is posted unless the policy decided the call in advance
 * (its residency then shows this call's copies and evictions: from a
 * snapshot taken before them, the plan asked for the same copies again and
 * planned around room already taken -- in the simulator on target-sized
 * experts, 0.006-0.046 of hit rate and up to 7% of TPOT; see
 * docs/results/planning.md). What the hook's thread spends on
 * this is deciding time (policy_ns); the planner's own is planner_ns.
 *
 * The hook reaches the steps here only through rt->async (async_ops below,
 * spice-runtime-internal.h says what each does); this file calls the hook's. */
#include "spice-runtime-core.h"
#include "spice-clock.h"
#include "spice-grow.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void spice_async_stop(spice_runtime * rt) {
    rt->async = NULL;
    spice_planner_stop(&rt->planner);
    rt->async_post = NULL; /* the ring is gone with the planner */
    rt->n_async_prefetch = rt->n_async_evict = rt->n_async_evict_from = 0;
}

static int spice_async_before(spice_runtime * rt, spice_policy_call * call);
static void spice_async_merge(spice_runtime * rt, spice_policy_call * call);
static void spice_async_post(spice_runtime * rt, const spice_policy_call * call);
static uint64_t spice_async_settle(spice_runtime * rt);

static const spice_runtime_async_ops async_ops = {
    spice_async_before, spice_async_merge, spice_async_post, spice_async_settle, spice_async_stop,
};

int spice_runtime_enable_async(spice_runtime * rt, spice_policy_fn fn, void * user_data, int32_t max_tokens,
                               const spice_async_params * params) {
    if (rt == NULL || fn == NULL || params == NULL || max_tokens < 0 || params->max_lag < 1 ||
        (params->deterministic && (params->lag < 1 || params->lag > 64)) ||
        (params->idle_poll != 0 && params->idle_poll != 1)) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (rt->store == NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "asynchronous planning runs calls by the rule, which plans a device tier: give the runtime "
                 "a tier first");
        return SPICE_ERR_STATE;
    }
    spice_runtime_disable(rt); /* stops a planner running, unregisters the hook */
    const int32_t pairs_all = 2 * rt->n_layers * rt->max_n_expert;
    spice_plan_buffers * l = &rt->async_lists;
    if (spice_grow_i32(&l->prefetch, &l->cap_prefetch, pairs_all) != 0 ||
        spice_grow_i32(&l->evict, &l->cap_evict, pairs_all) != 0 ||
        spice_grow_i32(&l->evict_from, &l->cap_evict_from, rt->n_layers) != 0) {
        return SPICE_ERR_NO_MEMORY;
    }
    rt->call_seq = 0;
    rt->plan_rule = NULL;
    memset(rt->layer_seq, 0, (size_t) rt->n_layers * sizeof(uint64_t));
    /* registered first (enable stops any planner), started before the next decode can call */
    const uint32_t flags = (params->with_probs ? SPICE_HOOK_WANT_PROBS : 0u) |
                           (params->with_shexp ? SPICE_HOOK_WANT_SHEXP : 0u);
    int status = spice_runtime_enable_ex(rt, fn, user_data, max_tokens, flags);
    if (status == SPICE_OK) {
        const spice_plan_limits limits = spice_runtime_plan_limits(rt);
        status = spice_planner_start(&rt->planner, fn, user_data, params, rt->max_n_expert, pairs_all,
                                     rt->n_layers, &limits);
        if (status == SPICE_OK) {
            rt->async = &async_ops;
        } else {
            spice_runtime_disable(rt);
            snprintf(rt->last_error, sizeof(rt->last_error), "could not start the planner thread");
        }
    }
    return status;
}

int spice_runtime_is_async(const spice_runtime * rt) {
    return rt != NULL && rt->planner.running;
}

static void append(int32_t * dst, int32_t * n, int32_t cap, const int32_t * src, int32_t count) {
    const int32_t room = cap - *n;
    const int32_t k = count < room ? count : room;
    if (k > 0) {
        memcpy(dst + *n, src, (size_t) k * sizeof(int32_t));
        *n += k;
    }
}

/* One finished plan, held: dropped (failed, invalid, stale) or its lists kept. */
static void take_plan(spice_runtime * rt, spice_async_entry * e, uint64_t seq, spice_counters * c) {
    const spice_policy_call * plan = &e->call;
    c->planner_ns += e->plan_ns;
    const uint64_t age = seq - atomic_load_explicit(&e->seq, memory_order_relaxed);
    if (e->rc == SPICE_POLICY_ABORT) {
        atomic_store(&rt->abort_requested, 1);
        c->policy_fallbacks++;
    } else if (e->rc != SPICE_POLICY_OK) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "layer %d: the policy failed on the planner thread%s%.400s; that call ran by the rule", e->shape.il,
                 e->err[0] != '\0' ? ": " : "", e->err);
        rt->plan_rejections++;
        c->policy_fallbacks++;
    } else if (!rt->planner.params.deterministic && age > (uint64_t) rt->planner.params.max_lag) {
        c->async_stale++;
    } else {
        if (!e->valid) { /* checked on the planner thread (spice-planner.h) */
            snprintf(rt->last_error, sizeof(rt->last_error), "%s", e->err);
            rt->plan_rejections++;
            c->policy_fallbacks++;
        } else {
            spice_plan_buffers * l = &rt->async_lists;
            append(l->prefetch, &rt->n_async_prefetch, l->cap_prefetch, plan->prefetch, plan->n_prefetch);
            append(l->evict, &rt->n_async_evict, l->cap_evict, plan->evict, plan->n_evict);
            if (plan->n_evict_from > 0) { /* the latest plan's order of victims */
                rt->n_async_evict_from = 0;
                append(l->evict_from, &rt->n_async_evict_from, l->cap_evict_from, plan->evict_from,
                       plan->n_evict_from);
            }
            spice_runtime_take_plan_rule(rt, plan); /* this call's rule plan already uses it */
            /* decided in advance up to resume_il: only while no call of that layer came since */
            if (plan->resume_il >= 0 &&
                rt->layer_seq[plan->resume_il] <= atomic_load_explicit(&e->seq, memory_order_relaxed)) {
                rt->resume_il = plan->resume_il;
            }
            c->async_applied++;
            c->async_lag_calls += age;
        }
    }
    spice_planner_release(&rt->planner, e);
}

static int spice_async_before(spice_runtime * rt, spice_policy_call * call) {
    spice_counters * c = &rt->counters[call->il];
    const uint64_t t0 = spice_monotonic_ns();
    const uint64_t seq = ++rt->call_seq;
    rt->layer_seq[call->il] = seq;
    rt->n_async_prefetch = rt->n_async_evict = rt->n_async_evict_from = 0;
    spice_planner * p = &rt->planner;
    uint64_t waited = 0; /* waiting for the planner is not deciding */
    if (p->params.deterministic) {
        if (seq > (uint64_t) p->params.lag) {
            const uint64_t tw = spice_monotonic_ns();
            spice_async_entry * e = spice_planner_wait(p, seq - (uint64_t) p->params.lag);
            waited = spice_monotonic_ns() - tw;
            c->async_wait_ns += waited;
            if (e != NULL) {
                take_plan(rt, e, seq, c);
            }
        }
    } else {
        for (spice_async_entry * e; (e = spice_planner_take_done(p)) != NULL;) {
            take_plan(rt, e, seq, c);
        }
    }
    const int quiet = rt->resume_il >= 0 && call->n_tokens == 1 && call->il != rt->resume_il;
    if (quiet) {
        c->policy_quiet++;
    } else {
        rt->resume_il = -1;
        int replaced = 0;
        spice_async_entry * e = spice_planner_acquire(p, &replaced);
        if (e == NULL || replaced) {
            c->async_skipped++;
        }
        rt->async_post = e; /* filled after the plan is applied (spice_async_post) */
        rt->async_post_seq = seq;
        c->policy_calls++;
    }
    const uint64_t spent = spice_monotonic_ns() - t0 - waited;
    c->policy_ns += spent;
    c->async_take_ns += spent;
    return quiet;
}

static void spice_async_post(spice_runtime * rt, const spice_policy_call * call) {
    spice_async_entry * e = rt->async_post;
    if (e == NULL) {
        return;
    }
    rt->async_post = NULL;
    spice_counters * c = &rt->counters[call->il];
    const uint64_t t0 = spice_monotonic_ns();
    /* call->residency is the store's own table: as of this call's plan, applied */
    int woke = 0;
    uint64_t epoch = 0;
    const uint32_t * versions = spice_store_row_versions(rt->store, &epoch);
    if (spice_planner_post(&rt->planner, e, rt->async_post_seq, call, call->actions, versions, epoch, &woke) ==
        SPICE_OK) {
        c->async_posted++;
        c->async_wakes += (uint64_t) woke;
    }
    const uint64_t spent = spice_monotonic_ns() - t0;
    c->policy_ns += spent;
    c->async_post_ns += spent;
}

static uint64_t spice_async_settle(spice_runtime * rt) {
    spice_async_entry * e = rt->planner.lent;
    if (e == NULL) {
        return 0;
    }
    spice_counters * c = &rt->counters[e->shape.il];
    const uint64_t t0 = spice_monotonic_ns();
    c->async_rows_by_hook += (uint64_t) spice_planner_settle(&rt->planner);
    const uint64_t spent = spice_monotonic_ns() - t0;
    c->policy_ns += spent;
    c->async_post_ns += spent;
    return spent;
}

static void spice_async_merge(spice_runtime * rt, spice_policy_call * call) {
    const spice_plan_buffers * l = &rt->async_lists;
    append(call->prefetch, &call->n_prefetch, call->cap_prefetch, l->prefetch, rt->n_async_prefetch);
    append(call->evict, &call->n_evict, call->cap_evict, l->evict, rt->n_async_evict);
    if (call->n_evict_from == 0) {
        append(call->evict_from, &call->n_evict_from, call->cap_evict_from, l->evict_from, rt->n_async_evict_from);
    }
}
