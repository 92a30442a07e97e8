/* The runtime handle: attaches to a llama_context, serves its MoE hook,
 * dispatches to a policy and keeps the counters.
 *
 * One hook call, on thread 0 while the other graph threads wait at the
 * barrier, in named steps: snapshot (residency and recency as the call
 * begins) -> decide (the policy's plan, validated, or the default one) ->
 * apply (the store carries the plan out) -> count (each activation's
 * outcome) -> execute (device work launched, host and surrogate jobs set
 * up); then every thread runs the executors. */
#include "spice-runtime-core.h"
#include "spice-counters.h"
#include "spice-grow.h"
#include "spice-runtime-host-read.h"
#include "spice-runtime-replay.h"

#include "ggml-backend.h"
#include "llama.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_error(spice_runtime * rt, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rt->last_error, sizeof(rt->last_error), fmt, ap);
    va_end(ap);
}

static void write_err(char * err, size_t err_len, const char * msg) {
    if (err && err_len) {
        snprintf(err, err_len, "%s", msg);
    }
}

/* ---- plan buffers ---------------------------------------------------------- */

static int plan_reserve(spice_runtime * rt, int32_t n_pairs) {
    spice_plan_buffers * p = &rt->plan;
    const int32_t old_cap = p->cap_actions;
    if (spice_grow_i32(&p->actions, &p->cap_actions, n_pairs) != 0) {
        return SPICE_ERR_NO_MEMORY;
    }
    if (p->cap_actions != old_cap || p->exec == NULL) {
        uint8_t * nexec = (uint8_t *) realloc(p->exec, (size_t) p->cap_actions);
        if (nexec == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        p->exec = nexec;
        uint8_t * nhit = (uint8_t *) realloc(p->hit, (size_t) p->cap_actions);
        if (nhit == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        p->hit = nhit;
    }
    if (p->device == NULL) {
        const size_t n = (size_t) (rt->max_n_expert > 0 ? rt->max_n_expert : 1);
        p->device = (const char **) calloc(n, sizeof(char *));
        p->slot = (int32_t *) calloc(n, sizeof(int32_t));
        p->wait = (int32_t *) calloc(n, sizeof(int32_t));
        if (p->device == NULL || p->slot == NULL || p->wait == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
    }
    /* experts of one layer; (layer, expert) pairs across all layers */
    const int32_t pairs_all = 2 * rt->n_layers * rt->max_n_expert;
    if (spice_grow_i32(&p->fetch, &p->cap_fetch, rt->max_n_expert) != 0 ||
        spice_grow_i32(&p->prefetch, &p->cap_prefetch, pairs_all) != 0 ||
        spice_grow_i32(&p->evict, &p->cap_evict, pairs_all) != 0 ||
        spice_grow_i32(&p->evict_from, &p->cap_evict_from, rt->n_layers) != 0) {
        return SPICE_ERR_NO_MEMORY;
    }
    return SPICE_OK;
}

static void plan_free(spice_plan_buffers * p) {
    free(p->actions);
    free(p->fetch);
    free(p->prefetch);
    free(p->evict);
    free(p->evict_from);
    free(p->exec);
    free(p->hit);
    free((void *) p->device);
    free(p->slot);
    free(p->wait);
    memset(p, 0, sizeof(*p));
}

/* ---- outcomes ------------------------------------------------------------------ */

/* docs/design.md section 11: a hit when its expert was resident as the call began
 * (without a device tier every expert is) and it ran exactly; otherwise a
 * miss by what happened to it. Lossy actions are never hits, resident or not. */
void spice_counters_add_outcomes(spice_counters * c, const int32_t * actions, const uint8_t * hit, int32_t n) {
    if (c == NULL || actions == NULL || hit == NULL) {
        return;
    }
    c->activations += (uint64_t) (n > 0 ? n : 0);
    for (int32_t i = 0; i < n; ++i) {
        switch (actions[i]) {
            case SPICE_ACTION_SURROGATE: c->misses_surrogate++; break;
            case SPICE_ACTION_DROP:      c->dropped++; break;
            case SPICE_ACTION_DEVICE:    hit[i] ? c->hits++ : c->misses_fetched++; break;
            default:                     hit[i] ? c->hits++ : c->misses_host++; break;
        }
    }
}

/* ---- the steps of one hook call (thread 0) -------------------------------------- */

static void default_actions(const spice_runtime * rt, spice_policy_call * call, int32_t n_pairs) {
    for (int32_t i = 0; i < n_pairs; ++i) {
        call->actions[i] = rt->plan.hit[i] ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
    }
    call->n_actions = n_pairs;
}

/* snapshot: the call as a policy sees it, which activations find their
 * expert resident (one poll of the device tier makes residency current,
 * copies in flight included), and the default plan. */
static void snapshot_call(spice_runtime * rt, const spice_hook_call * hc, spice_policy_call * call) {
    spice_runtime_replay_routing(rt, hc); /* recorded ids, if replaying, before anything reads them */
    memset(call, 0, sizeof(*call));
    call->il = hc->il;
    call->n_tokens = hc->n_tokens;
    call->n_embd = hc->n_embd;
    call->n_expert = hc->n_expert;
    call->n_expert_used = hc->n_expert_used;
    call->inp = hc->inp;         call->inp_nb1 = hc->inp_nb1;
    call->probs = hc->probs;     call->probs_nb1 = hc->probs_nb1;
    call->ids = hc->ids;         call->ids_nb1 = hc->ids_nb1;
    call->weights = hc->weights; call->weights_nb1 = hc->weights_nb1;
    call->shexp = hc->shexp;     call->shexp_nb1 = hc->shexp_nb1;
    call->next_logits = hc->next_logits; call->next_logits_nb1 = hc->next_logits_nb1;
    call->il_next = hc->il_next;         call->n_expert_next = hc->n_expert_next;
    call->actions = rt->plan.actions;   call->cap_actions = rt->plan.cap_actions;
    call->fetch = rt->plan.fetch;       call->cap_fetch = rt->plan.cap_fetch;
    call->prefetch = rt->plan.prefetch; call->cap_prefetch = rt->plan.cap_prefetch;
    call->evict = rt->plan.evict;       call->cap_evict = rt->plan.cap_evict;
    call->evict_from = rt->plan.evict_from; call->cap_evict_from = rt->plan.cap_evict_from;
    call->resume_il = -1;

    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    if (rt->store != NULL) {
        call->residency = spice_store_states(rt->store, &call->res_layers, &call->res_width);
        const uint64_t t0 = spice_monotonic_ns();
        if (rt->clock_step_ns > 0) { /* virtual time: a step per token of the call */
            spice_store_advance(rt->store, rt->clock_step_ns * (uint64_t) (hc->n_tokens > 0 ? hc->n_tokens : 1));
        }
        spice_store_begin_call(rt->store, hc->il, hc->n_tokens, hc->n_expert_used, hc->ids, hc->ids_nb1,
                               rt->plan.hit);
        rt->counters[hc->il].store_ns += spice_monotonic_ns() - t0;
    } else {
        memset(rt->plan.hit, 1, (size_t) n_pairs);
    }
    default_actions(rt, call, n_pairs);
}

/* The plan the policy wrote into call, against the runtime's layers and loaded
 * surrogates; on failure a message in err and SPICE_ERR_INVALID_PLAN. */
static int spice_plan_validate(const spice_runtime * rt, const spice_policy_call * call, char * err, size_t err_len) {
    const spice_plan_limits lim = spice_runtime_plan_limits(rt);
    return spice_plan_check(&lim, call, err, err_len);
}

static uint64_t settle_async(spice_runtime * rt) {
    return rt->async != NULL ? rt->async->settle(rt) : 0;
}

static void stop_async(spice_runtime * rt) {
    if (rt->async != NULL) {
        rt->async->stop(rt);
    }
}

/* The engine's own plan: the installed rule's (spice_rule), or without a
 * device tier the default one already written. Its time is deciding time. */
static void rule_call(spice_runtime * rt, spice_policy_call * call, spice_counters * c) {
    if (rt->store != NULL) {
        const uint64_t t0 = spice_monotonic_ns();
        spice_store_rule_plan(rt->store, call);
        const uint64_t spent = spice_monotonic_ns() - t0;
        c->policy_ns += spent;
        c->rule_ns += spent;
    }
}

/* decide: the policy's plan if it gives a valid one, else the default plan;
 * with no policy, and for a decode call the policy decided in advance, the
 * rule's plan. Asynchronous: the rule's plan, with the lists of the policy's
 * plans due at this call (spice-runtime-async.c). */
static void decide_call(spice_runtime * rt, const spice_hook_call * hc, spice_policy_call * call) {
    spice_counters * c = &rt->counters[hc->il];
    if (rt->async != NULL) {
        rt->async->before(rt, call);
        rule_call(rt, call, c);
        const uint64_t t0 = spice_monotonic_ns();
        rt->async->merge(rt, call);
        c->policy_ns += spice_monotonic_ns() - t0;
        return;
    }
    const int quiet = rt->policy_fn != NULL && rt->resume_il >= 0 && hc->n_tokens == 1 && hc->il != rt->resume_il;
    if (quiet) {
        c->policy_quiet++;
        rule_call(rt, call, c);
        return;
    }
    rt->resume_il = -1;
    if (rt->policy_fn == NULL) {
        c->policy_calls++;
        rule_call(rt, call, c);
        return;
    }
    const uint64_t t0 = spice_monotonic_ns();
    int use_plan = 0;
    const int rc = rt->policy_fn(call, rt->policy_user_data);
    if (rc == SPICE_POLICY_OK) {
        char err[sizeof(rt->last_error)];
        if (spice_plan_validate(rt, call, err, sizeof(err)) == SPICE_OK) {
            use_plan = 1;
        } else {
            memcpy(rt->last_error, err, sizeof(err)); /* the latest: callers warn once per policy */
            rt->plan_rejections++;
            c->policy_fallbacks++;
        }
    } else if (rc == SPICE_POLICY_ABORT) {
        atomic_store(&rt->abort_requested, 1);
    } else {
        set_error(rt, "layer %d: the policy failed; ran exact instead", hc->il);
        rt->plan_rejections++;
        c->policy_fallbacks++;
    }
    if (use_plan) {
        rt->resume_il = call->resume_il;
        spice_runtime_take_plan_rule(rt, call); /* for the calls the engine plans from now on; its
                                                   graph inputs from the next decode (sync_hook) */
    } else {
        default_actions(rt, call, hc->n_tokens * hc->n_expert_used);
        /* nothing of a rejected plan may act: its lists are unchecked */
        call->n_fetch = call->n_prefetch = call->n_evict = call->n_evict_from = 0;
        call->resume_il = -1;
    }
    c->policy_ns += spice_monotonic_ns() - t0;
    c->policy_calls++;
}

/* ids come from the graph's top-k; a bad one would index out of the tensor */
static void drop_bad_ids(spice_runtime * rt, const spice_hook_call * hc, spice_policy_call * call) {
    const int32_t n_expert = rt->layers[hc->il].n_expert;
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) hc->ids + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            if (ids[k] < 0 || ids[k] >= n_expert) {
                call->actions[t * hc->n_expert_used + k] = SPICE_ACTION_DROP;
                set_error(rt, "layer %d: graph selected expert %d outside 0..%d", hc->il, ids[k], n_expert - 1);
            }
        }
    }
}

