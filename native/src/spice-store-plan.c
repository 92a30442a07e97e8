/* The store's one entry point for a hook call's plan, and the call's
 * snapshot (residency as the call begins, and recency). Policies decide;
 * this applies what they decided, in a fixed order that a plan's author can
 * rely on (and that the simulator's twin, pyspice.sim.plan, follows):
 *
 *   1. pin the experts this call runs on the device that the tier holds,
 *      so the plan's own evictions cannot take them away;
 *   2. the plan's evictions (refused ones -- pinned, on the bus -- are not
 *      errors);
 *   3. its demand fetches, then the demand implied by device actions on
 *      absent experts (pinned when they get a slot);
 *   4. its prefetches, in order, queued behind the demand copies so they use
 *      the bus while the call waits; with evict_from each may take room from
 *      the layers listed before its own (see spice_policy_call);
 *   5. wait for the pinned device experts, in expert order;
 *   6. device actions of experts that got no slot become host actions;
 *   7. unpin. */
#include "spice-store-impl.h"

#include <string.h>

int spice_store_begin_call(spice_store * s, int32_t il, int32_t n_tokens, int32_t n_used, const int32_t * ids,
                           size_t ids_nb1, uint8_t * hit) {
    if (s == NULL || il < 0 || il >= s->n_layers || n_tokens < 0 || n_used < 0 || (n_tokens > 0 && ids == NULL)) {
        return SPICE_ERR_INVALID_ARG;
    }
    s->call_il = il;
    const int status = spice_store_poll(s);
    uint64_t * last_use = s->last_use + spice_store_cell(s, il, 0);
    const uint64_t clock = ++s->use_clock;
    for (int32_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + (size_t) t * ids_nb1);
        for (int32_t k = 0; k < n_used; ++k) {
            const int32_t e = row[k];
            const int ok = e >= 0 && e < s->n_expert[il];
            if (hit != NULL) {
                hit[t * n_used + k] = ok && s->states[spice_store_cell(s, il, e)] == SPICE_RES_RESIDENT;
            }
            if (ok) {
                last_use[e] = clock;
            }
        }
    }
    s->layer_changed[il] = 1; /* the rule's cached oldest there may be stamped newest now */
    return status;
}

/* evict_from: evicts the least recently selected resident expert of the first
 * listed layer, from *next on and before position `limit`, that is neither
 * pinned (e.g. running on the device in this call) nor kept by the plan; *next
 * skips the layers found empty (they stay so for the rest of the call). 0 when
 * none is left. */
static int evict_least_recent(spice_store * s, const spice_policy_call * call, int32_t * next, int32_t limit) {
    for (; *next < limit; ++*next) {
        const int32_t il = call->evict_from[*next];
        const uint64_t * last_use = s->last_use + spice_store_cell(s, il, 0);
        const uint8_t * kept = s->scratch.kept + spice_store_cell(s, il, 0);
        const int8_t * state = s->states + spice_store_cell(s, il, 0);
        int32_t victim = -1;
        const int32_t * slot_of = s->slot_of + spice_store_cell(s, il, 0);
        for (int32_t e = 0; e < s->n_expert[il]; ++e) {
            if ((victim < 0 || last_use[e] < last_use[victim]) && !kept[e] && state[e] == SPICE_RES_RESIDENT &&
                s->slots[slot_of[e]].pins == 0) {
                victim = e;
            }
        }
        if (victim >= 0 && spice_store_evict(s, il, victim) == SPICE_OK) {
            return 1; /* the layer may hold more: *next stays */
        }
        /* none left here (a resident, unpinned expert is never refused) */
    }
    return 0;
}

static void request_prefetches(spice_store * s, const spice_policy_call * call) {
    spice_store_scratch * p = &s->scratch;
    const int room = call->n_evict_from > 0;
    if (room) {
        for (int32_t il = 0; il < s->n_layers; ++il) {
            p->rank[il] = call->n_evict_from;
        }
        for (int32_t i = call->n_evict_from - 1; i >= 0; --i) {
            p->rank[call->evict_from[i]] = i; /* a layer listed twice counts where first listed */
        }
        for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
            p->kept[spice_store_cell(s, call->prefetch[i], call->prefetch[i + 1])] = 1;
        }
    }
    int32_t next_from = 0;
    for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
        const int32_t il = call->prefetch[i], e = call->prefetch[i + 1];
        int status = spice_store_request(s, il, e, SPICE_PRIORITY_PREFETCH);
        if (!room) {
            continue; /* refused requests are not errors: the expert stays on the host */
        }
        const int32_t limit = p->rank[il] < call->n_evict_from ? p->rank[il] : call->n_evict_from;
        while (status == SPICE_ERR_BUDGET && evict_least_recent(s, call, &next_from, limit)) {
            status = spice_store_request(s, il, e, SPICE_PRIORITY_PREFETCH);
        }
        if (status == SPICE_ERR_BUDGET) {
            break; /* no room for it, nor for the prefetches after it */
        }
    }
    if (room) {
        for (int32_t i = 0; i + 1 < call->n_prefetch; i += 2) {
            p->kept[spice_store_cell(s, call->prefetch[i], call->prefetch[i + 1])] = 0;
        }
    }
}

