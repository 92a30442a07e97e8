/* Validation of a policy's plan before anything acts on it. A plan comes
 * from Python and may be wrong in any way: every field is checked and the
 * first problem is named, so the policy's author can fix it. Only spice.h's
 * types: the planner thread and the fuzz harness check plans with no runtime
 * (spice-runtime.c gives the limits of its own). */
#include "spice.h"

#include <stdio.h>

static int is_moe(const spice_plan_limits * lim, int32_t il) {
    return il >= 0 && il < lim->n_layers && lim->n_expert[il] > 0;
}

static int check_pairs(const spice_plan_limits * lim, const char * what, const int32_t * pairs, int32_t n,
                       int32_t cap, char * err, size_t err_len) {
    if (n < 0 || n > cap) {
        snprintf(err, err_len, "plan %s has %d entries; at most %d fit", what, n, cap);
        return SPICE_ERR_INVALID_PLAN;
    }
    if (n % 2 != 0) {
        snprintf(err, err_len, "plan %s must be (layer, expert) pairs, got an odd count %d", what, n);
        return SPICE_ERR_INVALID_PLAN;
    }
    for (int32_t i = 0; i < n; i += 2) {
        const int32_t il = pairs[i], e = pairs[i + 1];
        if (!is_moe(lim, il)) {
            snprintf(err, err_len, "plan %s[%d] names layer %d, which is not an MoE layer", what, i / 2, il);
            return SPICE_ERR_INVALID_PLAN;
        }
        if (e < 0 || e >= lim->n_expert[il]) {
            snprintf(err, err_len, "plan %s[%d] names expert %d of layer %d, which has %d experts", what, i / 2,
                     e, il, lim->n_expert[il]);
            return SPICE_ERR_INVALID_PLAN;
        }
    }
    return SPICE_OK;
}

int spice_plan_check(const spice_plan_limits * lim, const spice_policy_call * call, char * err, size_t err_len) {
    if (lim == NULL || call == NULL || lim->n_expert == NULL) {
        snprintf(err, err_len, "plan check: no limits or no call given");
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t want = call->n_tokens * call->n_expert_used;
    if (call->n_actions != want) {
        snprintf(err, err_len,
                 "layer %d: plan has %d actions; it needs one per (token, selected expert): %d x %d = %d",
                 call->il, call->n_actions, call->n_tokens, call->n_expert_used, want);
        return SPICE_ERR_INVALID_PLAN;
    }
    for (int32_t i = 0; i < want; ++i) {
        const int32_t a = call->actions[i];
        if (a < 0 || a >= SPICE_ACTION_COUNT_) {
            snprintf(err, err_len,
                     "layer %d: plan action %d (token %d, slot %d) is %d, not a known action "
                     "(0 device, 1 host, 2 surrogate, 3 drop)",
                     call->il, i, i / call->n_expert_used, i % call->n_expert_used, a);
            return SPICE_ERR_INVALID_PLAN;
        }
        if (a == SPICE_ACTION_SURROGATE) {
            const int32_t t = i / call->n_expert_used, k = i % call->n_expert_used;
            const int32_t e = ((const int32_t *) ((const char *) call->ids + (size_t) t * call->ids_nb1))[k];
            if (lim->has_surrogate == NULL) {
                snprintf(err, err_len,
                         "layer %d: plan action %d asks for a surrogate, but no surrogates are loaded "
                         "(calibrate the model and pass its sidecar)", call->il, i);
                return SPICE_ERR_INVALID_PLAN;
            }
            if (!is_moe(lim, call->il) || e < 0 || e >= lim->n_expert[call->il] ||
                !lim->has_surrogate[(size_t) call->il * (size_t) lim->max_expert + (size_t) e]) {
                snprintf(err, err_len,
                         "layer %d: plan action %d (token %d, slot %d) asks for the surrogate of expert %d, "
                         "which the loaded sidecar does not have", call->il, i, t, k, e);
                return SPICE_ERR_INVALID_PLAN;
            }
        }
    }
    if (call->n_fetch < 0 || call->n_fetch > call->cap_fetch) {
        snprintf(err, err_len, "layer %d: plan fetch list has %d entries; at most %d fit", call->il,
                 call->n_fetch, call->cap_fetch);
        return SPICE_ERR_INVALID_PLAN;
    }
    for (int32_t i = 0; i < call->n_fetch; ++i) {
        if (call->fetch[i] < 0 || !is_moe(lim, call->il) || call->fetch[i] >= lim->n_expert[call->il]) {
            snprintf(err, err_len, "layer %d: plan fetch[%d] = %d is not an expert id (0..%d)", call->il, i,
                     call->fetch[i], is_moe(lim, call->il) ? lim->n_expert[call->il] - 1 : -1);
            return SPICE_ERR_INVALID_PLAN;
        }
    }
    if (call->n_evict_from < 0 || call->n_evict_from > call->cap_evict_from) {
        snprintf(err, err_len, "layer %d: plan evict_from has %d entries; at most %d fit", call->il,
                 call->n_evict_from, call->cap_evict_from);
        return SPICE_ERR_INVALID_PLAN;
    }
    for (int32_t i = 0; i < call->n_evict_from; ++i) {
        const int32_t il = call->evict_from[i];
        if (!is_moe(lim, il)) {
            snprintf(err, err_len, "layer %d: plan evict_from[%d] names layer %d, which is not an MoE layer",
                     call->il, i, il);
            return SPICE_ERR_INVALID_PLAN;
        }
    }
    if (call->resume_il != -1 && !is_moe(lim, call->resume_il)) {
        snprintf(err, err_len, "layer %d: plan resume_il = %d is neither -1 nor an MoE layer", call->il,
                 call->resume_il);
        return SPICE_ERR_INVALID_PLAN;
    }
    int status = check_pairs(lim, "prefetch", call->prefetch, call->n_prefetch, call->cap_prefetch, err, err_len);
    if (status != SPICE_OK) {
        return status;
    }
    return check_pairs(lim, "evict", call->evict, call->n_evict, call->cap_evict, err, err_len);
}