/* Whether the call's device pairs run on the device itself (else the host
 * executor reads their slots). Asked once per call, before the plan is
 * applied (a device readies what the call needs then); apply and execute
 * read the answer. */
static int device_computes(spice_runtime * rt, const spice_hook_call * hc) {
    return rt->store != NULL && spice_device_executes(spice_store_device(rt->store),
                                                      spice_runtime_slot_layer(rt, hc->il), hc->n_tokens,
                                                      hc->n_expert_used);
}

/* apply: the store carries the plan out (its own time, less what it waited
 * for copies, is bookkeeping). A device that computes waits for its copies
 * only when it launches, after the first barrier, while the host executor
 * already runs the misses (launch_device_work). */
static void apply_call(spice_runtime * rt, const spice_hook_call * hc, spice_policy_call * call) {
    if (rt->store == NULL) {
        return;
    }
    spice_counters k0, k1;
    spice_store_get_counters(rt->store, hc->il, &k0);
    const uint64_t t0 = spice_monotonic_ns();
    if (rt->call_computes) {
        spice_store_apply_plan_nowait(rt->store, call);
    } else {
        spice_store_apply_plan(rt->store, call, rt->plan.device);
    }
    const uint64_t spent = spice_monotonic_ns() - t0;
    spice_store_get_counters(rt->store, hc->il, &k1);
    const uint64_t waited = k1.stall_ns - k0.stall_ns;
    rt->counters[hc->il].store_ns += spent > waited ? spent - waited : 0;
}

