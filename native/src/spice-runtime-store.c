/* The runtime's device tier: creating the store for a model, applying plans
 * to it, preloading. */
#include "spice-runtime-internal.h"

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Where a CUDA slot puts each matrix: 256-byte aligned (what ggml's CUDA
 * buffers give every tensor), each followed by the zero padding ggml's
 * kernels may read. Returns the slot bytes this layer needs. */
static size_t cuda_layout(const spice_expert_layer * L, spice_store_source * src) {
    const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
    size_t offset = 0;
    for (int k = 0; k < 3; ++k) {
        offset = (offset + 255) & ~(size_t) 255;
        src->dst_offset[k] = offset;
        src->pad[k] = spice_cuda_matrix_pad(mats[k]->type, mats[k]->n_cols);
        offset += src->size[k] + src->pad[k];
    }
    return (offset + 255) & ~(size_t) 255;
}

typedef struct host_range {
    uintptr_t begin, end;
} host_range;

static int range_order(const void * a, const void * b) {
    const host_range * x = (const host_range *) a;
    const host_range * y = (const host_range *) b;
    return x->begin < y->begin ? -1 : (x->begin > y->begin);
}

/* Page-lock the host expert weights so copies are DMA and asynchronous:
 * every expert tensor's pages not locked already, merged into as few ranges
 * as touch. On a CUDA build the experts are normally loaded into llama.cpp's
 * CUDA host buffer type (spice-expert-buft.c), which is pinned already;
 * registering around it would overlap those allocations and make llama.cpp's
 * own copies from neighbouring weights fail. Returns how many bytes could not
 * be registered (copied from pageable memory). */
static uint64_t pin_host_weights(const spice_runtime * rt, spice_store * store) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    host_range * r = (host_range *) malloc((size_t) rt->n_layers * 3 * sizeof(host_range));
    if (r == NULL) {
        return 1;
    }
    int32_t n = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        const spice_expert_layer * L = &rt->layers[il];
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; L->is_moe && k < 3; ++k) {
            if (spice_cuda_is_pinned(mats[k]->tensor->data, ggml_nbytes(mats[k]->tensor))) {
                continue;
            }
            const uintptr_t b = (uintptr_t) mats[k]->tensor->data;
            r[n].begin = b & ~(page - 1);
            r[n].end = (b + ggml_nbytes(mats[k]->tensor) + page - 1) & ~(page - 1);
            n++;
        }
    }
    qsort(r, (size_t) n, sizeof(*r), range_order);
    uint64_t unpinned = 0;
    for (int32_t i = 0; i < n;) {
        host_range m = r[i++];
        while (i < n && r[i].begin <= m.end) {
            if (r[i].end > m.end) {
                m.end = r[i].end;
            }
            i++;
        }
        if (spice_cuda_register_host(store->cuda, (const void *) m.begin, m.end - m.begin) != SPICE_OK) {
            unpinned += m.end - m.begin;
        }
    }
    free(r);
    return unpinned;
}

/* evict_from: evicts the least recently selected resident expert of the first
 * listed layer, from *next on and before position `limit`, that has one neither
 * running on the device in this call (pinned) nor kept by the plan; *next skips
 * the layers found empty (they stay so for the rest of the call). 0 when none. */
static int evict_least_recent(spice_runtime * rt, const spice_policy_call * call, int32_t * next, int32_t limit) {
    spice_store * store = rt->store;
    const size_t width = (size_t) rt->max_n_expert;
    for (; *next < limit; ++*next) {
        const int32_t il = call->evict_from[*next];
        const uint64_t * last_use = rt->last_use + (size_t) il * width;
        const uint8_t * kept = rt->plan.kept + (size_t) il * width;
        int32_t victim = -1;
        for (int32_t e = 0; e < rt->layers[il].n_expert; ++e) {
            if ((victim < 0 || last_use[e] < last_use[victim]) && !kept[e] &&
                !(il == call->il && rt->plan.pinned[e]) && spice_store_state(store, il, e) == SPICE_RES_RESIDENT) {
                victim = e;
            }
        }
        if (victim >= 0 && spice_store_evict(store, il, victim) == SPICE_OK) {
            return 1; /* the layer may hold more: *next stays */
        }
        /* none left here (a refused eviction cannot happen to a resident, unpinned expert) */
    }
    return 0;
}

