/* The runtime handle: attaches to a llama_context, serves its MoE hook,
 * dispatches to a policy and keeps the counters. */
#include "spice-runtime-internal.h"

#include "ggml-backend.h"
#include "llama.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

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

static int grow_i32(int32_t ** buf, int32_t * cap, int32_t need) {
    if (need <= *cap) {
        return SPICE_OK;
    }
    int32_t * nbuf = (int32_t *) realloc(*buf, (size_t) need * sizeof(int32_t));
    if (nbuf == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    *buf = nbuf;
    *cap = need;
    return SPICE_OK;
}

static int plan_reserve(spice_runtime * rt, int32_t n_pairs) {
    spice_plan_buffers * p = &rt->plan;
    const int32_t old_cap = p->cap_actions;
    if (grow_i32(&p->actions, &p->cap_actions, n_pairs) != SPICE_OK) {
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
        p->device = (const char **) calloc(n, sizeof(const char *));
        p->need = (uint8_t *) calloc(n, 1);
        p->pinned = (uint8_t *) calloc(n, 1);
        p->kept = (uint8_t *) calloc((size_t) (rt->n_layers > 0 ? rt->n_layers : 1) * n, 1);
        p->rank = (int32_t *) calloc((size_t) (rt->n_layers > 0 ? rt->n_layers : 1), sizeof(int32_t));
        if (p->device == NULL || p->need == NULL || p->pinned == NULL || p->kept == NULL || p->rank == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
    }
    /* experts of one layer; (layer, expert) pairs across all layers */
    const int32_t pairs_all = 2 * rt->n_layers * rt->max_n_expert;
    if (grow_i32(&p->fetch, &p->cap_fetch, rt->max_n_expert) != SPICE_OK ||
        grow_i32(&p->prefetch, &p->cap_prefetch, pairs_all) != SPICE_OK ||
        grow_i32(&p->evict, &p->cap_evict, pairs_all) != SPICE_OK ||
        grow_i32(&p->evict_from, &p->cap_evict_from, rt->n_layers) != SPICE_OK) {
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
    free(p->need);
    free(p->pinned);
    free(p->kept);
    free(p->rank);
    memset(p, 0, sizeof(*p));
}

/* ---- the hook ---------------------------------------------------------------- */

/* Outcome of each activation (DESIGN section 11): a hit when its expert was
 * resident as the call began (without a device tier every expert is) and it
 * ran exactly; otherwise a miss by what happened to it. Lossy actions are
 * never hits, resident or not. */
static void count_actions(spice_counters * c, const int32_t * actions, const uint8_t * hit, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
        switch (actions[i]) {
            case SPICE_ACTION_SURROGATE: c->misses_surrogate++; break;
            case SPICE_ACTION_DROP:      c->dropped++; break;
            case SPICE_ACTION_DEVICE:    hit[i] ? c->hits++ : c->misses_fetched++; break;
            default:                     hit[i] ? c->hits++ : c->misses_host++; break;
        }
    }
}

/* verify mode, thread 0 after the host executor: how far the device's rows
 * are from the host's for the same pairs */
static void verify_device_rows(spice_runtime * rt, const struct llama_moe_hook_call * hc) {
    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (rt->verify_run[i] != SPICE_EXEC_DEVICE) {
            continue;
        }
        const float * dev = rt->verify_y + (size_t) i * (size_t) hc->n_embd;
        const float * host = rt->host.y + (size_t) i * (size_t) hc->n_embd;
        for (int32_t c = 0; c < hc->n_embd; ++c) {
            const double d = dev[c] > host[c] ? dev[c] - host[c] : host[c] - dev[c];
            const double a = host[c] >= 0 ? host[c] : -host[c];
            rt->verify_max_diff = d > rt->verify_max_diff ? d : rt->verify_max_diff;
            rt->verify_max_abs = a > rt->verify_max_abs ? a : rt->verify_max_abs;
        }
        rt->verify_rows++;
    }
}

/* Real device: queue this call's device pairs on the GPU (their slots are
 * pinned resident by the store plan); the host executor runs meanwhile. */
static int start_device_work(spice_runtime * rt, const struct llama_moe_hook_call * hc) {
    spice_cuda_job job;
    memset(&job, 0, sizeof(job));
    job.layer = &rt->layers[hc->il];
    job.n_tokens = hc->n_tokens;
    job.n_used = hc->n_expert_used;
    job.inp = hc->inp; job.inp_nb1 = hc->inp_nb1;
    job.ids = hc->ids; job.ids_nb1 = hc->ids_nb1;
    job.run = rt->verify ? rt->verify_run : rt->plan.exec;
    job.slot_of = rt->plan.device;
    for (int k = 0; k < 3; ++k) {
        job.matrix_offset[k] = rt->store->sources[hc->il].dst_offset[k];
    }
    char err[256];
    const int rc = spice_cuda_exec_begin(rt->store->cuda, &job, err, sizeof(err));
    if (rc != SPICE_OK) {
        set_error(rt, "layer %d: %s; ran those experts on the host", hc->il, err);
        return rc;
    }
    rt->device_work_pending = 1;
    return SPICE_OK;
}

/* before_combine of the host job: the device's rows land in y */
static void collect_device_work(void * user_data, float * y) {
    spice_runtime * rt = (spice_runtime *) user_data;
    char err[256];
    if (rt->verify) {
        y = rt->verify_y; /* compared with the host's rows once they are all done (verify_device_rows) */
    }
    if (spice_cuda_exec_end(rt->store->cuda, y, err, sizeof(err)) != SPICE_OK) {
        set_error(rt, "%s", err);
        atomic_store(&rt->abort_requested, 1);
    }
    rt->device_work_pending = 0;
}

/* The executor's device pairs (exec 2) run on the host weights instead (exec 1). */
static void device_pairs_to_host(uint8_t * exec, int32_t n_pairs) {
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (exec[i] == SPICE_EXEC_DEVICE) {
            exec[i] = 1;
        }
    }
}