/* The executor's device pairs run on the host weights instead. */
static void device_pairs_to_host(uint8_t * exec, int32_t n_pairs) {
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (exec[i] == SPICE_EXEC_DEVICE) {
            exec[i] = SPICE_EXEC_HOST;
        }
    }
}

/* The distinct experts of the call's device pairs: the copies the launch
 * waits for. */
static void note_device_experts(spice_runtime * rt, const spice_hook_call * hc, const uint8_t * run) {
    const int32_t n_expert = rt->layers[hc->il].n_expert;
    uint8_t seen[n_expert > 0 ? n_expert : 1];
    memset(seen, 0, sizeof(seen));
    rt->plan.n_wait = 0;
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) hc->ids + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            const int32_t e = ids[k];
            if (run[t * hc->n_expert_used + k] == SPICE_EXEC_DEVICE && e >= 0 && e < n_expert && !seen[e]) {
                seen[e] = 1;
                rt->plan.wait[rt->plan.n_wait++] = e;
            }
        }
    }
}

/* A device that computes: queue this call's device pairs there. */
static int start_device_work(spice_runtime * rt, const spice_hook_call * hc, const uint8_t * run) {
    const spice_expert_layer * L = spice_runtime_slot_layer(rt, hc->il); /* the experts as slots hold them */
    spice_device_job job;
    memset(&job, 0, sizeof(job));
    job.layer = L;
    job.n_tokens = hc->n_tokens;
    job.n_used = hc->n_expert_used;
    job.inp = hc->inp; job.inp_nb1 = hc->inp_nb1;
    job.ids = hc->ids; job.ids_nb1 = hc->ids_nb1;
    job.run = run;
    job.slot_of = rt->plan.slot;
    spice_device * dev = spice_store_device(rt->store);
    spice_counters * c = &rt->counters[hc->il];
    char err[256];
    const uint64_t t0 = spice_monotonic_ns();
    int rc = dev->iface->exec_begin(dev, &job, err, sizeof(err));
    c->launch_ns += spice_monotonic_ns() - t0;
    if (rc == SPICE_OK && rt->exec_fault_after > 0 && ++rt->n_launches > rt->exec_fault_after) {
        snprintf(err, sizeof(err), "launch %lld refused by the test fault hook (exec_fault_after)",
                 (long long) rt->n_launches);
        rc = SPICE_ERR_STATE;
    }
    c->device_launches++;
    if (rc != SPICE_OK) {
        set_error(rt, "layer %d: the device could not run its experts: %s", hc->il, err);
        return rc;
    }
    rt->device_work_pending = 1;
    return SPICE_OK;
}

/* Thread 0, after the first barrier, while the other threads run the host
 * executor's misses: wait for the device experts' copies, then queue this
 * call's device pairs on the device (their slots stay resident: nothing
 * evicts before the next hook call). Whatever fails here can no longer move
 * pairs to the host (the host job is running): the decode stops with the
 * reason, as a failed collect does. */
