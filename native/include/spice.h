/*
 * libspice: the native half of pyspice.
 *
 * Conventions: every function is spice_<object>_<verb>; objects are opaque
 * handles; every fallible function returns a spice_status (0 = success) and
 * never lets a C++ exception cross this boundary; there is no global state
 * (everything hangs off a handle the caller owns). Messages for the last
 * failure of a handle come from spice_runtime_last_error().
 *
 * Mechanism lives here, decisions live in Python: the runtime attaches to a
 * llama_context, receives every MoE layer's routed-expert work through the
 * patched llama.cpp hook (llama_set_moe_hook), asks a policy for a plan
 * (natively, or through a callback into Python), validates the plan and
 * executes it exactly: with ggml's CPU kernels on the GGUF weights, or on a
 * device tier's slots.
 */
#ifndef SPICE_H
#define SPICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SPICE_BUILD)
#define SPICE_API __attribute__((visibility("default")))
#else
#define SPICE_API
#endif

struct llama_context;

/* Status codes. Functions return these; spice_status_string() names them. */
typedef enum spice_status {
    SPICE_OK               = 0, /* success */
    SPICE_ERR_INVALID_ARG  = 1, /* a NULL handle, out-of-range index or bad size */
    SPICE_ERR_UNSUPPORTED  = 2, /* the model/tensor type/architecture is not handled */
    SPICE_ERR_NO_MEMORY    = 3, /* an allocation failed */
    SPICE_ERR_INCOMPATIBLE = 4, /* the model was loaded with settings the hook cannot use */
    SPICE_ERR_INVALID_PLAN = 5, /* a policy's plan failed validation */
    SPICE_ERR_BUDGET       = 6, /* the request does not fit the device byte budget */
    SPICE_ERR_STATE        = 7, /* the call is not valid in the object's current state */
    SPICE_ERR_INTERNAL     = 8  /* a bug in libspice; the message says where */
} spice_status;

/* Version of libspice ("MAJOR.MINOR.PATCH"). */
SPICE_API const char * spice_version_string(void);

/* Short English name of a status code; never NULL. */
SPICE_API const char * spice_status_string(int status);

/* The patch series (patches/series) the build applied to the libllama it
 * built libspice with and installed beside it, one patch file name per line. */
SPICE_API const char * spice_build_patch_series(void);

/* ---- plans ---------------------------------------------------------------
 *
 * What a policy decides for one hook call: an action per (token, selected
 * expert), and lists of experts to fetch now (demand), to prefetch and that
 * may be evicted. Python policies fill the buffers libspice hands them; the
 * plan is validated before use and an invalid plan falls back to exact
 * execution for that call.
 */
typedef enum spice_action {
    SPICE_ACTION_DEVICE    = 0, /* exact, expert resident in the device tier (all resident here) */
    SPICE_ACTION_HOST      = 1, /* exact, on the host weights */
    SPICE_ACTION_SURROGATE = 2, /* lossy: low-rank surrogate (needs a loaded surrogate) */
    SPICE_ACTION_DROP      = 3, /* lossy: contributes nothing (ablations, negative controls) */
    SPICE_ACTION_COUNT_    = 4
} spice_action;

/* One hook call as a policy sees it, plus the plan it fills.
 * Input arrays are row-major views valid only during the callback. */
typedef struct spice_policy_call {
    int32_t il;
    int32_t n_tokens;
    int32_t n_embd;
    int32_t n_expert;
    int32_t n_expert_used;

    const float   * inp;     size_t inp_nb1;     /* [n_tokens][n_embd] */
    const float   * probs;   size_t probs_nb1;   /* [n_tokens][n_expert], or NULL unless the hook was
                                                    registered with SPICE_HOOK_WANT_PROBS */
    const int32_t * ids;     size_t ids_nb1;     /* [n_tokens][n_expert_used] */
    const float   * weights; size_t weights_nb1; /* [n_tokens][n_expert_used] */
    const float   * shexp;   size_t shexp_nb1;   /* [n_tokens][n_embd], or NULL: not registered with
                                                    SPICE_HOOK_WANT_SHEXP (nor surrogates loaded), or
                                                    the architecture has no shared expert */
    /* the device tier's residency as the call began (spice_residency values,
     * n_layers rows of max_expert), or NULL without a tier: the store's live
     * table for a synchronous call, the snapshot's own copy for an
     * asynchronous one (see spice_runtime_enable_async) */
    const int8_t  * residency; int32_t res_layers; int32_t res_width;
    /* the next MoE layer's router logits on this call's input, computed in
     * llama.cpp's graph (SPICE_HOOK_WANT_NEXT_LOGITS): [n_tokens][n_expert_next]
     * for layer il_next, or NULL (il_next -1) */
    const float   * next_logits; size_t next_logits_nb1; int32_t il_next; int32_t n_expert_next;

    /* plan, written by the policy; n_* say how many entries it wrote */
    int32_t * actions;  int32_t n_actions;  int32_t cap_actions;  /* n_tokens*n_expert_used, row-major */
    int32_t * fetch;    int32_t n_fetch;    int32_t cap_fetch;    /* expert ids of this layer */
    int32_t * prefetch; int32_t n_prefetch; int32_t cap_prefetch; /* (layer, expert) pairs, flattened */
    int32_t * evict;    int32_t n_evict;    int32_t cap_evict;    /* (layer, expert) pairs, flattened */
    /* MoE layers a prefetch may take room from, most evictable first (needed
     * last). When a prefetch does not fit the budget (after the plan's
     * evictions), libspice evicts, from the first of the layers listed before
     * the prefetch's own layer that has one, the resident expert selected
     * least recently -- never a pinned one (those this call runs on the
     * device are) nor one named in this plan's prefetch list (a resident
     * expert listed there is kept, not copied) -- and tries again; a prefetch that still finds no room is
     * dropped with every prefetch after it (the policy lists them in order of
     * need). A prefetch of a layer not listed may take from any listed layer.
     * Empty: a prefetch only gets room that is free. */
    int32_t * evict_from; int32_t n_evict_from; int32_t cap_evict_from;
    /* -1 (set before each call): call the policy again at the next hook call.
     * An MoE layer: the policy has decided the calls until then in advance --
     * the following one-token (decode) calls take the default plan without
     * calling it, until the call of layer resume_il; a call of more tokens
     * always calls it. Lets a policy that plans every few layers skip the
     * calls in between, which would only return the default plan. */
    int32_t resume_il;
    /* NULL (set before each call): keep the installed rule. Else a new rule
     * (spice_rule, declared below; copied when the plan is applied) for the
     * calls the engine plans from then on -- the next ones when synchronous;
     * when asynchronous, from the call that applies this plan. A rule whose
     * address is the installed one's is not installed again (its state, e.g.
     * LAYER_LRU's re-split, carries on). */
    const struct spice_rule * rule;
} spice_policy_call;