static const int32_t * ids_row(const spice_policy_call * call, int32_t t) {
    return (const int32_t *) ((const char *) call->ids + (size_t) t * call->ids_nb1);
}

static int apply_plan(spice_store * s, const spice_policy_call * call, const char ** slot_data, int wait) {
    if (s == NULL || call == NULL || call->il < 0 || call->il >= s->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t il = call->il;
    const int32_t n_e = s->n_expert[il];
    const int32_t n_used = call->n_expert_used;
    spice_store_scratch * p = &s->scratch;
    memset(p->need, 0, (size_t) n_e);
    memset(p->pinned, 0, (size_t) n_e);
    if (slot_data != NULL) {
        memset((void *) slot_data, 0, (size_t) n_e * sizeof(const char *));
    }
    for (int32_t t = 0; t < call->n_tokens; ++t) {
        const int32_t * ids = ids_row(call, t);
        for (int32_t k = 0; k < n_used; ++k) {
            if (call->actions[t * n_used + k] == SPICE_ACTION_DEVICE && ids[k] >= 0 && ids[k] < n_e) {
                p->need[ids[k]] = 1;
            }
        }
    }
    for (int32_t e = 0; e < n_e; ++e) { /* 1 */
        if (p->need[e] && s->states[spice_store_cell(s, il, e)] != SPICE_RES_ABSENT &&
            spice_store_pin(s, il, e) == SPICE_OK) {
            p->pinned[e] = 1;
        }
    }
    for (int32_t i = 0; i + 1 < call->n_evict; i += 2) { /* 2 */
        spice_store_evict(s, call->evict[i], call->evict[i + 1]);
    }
    for (int32_t i = 0; i < call->n_fetch; ++i) { /* 3 */
        spice_store_request(s, il, call->fetch[i], SPICE_PRIORITY_DEMAND);
    }
    for (int32_t e = 0; e < n_e; ++e) {
        if (p->need[e] && !p->pinned[e] && spice_store_request(s, il, e, SPICE_PRIORITY_DEMAND) == SPICE_OK &&
            spice_store_pin(s, il, e) == SPICE_OK) {
            p->pinned[e] = 1;
        }
    }
    request_prefetches(s, call); /* 4 */
    for (int32_t e = 0; e < n_e; ++e) { /* 5 */
        if (!p->need[e]) {
            continue;
        }
        if (!p->pinned[e] || (wait && spice_store_wait(s, il, e, NULL) != SPICE_OK)) {
            p->need[e] = 0; /* no slot for it: its activations run on the host */
        } else if (slot_data != NULL && wait) {
            slot_data[e] = spice_store_slot_data(s, il, e);
        }
    }
    for (int32_t t = 0; t < call->n_tokens; ++t) { /* 6 */
        const int32_t * ids = ids_row(call, t);
        for (int32_t k = 0; k < n_used; ++k) {
            int32_t * a = &call->actions[t * n_used + k];
            if (*a == SPICE_ACTION_DEVICE && !(ids[k] >= 0 && ids[k] < n_e && p->need[ids[k]])) {
                *a = SPICE_ACTION_HOST;
            }
        }
    }
    for (int32_t e = 0; e < n_e; ++e) { /* 7 */
        if (p->pinned[e]) {
            spice_store_unpin(s, il, e);
        }
    }
    return SPICE_OK;
}

int spice_store_apply_plan(spice_store * s, const spice_policy_call * call, const char ** slot_data) {
    return apply_plan(s, call, slot_data, 1);
}

int spice_store_apply_plan_nowait(spice_store * s, const spice_policy_call * call) {
    return apply_plan(s, call, NULL, 0);
}