static void launch_device_work(spice_runtime * rt, const spice_hook_call * hc) {
    rt->device_launch_due = 0;
    const spice_expert_layer * L = &rt->layers[hc->il];
    for (int32_t e = 0; e < L->n_expert; ++e) {
        rt->plan.slot[e] = -1;
    }
    /* the store's work here -- issuing copies queued behind the awaited ones, landing
     * them, polling -- is its bookkeeping (store_ns); only blocking on a copy is a stall.
     * Uncounted, it was hook time no counter named: on an H200 3.9-16 us a decode call
     * for lru and 22-43 for adapmoe with copies issued inline (docs/results/gpu.md) */
    const uint64_t t0 = spice_monotonic_ns();
    uint64_t stalled = 0;
    for (int32_t i = 0; i < rt->plan.n_wait; ++i) {
        const int32_t e = rt->plan.wait[i];
        uint64_t stall = 0;
        const int rc = spice_store_wait(rt->store, hc->il, e, &stall);
        stalled += stall;
        if (rc != SPICE_OK || (rt->plan.slot[e] = spice_store_slot_index(rt->store, hc->il, e)) < 0) {
            set_error(rt, "layer %d: the copy of expert %d never landed on the device; stopped", hc->il, e);
            atomic_store(&rt->failed, 1);
            atomic_store(&rt->abort_requested, 1);
            return;
        }
    }
    const uint64_t spent = spice_monotonic_ns() - t0;
    rt->counters[hc->il].store_ns += spent > stalled ? spent - stalled : 0;
    if (start_device_work(rt, hc, rt->device_run) != SPICE_OK) {
        atomic_store(&rt->failed, 1);
        atomic_store(&rt->abort_requested, 1);
    }
}

/* before_combine of the host job: the device's rows land in y (verify mode:
 * in the verifier's buffer, compared once the host's rows are done) */
static void collect_device_work(void * user_data, float * y) {
    spice_runtime * rt = (spice_runtime *) user_data;
    spice_device * dev = spice_store_device(rt->store);
    spice_counters * c = &rt->counters[rt->call_il];
    char err[256];
    const uint64_t t0 = spice_monotonic_ns();
    int rc = dev->iface->exec_end(dev, rt->device_y != NULL ? rt->device_y : y, err, sizeof(err));
    if (rc == SPICE_OK && rt->exec_fault_after < 0 && ++rt->n_collects > -(int64_t) rt->exec_fault_after) {
        snprintf(err, sizeof(err), "collect %lld refused by the test fault hook (exec_fault_after)",
                 (long long) rt->n_collects);
        rc = SPICE_ERR_STATE;
    }
    if (rc != SPICE_OK) { /* the call's rows are not all there: stop, with the reason (not as Ctrl-C) */
        set_error(rt, "layer %d: the device's results could not be collected: %s", rt->call_il, err);
        atomic_store(&rt->failed, 1);
        atomic_store(&rt->abort_requested, 1);
    }
    c->collect_ns += spice_monotonic_ns() - t0;
    c->device_collects++;
    rt->device_work_pending = 0;
}

/* execute: the executors' views of the final actions -- exact for device and
 * host, nothing for drop and surrogate (the surrogate executor adds those) --
 * device work launched, host and surrogate jobs prepared. */
static void execute_call(spice_runtime * rt, const spice_hook_call * hc, const spice_policy_call * call) {
    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    const int computes = rt->call_computes;
    int any_surrogate = 0, any_device = 0;
    for (int32_t i = 0; i < n_pairs; ++i) {
        const int32_t a = call->actions[i];
        /* a device that computes runs its pairs; the host only sums their rows */
        rt->plan.exec[i] = (uint8_t) (a == SPICE_ACTION_DEVICE ? (computes ? SPICE_EXEC_DEVICE : SPICE_EXEC_HOST)
                                      : a == SPICE_ACTION_HOST ? SPICE_EXEC_HOST
                                                               : SPICE_EXEC_NONE);
        any_surrogate |= a == SPICE_ACTION_SURROGATE;
        any_device |= a == SPICE_ACTION_DEVICE;
    }

    spice_host_job job;
    memset(&job, 0, sizeof(job));
    job.layer = &rt->layers[hc->il];
    rt->call_il = hc->il;
    rt->device_y = NULL;
    rt->device_work_pending = 0;
    rt->device_launch_due = 0;
    if (computes && any_device) {
        const uint8_t * run = rt->plan.exec;
        if (rt->verify != NULL) {
            const uint8_t * kept = spice_cuda_verify_begin(rt->verify, rt->plan.exec, n_pairs, hc->n_embd,
                                                           &rt->device_y);
            run = kept; /* NULL (no memory to verify): the host runs everything */
        }
        if (run == NULL) {
            device_pairs_to_host(rt->plan.exec, n_pairs); /* exact on the host weights instead */
            rt->device_y = NULL;
        } else {
            note_device_experts(rt, hc, run);
            rt->device_run = run;
            rt->device_launch_due = 1;
            rt->device_work_pending = 1; /* collected before combine (a failed launch collects nothing) */
        }
    }
    job.n_tokens = hc->n_tokens;
    job.n_used = hc->n_expert_used;
    job.inp = hc->inp;         job.inp_nb1 = hc->inp_nb1;
    job.ids = hc->ids;         job.ids_nb1 = hc->ids_nb1;
    job.weights = hc->weights; job.weights_nb1 = hc->weights_nb1;
    job.exec = rt->plan.exec;
    job.device = rt->store != NULL && !computes ? rt->plan.device : NULL; /* host-readable slots */
    job.device_layer = spice_runtime_slot_layer(rt, hc->il);
    if (rt->device_work_pending) {
        job.before_combine = collect_device_work;
        job.before_combine_data = rt;
    }
    job.out = hc->out;         job.out_nb1 = hc->out_nb1;
    if (spice_host_exec_prepare(&rt->host, &job) != SPICE_OK) {
        set_error(rt, "layer %d: out of memory for the executor's scratch (%d tokens)", hc->il, hc->n_tokens);
        atomic_store(&rt->abort_requested, 1);
    }

    /* surrogate actions (validated: each names a loaded surrogate) add to
     * what the host executor wrote */
    if (any_surrogate) {
        spice_surrogate_job sj;
        memset(&sj, 0, sizeof(sj));
        sj.n_tokens = hc->n_tokens;
        sj.n_used = hc->n_expert_used;
        sj.n_embd = hc->n_embd;
        sj.inp = hc->inp;         sj.inp_nb1 = hc->inp_nb1;
        sj.ids = hc->ids;         sj.ids_nb1 = hc->ids_nb1;
        sj.weights = hc->weights; sj.weights_nb1 = hc->weights_nb1;
        sj.shexp = hc->shexp;     sj.shexp_nb1 = hc->shexp_nb1;
        sj.actions = call->actions;
        sj.table = rt->surrogates.entries + (size_t) hc->il * (size_t) rt->surrogates.max_expert;
        sj.out = hc->out;         sj.out_nb1 = hc->out_nb1;
        if (spice_surrogate_exec_prepare(&rt->surrogate_exec, &sj, hc->nth) != SPICE_OK) {
            set_error(rt, "layer %d: out of memory for the surrogate executor's scratch", hc->il);
            atomic_store(&rt->abort_requested, 1);
        }
    }
}