/* Return values of a policy callback. */
#define SPICE_POLICY_OK     0 /* plan written */
#define SPICE_POLICY_FAILED 1 /* the policy raised: run exact, count a fallback */
#define SPICE_POLICY_ABORT  2 /* stop generation (Ctrl-C): run exact, then abort the graph */

typedef int (*spice_policy_fn)(spice_policy_call * call, void * user_data);

/* Event counters of one layer, or of the whole model (il = -1). */
typedef struct spice_counters {
    uint64_t hook_calls;
    uint64_t activations;
    uint64_t hits;
    uint64_t misses_fetched;
    uint64_t misses_host;
    uint64_t misses_surrogate;
    uint64_t dropped;
    uint64_t prefetch_issued;
    uint64_t prefetch_used;
    uint64_t prefetch_cancelled;
    uint64_t bytes_h2d;
    uint64_t copy_ns;
    uint64_t stall_ns;
    uint64_t policy_ns;
    uint64_t policy_calls;
    uint64_t policy_fallbacks;
    uint64_t store_ns;      /* thread 0's device-tier bookkeeping (residency, requests, waits minus stalls) */
    uint64_t policy_quiet;  /* hook calls the policy answered in advance (resume_il): not called */
    /* per-call costs of the mechanism (thread 0), and the device-interface
     * operations it made; a layer's are counted against the hook call that
     * made them */
    uint64_t hook_ns;         /* inside hook calls, entry to return (executors included) */
    uint64_t gap_ns;          /* from the end of one hook call to the start of the next in the same graph */
    uint64_t store_polls;     /* polls of the device tier: one per hook call with a tier */
    uint64_t device_copies;   /* copies handed to the device */
    uint64_t device_waits;    /* blocking waits on a copy */
    uint64_t device_launches; /* launches of device work (devices that compute) */
    uint64_t device_collects; /* collections of device results */
    uint64_t launch_ns;       /* time spent launching device work */
    uint64_t collect_ns;      /* time spent waiting for device results */
    /* a disk tier (SPICE_DEVICE_DISK): what was read from the file, by the
     * call during which it landed or was asked for */
    uint64_t disk_read_bytes; /* bytes read, widened to the file system's alignment */
    uint64_t disk_reads;      /* read requests (one per matrix of an expert) */
    uint64_t scratch_reads;   /* experts read for one call only (host actions on absent experts) */
    uint64_t scratch_ns;      /* time waiting for them */
    /* asynchronous planning (spice_runtime_enable_async): snapshots by the
     * layer of the call that posted them, plans by the layer of the call
     * that applied (or dropped) them */
    uint64_t async_posted;    /* snapshots handed to the planner thread */
    uint64_t async_skipped;   /* snapshots replaced by a newer one before the planner took them */
    uint64_t async_applied;   /* plans applied */
    uint64_t async_stale;     /* plans dropped: older than max_lag hook calls when they could be applied */
    uint64_t async_lag_calls; /* sum over applied plans of the hook calls from snapshot to application */
    uint64_t async_wait_ns;   /* time the hook waited for the planner (deterministic mode) */
    uint64_t planner_ns;      /* the planner thread's time in the policy for the plans collected */
    uint64_t exec_ns;         /* inside hook calls, thread 0 from the end of planning (and any device
                               * launch) to return: running the experts, surrogates included */
    uint64_t call_ns;         /* inside hook calls, thread 0's steps that every policy's calls take
                               * alike: reading the call, checking its ids, booking its outcomes,
                               * preparing the executors (not deciding, not the store) */
    uint64_t async_wakes;     /* snapshots whose post woke a parked planner thread (a futex wake
                               * on the hook's thread; see spice_async_params.idle_poll) */
    /* of policy_ns, where deciding went: the engine's rule planning calls, and
     * asynchronous planning's collecting plans and taking an entry, and posting snapshots */
    uint64_t rule_ns;
    uint64_t async_take_ns;
    uint64_t async_post_ns;
    uint64_t async_rows_by_hook; /* snapshots whose hidden rows the hook's thread copied itself: the
                                  * planner had not taken them by the time the call's experts ran */
} spice_counters;

/* Add each activation's outcome (docs/design.md section 11) to c: n actions with,
 * per activation, whether its expert was resident as the call began. A
 * device or host action is a hit when resident, else a fetched (device) or
 * host miss; surrogate and drop actions are never hits. */
SPICE_API void spice_counters_add_outcomes(spice_counters * c, const int32_t * actions, const uint8_t * hit,
                                           int32_t n);

/* What a plan is checked against: the model's layers (n_expert[il] routed
 * experts, 0 for a dense layer) and which (layer, expert) pairs have a loaded
 * surrogate (has_surrogate[il * max_expert + e]; NULL: none loaded). */
typedef struct spice_plan_limits {
    int32_t n_layers;
    const int32_t * n_expert;
    int32_t max_expert;
    const uint8_t * has_surrogate;
} spice_plan_limits;

/* Check the plan a policy wrote into call: action values, a loaded surrogate
 * for every surrogate action, ids and (layer, expert) pairs in range, list
 * counts within their capacities, evict_from and resume_il naming MoE
 * layers. SPICE_ERR_INVALID_PLAN with the first problem named in err. */
SPICE_API int spice_plan_check(const spice_plan_limits * limits, const spice_policy_call * call, char * err,
                               size_t err_len);

/* ---- the per-activation rule ------------------------------------------------
 *
 * What the engine decides by itself, with no policy call: every call of a
 * runtime with no policy callback, and the calls a policy decided in advance
 * (resume_il). A policy declares it once (spice_runtime_set_rule) and may
 * replace it at any call; the shipped baselines are nothing but a rule, so
 * they pay no Python per call. Per activation, in order:
 *   resident                      -> resident_action (device, or host)
 *   a surrogate in surrogate_set, gate weight below surrogate_weight
 *                                 -> surrogate (lossy rules only)
 *   in flight                     -> wait (device) when miss is FETCH, or when
 *                                    its copy lands sooner than host execution
 *                                    would take (COST, or HOST with host_us > 0)
 *   absent                        -> host (HOST), demand fetch (FETCH), or a
 *                                    fetch where that shortens the layer (COST)
 * The costs are weighed per expert of the call, for the n activations left
 * to it (a batch's tokens that picked it, less those substituted), host(n) being
 * the host's time per activation at n tokens (host points; host_us without
 * them): an in-flight copy is waited for when its remaining time + n x device
 * time beats n x host(n); COST fetches, of the absent misses, the most activations
 * first, as many as give the least layer time -- the bus copying them one after
 * another, the device running each as it lands, the host the rest meanwhile --
 * where that beats all-host by the margin. One copy is weighed against every
 * token of a batch that waits for it. Without overlap (the emulated device, whose
 * work is the host's time) every miss runs on the host.
 * Room for demand fetches comes from `keep` (for KEEP_DECAYED: each call of a
 * layer multiplies that layer's use counts by `decay`, then counts each expert
 * it selects once more; the lowest count goes first); a layer in whole_layers fetches
 * all its absent experts at its call (and runs them on the device); with
 * prefetch_next the next MoE layer's router, applied to this call's input,
 * names experts to prefetch (at the calls of next_layers; with next_room
 * taking room from the layers that run again last, as a policy's evict_from
 * would). The rule writes a plan like a policy's, which
 * the store then applies (spice_store_apply_plan). */