/* Thread 0: ask the policy, validate, count, and prepare the executor. */
static void plan_call(spice_runtime * rt, const struct llama_moe_hook_call * hc) {
    rt->device_work_pending = 0;
    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    spice_counters * c = &rt->counters[hc->il];
    const spice_expert_layer * L = &rt->layers[hc->il];

    if (plan_reserve(rt, n_pairs) != SPICE_OK) {
        set_error(rt, "layer %d: out of memory for a plan of %d actions", hc->il, n_pairs);
        atomic_store(&rt->abort_requested, 1);
        spice_host_job job = { 0 };
        job.layer = L;
        job.n_tokens = hc->n_tokens;
        job.out = hc->out;
        job.out_nb1 = hc->out_nb1;
        rt->host.job = job;
        rt->host.failed = 1;
        return;
    }

    spice_policy_call call;
    memset(&call, 0, sizeof(call));
    call.il = hc->il;
    call.n_tokens = hc->n_tokens;
    call.n_embd = hc->n_embd;
    call.n_expert = hc->n_expert;
    call.n_expert_used = hc->n_expert_used;
    call.inp = hc->inp;         call.inp_nb1 = hc->inp_nb1;
    call.probs = hc->probs;     call.probs_nb1 = hc->probs_nb1;
    call.ids = hc->ids;         call.ids_nb1 = hc->ids_nb1;
    call.weights = hc->weights; call.weights_nb1 = hc->weights_nb1;
    call.shexp = hc->shexp;     call.shexp_nb1 = hc->shexp_nb1;
    call.actions = rt->plan.actions;   call.cap_actions = rt->plan.cap_actions;
    call.fetch = rt->plan.fetch;       call.cap_fetch = rt->plan.cap_fetch;
    call.prefetch = rt->plan.prefetch; call.cap_prefetch = rt->plan.cap_prefetch;
    call.evict = rt->plan.evict;       call.cap_evict = rt->plan.cap_evict;
    call.evict_from = rt->plan.evict_from; call.cap_evict_from = rt->plan.cap_evict_from;

    /* which activations find their expert resident as the call begins; and when
     * each expert was last selected (for evict_from) */
    const uint64_t t_hits = now_ns();
    const int32_t * ids_base = hc->ids;
    uint64_t * last_use = rt->last_use + (size_t) hc->il * (size_t) rt->max_n_expert;
    const uint64_t clock = ++rt->use_clock;
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) ids_base + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            const int32_t i = t * hc->n_expert_used + k;
            rt->plan.hit[i] = rt->store == NULL ||
                              spice_store_state(rt->store, hc->il, ids[k]) == SPICE_RES_RESIDENT;
            if (ids[k] >= 0 && ids[k] < rt->max_n_expert) {
                last_use[ids[k]] = clock;
            }
        }
    }
    if (rt->store != NULL) {
        c->store_ns += now_ns() - t_hits;
    }
    /* the default plan, and every fallback: resident experts on the device,
     * the others on the host; both exact */
    for (int32_t i = 0; i < n_pairs; ++i) {
        call.actions[i] = rt->plan.hit[i] ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
    }
    call.n_actions = n_pairs;

    call.resume_il = -1;

    /* a decode call the policy decided in advance: the default plan, no call */
    const int quiet = rt->policy_fn != NULL && rt->resume_il >= 0 && hc->n_tokens == 1 && hc->il != rt->resume_il;
    if (quiet) {
        c->policy_quiet++;
    } else {
        rt->resume_il = -1;
    }

    const uint64_t t0 = now_ns();
    int use_plan = 0;
    if (rt->policy_fn != NULL && !quiet) {
        const int rc = rt->policy_fn(&call, rt->policy_user_data);
        if (rc == SPICE_POLICY_OK) {
            char err[sizeof(rt->last_error)];
            if (spice_plan_validate(rt, &call, err, sizeof(err)) == SPICE_OK) {
                use_plan = 1;
            } else {
                memcpy(rt->last_error, err, sizeof(err)); /* the latest: callers warn once per policy */
                rt->plan_rejections++;
                c->policy_fallbacks++;
            }
        } else {
            if (rc == SPICE_POLICY_ABORT) {
                atomic_store(&rt->abort_requested, 1);
            } else {
                set_error(rt, "layer %d: the policy failed; ran exact instead", hc->il);
                rt->plan_rejections++;
                c->policy_fallbacks++;
            }
        }
        if (!use_plan) {
            for (int32_t i = 0; i < n_pairs; ++i) {
                call.actions[i] = rt->plan.hit[i] ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
            }
            /* nothing of a rejected plan may act: its lists are unchecked */
            call.n_fetch = call.n_prefetch = call.n_evict = call.n_evict_from = 0;
            call.resume_il = -1;
        } else {
            rt->resume_il = call.resume_il;
        }
    }
    if (!quiet) {
        c->policy_ns += now_ns() - t0;
        c->policy_calls++;
    }

    /* ids come from the graph's top-k; a bad one would index out of the tensor */
    int bad_ids = 0;
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) hc->ids + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            if (ids[k] < 0 || ids[k] >= L->n_expert) {
                call.actions[t * hc->n_expert_used + k] = SPICE_ACTION_DROP;
                set_error(rt, "layer %d: graph selected expert %d outside 0..%d", hc->il, ids[k], L->n_expert - 1);
                bad_ids = 1;
            }
        }
    }
    (void) bad_ids;

    if (rt->store != NULL) {
        const uint64_t t_store = now_ns();
        const uint64_t stalled = rt->store->counters[hc->il].stall_ns;
        spice_runtime_apply_store_plan(rt, hc, &call);
        const uint64_t spent = now_ns() - t_store, waited = rt->store->counters[hc->il].stall_ns - stalled;
        c->store_ns += spent > waited ? spent - waited : 0;
    }

    c->hook_calls++;
    c->activations += (uint64_t) n_pairs;
    count_actions(c, call.actions, rt->plan.hit, n_pairs);

    /* the executor's view: exact for device and host, nothing for drop and
     * surrogate (the surrogate executor adds those afterwards) */
    int any_surrogate = 0, any_device = 0;
    const int real_device = rt->store != NULL && spice_store_is_real(rt->store);
    for (int32_t i = 0; i < n_pairs; ++i) {
        const int32_t a = call.actions[i];
        /* on a real device, device pairs run there and the host only sums their rows */
        rt->plan.exec[i] = (uint8_t) (a == SPICE_ACTION_DEVICE ? (real_device ? SPICE_EXEC_DEVICE : 1)
                                                                : a == SPICE_ACTION_HOST);
        any_surrogate |= a == SPICE_ACTION_SURROGATE;
        any_device |= a == SPICE_ACTION_DEVICE;
    }
    if (real_device && any_device && rt->verify) {
        /* verify: the device computes its pairs on the side, the host computes everything */
        const size_t need_y = (size_t) n_pairs * (size_t) hc->n_embd;
        if ((size_t) n_pairs > rt->verify_run_cap) {
            free(rt->verify_run);
            rt->verify_run = (uint8_t *) malloc((size_t) n_pairs);
            rt->verify_run_cap = rt->verify_run ? (size_t) n_pairs : 0;
        }
        if (need_y > rt->verify_y_cap) {
            free(rt->verify_y);
            rt->verify_y = (float *) malloc(need_y * sizeof(float));
            rt->verify_y_cap = rt->verify_y ? need_y : 0;
        }
        if (rt->verify_run && rt->verify_y) {
            memcpy(rt->verify_run, rt->plan.exec, (size_t) n_pairs);
            device_pairs_to_host(rt->plan.exec, n_pairs);
            start_device_work(rt, hc);
        }
    }
    if (real_device && any_device && !rt->verify && start_device_work(rt, hc) != SPICE_OK) {
        device_pairs_to_host(rt->plan.exec, n_pairs); /* exact on the host weights instead */
    }

    spice_host_job job;
    memset(&job, 0, sizeof(job));
    job.layer = L;
    job.n_tokens = hc->n_tokens;
    job.n_used = hc->n_expert_used;
    job.inp = hc->inp;         job.inp_nb1 = hc->inp_nb1;
    job.ids = hc->ids;         job.ids_nb1 = hc->ids_nb1;
    job.weights = hc->weights; job.weights_nb1 = hc->weights_nb1;
    job.exec = rt->plan.exec;
    job.device = rt->store != NULL && !real_device ? rt->plan.device : NULL; /* emulated slots are host memory */
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
        sj.actions = call.actions;
        sj.table = rt->surrogates.entries + (size_t) hc->il * (size_t) rt->surrogates.max_expert;
        sj.out = hc->out;         sj.out_nb1 = hc->out_nb1;
        if (spice_surrogate_exec_prepare(&rt->surrogate_exec, &sj, hc->nth) != SPICE_OK) {
            set_error(rt, "layer %d: out of memory for the surrogate executor's scratch", hc->il);
            atomic_store(&rt->abort_requested, 1);
        }
    }
}