/* Thread 0: everything before the executors run. */
static void plan_call(spice_runtime * rt, const spice_hook_call * hc) {
    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    if (plan_reserve(rt, n_pairs) != SPICE_OK) {
        set_error(rt, "layer %d: out of memory for a plan of %d actions", hc->il, n_pairs);
        atomic_store(&rt->abort_requested, 1);
        spice_host_job job = { 0 };
        job.layer = &rt->layers[hc->il];
        job.n_tokens = hc->n_tokens;
        job.out = hc->out;
        job.out_nb1 = hc->out_nb1;
        rt->host.job = job;
        rt->host.failed = 1;
        return;
    }
    /* call_ns: the steps every policy's calls take alike, timed apart from
     * deciding (policy_ns) and the store (store_ns) so that the hook's time
     * is accounted for in full */
    spice_counters * c = &rt->counters[hc->il];
    spice_policy_call call;
    uint64_t t = spice_monotonic_ns();
    const uint64_t store0 = c->store_ns;
    snapshot_call(rt, hc, &call);
    c->call_ns += spice_monotonic_ns() - t - (c->store_ns - store0);
    decide_call(rt, hc, &call);
    t = spice_monotonic_ns();
    drop_bad_ids(rt, hc, &call);
    rt->call_computes = device_computes(rt, hc);
    c->call_ns += spice_monotonic_ns() - t;
    apply_call(rt, hc, &call);
    if (rt->async != NULL) {
        rt->async->post(rt, &call); /* the snapshot, residency as the plan left it */
    }
    t = spice_monotonic_ns();
    c->hook_calls++;
    spice_counters_add_outcomes(c, call.actions, rt->plan.hit, n_pairs);
    c->call_ns += spice_monotonic_ns() - t;
    if (spice_runtime_read_host_experts(rt, hc->il, &call) != SPICE_OK) {
        /* no bytes to run some experts on: no output from this call, and the decode stops */
        atomic_store(&rt->failed, 1);
        atomic_store(&rt->abort_requested, 1);
        rt->host.failed = 1;
        rt->host.job.layer = NULL;
        return;
    }
    t = spice_monotonic_ns();
    execute_call(rt, hc, &call);
    c->call_ns += spice_monotonic_ns() - t;
}