typedef enum spice_miss_rule {
    SPICE_MISS_HOST  = 0, /* a miss runs on the host */
    SPICE_MISS_FETCH = 1, /* a miss is fetched on demand and waited for */
    SPICE_MISS_COST  = 2  /* fetched (or waited for) when that beats the host by the cost table */
} spice_miss_rule;

typedef enum spice_keep_rule {
    SPICE_KEEP_ALL       = 0, /* nothing evicted: a fetch that does not fit runs on the host */
    SPICE_KEEP_LRU       = 1, /* one pooled cache: least recently selected out first */
    SPICE_KEEP_LAYER_LRU = 2, /* capacity[il] experts per layer, least recently selected out first */
    SPICE_KEEP_NONE      = 3, /* keep nothing between calls: each evicts what earlier calls brought in */
    SPICE_KEEP_DECAYED   = 4  /* one pooled cache: the lowest use count decayed by `decay` out first */
} spice_keep_rule;

typedef struct spice_rule spice_rule;
struct spice_rule {
    int32_t resident_action;       /* SPICE_ACTION_DEVICE (default) or SPICE_ACTION_HOST */
    int32_t miss;                  /* spice_miss_rule */
    int32_t keep;                  /* spice_keep_rule */
    double  host_us;               /* cost table: host time per activation (0: unknown) */
    double  device_us;             /* device time per activation */
    double  margin;                /* COST: fetch only where that beats all-host by this share */
    float   surrogate_weight;      /* 0: no surrogates */
    const uint8_t * surrogate_set; /* [n_layers * max_expert] 1 = may be substituted; NULL: none */
    const uint8_t * whole_layers;  /* [n_layers] or NULL */
    const int32_t * capacity;      /* [n_layers] experts per layer for SPICE_KEEP_LAYER_LRU */
    int32_t resize_every;          /* LAYER_LRU: every this many calls, capacities re-split by
                                      (misses + 1) x copy time per layer (0: fixed) */
    int32_t prefetch_next;         /* 1: prefetch the next MoE layer's router top-k (n_expert_used) */
    const uint8_t * next_layers;   /* [n_layers] the layers whose calls prefetch_next (1) or NULL: every layer */
    int32_t next_room;             /* 1: prefetch_next may take room from the layers that run again last
                                      first (evict_from: this call's layer, then the MoE layers before it,
                                      wrapping: every MoE layer, the next one last); 0: free room only (or a
                                      LAYER_LRU capacity) */
    const float * const * routers; /* [n_layers] router weights [n_expert][n_embd] f32, NULL entries allowed;
                                      the store keeps them in int16 (a scale per row) and scales each
                                      input row to 15 bits: the top-k is of those exact integer logits */
    int32_t n_embd;                /* the routers' row width */
    double  decay;                 /* KEEP_DECAYED: in (0, 1], per call of the layer */
    int32_t n_host_points;         /* host(n), the host's time per activation for n tokens of one expert
                                      (its weights are read once for them all): 0 = host_us at any n; else
                                      up to SPICE_RULE_MAX_HOST_POINTS points, tokens ascending and > 0,
                                      linear between them and flat beyond either end */
    const int32_t * host_point_tokens; /* [n_host_points] */
    const double * host_point_us;      /* [n_host_points] us per activation at that many tokens, > 0 */
    int32_t overlap;               /* 1: the device runs beside the host (a GPU); 0: its work is the host's
                                      time too (the emulated device): waiting for a copy or fetching one
                                      only adds it, so every miss runs on the host */
};
#define SPICE_RULE_MAX_HOST_POINTS 16

/* ---- expert store -----------------------------------------------------------
 *
 * The device tier: expert slots under one pooled byte budget, a residency
 * table (layer, expert) -> slot, a copy queue with two priorities, and
 * recency. Each expert is charged its own bytes (quant types make experts
 * differ): a request succeeds while the experts on the device or on their
 * way fit the budget. The store keeps the bookkeeping; the slot memory and
 * the bus belong to its device, the same interface for every kind:
 *
 * - EMULATED (CPU-only builds, or asked for): slots live in their own host
 *   buffer and copies follow a virtual timeline on one bus. A copy starts
 *   when the bus is free of earlier copies of higher or equal priority (a
 *   demand copy overtakes queued prefetches, never one already started) and
 *   lands latency + bytes / bandwidth later; whoever needs the expert before
 *   then waits until then. No thread is added: tests drive the clock by hand
 *   (manual_clock).
 * - CUDA (CUDA builds): slots in GPU memory, copies from page-locked host
 *   weights on a stream of their own, completion by CUDA events. A few
 *   copies at a time are on the stream; the rest wait in the store's queue,
 *   where they can still be overtaken or cancelled. bandwidth_gbps /
 *   latency_us then only estimate ready_at; copy_ns is measured by events
 *   and stall_ns is wall time spent waiting. A CUDA store needs its host
 *   weights bound, so only a runtime creates one (spice_runtime_set_store).
 *
 * Landed copies are seen by one poll (spice_store_poll, made by the runtime
 * once per hook call) or by a wait; every other operation works on the
 * residency table as of the last poll plus its own changes, so lookups cost
 * no device call. Eviction: a plan names evictions, or with evict_from the
 * layers a prefetch may take room from (the store then picks the least
 * recently selected resident expert there). */
typedef struct spice_store spice_store;

typedef enum spice_device_kind {
    SPICE_DEVICE_EMULATED = 0, /* slots in host memory, virtual bus */
    SPICE_DEVICE_CUDA     = 1, /* slots on CUDA device `device_index` */
    SPICE_DEVICE_DISK     = 2  /* slots in RAM, copies read from the model file (`path`), O_DIRECT
                                  where the file system allows, on `io_threads` reader threads */
} spice_device_kind;

/* CUDA devices this libspice can use: 0 on a CPU-only build. */
SPICE_API int spice_device_count(void);
/* Free and total memory of CUDA device `device`, in bytes;
 * SPICE_ERR_UNSUPPORTED on a CPU-only build, INVALID_ARG for a bad index. */
SPICE_API int spice_device_memory(int32_t device, uint64_t * free_bytes, uint64_t * total_bytes);

