/* The expert store's state, shared by its own files only (spice-store.c:
 * slots, queues and the copy engine; spice-store-plan.c: applying a plan).
 * Everything here is bookkeeping; the bytes and the bus belong to the
 * device (spice-device.h). */
#ifndef SPICE_STORE_IMPL_H
#define SPICE_STORE_IMPL_H

#include "spice-store.h"

#include <stdint.h>

/* A pending copy: queued in the store (started = 0) or handed to the device
 * (started = 1, until a poll or a wait sees it land). */
typedef struct spice_copy {
    int32_t  il, e, slot;
    int32_t  priority;     /* SPICE_PRIORITY_* */
    int32_t  was_prefetch; /* issued as a prefetch (possibly upgraded since) */
    int32_t  started;
    uint64_t bytes;
    uint64_t issue_ns;     /* when the store queued it */
    uint64_t seq;          /* request order: the tie-break among copies queued at the same time */
    uint64_t start_ns, end_ns; /* once started: as the device reports them (end: due, an estimate on a real bus) */
} spice_copy;

typedef struct spice_slot {
    int32_t il, e;         /* -1 when free */
    int32_t pins;
    int32_t copy;          /* index into copies while a copy is pending, else -1 */
    int32_t from_prefetch; /* landed from a prefetch not yet used */
} spice_slot;

/* Scratch of one plan application, sized once. */
typedef struct spice_store_scratch {
    uint8_t * need;   /* [max_expert] the expert has a device action in this call */
    uint8_t * pinned; /* [max_expert] pinned during this call */
    uint8_t * kept;   /* [n_layers * max_expert] named in this call's prefetch list (evict_from) */
    int32_t * rank;   /* [n_layers] position in this call's evict_from (n_evict_from: not listed) */
    int32_t * started; /* [n_slots] slots of started copies, for one poll */
    uint8_t * landed;  /* [n_slots] */
} spice_store_scratch;

/* A router as the rule keeps it: each row [n_embd] in int16 with its own
 * scale (w ~ scale * q), half the f32 bytes. The next layer's router is read
 * once per call on caches ggml's kernels have just emptied, so its bytes, not
 * its arithmetic, are most of the rule's time
 * (docs/results/cpu-overhead.md). Each hidden row is
 * scaled to 15 bits the same way, so a logit is an exact integer sum times
 * the two scales: every build, and the twin in numpy, get the same number
 * (pyspice/sim/rule.py). Fewer bits lose experts: routers' rows have weights
 * 40-200x their median, and int8 rows changed a quarter of some layers'
 * top-4 on smolmoe-b (docs/results/cpu-overhead.md). */
typedef struct spice_router_q {
    int16_t * q;   /* [n_expert][n_embd] */
    float * scale; /* [n_expert] */
} spice_router_q;

/* The installed per-activation rule (spice_rule, with store-owned copies of
 * its arrays) and its running state. */
typedef struct spice_store_rule {
    spice_rule rule;
    uint8_t * surrogate_set; /* [n_layers * max_expert] or NULL */
    uint8_t * whole_layers;  /* [n_layers] or NULL */
    uint8_t * next_layers;   /* [n_layers] or NULL (prefetch_next at every layer) */
    int32_t * capacity;      /* [n_layers] (LAYER_LRU) or NULL */
    spice_router_q * routers; /* [n_layers] int16 copies of the routers (entries with q NULL: none); the
                                array NULL without prefetch_next */
    int16_t * hidden_q;       /* [n_embd] scratch: one hidden row in int16, with prefetch_next */
    int32_t * misses;        /* [n_layers] misses since the last resize */
    int64_t calls;           /* calls planned by the rule */
    int32_t * host_tokens;   /* [n_host_points] copies of the rule's host cost points, or NULL */
    double * host_per_act;   /* [n_host_points] */
    int32_t * sel;           /* [max_expert] scratch: the experts this call selects, in first-use order */
    int32_t * count;         /* [max_expert] scratch: the call's activations per selected expert */
    int32_t * left;          /* [max_expert] scratch: ... of them no fixed action took (miss_actions') */
    int32_t * order;         /* [max_expert] scratch: COST's misses, the most activations first, then
                                the experts whose device work is due, by id */
    int32_t * act;           /* [max_expert] scratch: the action an expert's left activations get */
    uint8_t * incoming;      /* [max_expert] scratch: absent experts this call fetches */
    uint8_t * selected;      /* [max_expert] scratch: experts this call selects (never victims) */
    uint8_t * chosen;        /* [n_layers * max_expert] scratch: victims already listed */
    double * logits;         /* [max_expert] scratch */
    int32_t * oldest;        /* [n_layers] KEEP_LRU (DECAYED): the layer's least recently selected (least
                                used) evictable expert
                                (-1: none) as of the last look, valid while layer_changed says so */
    uint8_t * predicted;     /* [max_expert] scratch */
    double * uses;           /* [n_layers * max_expert] KEEP_DECAYED: decayed use counts, zero at set_rule */
} spice_store_rule;

