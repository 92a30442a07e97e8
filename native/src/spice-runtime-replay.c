/* Routing replay (the spice_runtime_*routing_replay* part of the C API): the
 * hook uses the expert ids of a recorded trace instead of the router's, so
 * timing runs on random-weight models see real locality. The hook's snapshot
 * step calls spice_runtime_replay_routing first, before the policy, the store,
 * the executors or the counters read the ids; the gate weights stay the
 * router's. */
#include "spice-runtime-replay.h"

#include "llama.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static const int32_t * replay_row(const spice_routing_replay * r, int64_t t, int32_t il) {
    return r->ids + ((size_t) t * (size_t) r->n_layers + (size_t) il) * (size_t) r->n_used;
}

/* Every MoE layer's row names distinct experts of that layer; the first
 * problem goes to last_error. */
static int check_rows(spice_runtime * rt, const spice_routing_replay * r) {
    for (int64_t t = 0; t < r->n_tokens; ++t) {
        for (int32_t il = 0; il < r->n_layers; ++il) {
            if (!rt->layers[il].is_moe) {
                continue;
            }
            const int32_t n_expert = rt->layers[il].n_expert;
            const int32_t * row = replay_row(r, t, il);
            for (int32_t k = 0; k < r->n_used; ++k) {
                int repeated = 0;
                for (int32_t j = 0; j < k; ++j) {
                    repeated |= row[j] == row[k];
                }
                if (row[k] < 0 || row[k] >= n_expert || repeated) {
                    snprintf(rt->last_error, sizeof(rt->last_error),
                             "routing replay: token %" PRId64 " layer %d names expert %d %s", t, il, row[k],
                             repeated ? "twice" : "outside the layer's experts");
                    return SPICE_ERR_INVALID_ARG;
                }
            }
        }
    }
    return SPICE_OK;
}

int spice_runtime_set_routing_replay(spice_runtime * rt, const int32_t * ids, int64_t n_tokens, int32_t n_layers,
                                     int32_t n_used) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (ids == NULL) {
        memset(&rt->replay, 0, sizeof(rt->replay));
        return SPICE_OK;
    }
    if (n_tokens < 1 || n_used < 1 || n_layers != rt->n_layers) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "routing replay: %" PRId64 " tokens of %d layers x %d experts given; needs at least one "
                 "token and one expert, for the model's %d layers",
                 n_tokens, n_layers, n_used, rt->n_layers);
        return SPICE_ERR_INVALID_ARG;
    }
    spice_routing_replay r = { 0 };
    r.ids = ids;
    r.n_tokens = n_tokens;
    r.n_layers = n_layers;
    r.n_used = n_used;
    r.last_il = -1;
    const int status = check_rows(rt, &r);
    if (status == SPICE_OK) {
        rt->replay = r;
    }
    return status;
}

int64_t spice_runtime_routing_replay_position(const spice_runtime * rt) {
    if (rt == NULL || rt->replay.ids == NULL) {
        return -1;
    }
    return (rt->replay.base + rt->replay.batch_rows) % rt->replay.n_tokens;
}

int spice_runtime_seek_routing_replay(spice_runtime * rt, int64_t token) {
    if (rt == NULL || token < 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (rt->replay.ids == NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error), "routing replay: none is set");
        return SPICE_ERR_STATE;
    }
    rt->replay.base = token % rt->replay.n_tokens;
    rt->replay.batch_rows = 0;
    rt->replay.last_il = -1;
    return SPICE_OK;
}

void spice_runtime_replay_routing(spice_runtime * rt, const spice_hook_call * hc) {
    spice_routing_replay * r = &rt->replay;
    if (r->ids == NULL || hc->n_expert_used > r->n_used || hc->n_tokens < 1) {
        return;
    }
    if (r->last_il < 0 || hc->il <= r->last_il) { /* a new micro-batch: the last one's rows are used up */
        r->base = (r->base + r->batch_rows) % r->n_tokens;
        r->batch_rows = hc->n_tokens;
    }
    r->last_il = hc->il;
    /* fewer rows than the micro-batch has: its last ones (those whose logits are wanted) */
    const int64_t first = r->base + (hc->n_tokens < r->batch_rows ? r->batch_rows - hc->n_tokens : 0);
    /* the ids are the runtime's own int32 copy of the graph's top-k (spice-hook-call.c), which
     * everything after the snapshot reads */
    char * rows = (char *) (uintptr_t) hc->ids;
    for (int32_t t = 0; t < hc->n_tokens; ++t) {
        const int32_t * rec = replay_row(r, (first + t) % r->n_tokens, hc->il);
        memcpy(rows + (size_t) t * hc->ids_nb1, rec, (size_t) hc->n_expert_used * sizeof(int32_t));
    }
}