/* Which executor a device that computes runs its pairs with. */
typedef enum spice_executor {
    SPICE_EXECUTOR_AUTO   = 0, /* CUDA: the slot-pool graph where the layer's types allow, else per expert;
                                  emulated: none (the host executor reads the slots) */
    SPICE_EXECUTOR_POOL   = 1, /* the slot-pool graph: one mul_mat_id per matrix kind per call; on the
                                  emulated device it runs on ggml's CPU backend (bit-identical rows) */
    SPICE_EXECUTOR_LEGACY = 2  /* CUDA: one small graph per device expert (for A/B runs); emulated: none */
} spice_executor;

/* What a runtime's device slots hold (spice_store_params.slot_precision). */
typedef enum spice_slot_precision {
    SPICE_SLOT_EXACT = 0, /* the experts' own bytes: device pairs are bit-identical to host ones */
    SPICE_SLOT_4BIT  = 1, /* LOSSY: each expert matrix re-quantized to about 4.5 bits per weight
                             (IQ4_NL, else IQ4_XS or Q4_K: the first smaller type whose activations
                             quantize as the matrix's own do); about 1.9x the experts of a Q8_0
                             model fit the budget, and each copy carries that much less over the
                             bus. The host still runs its own activations on the model's weights.
                             Copies are made in host memory when the tier is set (then kept for
                             later tiers of the same precision). Not on a disk tier, nor with
                             SPICE_CUDA_VERIFY (which compares device rows with exact ones). */
    SPICE_SLOT_5BIT  = 2  /* LOSSY, as SPICE_SLOT_4BIT but about 5.5 bits per weight (Q5_0, else
                             Q5_K); about 1.55x the experts of a Q8_0 model fit; a matrix already
                             at 5 bits or fewer (Q5_K_M's experts) keeps its own bytes */
} spice_slot_precision;

typedef struct spice_store_params {
    uint64_t budget_bytes;       /* pooled device budget */
    double   bandwidth_gbps;     /* bus bandwidth, 1e9 bytes per second */
    double   latency_us;         /* per-copy latency */
    int32_t  prefetch_queue_max; /* prefetches queued but not started; <= 0: 64 */
    int32_t  manual_clock;       /* 1: time moves only via spice_store_advance (emulated, disk) */
    int32_t  device_kind;        /* spice_device_kind; 0 (zeroed params) = emulated */
    int32_t  device_index;       /* CUDA device for SPICE_DEVICE_CUDA */
    /* SPICE_DEVICE_DISK only */
    const char * path;           /* the file experts are read from (a runtime's: the model's GGUF) */
    int32_t  io_threads;         /* reader threads; <= 0: 4 */
    int32_t  io_fault_after;     /* tests: every read after this many fails with EIO; 0: never */
    int32_t  executor;           /* spice_executor; 0 = auto */
    /* tests: on a device that computes, every launch after this many fails
     * (> 0), or every collect after -this many (< 0); 0: never. The decode
     * stops with the reason, as for a real device failure. */
    int32_t  exec_fault_after;
    /* spice_slot_precision; 0 (zeroed params) = exact. Used by a runtime's
     * tier (spice_runtime_set_store); a standalone store has no weights. */
    int32_t  slot_precision;
} spice_store_params;

/* Fill *out with libspice's defaults, for a caller to change only what it
 * needs (pyspice's StoreParams takes its own defaults from here). Returns
 * SPICE_ERR_INVALID_ARG for a NULL out. The defaults:
 *   budget_bytes        0: none, every tier is sized by its caller (a store
 *                       of 0 bytes fails with SPICE_ERR_BUDGET)
 *   bandwidth_gbps      16.0, latency_us 10.0: a PCIe 4.0 x16 bus in round
 *                       figures, for stores whose caller names no bus
 *   prefetch_queue_max  64, what <= 0 also means
 *   manual_clock        0: the monotonic clock
 *   device_kind         SPICE_DEVICE_EMULATED, device_index 0
 *   path                NULL
 *   io_threads          4, what <= 0 also means
 *   io_fault_after      0, exec_fault_after 0: no injected faults
 *   executor            SPICE_EXECUTOR_AUTO
 *   slot_precision      SPICE_SLOT_EXACT
 * A zeroed struct differs in bandwidth_gbps and latency_us only, and
 * spice_store_create refuses its bandwidth of 0. */
SPICE_API int spice_store_default_params(spice_store_params * out);

typedef enum spice_residency {
    SPICE_RES_ABSENT   = 0,
    SPICE_RES_QUEUED   = 1, /* copy waiting for the bus */
    SPICE_RES_COPYING  = 2, /* copy in flight */
    SPICE_RES_RESIDENT = 3
} spice_residency;

typedef enum spice_priority {
    SPICE_PRIORITY_PREFETCH = 0, /* low: bounded queue, overtaken by demand copies */
    SPICE_PRIORITY_DEMAND   = 1  /* high: needed by the current layer */
} spice_priority;

/* n_expert[il] routed experts of expert_bytes[il] bytes each per layer (0
 * experts: not an MoE layer), with a device of params->device_kind whose
 * slots hold the experts' bytes back to back (no host weights are bound, so
 * no bytes move: for tests and standalone use). Every slot is as large as
 * the largest expert, and the budget bounds the slots' bytes: each expert
 * held takes a slot's bytes of it, whatever its own size, so a model whose
 * layers' experts differ in size holds budget / largest experts. Fails with
 * SPICE_ERR_BUDGET when not even one slot fits, SPICE_ERR_UNSUPPORTED when
 * this build has no such device. */
SPICE_API int spice_store_create(const spice_store_params * params, int32_t n_layers,
                                 const int32_t * n_expert, const uint64_t * expert_bytes,
                                 spice_store ** out);
SPICE_API void spice_store_free(spice_store * store);

/* Slot records (the most experts the budget holds), a slot's bytes (the
 * largest expert's), free records, and bytes in use of the budget (a slot's
 * bytes per expert held or on its way, plus reserved bytes). */
SPICE_API int32_t  spice_store_n_slots(const spice_store * store);
SPICE_API uint64_t spice_store_slot_bytes(const spice_store * store);
SPICE_API int32_t  spice_store_n_free(const spice_store * store);
SPICE_API uint64_t spice_store_used_bytes(const spice_store * store);
SPICE_API uint64_t spice_store_budget_bytes(const spice_store * store);
/* Bytes of one expert of layer il as the store holds and copies it (a
 * runtime's tier with low-precision slots: the copies' bytes); 0 for a
 * layer without routed experts or an il out of range. */
SPICE_API uint64_t spice_store_expert_bytes(const spice_store * store, int32_t il);

