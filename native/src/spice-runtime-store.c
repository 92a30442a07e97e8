/* The runtime's device tier: creating the store for a model, applying plans
 * to it, preloading. */
#include "spice-runtime-internal.h"

#include "llama.h"

#include <stdio.h>
#include <string.h>

void spice_runtime_apply_store_plan(spice_runtime * rt, const struct llama_moe_hook_call * hc,
                                    spice_policy_call * call) {
    spice_store * store = rt->store;
    const int32_t il = hc->il;
    const int32_t n_e = rt->layers[il].n_expert;
    const int32_t n_pairs = hc->n_tokens * hc->n_expert_used;
    spice_plan_buffers * p = &rt->plan;
    memset(p->need, 0, (size_t) n_e);
    memset(p->pinned, 0, (size_t) n_e);
    memset((void *) p->device, 0, (size_t) n_e * sizeof(const char *));

    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) hc->ids + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            if (call->actions[t * hc->n_expert_used + k] == SPICE_ACTION_DEVICE) {
                p->need[ids[k]] = 1;
            }
        }
    }
    /* experts this call runs on the device are pinned first, so the plan's
     * own evictions cannot take them away */
    for (int32_t e = 0; e < n_e; ++e) {
        if (p->need[e] && spice_store_state(store, il, e) != SPICE_RES_ABSENT &&
            spice_store_pin(store, il, e) == SPICE_OK) {
            p->pinned[e] = 1;
        }
    }
    /* refused evictions (pinned, in flight) and failed requests (no slot,
     * queue full) are not errors: the plan degrades to host execution */
    for (int32_t i = 0; i + 1 < call->n_evict; i += 2) {
        spice_store_evict(store, call->evict[i], call->evict[i + 1]);
    }
    for (int32_t i = 0; i < call->n_fetch; ++i) {
        spice_store_request(store, il, call->fetch[i], SPICE_PRIORITY_DEMAND);
    }
    for (int32_t e = 0; e < n_e; ++e) {
        if (p->need[e] && !p->pinned[e] && spice_store_request(store, il, e, SPICE_PRIORITY_DEMAND) == SPICE_OK &&
            spice_store_pin(store, il, e) == SPICE_OK) {
            p->pinned[e] = 1;
        }
    }
    /* prefetches queue behind the demand copies and use the bus while we wait */
    for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
        spice_store_request(store, call->prefetch[i], call->prefetch[i + 1], SPICE_PRIORITY_PREFETCH);
    }
    for (int32_t e = 0; e < n_e; ++e) {
        if (!p->need[e]) {
            continue;
        }
        uint64_t stall = 0;
        if (p->pinned[e] && spice_store_wait(store, il, e, &stall) == SPICE_OK) {
            p->device[e] = spice_store_slot_data(store, il, e);
        }
        if (p->device[e] == NULL) {
            p->need[e] = 0; /* no slot for it: its activations run on the host */
        }
    }
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) hc->ids + (size_t) t * hc->ids_nb1);
        for (int32_t k = 0; k < hc->n_expert_used; ++k) {
            int32_t * a = &call->actions[t * hc->n_expert_used + k];
            if (*a == SPICE_ACTION_DEVICE && !p->need[ids[k]]) {
                *a = SPICE_ACTION_HOST;
            }
        }
    }
    for (int32_t e = 0; e < n_e; ++e) {
        if (p->pinned[e]) {
            spice_store_unpin(store, il, e);
        }
    }
    (void) n_pairs;
}

int spice_runtime_set_store(spice_runtime * rt, const spice_store_params * params) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_store_free(rt->store);
    rt->store = NULL;
    if (params == NULL) {
        return SPICE_OK;
    }
    int32_t n_expert[rt->n_layers > 0 ? rt->n_layers : 1];
    uint64_t bytes[rt->n_layers > 0 ? rt->n_layers : 1];
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        n_expert[il] = rt->layers[il].is_moe ? rt->layers[il].n_expert : 0;
        bytes[il] = rt->layers[il].bytes_per_expert;
    }
    spice_store * store = NULL;
    int status = spice_store_create(params, rt->n_layers, n_expert, bytes, &store);
    if (status == SPICE_ERR_BUDGET) {
        snprintf(rt->last_error, sizeof(rt->last_error), "the device budget of %llu bytes is smaller than one expert",
                 (unsigned long long) params->budget_bytes);
    }
    if (status != SPICE_OK) {
        return status;
    }
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        const spice_expert_layer * L = &rt->layers[il];
        if (!L->is_moe) {
            continue;
        }
        spice_store_source src;
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; k < 3; ++k) {
            src.base[k] = (const char *) mats[k]->tensor->data;
            src.stride[k] = mats[k]->tensor->nb[2];
            src.size[k] = mats[k]->tensor->nb[2];
        }
        if ((status = spice_store_bind(store, il, &src)) != SPICE_OK) {
            spice_store_free(store);
            return status;
        }
    }
    /* loaded surrogates live on the device: a new tier holds them first */
    if (rt->surrogates.bytes > 0 && spice_store_reserve(store, (int64_t) rt->surrogates.bytes) != SPICE_OK) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "the loaded surrogates need %llu device bytes; the budget is %llu (clear them or raise it)",
                 (unsigned long long) rt->surrogates.bytes, (unsigned long long) params->budget_bytes);
        spice_store_free(store);
        return SPICE_ERR_BUDGET;
    }
    rt->store = store;
    return SPICE_OK;
}

spice_store * spice_runtime_get_store(spice_runtime * rt) {
    return rt ? rt->store : NULL;
}

int spice_runtime_preload(spice_runtime * rt, int32_t * n_loaded) {
    if (rt == NULL || rt->store == NULL) {
        return SPICE_ERR_STATE;
    }
    int32_t n = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        for (int32_t e = 0; rt->layers[il].is_moe && e < rt->layers[il].n_expert; ++e) {
            if (spice_store_request(rt->store, il, e, SPICE_PRIORITY_DEMAND) != SPICE_OK) {
                goto done;
            }
            n++;
        }
    }
done:
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        for (int32_t e = 0; rt->layers[il].is_moe && e < rt->layers[il].n_expert; ++e) {
            if (spice_store_state(rt->store, il, e) != SPICE_RES_ABSENT) {
                spice_store_wait(rt->store, il, e, NULL);
            }
        }
    }
    /* a preload is set-up, not service: it does not count as traffic or stalls */
    memset(rt->store->counters, 0, (size_t) rt->n_layers * sizeof(spice_counters));
    if (n_loaded) {
        *n_loaded = n;
    }
    return SPICE_OK;
}