static void hook_entry(const struct llama_moe_hook_call * hc, void * user_data) {
    spice_runtime * rt = (spice_runtime *) user_data;
    if (hc->ith == 0) {
        rt->surrogate_exec.n_pairs = 0;
        if (hc->il < 0 || hc->il >= rt->n_layers || !rt->layers[hc->il].is_moe ||
            hc->n_embd != rt->layers[hc->il].n_embd || hc->n_expert != rt->layers[hc->il].n_expert) {
            /* cannot happen for a runtime attached to this context's model */
            set_error(rt, "hook called for layer %d, which the runtime does not serve", hc->il);
            atomic_store(&rt->abort_requested, 1);
            rt->host.failed = 1;
            rt->host.job.layer = NULL;
        } else {
            plan_call(rt, hc);
        }
    }
    spice_barrier_wait(&rt->barrier, hc->nth);
    if (rt->host.job.layer == NULL) {
        for (int32_t t = hc->ith; t < hc->n_tokens; t += hc->nth) {
            memset((char *) hc->out + (size_t) t * hc->out_nb1, 0, (size_t) hc->n_embd * sizeof(float));
        }
        return;
    }
    spice_host_exec_run(&rt->host, hc->ith, hc->nth, &rt->barrier);
    if (hc->ith == 0 && rt->verify && rt->verify_run != NULL && rt->host.job.before_combine != NULL) {
        verify_device_rows(rt, hc); /* y is complete: every thread passed the barrier before combine */
    }
    if (rt->surrogate_exec.n_pairs > 0) {
        /* one barrier serves both: the host executor's combine wrote out with
         * its own split, and every pair's A h must be ready before combining */
        spice_surrogate_exec_project(&rt->surrogate_exec, hc->ith, hc->nth);
        spice_barrier_wait(&rt->barrier, hc->nth);
        spice_surrogate_exec_combine(&rt->surrogate_exec, hc->ith, hc->nth);
    }
}