/* Ask for expert (il, e) on the device. Already resident or pending: a
 * demand request upgrades a queued prefetch; nothing else changes. Returns
 * SPICE_ERR_BUDGET when its bytes do not fit the budget (evict first) and
 * SPICE_ERR_STATE when the prefetch queue is full. */
SPICE_API int spice_store_request(spice_store * store, int32_t il, int32_t e, int32_t priority);

/* Drop (il, e): a queued copy is cancelled, a resident expert's slot freed.
 * SPICE_ERR_STATE when it is pinned or its copy is in flight. Absent: no-op. */
SPICE_API int spice_store_evict(spice_store * store, int32_t il, int32_t e);

/* Charge bytes a policy keeps on the device besides experts (e.g. surrogate
 * matrices) to the same budget; a negative value releases them. Fails with
 * SPICE_ERR_BUDGET when they do not fit beside the experts held now. */
SPICE_API int spice_store_reserve(spice_store * store, int64_t bytes);

/* Pinned experts cannot be evicted (pins nest). */
SPICE_API int spice_store_pin(spice_store * store, int32_t il, int32_t e);
SPICE_API int spice_store_unpin(spice_store * store, int32_t il, int32_t e);

/* Residency of (il, e) as of the last poll and the store's own changes since
 * (a spice_residency value), or -1 for a bad index. Asks the device nothing. */
SPICE_API int spice_store_state(const spice_store * store, int32_t il, int32_t e);

/* Poll the device once: copies that have landed become resident, queued
 * copies start as the device can take them. */
SPICE_API int spice_store_poll(spice_store * store);

/* Block until (il, e) is resident; *stall_ns gets the time waited (0 when it
 * had landed). SPICE_ERR_STATE when no copy is pending or done. */
SPICE_API int spice_store_wait(spice_store * store, int32_t il, int32_t e, uint64_t * stall_ns);

/* When the pending copy of (il, e) lands (ns on the store's clock), or 0; a
 * queued copy's is projected behind the copies ahead of it. */
SPICE_API uint64_t spice_store_ready_at(spice_store * store, int32_t il, int32_t e);

/* The store's clock in ns; manual clocks start at 0 and move only by advance
 * (which then polls). */
SPICE_API uint64_t spice_store_now(spice_store * store);
SPICE_API int spice_store_advance(spice_store * store, uint64_t ns);

/* Per-layer counters (il = -1: totals): bytes_h2d, copy_ns (counted when a
 * copy lands), stall_ns, prefetch_issued / used / cancelled by the copied
 * expert's layer; store_polls, device_copies, device_waits by the layer of
 * the hook call that made them (spice_store_begin_call); the rest are zero. */
SPICE_API int spice_store_get_counters(const spice_store * store, int32_t il, spice_counters * out);

/* The residency table spice_store_state reads: n_layers rows of max_expert
 * int8 spice_residency values, updated in place (the pointer stays valid
 * for the store's life). */
SPICE_API const int8_t * spice_store_states(const spice_store * store, int32_t * n_layers, int32_t * max_expert);

/* A hook call begins: poll once, write per activation (n_tokens rows of
 * n_used ids, row stride ids_nb1 bytes) whether its expert is resident into
 * hit (may be NULL), and note the selected experts as the most recently used
 * (the recency evict_from picks victims by). Ids out of range are no hit. */
SPICE_API int spice_store_begin_call(spice_store * store, int32_t il, int32_t n_tokens, int32_t n_used,
                                     const int32_t * ids, size_t ids_nb1, uint8_t * hit);

/* Carry out a validated plan for the hook call described by call (layer,
 * ids, actions, fetch, prefetch, evict, evict_from), in this order: pin the
 * experts it runs on the device that the tier holds; its evictions; its
 * demand fetches, then demand for device actions on absent experts; its
 * prefetches (room by evict_from); wait for the device experts; device
 * actions of experts that got no slot become host actions (call->actions
 * is written); unpin. Refused requests and evictions are not errors.
 * slot_data (may be NULL): [n_expert of the layer], each device expert's
 * slot memory (NULL where none, also for experts with no device action). */
SPICE_API int spice_store_apply_plan(spice_store * store, const spice_policy_call * call, const char ** slot_data);

/* Install the per-activation rule the store plans by (copied; NULL: the
 * default rule -- resident on the device, misses on the host, keep all). */
SPICE_API int spice_store_set_rule(spice_store * store, const spice_rule * rule);

/* Write the rule's plan for the hook call into call (actions, fetch,
 * prefetch, evict; within the call's capacities), from the residency table,
 * recency, and the call's ids, gate weights and input rows. Call it after
 * spice_store_begin_call, then apply it (spice_store_apply_plan). */
SPICE_API int spice_store_rule_plan(spice_store * store, spice_policy_call * call);

/* The logits prefetch_next ranks, on plain arrays, for tests: router
 * [n_expert][n_embd] f32 taken to int16 with a scale per row, each of the
 * n_rows hidden rows [n_embd] to 15 bits with its own, and
 * logits[i][e] = (double) (exact integer dot) * router scale * row scale. */
SPICE_API int spice_rule_router_logits(int32_t n_expert, int32_t n_embd, const float * router, int32_t n_rows,
                                       const float * hidden, double * logits);

/* Copy the first `size` bytes of resident expert (il, e)'s slot into dst
 * (host memory), whatever the device: tests check that copies move the right
 * bytes. SPICE_ERR_STATE when it is not resident or nothing is bound. */
SPICE_API int spice_store_read_slot(spice_store * store, int32_t il, int32_t e, void * dst, size_t size);

/* 1 when this store's device computes (a real GPU: device pairs run there),
 * 0 when the host executor reads its slots (emulated). */
SPICE_API int spice_store_is_real(const spice_store * store);

/* Switch an emulated store's clock between real time (virtual = 0) and a clock
 * that moves only through spice_store_advance (virtual = 1), continuing from
 * what it reads now. SPICE_ERR_STATE for any other device (CUDA, disk): their
 * copies take the time they take. */
SPICE_API int spice_store_set_virtual_clock(spice_store * store, int virtual_clock);

/* ---- runtime -------------------------------------------------------------- */

typedef struct spice_runtime spice_runtime;

/* Per-layer description of the routed experts the runtime serves. */
typedef struct spice_layer_info {
    int32_t il;
    int32_t is_moe;         /* 0: dense layer (or experts the hook cannot serve) */
    int32_t n_expert;
    int32_t n_embd;
    int32_t n_ff;           /* expert FFN width */
    int32_t type_gate;      /* ggml_type of each expert tensor */
    int32_t type_up;
    int32_t type_down;
    uint64_t bytes_per_expert; /* gate + up + down bytes of one expert */
} spice_layer_info;


/* Attach a runtime to a context. Checks that every MoE layer's expert tensors
 * are in plain host memory (not repacked) with a supported type; on failure
 * returns SPICE_ERR_INCOMPATIBLE / SPICE_ERR_UNSUPPORTED and writes the reason
 * into err (err_len bytes, may be NULL). The hook is not registered yet. */
