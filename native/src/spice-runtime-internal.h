/* The runtime handle's layout, shared by the runtime's source files. */
#ifndef SPICE_RUNTIME_INTERNAL_H
#define SPICE_RUNTIME_INTERNAL_H

#include "spice.h"
#include "spice-barrier.h"
#include "spice-experts.h"
#include "spice-host-exec.h"
#include "spice-store.h"
#include "spice-surrogate.h"

#include <stdatomic.h>
#include <stdint.h>

struct llama_model;
struct llama_moe_hook_call;

/* Plan buffers handed to a policy; grown by thread 0 as calls need. */
typedef struct spice_plan_buffers {
    int32_t * actions;  int32_t cap_actions;
    int32_t * fetch;    int32_t cap_fetch;
    int32_t * prefetch; int32_t cap_prefetch;
    int32_t * evict;    int32_t cap_evict;
    int32_t * evict_from; int32_t cap_evict_from;
    uint8_t * exec;     /* executor's view of the actions */
    uint8_t * hit;      /* [cap_actions] expert resident when the call began */
    const char ** device; /* [max_n_expert] slot memory per expert for the executor */
    uint8_t * need;     /* [max_n_expert] expert has a device action this call */
    uint8_t * pinned;   /* [max_n_expert] pinned during this call */
    uint8_t * kept;     /* [n_layers * max_n_expert] named in this call's prefetch list (evict_from) */
    int32_t * rank;     /* [n_layers] position in this call's evict_from (n_evict_from: not listed) */
} spice_plan_buffers;

struct spice_runtime {
    struct llama_context * lctx;
    const struct llama_model * model;
    int32_t n_layers;
    spice_expert_layer * layers;
    int32_t max_n_expert;

    int enabled;
    spice_policy_fn policy_fn; /* NULL: built-in exact policy */
    void * policy_user_data;
    int32_t resume_il; /* -1, or the layer whose decode call next calls the policy (spice_policy_call) */

    spice_store * store; /* device tier; NULL: none (every expert counts as resident) */

    spice_barrier barrier;
    spice_host_exec host;
    spice_plan_buffers plan;

    spice_surrogate_table surrogates; /* loaded LoRE surrogates (device-resident) */
    spice_surrogate_exec surrogate_exec;

    spice_counters * counters; /* [n_layers], written by thread 0 only */
    /* [n_layers * max_n_expert]: the hook call (use_clock) that last selected each
     * expert, for spice_policy_call.evict_from */
    uint64_t * last_use;
    uint64_t use_clock;
    atomic_int abort_requested;
    uint64_t plan_rejections;
    char last_error[512];
    int device_work_pending;  /* CUDA: this call's device rows are still to be collected */
    uint64_t unpinned_bytes; /* CUDA: expert weight bytes that could not be page-locked */
    /* SPICE_CUDA_VERIFY=1: device pairs also run on the host; the device's rows
     * are compared with the host's (which are the ones used) and the largest
     * difference is reported when the runtime is freed */
    int verify;
    uint8_t * verify_run;  size_t verify_run_cap;
    float * verify_y;      size_t verify_y_cap;
    double verify_max_diff, verify_max_abs;
    uint64_t verify_rows;  /* device rows compared so far */
};

/* Validates the plan the policy wrote into call against the runtime's
 * capabilities; on failure writes a message into err and returns
 * SPICE_ERR_INVALID_PLAN. */
int spice_plan_validate(const spice_runtime * rt, const spice_policy_call * call, char * err, size_t err_len);

/* Thread 0, after the plan is final: apply its evictions, demand copies
 * (explicit and those implied by device actions on absent experts) and
 * prefetches to the store, wait for the experts this call runs on the
 * device, and fill plan.device for the executor. An expert that cannot get a
 * slot runs on the host instead (its device actions become host actions). */
void spice_runtime_apply_store_plan(spice_runtime * rt, const struct llama_moe_hook_call * hc,
                                    spice_policy_call * call);

/* The surrogate of (il, e), or NULL when none is loaded. */
const spice_surrogate * spice_runtime_surrogate(const spice_runtime * rt, int32_t il, int32_t e);

#endif /* SPICE_RUNTIME_INTERNAL_H */