/* The plan's prefetches in order; with evict_from, each may take room from the
 * layers listed before its own (see spice_policy_call). */
static void request_prefetches(spice_runtime * rt, const spice_policy_call * call) {
    spice_store * store = rt->store;
    spice_plan_buffers * p = &rt->plan;
    const size_t width = (size_t) rt->max_n_expert;
    const int room = call->n_evict_from > 0;
    if (room) {
        for (int32_t il = 0; il < rt->n_layers; ++il) {
            p->rank[il] = call->n_evict_from;
        }
        for (int32_t i = call->n_evict_from - 1; i >= 0; --i) {
            p->rank[call->evict_from[i]] = i; /* a layer listed twice counts where first listed */
        }
        for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
            p->kept[(size_t) call->prefetch[i] * width + (size_t) call->prefetch[i + 1]] = 1;
        }
    }
    int32_t next_from = 0;
    for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
        const int32_t il = call->prefetch[i], e = call->prefetch[i + 1];
        int status = spice_store_request(store, il, e, SPICE_PRIORITY_PREFETCH);
        if (!room) {
            continue; /* refused requests are not errors: the expert stays on the host */
        }
        const int32_t limit = p->rank[il] < call->n_evict_from ? p->rank[il] : call->n_evict_from;
        while (status == SPICE_ERR_BUDGET && evict_least_recent(rt, call, &next_from, limit)) {
            status = spice_store_request(store, il, e, SPICE_PRIORITY_PREFETCH);
        }
        if (status == SPICE_ERR_BUDGET) {
            break; /* no room for it, nor for the prefetches after it */
        }
    }
    if (room) {
        for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
            p->kept[(size_t) call->prefetch[i] * width + (size_t) call->prefetch[i + 1]] = 0;
        }
    }
}

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
    request_prefetches(rt, call);
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
    rt->resume_il = -1; /* a new tier: the policy decides the next call afresh */
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
    size_t slot_stride = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        const spice_expert_layer * L = &rt->layers[il];
        if (!L->is_moe) {
            continue;
        }
        spice_store_source src;
        memset(&src, 0, sizeof(src));
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        size_t packed = 0;
        for (int k = 0; k < 3; ++k) {
            src.base[k] = (const char *) mats[k]->tensor->data;
            src.stride[k] = mats[k]->tensor->nb[2];
            src.size[k] = mats[k]->tensor->nb[2];
            src.dst_offset[k] = packed;
            packed += src.size[k];
        }
        if (params->device_kind == SPICE_DEVICE_CUDA) {
            const size_t need = cuda_layout(L, &src);
            if (need > slot_stride) {
                slot_stride = need;
            }
        }
        if ((status = spice_store_bind(store, il, &src)) != SPICE_OK) {
            spice_store_free(store);
            return status;
        }
    }
    if (params->device_kind == SPICE_DEVICE_CUDA) {
        status = spice_store_attach_cuda(store, slot_stride, rt->last_error, sizeof(rt->last_error));
        if (status != SPICE_OK) {
            spice_store_free(store);
            return status;
        }
        const char * no_pin = getenv("SPICE_CUDA_NO_PIN"); /* diagnosis: copies from pageable memory */
        rt->unpinned_bytes = no_pin != NULL && no_pin[0] == '1' ? 0 : pin_host_weights(rt, store);
        if (rt->unpinned_bytes > 0) {
            fprintf(stderr, "libspice: %llu bytes of expert weights could not be page-locked; "
                            "copies from them are slower (pageable)\n", (unsigned long long) rt->unpinned_bytes);
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