SPICE_API int spice_runtime_create(struct llama_context * lctx, spice_runtime ** out,
                                   char * err, size_t err_len);

/* Unregisters the hook (if registered) and frees the runtime. NULL is a no-op. */
SPICE_API void spice_runtime_free(spice_runtime * rt);

/* Message of the runtime's last failure (or last plan rejection); "" if none. */
SPICE_API const char * spice_runtime_last_error(const spice_runtime * rt);

SPICE_API int spice_runtime_n_layers(const spice_runtime * rt);
SPICE_API int spice_runtime_layer_info(const spice_runtime * rt, int32_t il, spice_layer_info * out);

/* Register the hook with the built-in exact policy (fn = NULL) or a policy
 * callback. max_tokens: micro-batches above it keep upstream's path (0 = none).
 * The same as spice_runtime_enable_ex with no flags. */
SPICE_API int spice_runtime_enable(spice_runtime * rt, spice_policy_fn fn, void * user_data,
                                   int32_t max_tokens);

/* What a hook call carries beyond the hidden rows, the selected ids and their
 * gate weights. Each input is a copy on a GPU build (the graph hands the hook
 * one packed tensor per layer), so a policy asks only for what it reads. */
#define SPICE_HOOK_WANT_PROBS 1 /* spice_policy_call.probs: the router probabilities */
#define SPICE_HOOK_WANT_SHEXP 2 /* spice_policy_call.shexp: the shared-expert output */
#define SPICE_HOOK_WANT_NEXT_LOGITS 4 /* spice_policy_call.next_logits: the next layer's router on this
                                         call's input, from the graph (on the GPU where it runs) */

/* spice_runtime_enable with flags (SPICE_HOOK_WANT_*, others must be 0). The
 * runtime adds SPICE_HOOK_WANT_SHEXP by itself while surrogates are loaded:
 * the surrogate executor needs the shared-expert output (loading or clearing
 * surrogates re-registers the hook); and SPICE_HOOK_WANT_NEXT_LOGITS while the
 * rule installed with spice_runtime_set_rule prefetches by the next layer's
 * router (prefetch_next): the graph computes those logits, where the rule
 * would otherwise read the whole router on the hook's thread. A graph is built again when the flags
 * change: llama.cpp never reuses one built with other flags. */
SPICE_API int spice_runtime_enable_ex(spice_runtime * rt, spice_policy_fn fn, void * user_data,
                                      int32_t max_tokens, uint32_t flags);

/* The flags the hook is registered with now (SPICE_HOOK_WANT_*, those the
 * runtime added included); 0 when not registered. */
SPICE_API uint32_t spice_runtime_hook_flags(const spice_runtime * rt);

/* Between decodes, never inside one: registers the hook again where what the
 * runtime needs from the graph changed since. A plan may install a rule while
 * a decode runs (spice_policy_call.rule), when the graph cannot change: until
 * this call, a rule that newly prefetches by the next router computes those
 * logits itself (int16), and the graph goes on computing them for a rule that
 * no longer does. pyspice calls it before every decode. */
SPICE_API int spice_runtime_sync_hook(spice_runtime * rt);

/* ---- asynchronous planning ---------------------------------------------------
 *
 * The policy callback runs on a planner thread owned by the runtime instead
 * of the hook's thread: each hook call that would call the policy copies its
 * snapshot (layer, hidden rows, ids, gate weights, the probabilities when
 * with_probs, the shared expert's rows when with_shexp, residency as the
 * call began) into arrays the snapshot owns (the hidden and shared-expert
 * rows copied by the planner thread while the call's experts run, or by the
 * hook's thread before the call returns where the planner is still busy:
 * async_rows_by_hook), hands it to the planner and runs
 * by the installed rule (spice_rule) at once. A plan the planner finished is validated
 * (spice_plan_check) and applied by the hook's thread at a later hook call:
 * its prefetch, evict and evict_from lists join that call's plan, and its
 * resume_il holds unless a call of that layer came in between; its actions
 * and demand fetches were for the snapshot's call, which has run, and are
 * not used. The store is only ever touched by the hook's thread.
 *
 * Ages count hook calls. Free-running (deterministic = 0): a plan older than
 * max_lag when it could be applied is dropped (async_stale), a snapshot the
 * planner had not started when the next one came is replaced by it
 * (async_skipped), and the lag is measured (async_lag_calls). Deterministic:
 * the plan of the snapshot posted at call c is applied exactly at call
 * c + lag, the hook waiting for the planner (async_wait_ns), so a run
 * repeats exactly. A policy returning SPICE_POLICY_FAILED has its plan
 * dropped (policy_fallbacks; the call ran by the rule), as is an invalid
 * plan (also plan_rejections and last_error). */
typedef struct spice_async_params {
    int32_t max_lag;       /* free-running: drop plans older than this many hook calls (>= 1) */
    int32_t deterministic; /* 1: apply the plan of call c exactly at call c + lag */
    int32_t lag;           /* deterministic mode's lag in hook calls (>= 1) */
    int32_t with_probs;    /* 1: snapshots carry the router probabilities (else probs is NULL) */
    int32_t with_shexp;    /* 1: snapshots carry the shared-expert output (else shexp is NULL) */
    int32_t idle_poll;     /* 1: an idle planner polls for the next snapshot a while (a 50 us spin,
                            * then short sleeps up to twice the longest recent gap between
                            * snapshots, within 5 .. 250 ms) before it parks, so a steady decode,
                            * token ends included, never wakes it -- for a planner with a core
                            * of its own; 0: it parks
                            * at once and each post after an idle spell wakes it (async_wakes) --
                            * where the graph's threads take every core, polling takes their time */
} spice_async_params;

/* Register the hook with a policy callback called on the runtime's planner
 * thread (started here; a running one is stopped first), with the flags
 * with_probs and with_shexp imply (spice_runtime_enable_ex). The callback then
 * runs on a thread that is not the hook's: a Python callback takes the GIL
 * there (cffi does), and the hook's thread never waits for Python except in
 * deterministic mode. SPICE_ERR_INVALID_ARG for a NULL fn or out-of-range
 * params, SPICE_ERR_STATE without a device tier, SPICE_ERR_NO_MEMORY when the
 * thread cannot start. Stopped (the thread joined, plans not yet applied
 * dropped) by spice_runtime_disable, spice_runtime_enable and
 * spice_runtime_free. */
SPICE_API int spice_runtime_enable_async(spice_runtime * rt, spice_policy_fn fn, void * user_data,
                                         int32_t max_tokens, const spice_async_params * params);

/* 1 while the runtime plans asynchronously, else 0. */
SPICE_API int spice_runtime_is_async(const spice_runtime * rt);