static void hook_entry(const struct llama_moe_hook_call * lc, void * user_data) {
    spice_runtime * rt = (spice_runtime *) user_data;
    spice_hook_call call; /* the ids stay NULL on every thread but 0, where they are converted */
    spice_hook_call_view(lc, &call);
    const spice_hook_call * hc = &call;
    const uint64_t t_entry = hc->ith == 0 ? spice_monotonic_ns() : 0;
    const int served = hc->il >= 0 && hc->il < rt->n_layers && rt->layers[hc->il].is_moe &&
                       hc->n_embd == rt->layers[hc->il].n_embd && hc->n_expert == rt->layers[hc->il].n_expert;
    if (hc->ith == 0) {
        rt->surrogate_exec.n_pairs = 0;
        if (!served) {
            /* cannot happen for a runtime attached to this context's model */
            set_error(rt, "hook called for layer %d, which the runtime does not serve", hc->il);
            atomic_store(&rt->abort_requested, 1);
            rt->host.failed = 1;
            rt->host.job.layer = NULL;
        } else if (spice_hook_call_ids(&call, lc, &rt->hook_ids) != SPICE_OK) {
            set_error(rt, "layer %d: out of memory for the ids of %d tokens", hc->il, hc->n_tokens);
            atomic_store(&rt->abort_requested, 1);
            rt->host.failed = 1;
            rt->host.job.layer = NULL;
        } else {
            if (rt->hook_end_ns != 0 && hc->il > rt->hook_end_il) {
                /* a later layer of the same graph: the gap is the graph's own work in between
                 * (a new graph starts again from the first MoE layer; the time before it is
                 * the caller's) */
                rt->counters[hc->il].gap_ns += t_entry - rt->hook_end_ns;
            }
            plan_call(rt, hc);
        }
    }
    spice_barrier_wait(&rt->barrier, hc->nth);
    if (hc->ith == 0 && rt->device_launch_due) {
        launch_device_work(rt, hc); /* the other threads start the host's misses meanwhile */
    }
    const uint64_t t_exec = hc->ith == 0 ? spice_monotonic_ns() : 0;
    if (rt->host.job.layer == NULL) {
        for (int32_t t = hc->ith; t < hc->n_tokens; t += hc->nth) {
            memset((char *) hc->out + (size_t) t * hc->out_nb1, 0, (size_t) hc->n_embd * sizeof(float));
        }
        if (hc->ith == 0) {
            settle_async(rt); /* a snapshot posted before the call failed still borrows its rows */
        }
        return;
    }
    spice_host_exec_run(&rt->host, hc->ith, hc->nth, &rt->barrier);
    if (hc->ith == 0 && rt->verify != NULL && rt->device_y != NULL) {
        /* y is complete: every thread passed the barrier before combine */
        spice_cuda_verify_rows(rt->verify, rt->host.y, hc->n_tokens * hc->n_expert_used, hc->n_embd);
    }
    if (rt->surrogate_exec.n_pairs > 0) {
        /* one barrier serves both: the host executor's combine wrote out with
         * its own split, and every pair's A h must be ready before combining */
        spice_surrogate_exec_project(&rt->surrogate_exec, hc->ith, hc->nth);
        spice_barrier_wait(&rt->barrier, hc->nth);
        spice_surrogate_exec_combine(&rt->surrogate_exec, hc->ith, hc->nth);
    }
    if (hc->ith == 0 && served) {
        /* the hidden rows stay valid until this call returns: the planner has
         * copied them meanwhile, or thread 0 does now (deciding, not executing) */
        const uint64_t settled = settle_async(rt);
        rt->hook_end_ns = spice_monotonic_ns();
        rt->hook_end_il = hc->il;
        rt->counters[hc->il].hook_ns += rt->hook_end_ns - t_entry;
        rt->counters[hc->il].exec_ns += rt->hook_end_ns - t_exec - settled;
    }
}

static bool abort_entry(void * user_data) {
    const spice_runtime * rt = (const spice_runtime *) user_data;
    return atomic_load(&rt->abort_requested) != 0;
}

/* ---- C API ------------------------------------------------------------------- */

static void unregister(spice_runtime * rt);

/* The runtime's log filter out, and freed unless a callback installed over it
 * may still hand it lines (then it stays allocated: spice-log-filter.h). */
static void release_log_filter(spice_runtime * rt) {
    if (spice_log_filter_release(rt->log_filter)) {
        free(rt->log_filter);
        rt->log_filter = NULL;
    }
}

int spice_runtime_create(struct llama_context * lctx, spice_runtime ** out, char * err, size_t err_len) {
    if (out == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    *out = NULL;
    if (lctx == NULL) {
        write_err(err, err_len, "no llama_context given");
        return SPICE_ERR_INVALID_ARG;
    }
    const struct llama_model * model = llama_get_model(lctx);
    const int32_t n_layers = llama_model_n_layer(model);

    spice_runtime * rt = (spice_runtime *) calloc(1, sizeof(spice_runtime));
    if (rt == NULL) {
        write_err(err, err_len, "out of memory");
        return SPICE_ERR_NO_MEMORY;
    }
    rt->lctx = lctx;
    rt->model = model;
    rt->n_layers = n_layers;
    rt->resume_il = -1;
    rt->layers = (spice_expert_layer *) calloc((size_t) (n_layers > 0 ? n_layers : 1), sizeof(spice_expert_layer));
    rt->counters = (spice_counters *) calloc((size_t) (n_layers > 0 ? n_layers : 1), sizeof(spice_counters));
    rt->layer_seq = (uint64_t *) calloc((size_t) (n_layers > 0 ? n_layers : 1), sizeof(uint64_t));
    if (rt->layers == NULL || rt->counters == NULL || rt->layer_seq == NULL) {
        spice_runtime_free(rt);
        write_err(err, err_len, "out of memory");
        return SPICE_ERR_NO_MEMORY;
    }
    spice_barrier_init(&rt->barrier);
    rt->verify = spice_cuda_verify_from_env();
    spice_host_exec_init(&rt->host);
    spice_surrogate_exec_init(&rt->surrogate_exec);
    atomic_init(&rt->abort_requested, 0);
    atomic_init(&rt->failed, 0);

    int n_moe = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        const struct ggml_tensor * gate = llama_model_get_moe_tensor(model, il, LLAMA_MOE_TENSOR_GATE);
        if (gate == NULL) {
            continue; /* dense layer */
        }
        char msg[512];
        const int status = spice_expert_layer_init(&rt->layers[il], il, gate,
                                                   llama_model_get_moe_tensor(model, il, LLAMA_MOE_TENSOR_UP),
                                                   llama_model_get_moe_tensor(model, il, LLAMA_MOE_TENSOR_DOWN),
                                                   msg, sizeof(msg));
        if (status != SPICE_OK) {
            write_err(err, err_len, msg);
            spice_runtime_free(rt);
            return status;
        }
        if (rt->layers[il].n_expert > rt->max_n_expert) {
            rt->max_n_expert = rt->layers[il].n_expert;
        }
        n_moe++;
    }
    if (n_moe == 0) {
        char desc[128];
        llama_model_desc(model, desc, sizeof(desc));
        char msg[512];
        snprintf(msg, sizeof(msg),
                 "the model (%s) has no MoE layers with separate gate/up/down expert tensors; the MoE hook "
                 "only serves Mixture-of-Experts models such as qwen2moe and deepseek2", desc);
        write_err(err, err_len, msg);
        spice_runtime_free(rt);
        return SPICE_ERR_UNSUPPORTED;
    }
    rt->n_expert_of = (int32_t *) calloc((size_t) n_layers, sizeof(int32_t));
    rt->surrogate_mask = (uint8_t *) calloc((size_t) n_layers * (size_t) rt->max_n_expert, 1);
    if (rt->n_expert_of == NULL || rt->surrogate_mask == NULL ||
        spice_runtime_host_read_init(rt) != SPICE_OK) {
        write_err(err, err_len, "out of memory");
        spice_runtime_free(rt);
        return SPICE_ERR_NO_MEMORY;
    }
    for (int32_t il = 0; il < n_layers; ++il) {
        rt->n_expert_of[il] = rt->layers[il].is_moe ? rt->layers[il].n_expert : 0;
    }
    *out = rt;
    return SPICE_OK;
}