struct spice_store {
    spice_store_params params;
    int32_t  n_layers;
    int32_t  max_expert;
    int32_t *n_expert;        /* [n_layers] */
    uint64_t *expert_bytes;   /* [n_layers] */
    int32_t *slot_of;         /* [n_layers * max_expert], -1 = absent */
    int8_t  *states;          /* [n_layers * max_expert] spice_residency, kept current by every operation */
    spice_store_source *sources; /* [n_layers]; base NULL = not bound (no bytes move) */

    uint64_t slot_bytes;      /* the largest expert: every slot's size, and what each held expert takes of the budget */
    uint64_t used_bytes;      /* slot_bytes per expert on the device or on its way, plus reserved bytes */
    uint64_t reserved_bytes;  /* non-expert data charged to the budget (spice_store_reserve) */
    int32_t  n_slots;         /* slot records: the most experts the budget can hold */
    spice_slot *slots;
    int32_t *free_slots;
    int32_t  n_free;

    spice_copy *copies;       /* pending copies, unordered */
    int32_t  n_copies;
    int32_t  n_started;       /* of which handed to the device */
    uint64_t n_requested;     /* copies ever queued (their seq) */

    spice_clock clock;
    spice_device * device;    /* NULL until attached */

    /* recency for evict_from: the hook call (use_clock) that last selected
     * each (layer, expert), and the layer of the call in progress (device
     * operations are counted against it) */
    uint64_t *last_use;       /* [n_layers * max_expert] */
    uint64_t  use_clock;
    int32_t   call_il;

    /* per layer, so a rule's scans skip what cannot have changed: experts not
     * absent, and whether a state or a recency stamp changed since the rule
     * last looked (set by every state change and by spice_store_begin_call) */
    int32_t *layer_held;      /* [n_layers] */
    uint8_t *layer_changed;   /* [n_layers] */
    /* every state change of a layer bumps its row's version, so that a copy of the table
     * takes only the rows changed since it last took them (spice-row-snapshot.h); the
     * epoch tells this store's versions from another's */
    uint32_t *row_version;    /* [n_layers] */
    uint64_t  epoch;

    spice_store_rule rule;    /* the per-activation rule for the calls no policy decides */

    spice_counters *counters; /* [n_layers]: traffic by the copied expert's layer, device operations by call_il */
    spice_store_scratch scratch;
};

static inline size_t spice_store_cell(const spice_store * s, int32_t il, int32_t e) {
    return (size_t) il * (size_t) s->max_expert + (size_t) e;
}

static inline int spice_store_valid(const spice_store * s, int32_t il, int32_t e) {
    return s != NULL && il >= 0 && il < s->n_layers && e >= 0 && e < s->n_expert[il];
}

/* Counters for a device operation done now: the current call's layer. */
static inline spice_counters * spice_store_op_counters(spice_store * s) {
    return &s->counters[s->call_il >= 0 && s->call_il < s->n_layers ? s->call_il : 0];
}

/* Rule state: allocated with the store, released with it (spice-store-rule.c). */
int spice_store_rule_init(spice_store * s);
void spice_store_rule_free(spice_store * s);

#endif /* SPICE_STORE_IMPL_H */
