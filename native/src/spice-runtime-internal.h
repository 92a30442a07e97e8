/* The runtime handle's layout: data only, shared by the runtime's source
 * files. Which file calls which goes one way, from the features to the hook:
 *   spice-runtime.c            the hook and the handle's lifetime (its
 *                              functions for the others: spice-runtime-core.h)
 *   spice-runtime-async.c      asynchronous planning; calls the hook's file,
 *                              which reaches it only through rt->async
 *   spice-runtime-surrogates.c the loaded surrogates; calls the hook's file
 *   spice-runtime-store.c      the device tier
 *   spice-runtime-host-read.c  host reads on a disk tier (its header: the
 *                              hook's file and the tier's call it)
 *   spice-runtime-replay.c     routing replay (its header: the hook calls it)
 * It declares no functions: what a file calls shows in the headers it
 * includes besides this one. */
#ifndef SPICE_RUNTIME_INTERNAL_H
#define SPICE_RUNTIME_INTERNAL_H

#include "spice.h"
#include "spice-barrier.h"
#include "spice-cuda-verify.h"
#include "spice-experts.h"
#include "spice-hook-call.h"
#include "spice-host-exec.h"
#include "spice-log-filter.h"
#include "spice-planner.h"
#include "spice-slot-copies.h"
#include "spice-store.h"
#include "spice-surrogate.h"

#include <stdatomic.h>
#include <stdint.h>

struct llama_model;
struct llama_moe_hook_call;

/* Routing replay (spice_runtime_set_routing_replay): recorded expert ids the
 * hook uses instead of the router's. Zeroed (ids NULL) means off; the ids are
 * the caller's, so nothing here is freed. */
typedef struct spice_routing_replay {
    const int32_t * ids; /* [n_tokens][n_layers][n_used], borrowed */
    int64_t n_tokens;
    int32_t n_layers;
    int32_t n_used;
    int64_t base;        /* trace token of the current micro-batch's first row */
    int32_t batch_rows;  /* rows of the current micro-batch's first MoE layer (0: none yet) */
    int32_t last_il;     /* layer of the previous hooked call; -1: a micro-batch begins next */
} spice_routing_replay;

/* Plan buffers handed to a policy; grown by thread 0 as calls need. */
typedef struct spice_plan_buffers {
    int32_t * actions;  int32_t cap_actions;
    int32_t * fetch;    int32_t cap_fetch;
    int32_t * prefetch; int32_t cap_prefetch;
    int32_t * evict;    int32_t cap_evict;
    int32_t * evict_from; int32_t cap_evict_from;
    uint8_t * exec;       /* [cap_actions] executor's view of the actions */
    uint8_t * hit;        /* [cap_actions] expert resident when the call began */
    const char ** device; /* [max_n_expert] slot memory per expert the device tier runs */
    int32_t * slot;       /* [max_n_expert] its slot (-1: none), for a device that computes */
    int32_t * wait;       /* [max_n_expert] experts whose copies the launch waits for */
    int32_t n_wait;
} spice_plan_buffers;

/* Asynchronous planning's steps in a hook call, set by spice_runtime_enable_async
 * (spice-runtime-async.c) while its planner runs, NULL otherwise. A table,
 * not calls by name, so that the hook's file does not depend on the planner's:
 * the dependency runs from asynchronous planning to the hook only.
 *   before  collect the plans due (validated; their lists kept for merge,
 *           their resume_il taken when still ahead), then, unless the policy
 *           answered this call in advance, take a planner entry for the
 *           call's snapshot, which post fills once the call's plan is
 *           applied; 1 when the call is quiet (resume_il), else 0
 *   merge   append the collected plans' lists to the call's plan (after the rule's)
 *   post    after the call's plan is applied, before its experts run: post its
 *           snapshot, with the residency as it now stands -- the copies and
 *           evictions this call just made included, so the planner neither
 *           asks for them again nor plans around room already taken -- and
 *           the actions as carried out
 *   settle  thread 0, before the call returns: the posted snapshot's hidden
 *           rows, which the post only lent (spice-planner.h), copied by now;
 *           counted as deciding time (and posting); the nanoseconds it took,
 *           0 when nothing was posted
 *   stop    stop the planner thread, dropping what it has not applied, and
 *           clear rt->async */
typedef struct spice_runtime_async_ops {
    int (*before)(spice_runtime * rt, spice_policy_call * call);
    void (*merge)(spice_runtime * rt, spice_policy_call * call);
    void (*post)(spice_runtime * rt, const spice_policy_call * call);
    uint64_t (*settle)(spice_runtime * rt);
    void (*stop)(spice_runtime * rt);
} spice_runtime_async_ops;