void spice_runtime_free(spice_runtime * rt) {
    if (rt == NULL) {
        return;
    }
    if (rt->enabled) {
        unregister(rt); /* not disable: no log filter to put in just before it comes out */
    }
    stop_async(rt);
    spice_cuda_verify_report(rt->verify);
    spice_cuda_verify_free(rt->verify);
    spice_host_exec_free(&rt->host);
    spice_hook_ids_free(&rt->hook_ids);
    spice_surrogate_table_free(&rt->surrogates); /* no budget to give back: the store goes too */
    spice_surrogate_exec_free(&rt->surrogate_exec);
    spice_store_free(rt->store);
    spice_slot_copies_free(&rt->slot_copies); /* after the store: a CUDA device unpins them */
    spice_runtime_host_read_free(rt);
    plan_free(&rt->plan);
    plan_free(&rt->async_lists);
    free(rt->layer_seq);
    release_log_filter(rt);
    free(rt->layers);
    free(rt->counters);
    free(rt->n_expert_of);
    free(rt->surrogate_mask);
    free(rt);
}

const char * spice_runtime_last_error(const spice_runtime * rt) {
    return rt ? rt->last_error : "no runtime";
}

int spice_runtime_n_layers(const spice_runtime * rt) {
    return rt ? rt->n_layers : 0;
}

int spice_runtime_layer_info(const spice_runtime * rt, int32_t il, spice_layer_info * out) {
    if (rt == NULL || out == NULL || il < 0 || il >= rt->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    const spice_expert_layer * L = &rt->layers[il];
    memset(out, 0, sizeof(*out));
    out->il = il;
    out->is_moe = L->is_moe;
    if (L->is_moe) {
        out->n_expert = L->n_expert;
        out->n_embd = L->n_embd;
        out->n_ff = L->n_ff;
        out->type_gate = (int32_t) L->gate.type;
        out->type_up = (int32_t) L->up.type;
        out->type_down = (int32_t) L->down.type;
        out->bytes_per_expert = L->bytes_per_expert;
    }
    return SPICE_OK;
}

/* What the hook asks llama.cpp for: the registration's flags, plus the
 * shared-expert output while surrogates are loaded (alpha * shared), plus the
 * next layer's router logits while the installed rule prefetches by them. */
static uint32_t hook_flags_needed(const spice_runtime * rt) {
    return rt->hook_flags | (rt->surrogates.n_loaded > 0 ? SPICE_HOOK_WANT_SHEXP : 0u) |
           (rt->store != NULL && spice_store_rule_prefetches_next(rt->store) ? SPICE_HOOK_WANT_NEXT_LOGITS : 0u);
}

static void register_hook(spice_runtime * rt) {
    const uint32_t flags = hook_flags_needed(rt);
    const uint32_t lflags = ((flags & SPICE_HOOK_WANT_PROBS) ? LLAMA_MOE_HOOK_WANT_PROBS : 0u) |
                            ((flags & SPICE_HOOK_WANT_SHEXP) ? LLAMA_MOE_HOOK_WANT_SHEXP : 0u) |
                            ((flags & SPICE_HOOK_WANT_NEXT_LOGITS) ? LLAMA_MOE_HOOK_WANT_NEXT_LOGITS : 0u);
    llama_set_moe_hook(rt->lctx, hook_entry, rt, rt->hook_max_tokens, lflags);
    rt->hook_flags_registered = flags;
}

void spice_runtime_update_hook(spice_runtime * rt) {
    if (rt->enabled && hook_flags_needed(rt) != rt->hook_flags_registered) {
        register_hook(rt);
    }
}

int spice_runtime_enable(spice_runtime * rt, spice_policy_fn fn, void * user_data, int32_t max_tokens) {
    return spice_runtime_enable_ex(rt, fn, user_data, max_tokens, 0);
}

/* No Python (GIL) per CUDA graph launch: spice-log-filter.h */
static void quiet_llama_log(spice_runtime * rt) {
    if (!rt->keep_debug_log) {
        rt->log_filter = spice_log_filter_ensure(rt->log_filter);
    }
}

int spice_runtime_enable_ex(spice_runtime * rt, spice_policy_fn fn, void * user_data, int32_t max_tokens,
                            uint32_t flags) {
    if (rt == NULL || max_tokens < 0 ||
        (flags & ~(uint32_t) (SPICE_HOOK_WANT_PROBS | SPICE_HOOK_WANT_SHEXP | SPICE_HOOK_WANT_NEXT_LOGITS)) != 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    stop_async(rt); /* a synchronous policy from here on */
    rt->plan_rule = NULL;
    rt->policy_fn = fn;
    rt->policy_user_data = user_data;
    rt->resume_il = -1;
    rt->enabled = 1;
    rt->hook_flags = flags;
    rt->hook_max_tokens = max_tokens;
    llama_set_abort_callback(rt->lctx, abort_entry, rt);
    register_hook(rt);
    quiet_llama_log(rt);
    return SPICE_OK;
}

int spice_runtime_sync_hook(spice_runtime * rt) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_runtime_update_hook(rt);
    return SPICE_OK;
}

uint32_t spice_runtime_hook_flags(const spice_runtime * rt) {
    return rt != NULL && rt->enabled ? rt->hook_flags_registered : 0u;
}

/* The hook unregistered, the planner stopped: what disable and free share. */
static void unregister(spice_runtime * rt) {
    llama_set_moe_hook(rt->lctx, NULL, NULL, 0, 0);
    rt->hook_flags_registered = 0;
    llama_set_abort_callback(rt->lctx, NULL, NULL);
    stop_async(rt); /* joins the planner: after the policy call in progress, if any */
    rt->enabled = 0;
    rt->resume_il = -1;
    rt->policy_fn = NULL;
    rt->policy_user_data = NULL;
}

int spice_runtime_disable(spice_runtime * rt) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    unregister(rt);
    quiet_llama_log(rt); /* stock decodes through CUDA graphs too */
    return SPICE_OK;
}

