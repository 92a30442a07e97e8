/* The expert store's state, shared by its own files only (spice-store.c:
 * slots, queues and the copy engine; spice-store-plan.c: applying a plan;
 * spice-store-rule.c: the per-activation rule). The plan and rule files call
 * spice-store.c, never the other way.
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

/* The rule's state (spice-store-rule.c), made by the rule's file when a rule
 * is first set or planned with. The store only frees it, through free_rule,
 * so that its files call the rule's none by name. */
struct spice_store_rule;

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

    struct spice_store_rule * rule; /* the per-activation rule for the calls no policy decides; NULL: none
                                       made yet (the default rule then) */
    void (*free_rule)(spice_store * s); /* set with rule */

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

#endif /* SPICE_STORE_IMPL_H */