struct spice_runtime {
    struct llama_context * lctx;
    const struct llama_model * model;
    int32_t n_layers;
    spice_expert_layer * layers;
    int32_t max_n_expert;
    int32_t * n_expert_of;     /* [n_layers]: routed experts, 0 for a dense layer (plan limits) */
    uint8_t * surrogate_mask;  /* [n_layers * max_n_expert]: 1 where a surrogate is loaded */

    int enabled;
    uint32_t hook_flags;            /* SPICE_HOOK_WANT_* the registration asked for */
    uint32_t hook_flags_registered; /* and what the hook asks llama.cpp for (surrogates add SHEXP) */
    int32_t hook_max_tokens;
    spice_hook_ids hook_ids;   /* the call in progress's ids as int32 (thread 0 converts them) */
    spice_policy_fn policy_fn; /* NULL: built-in exact policy */
    void * policy_user_data;
    int32_t resume_il; /* -1, or the layer whose decode call next calls the policy (spice_policy_call) */

    spice_store * store;       /* device tier; NULL: none (every expert counts as resident) */
    spice_slot_copies slot_copies; /* the experts as low-precision slots hold them (precision 0: none) */
    /* bytes of slot copies made or read so far, of copies_total, while set_store or
     * slot_copies_load fills them (then the last fill's): read by another thread
     * (spice_runtime_slot_copies_progress) */
    _Atomic uint64_t copies_done;
    _Atomic uint64_t copies_total;

    spice_barrier barrier;
    spice_host_exec host;
    spice_plan_buffers plan;

    spice_surrogate_table surrogates; /* loaded LoRE surrogates (host f16 copies, charged to the budget) */
    spice_surrogate_exec surrogate_exec;

    spice_counters * counters; /* [n_layers], written by thread 0 only */
    uint64_t hook_end_ns;      /* when thread 0 left the last hook call (0: none yet) */
    uint64_t clock_step_ns;    /* > 0: the tier's clock is virtual and moves this much per token of a hook call */
    int32_t hook_end_il;       /* and its layer */
    atomic_int abort_requested;
    uint64_t plan_rejections;
    char last_error[512];
    int32_t call_il;           /* layer of the hook call in progress (thread 0) */
    int device_work_pending;   /* this call's device rows are still to be collected */
    int device_launch_due;     /* thread 0 launches this call's device work after the first barrier */
    int call_computes;         /* the device runs this call's device pairs (plan_call decides, once) */
    const uint8_t * device_run; /* and the pairs it runs (plan.exec, or verify mode's copy) */
    float * device_y;          /* verify mode: where the device's rows go instead of the host's */
    uint64_t unpinned_bytes;   /* CUDA: expert weight bytes that could not be page-locked */
    spice_cuda_verify * verify; /* SPICE_CUDA_VERIFY=1 only */
    atomic_int failed;         /* the runtime stopped the decode itself (spice_runtime_failed) */
    int32_t exec_fault_after;  /* the tier's spice_store_params.exec_fault_after (tests) */
    int64_t n_launches, n_collects; /* device launches and collects on this tier, for that hook */
    struct {                   /* a tier without host weights in memory (spice-runtime-host-read.c) */
        uint8_t * wanted;      /* [max_n_expert] */
        int32_t * experts;     /* [max_n_expert] read for this call */
        spice_device_copy * copies; /* [max_n_expert] */
        char ** dst;           /* [max_n_expert] */
        char * buf;            /* the call's scratch */
        size_t cap;
        uint64_t bytes_seen, reads_seen; /* the tier's read totals already booked */
    } host_read;

    /* asynchronous planning (spice_runtime_enable_async); the hook's thread only */
    const spice_runtime_async_ops * async; /* NULL: planning is synchronous */
    spice_planner planner;
    uint64_t call_seq;   /* served hook calls since the policy was enabled (the first is 1) */
    uint64_t * layer_seq; /* [n_layers]: call_seq of each layer's latest call */
    spice_plan_buffers async_lists; /* prefetch, evict, evict_from of the plans collected at this call */
    int32_t n_async_prefetch, n_async_evict, n_async_evict_from;
    spice_async_entry * async_post; /* the entry this call's snapshot goes into once its plan is
                                       applied (spice_async_post), or NULL */
    uint64_t async_post_seq;
    const void * plan_rule;   /* the last rule a plan installed (its address), or NULL */

    spice_routing_replay replay; /* routing replay; ids NULL: the router's ids */
    spice_log_filter * log_filter; /* llama.cpp's log without debug lines once a hook was enabled or
                                      disabled (NULL: not yet) */
    int keep_debug_log;            /* spice_runtime_keep_debug_log */
};

/* Layer il's experts as the device tier's slots hold them: the low-precision
 * copies where the tier has them, else the model's own. */
static inline const spice_expert_layer * spice_runtime_slot_layer(const spice_runtime * rt, int32_t il) {
    return rt->slot_copies.precision != 0 ? &rt->slot_copies.layers[il] : &rt->layers[il];
}

#endif /* SPICE_RUNTIME_INTERNAL_H */