/* Unregister the hook: the context computes exactly upstream's graph again. */
SPICE_API int spice_runtime_disable(spice_runtime * rt);

/* From the runtime's first enable or disable until it is freed, llama.cpp's
 * debug log lines are dropped in C before they reach the installed log
 * callback: ggml-cuda logs one at every CUDA graph it replays, and where that
 * callback is Python (llama-cpp-python's) each launch took the GIL, waiting
 * for a policy planning on the planner thread. keep = 1 keeps them (a verbose
 * model; also where SPICE_LLAMA_DEBUG_LOG=1 or GGML_SCHED_DEBUG is set), and
 * takes out a filter this runtime installed. */
SPICE_API int spice_runtime_keep_debug_log(spice_runtime * rt, int keep);

/* Give the runtime a device tier (params = NULL removes it). Without one,
 * every expert counts as resident and runs on the host executor. A tier of
 * SPICE_SLOT_4BIT or _5BIT first makes its low-precision expert copies (seconds for a
 * large model; kept for later tiers of that precision): budget and bus
 * then count the copies' bytes. */
SPICE_API int spice_runtime_set_store(spice_runtime * rt, const spice_store_params * params);

/* The low-precision copies the runtime holds for its slots: the
 * spice_slot_precision they were made for, bytes of host memory and seconds
 * it took to make them (SPICE_SLOT_EXACT, 0 and 0 when it holds none). Any
 * out pointer may be NULL. */
SPICE_API int spice_runtime_slot_copies(const spice_runtime * rt, int32_t * precision, uint64_t * bytes,
                                        double * seconds);

/* Bytes of host memory the copies for slots of `precision` would take (0 for
 * SPICE_SLOT_EXACT, or where no matrix has a smaller type), without making
 * them: so a caller can check they fit before asking for such a tier. */
SPICE_API int spice_runtime_slot_copies_size(const spice_runtime * rt, int32_t precision, uint64_t * bytes);

/* Read the low-precision copies for slots of `precision` from `path`, a file
 * spice_runtime_slot_copies_save wrote for this model, instead of making
 * them: later tiers of that precision use them as made ones (seconds: the
 * time reading took). `model_key` is the caller's name for the model (pyspice:
 * its sidecar fingerprint); the file must carry the same key, have been
 * quantized by this build's ggml, and hold exactly the matrices and types the
 * copies take. Where it does not -- missing, truncated, another model, another
 * build -- SPICE_ERR_INVALID_ARG says which in the last error and the runtime
 * holds no copies (make them with spice_runtime_set_store). SPICE_ERR_STATE
 * while a device tier is set (its slots may read the copies: remove it
 * first); SPICE_ERR_UNSUPPORTED where a tier could not use them (see
 * spice_runtime_set_store: SPICE_CUDA_VERIFY). */
SPICE_API int spice_runtime_slot_copies_load(spice_runtime * rt, int32_t precision, const char * path,
                                             const char * model_key);

/* Write the low-precision copies the runtime holds to `path` (a GGUF, each
 * copied matrix named after its source plus ".slot"), under `model_key`, for
 * spice_runtime_slot_copies_load. The file appears whole or not at all.
 * SPICE_ERR_STATE where the runtime holds no copies; SPICE_ERR_INVALID_ARG
 * (the last error says why) where it cannot be written. */
SPICE_API int spice_runtime_slot_copies_save(spice_runtime * rt, const char * path, const char * model_key);

/* How far the low-precision copies being made or read are (or the last ones
 * made or read: done == total once they all were): bytes done and bytes in
 * all; both 0 before any. The one call that may come from another thread
 * while spice_runtime_set_store or spice_runtime_slot_copies_load runs on
 * this runtime: for a progress bar over what can take minutes. */
SPICE_API int spice_runtime_slot_copies_progress(const spice_runtime * rt, uint64_t * done, uint64_t * total);

/* The runtime's store (NULL: none), for reading residency and the clock. */
SPICE_API spice_store * spice_runtime_get_store(spice_runtime * rt);

/* Install the per-activation rule (see spice_rule) on the runtime's device tier,
 * for the calls no policy decides; also valid from inside a synchronous policy
 * callback (it plans the next call on) -- never from the planner thread of
 * asynchronous planning, which must not touch the store: a plan's `rule` does
 * that there. SPICE_ERR_STATE without a device tier. */
SPICE_API int spice_runtime_set_rule(spice_runtime * rt, const spice_rule * rule);

/* Deterministic timing on an emulated tier: with step_ns > 0 the tier's clock
 * leaves real time (spice_store_set_virtual_clock) and moves by step_ns per token
 * of each hook call as it starts (a prompt batch's layer takes longer than a
 * decode token's: its copies land as they would), so which copies have landed
 * when a call comes -- and so its
 * actions and, with lossy slots, its output -- depends only on the calls before
 * it. With a deterministic plan lag (spice_async_params) a run then repeats
 * exactly. 0: real time again. A new tier starts on real time.
 * SPICE_ERR_STATE without a tier, or where its device is not emulated. */
SPICE_API int spice_runtime_set_clock_step(spice_runtime * rt, uint64_t step_ns);

/* Copy experts onto the device tier in layer order until it is full and wait
 * for them; *n_loaded = how many. Not counted as traffic. */
SPICE_API int spice_runtime_preload(spice_runtime * rt, int32_t * n_loaded);

/* Counters of layer il, or totals for il = -1. */
SPICE_API int spice_runtime_get_counters(const spice_runtime * rt, int32_t il, spice_counters * out);
SPICE_API void spice_runtime_reset_counters(spice_runtime * rt);

/* Set by a policy returning SPICE_POLICY_ABORT, or by
 * spice_runtime_request_abort; the runtime's abort callback stops the current
 * llama_decode. Reading clears nothing; clear it explicitly. */
SPICE_API int spice_runtime_abort_requested(const spice_runtime * rt);
SPICE_API void spice_runtime_clear_abort(spice_runtime * rt);
/* 1 when the runtime itself stopped the decode because it could not go on
 * exactly (a read error from a disk tier, no memory for the executors):
 * spice_runtime_last_error says why. Cleared by spice_runtime_clear_abort. */
SPICE_API int spice_runtime_failed(const spice_runtime * rt);

/* Ask the running llama_decode to stop (Ctrl-C under a policy with no
 * callback: nothing else runs on the decoding thread to notice it). Safe
 * from any thread at any time, and from a signal handler (one atomic store);
 * a no-op for NULL. The decode stops at its next graph node, or within
 * about 10 ms while it waits for an emulated copy (the wait is cut short;
 * the copy's bytes are in its slot, so it counts as landed then), and
 * llama_decode returns 2, its batch's positions removed from the KV cache.
 * The request stays set -- every later decode stops at once -- until
 * spice_runtime_clear_abort. */
