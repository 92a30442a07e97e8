/* The runtime's loaded LoRE surrogates (the spice_runtime_*surrogate* part of
 * the C API): one table per runtime, its bytes charged to the device tier's
 * budget while one is attached. The executor itself is spice-surrogate.c.
 * Loading one changes what the hook asks llama.cpp for, so this file calls
 * the hook's (spice-runtime-core.h); the hook reads the table, never calls here. */
#include "spice-runtime-core.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the runtime's surrogates ---------------------------------------------------- */

static const spice_surrogate * spice_runtime_surrogate(const spice_runtime * rt, int32_t il, int32_t e) {
    const spice_surrogate_table * tab = &rt->surrogates;
    if (tab->entries == NULL || il < 0 || il >= tab->n_layers || e < 0 || e >= tab->max_expert) {
        return NULL;
    }
    const spice_surrogate * s = &tab->entries[(size_t) il * (size_t) tab->max_expert + (size_t) e];
    return s->loaded ? s : NULL;
}

int spice_runtime_set_surrogate(spice_runtime * rt, int32_t il, int32_t e, float alpha, int32_t rank,
                                const float * a, const float * b) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (il < 0 || il >= rt->n_layers || !rt->layers[il].is_moe) {
        snprintf(rt->last_error, sizeof(rt->last_error), "surrogate for layer %d: not an MoE layer of this model", il);
        return SPICE_ERR_INVALID_ARG;
    }
    const spice_expert_layer * L = &rt->layers[il];
    if (e < 0 || e >= L->n_expert || rank < 0 || (rank > 0 && (a == NULL || b == NULL))) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "surrogate for layer %d expert %d rank %d: the layer has %d experts; rank must be >= 0 "
                 "with A and B given when > 0", il, e, rank, L->n_expert);
        return SPICE_ERR_INVALID_ARG;
    }
    spice_surrogate_table * tab = &rt->surrogates;
    if (tab->entries == NULL) {
        const size_t n = (size_t) rt->n_layers * (size_t) rt->max_n_expert;
        tab->entries = (spice_surrogate *) calloc(n > 0 ? n : 1, sizeof(spice_surrogate));
        if (tab->entries == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        tab->n_layers = rt->n_layers;
        tab->max_expert = rt->max_n_expert;
    }
    spice_surrogate * slot = &tab->entries[(size_t) il * (size_t) tab->max_expert + (size_t) e];
    const uint64_t old_bytes = slot->loaded ? spice_surrogate_bytes_of(slot->rank, L->n_embd) : 0;
    const uint64_t new_bytes = spice_surrogate_bytes_of(rank, L->n_embd);

    spice_surrogate fresh;
    int status = spice_surrogate_init(&fresh, L->n_embd, rank, alpha, a, b);
    if (status != SPICE_OK) {
        return status;
    }
    if (rt->store != NULL && new_bytes != old_bytes) {
        const int64_t delta = (int64_t) new_bytes - (int64_t) old_bytes;
        if (spice_store_reserve(rt->store, delta) != SPICE_OK) {
            spice_surrogate_release(&fresh);
            const uint64_t budget = spice_store_budget_bytes(rt->store);
            snprintf(rt->last_error, sizeof(rt->last_error),
                     "surrogate for layer %d expert %d needs %" PRIu64 " more device bytes; the budget of %" PRIu64
                     " has %" PRIu64 " free (surrogates hold %" PRIu64 ")", il, e, (uint64_t) delta, budget,
                     budget - spice_store_used_bytes(rt->store), tab->bytes);
            return SPICE_ERR_BUDGET;
        }
    }
    if (slot->loaded) {
        spice_surrogate_release(slot);
        tab->n_loaded--;
    }
    *slot = fresh;
    rt->surrogate_mask[(size_t) il * (size_t) rt->max_n_expert + (size_t) e] = 1;
    tab->n_loaded++;
    tab->bytes = tab->bytes - old_bytes + new_bytes;
    spice_runtime_update_hook(rt); /* surrogates read the shared-expert output */
    return SPICE_OK;
}

int spice_runtime_clear_surrogates(spice_runtime * rt) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_surrogate_table * tab = &rt->surrogates;
    if (rt->store != NULL && tab->bytes > 0) {
        spice_store_reserve(rt->store, -(int64_t) tab->bytes);
    }
    spice_surrogate_table_free(tab);
    if (rt->surrogate_mask != NULL) {
        memset(rt->surrogate_mask, 0, (size_t) rt->n_layers * (size_t) rt->max_n_expert);
    }
    spice_runtime_update_hook(rt);
    return SPICE_OK;
}

uint64_t spice_runtime_surrogate_bytes(const spice_runtime * rt) {
    return rt ? rt->surrogates.bytes : 0;
}

int32_t spice_runtime_n_surrogates(const spice_runtime * rt) {
    return rt ? rt->surrogates.n_loaded : 0;
}

int spice_runtime_has_surrogate(const spice_runtime * rt, int32_t il, int32_t e) {
    return rt != NULL && spice_runtime_surrogate(rt, il, e) != NULL;
}