int spice_runtime_keep_debug_log(spice_runtime * rt, int keep) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    rt->keep_debug_log = keep != 0;
    if (rt->keep_debug_log) {
        release_log_filter(rt);
    }
    return SPICE_OK;
}

int spice_runtime_get_counters(const spice_runtime * rt, int32_t il, spice_counters * out) {
    if (rt == NULL || out == NULL || il < -1 || il >= rt->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    for (int32_t l = (il < 0 ? 0 : il); l < (il < 0 ? rt->n_layers : il + 1); ++l) {
        spice_counters_accumulate(out, &rt->counters[l]);
    }
    if (rt->store != NULL) { /* traffic, stalls, prefetch outcomes and device operations live in the store */
        spice_counters k;
        spice_store_get_counters(rt->store, il, &k);
        spice_counters_accumulate(out, &k);
    }
    return SPICE_OK;
}

void spice_runtime_reset_counters(spice_runtime * rt) {
    if (rt != NULL) {
        memset(rt->counters, 0, (size_t) rt->n_layers * sizeof(spice_counters));
        spice_store_reset_counters(rt->store);
    }
}

int spice_runtime_abort_requested(const spice_runtime * rt) {
    return rt ? atomic_load(&rt->abort_requested) : 0;
}

int spice_runtime_failed(const spice_runtime * rt) {
    return rt ? atomic_load(&rt->failed) : 0;
}

void spice_runtime_clear_abort(spice_runtime * rt) {
    if (rt != NULL) {
        atomic_store(&rt->failed, 0);
        atomic_store(&rt->abort_requested, 0);
    }
}

void spice_runtime_request_abort(spice_runtime * rt) {
    if (rt != NULL) {
        atomic_store(&rt->abort_requested, 1);
    }
}

uint64_t spice_runtime_plan_rejections(const spice_runtime * rt) {
    return rt ? rt->plan_rejections : 0;
}

/* what spice_store_set_rule refuses, for both ways a rule is installed */
static const char RULE_PROBLEMS[] = "an action, miss or keep value out of range, LAYER_LRU without capacities, "
                                    "DECAYED without a decay in (0, 1], or prefetch_next without routers";

spice_plan_limits spice_runtime_plan_limits(const spice_runtime * rt) {
    const spice_plan_limits lim = { rt->n_layers, rt->n_expert_of, rt->max_n_expert,
                                    rt->surrogates.n_loaded > 0 ? rt->surrogate_mask : NULL };
    return lim;
}

void spice_runtime_take_plan_rule(spice_runtime * rt, const spice_policy_call * call) {
    if (call->rule == NULL || (const void *) call->rule == rt->plan_rule || rt->store == NULL) {
        return;
    }
    if (spice_store_set_rule(rt->store, call->rule) == SPICE_OK) {
        rt->plan_rule = call->rule;
    } else {
        set_error(rt, "layer %d: the plan's rule is invalid (%s); the rule stays", call->il, RULE_PROBLEMS);
        rt->plan_rejections++;
    }
}

int spice_runtime_set_rule(spice_runtime * rt, const spice_rule * rule) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (rt->store == NULL) {
        set_error(rt, "a rule plans a device tier's experts: give the runtime a tier first");
        return SPICE_ERR_STATE;
    }
    const int status = spice_store_set_rule(rt->store, rule);
    rt->plan_rule = NULL;
    if (status == SPICE_ERR_INVALID_ARG) {
        set_error(rt, "invalid rule: %s", RULE_PROBLEMS);
    }
    spice_runtime_update_hook(rt); /* a rule that prefetches by the next router wants its logits */
    return status;
}