SPICE_API void spice_runtime_request_abort(spice_runtime * rt);

/* Number of plan rejections and policy failures so far; last_error holds the
 * latest message, so a caller that sees the count grow can warn once. */
SPICE_API uint64_t spice_runtime_plan_rejections(const spice_runtime * rt);

/* ---- LoRE surrogates ----------------------------------------------------------
 *
 * A surrogate stands in for routed expert e of layer il when a plan marks an
 * activation SPICE_ACTION_SURROGATE: token t's routed output then gets
 *     w[t,k] * (alpha * S_t + B (A h_t))
 * where h_t is the MoE input row, S_t the shared-expert output before its
 * gate (architectures without a shared expert: no alpha term), A is
 * [rank][n_embd] and B [n_embd][rank] (row-major f32, as numpy writes them).
 * Rank 0 is allowed: alpha * S_t alone ("the shared expert instead").
 *
 * libspice keeps copies of the matrices in f16 in host memory and computes
 * surrogates on the host (half the bytes of f32; arithmetic stays f32).
 * While a device tier is attached their bytes are charged to its budget
 * (spice_store_reserve), also when a tier is attached later, as if they
 * lived there. Exact actions never read them. Not to be called during a
 * llama_decode. */

/* Load (or replace) the surrogate of (il, e); copies A and B. Returns
 * SPICE_ERR_INVALID_ARG for a layer that is not MoE, an expert out of range or
 * rank < 0 (A/B may be NULL only for rank 0), SPICE_ERR_BUDGET when the
 * device tier cannot hold its bytes beside what it holds now (the old
 * surrogate, if any, stays), SPICE_ERR_NO_MEMORY. */
SPICE_API int spice_runtime_set_surrogate(spice_runtime * rt, int32_t il, int32_t e, float alpha, int32_t rank,
                                          const float * a, const float * b);

/* Unload every surrogate and release their device bytes. */
SPICE_API int spice_runtime_clear_surrogates(spice_runtime * rt);

/* Device bytes held by loaded surrogates (2 * rank * n_embd f16 values plus
 * alpha, each); how many are loaded. */
SPICE_API uint64_t spice_runtime_surrogate_bytes(const spice_runtime * rt);
SPICE_API int32_t spice_runtime_n_surrogates(const spice_runtime * rt);

/* 1 when (il, e) has a loaded surrogate, else 0. */
SPICE_API int spice_runtime_has_surrogate(const spice_runtime * rt, int32_t il, int32_t e);

/* The executor on plain arrays, for tests: for each of n_rows rows,
 *     out[i] += weights[i] * (alpha * shexp[i] + B (A h[i]))
 * (shexp NULL: no alpha term), with A and B rounded to f16 exactly as a loaded
 * surrogate is, and the work split as n_threads graph threads would split it
 * (run one after another). Row strides in bytes. */
SPICE_API int spice_surrogate_apply(int32_t n_embd, int32_t rank, float alpha, const float * a, const float * b,
                                    int32_t n_rows, const float * h, size_t h_nb1, const float * shexp,
                                    size_t shexp_nb1, const float * weights, float * out, size_t out_nb1,
                                    int32_t n_threads);

/* ---- routing replay (timing runs) ---------------------------------------------
 *
 * Random-weight models route uniformly; replaying the expert ids of a
 * recorded trace gives their runs real locality. While a replay is set, every
 * hook call first replaces the router's selected expert ids with recorded
 * ones, before anything reads them: the policy, the store (residency,
 * recency, hit counters), the executors and the counters all see the
 * recorded ids. The gate weights stay the router's, so the output is not the
 * model's (timing only). The replacement is written over the call's id rows
 * in the graph's buffer, which nothing reads after the hook.
 *
 * ids[(t * n_layers + il) * n_used + k] is the k-th expert of token t at
 * layer il (n_layers = spice_runtime_n_layers; rows of dense layers are
 * ignored); each MoE layer's row names distinct experts of that layer.
 * Positions: the replay keeps the trace token of the current micro-batch's
 * first row. A micro-batch begins at a hook call whose layer is not after the
 * previous call's; its rows take the next tokens in order (a decode call
 * one, a prompt batch one per row), wrapping around at n_tokens. A layer
 * handed fewer rows than the micro-batch's first MoE layer (llama.cpp gives
 * the last layer only the rows whose logits are wanted) takes the
 * micro-batch's last rows. Micro-batches that keep upstream's path
 * (max_tokens) are not hooked and take no tokens. A call selecting more
 * experts than n_used keeps the router's ids.
 *
 * The array is borrowed, not copied: it must stay valid and unchanged until
 * the replay is cleared (ids = NULL) or the runtime freed. Not to be called
 * during a llama_decode. SPICE_ERR_INVALID_ARG for n_tokens < 1, n_used < 1,
 * n_layers other than the runtime's, or an id out of range or repeated in a
 * row (nothing changes then). The position starts at token 0. */
SPICE_API int spice_runtime_set_routing_replay(spice_runtime * rt, const int32_t * ids, int64_t n_tokens,
                                               int32_t n_layers, int32_t n_used);

/* The trace token the next micro-batch starts at, or -1 with no replay. */
SPICE_API int64_t spice_runtime_routing_replay_position(const spice_runtime * rt);

/* The next micro-batch starts at trace token `token` (modulo the trace's
 * length; e.g. 0 before each of several runs that must replay alike).
 * SPICE_ERR_STATE with no replay, SPICE_ERR_INVALID_ARG for token < 0. */
SPICE_API int spice_runtime_seek_routing_replay(spice_runtime * rt, int64_t token);

/* ---- expert buffer type ------------------------------------------------------
 *
 * Where routed-expert tensors must live for the hook: plain host memory in
 * ggml's own layout. Overriding tensors to ggml_backend_cpu_buffer_type()
 * is not enough (llama.cpp then still repacks them into an "extra" buffer
 * type), so this is a distinct buffer type with the CPU buffer's behaviour;
 * on a GPU build it is the GPU's pinned host buffer type instead. Pass the
 * pointer as the buft of a llama_model_tensor_buft_override; keep the handle
 * alive until every model loaded with it is freed. */
typedef struct spice_expert_buft spice_expert_buft;

SPICE_API int spice_expert_buft_create(spice_expert_buft ** out);
SPICE_API void spice_expert_buft_free(spice_expert_buft * buft);

/* The ggml_backend_buffer_type_t to use in the override. */
SPICE_API void * spice_expert_buft_get(const spice_expert_buft * buft);

/* Its name, as ggml reports it ("CPU_Experts" or e.g. "CUDA_Host"). */
SPICE_API const char * spice_expert_buft_name(const spice_expert_buft * buft);

#ifdef __cplusplus
}
#endif

#endif /* SPICE_H */