static bool abort_entry(void * user_data) {
    const spice_runtime * rt = (const spice_runtime *) user_data;
    return atomic_load(&rt->abort_requested) != 0;
}

/* ---- C API ------------------------------------------------------------------- */

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
    if (rt->layers == NULL || rt->counters == NULL) {
        spice_runtime_free(rt);
        write_err(err, err_len, "out of memory");
        return SPICE_ERR_NO_MEMORY;
    }
    spice_barrier_init(&rt->barrier);
    const char * verify = getenv("SPICE_CUDA_VERIFY");
    rt->verify = verify != NULL && verify[0] == '1';
    spice_host_exec_init(&rt->host);
    spice_surrogate_exec_init(&rt->surrogate_exec);
    atomic_init(&rt->abort_requested, 0);

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
    rt->last_use = (uint64_t *) calloc((size_t) n_layers * (size_t) rt->max_n_expert, sizeof(uint64_t));
    if (rt->last_use == NULL) {
        write_err(err, err_len, "out of memory");
        spice_runtime_free(rt);
        return SPICE_ERR_NO_MEMORY;
    }
    *out = rt;
    return SPICE_OK;
}

void spice_runtime_free(spice_runtime * rt) {
    if (rt == NULL) {
        return;
    }
    if (rt->enabled) {
        spice_runtime_disable(rt);
    }
    if (rt->verify && rt->verify_rows > 0) {
        fprintf(stderr, "libspice: SPICE_CUDA_VERIFY: %llu device rows vs the host's: max |diff| %.3g, "
                        "max |host| %.3g, relative %.3g\n", (unsigned long long) rt->verify_rows,
                rt->verify_max_diff, rt->verify_max_abs,
                rt->verify_max_abs > 0 ? rt->verify_max_diff / rt->verify_max_abs : 0.0);
    }
    free(rt->verify_run);
    free(rt->verify_y);
    spice_host_exec_free(&rt->host);
    spice_runtime_clear_surrogates(rt);
    spice_surrogate_exec_free(&rt->surrogate_exec);
    spice_store_free(rt->store);
    plan_free(&rt->plan);
    free(rt->layers);
    free(rt->counters);
    free(rt->last_use);
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

int spice_runtime_enable(spice_runtime * rt, spice_policy_fn fn, void * user_data, int32_t max_tokens) {
    if (rt == NULL || max_tokens < 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    rt->policy_fn = fn;
    rt->policy_user_data = user_data;
    rt->resume_il = -1;
    rt->enabled = 1;
    llama_set_abort_callback(rt->lctx, abort_entry, rt);
    llama_set_moe_hook(rt->lctx, hook_entry, rt, max_tokens);
    return SPICE_OK;
}

int spice_runtime_disable(spice_runtime * rt) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    llama_set_moe_hook(rt->lctx, NULL, NULL, 0);
    llama_set_abort_callback(rt->lctx, NULL, NULL);
    rt->enabled = 0;
    rt->resume_il = -1;
    rt->policy_fn = NULL;
    rt->policy_user_data = NULL;
    return SPICE_OK;
}

int spice_runtime_get_counters(const spice_runtime * rt, int32_t il, spice_counters * out) {
    if (rt == NULL || out == NULL || il < -1 || il >= rt->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    for (int32_t l = (il < 0 ? 0 : il); l < (il < 0 ? rt->n_layers : il + 1); ++l) {
        const uint64_t * src = (const uint64_t *) &rt->counters[l];
        uint64_t * dst = (uint64_t *) out;
        for (size_t i = 0; i < sizeof(spice_counters) / sizeof(uint64_t); ++i) {
            dst[i] += src[i];
        }
    }
    if (rt->store != NULL) { /* traffic, stalls and prefetch outcomes live in the store */
        spice_counters k;
        spice_store_get_counters(rt->store, il, &k);
        out->bytes_h2d += k.bytes_h2d;
        out->copy_ns += k.copy_ns;
        out->stall_ns += k.stall_ns;
        out->prefetch_issued += k.prefetch_issued;
        out->prefetch_used += k.prefetch_used;
        out->prefetch_cancelled += k.prefetch_cancelled;
    }
    return SPICE_OK;
}

void spice_runtime_reset_counters(spice_runtime * rt) {
    if (rt != NULL) {
        memset(rt->counters, 0, (size_t) rt->n_layers * sizeof(spice_counters));
        if (rt->store != NULL) {
            memset(rt->store->counters, 0, (size_t) rt->n_layers * sizeof(spice_counters));
        }
    }
}

int spice_runtime_abort_requested(const spice_runtime * rt) {
    return rt ? atomic_load(&rt->abort_requested) : 0;
}

void spice_runtime_clear_abort(spice_runtime * rt) {
    if (rt != NULL) {
        atomic_store(&rt->abort_requested, 0);
    }
}

uint64_t spice_runtime_plan_rejections(const spice_runtime * rt) {
    return rt ? rt->plan_rejections : 0;
}
