/* Expert store: device slots, residency and the emulated copy engine.
 *
 * The bus is modelled as one serial timeline. Copies that have started keep
 * their place; every change (a new copy, an upgrade, a cancellation)
 * re-lays the copies that have not started: demand copies first, then
 * prefetches, each group in issue order, each starting when the bus is free
 * and occupying it for latency + bytes / bandwidth. Copies land lazily:
 * whichever operation first looks at the clock after a copy's end retires it.
 * Bytes move into slot memory when the expert is first used (the cost of the
 * emulation falls where the data is needed, and no thread is added).
 *
 * A CUDA store (spice_store_attach_cuda) keeps the same bookkeeping, but the
 * bus is real: a copy is "started" when it is handed to the GPU's copy
 * stream and lands when its event fires. Demand copies go to the GPU at
 * once; prefetches go a few at a time (SPICE_CUDA_IN_FLIGHT), so the rest
 * stay in our queue where demand overtakes them and a stale one can be
 * cancelled. */
#include "spice-store.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SPICE_PREFETCH_QUEUE_DEFAULT 64
#define NOT_STARTED UINT64_MAX
/* Copies a CUDA store keeps on the GPU's stream at once: enough to keep the
 * bus busy between two hook calls, few enough that queued prefetches stay
 * cancellable. */
#define SPICE_CUDA_IN_FLIGHT 4

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static uint64_t clock_now(spice_store * s) {
    if (s->params.manual_clock) {
        return s->now_ns;
    }
    return monotonic_ns() - s->epoch_ns;
}

static void sleep_until(spice_store * s, uint64_t t) {
    if (s->params.manual_clock) {
        if (t > s->now_ns) {
            s->now_ns = t;
        }
        return;
    }
    for (uint64_t now = clock_now(s); now < t; now = clock_now(s)) {
        const uint64_t left = t - now;
        struct timespec ts = { (time_t) (left / 1000000000ull), (long) (left % 1000000000ull) };
        nanosleep(&ts, NULL);
    }
}

static uint64_t occupancy_ns(const spice_store * s, uint64_t bytes) {
    return (uint64_t) (s->params.latency_us * 1e3 + (double) bytes / s->params.bandwidth_gbps);
}

static int valid(const spice_store * s, int32_t il, int32_t e) {
    return s != NULL && il >= 0 && il < s->n_layers && e >= 0 && e < s->n_expert[il];
}

static int32_t * slot_ref(spice_store * s, int32_t il, int32_t e) {
    return &s->slot_of[(size_t) il * (size_t) s->max_expert + (size_t) e];
}

static int8_t * state_ref(spice_store * s, int32_t il, int32_t e) {
    return &s->states[(size_t) il * (size_t) s->max_expert + (size_t) e];
}

/* ---- copy list ------------------------------------------------------------------ */

static void remove_copy(spice_store * s, int32_t index) {
    const int32_t last = s->n_copies - 1;
    s->slots[s->copies[index].slot].copy = -1;
    if (index != last) {
        s->copies[index] = s->copies[last];
        s->slots[s->copies[index].slot].copy = index;
    }
    s->n_copies--;
}

static uint64_t cuda_refresh(spice_store * s);
static int copy_order(const void * a, const void * b);

/* Retire every copy that has landed by now. */
static uint64_t refresh(spice_store * s) {
    if (s->cuda != NULL) {
        return cuda_refresh(s);
    }
    const uint64_t now = clock_now(s);
    for (int32_t i = 0; i < s->n_copies;) {
        const spice_copy * c = &s->copies[i];
        if (c->start_ns != NOT_STARTED && c->end_ns <= now) {
            spice_slot * slot = &s->slots[c->slot];
            slot->from_prefetch = c->was_prefetch;
            *state_ref(s, c->il, c->e) = SPICE_RES_RESIDENT;
            remove_copy(s, i); /* the last copy moved into i: look at i again */
        } else {
            ++i;
        }
    }
    return now;
}

static int copy_order(const void * a, const void * b) {
    const spice_copy * x = *(const spice_copy * const *) a;
    const spice_copy * y = *(const spice_copy * const *) b;
    if (x->priority != y->priority) {
        return x->priority > y->priority ? -1 : 1; /* demand first */
    }
    if (x->issue_ns != y->issue_ns) {
        return x->issue_ns < y->issue_ns ? -1 : 1;
    }
    return x->slot < y->slot ? -1 : (x->slot > y->slot); /* any fixed tie-break */
}

/* ---- CUDA bus ------------------------------------------------------------------ */

static int cuda_issue(spice_store * s, spice_copy * c, uint64_t now) {
    const spice_store_source * src = &s->sources[c->il];
    spice_cuda_segment seg[3];
    for (int k = 0; k < 3; ++k) {
        seg[k].src = src->base[k] + (size_t) c->e * src->stride[k];
        seg[k].dst_offset = src->dst_offset[k];
        seg[k].size = src->size[k];
        seg[k].pad = src->pad[k];
    }
    if (spice_cuda_copy_issue(s->cuda, c->slot, seg) != SPICE_OK) {
        return SPICE_ERR_INTERNAL;
    }
    c->start_ns = now;
    c->end_ns = now + occupancy_ns(s, c->bytes); /* an estimate: the event says when */
    return SPICE_OK;
}

/* Retire landed copies, then hand the GPU the next ones in priority order. */
static uint64_t cuda_refresh(spice_store * s) {
    const uint64_t now = clock_now(s);
    int32_t in_flight = 0;
    for (int32_t i = 0; i < s->n_copies;) {
        const spice_copy * c = &s->copies[i];
        if (c->start_ns != NOT_STARTED && spice_cuda_copy_done(s->cuda, c->slot) == 1) {
            spice_slot * slot = &s->slots[c->slot];
            slot->from_prefetch = c->was_prefetch;
            slot->filled = 1;
            s->counters[c->il].copy_ns += spice_cuda_copy_ns(s->cuda, c->slot);
            *state_ref(s, c->il, c->e) = SPICE_RES_RESIDENT;
            remove_copy(s, i);
        } else {
            in_flight += c->start_ns != NOT_STARTED;
            ++i;
        }
    }
    while (in_flight < SPICE_CUDA_IN_FLIGHT) {
        spice_copy * next = NULL;
        for (int32_t i = 0; i < s->n_copies; ++i) {
            spice_copy * c = &s->copies[i];
            if (c->start_ns == NOT_STARTED && (next == NULL || copy_order(&c, &next) < 0)) {
                next = c;
            }
        }
        if (next == NULL || cuda_issue(s, next, now) != SPICE_OK) {
            break;
        }
        in_flight++;
    }
    return now;
}

/* Lay out the copies that have not started behind those that have. */
static void reschedule(spice_store * s) {
    if (s->cuda != NULL) {
        cuda_refresh(s);
        return;
    }
    const uint64_t now = refresh(s);
    uint64_t cursor = now;
    int32_t n_pending = 0;
    spice_copy ** pending = (spice_copy **) malloc((size_t) (s->n_copies > 0 ? s->n_copies : 1) * sizeof(*pending));
    for (int32_t i = 0; i < s->n_copies; ++i) {
        spice_copy * c = &s->copies[i];
        if (c->start_ns != NOT_STARTED && c->start_ns <= now) {
            if (c->end_ns > cursor) {
                cursor = c->end_ns;
            }
        } else {
            c->start_ns = NOT_STARTED;
            if (pending) {
                pending[n_pending++] = c;
            }
        }
    }
    if (pending == NULL) {
        return; /* out of memory: copies stay unscheduled and wait() reports it */
    }
    qsort(pending, (size_t) n_pending, sizeof(*pending), copy_order);
    for (int32_t i = 0; i < n_pending; ++i) {
        spice_copy * c = pending[i];
        c->start_ns = cursor > c->issue_ns ? cursor : c->issue_ns;
        c->end_ns = c->start_ns + occupancy_ns(s, c->bytes);
        cursor = c->end_ns;
    }
    free(pending);
}

static int32_t queued_prefetches(const spice_store * s, uint64_t now) {
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_copies; ++i) {
        const spice_copy * c = &s->copies[i];
        if (c->priority == SPICE_PRIORITY_PREFETCH && (c->start_ns == NOT_STARTED || c->start_ns > now)) {
            n++;
        }
    }
    return n;
}

/* ---- C API ------------------------------------------------------------------------ */

int spice_store_create(const spice_store_params * params, int32_t n_layers, const int32_t * n_expert,
                       const uint64_t * expert_bytes, spice_store ** out) {
    if (out == NULL || params == NULL || n_layers <= 0 || n_expert == NULL || expert_bytes == NULL ||
        !(params->bandwidth_gbps > 0.0) || params->latency_us < 0.0 ||
        (params->device_kind != SPICE_DEVICE_EMULATED && params->device_kind != SPICE_DEVICE_CUDA) ||
        (params->device_kind == SPICE_DEVICE_CUDA && params->manual_clock)) {
        return SPICE_ERR_INVALID_ARG;
    }
    *out = NULL;
    spice_store * s = (spice_store *) calloc(1, sizeof(*s));
    if (s == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    s->params = *params;
    if (s->params.prefetch_queue_max <= 0) {
        s->params.prefetch_queue_max = SPICE_PREFETCH_QUEUE_DEFAULT;
    }
    s->n_layers = n_layers;
    s->epoch_ns = monotonic_ns();
    uint64_t total_experts = 0, min_bytes = UINT64_MAX;
    for (int32_t il = 0; il < n_layers; ++il) {
        if (n_expert[il] < 0) {
            free(s);
            return SPICE_ERR_INVALID_ARG;
        }
        if (n_expert[il] > s->max_expert) {
            s->max_expert = n_expert[il];
        }
        if (n_expert[il] > 0 && expert_bytes[il] > s->slot_bytes) {
            s->slot_bytes = expert_bytes[il];
        }
        if (n_expert[il] > 0 && expert_bytes[il] < min_bytes) {
            min_bytes = expert_bytes[il];
        }
        total_experts += (uint64_t) n_expert[il];
    }
    if (s->slot_bytes == 0 || params->budget_bytes < min_bytes) {
        free(s);
        return SPICE_ERR_BUDGET;
    }
    /* enough slot records for the budget filled with the smallest experts */
    uint64_t n_slots = params->budget_bytes / min_bytes;
    if (n_slots > total_experts) {
        n_slots = total_experts; /* a budget above the whole model holds all of it */
    }
    s->n_slots = (int32_t) n_slots;

    const size_t cells = (size_t) n_layers * (size_t) s->max_expert;
    s->n_expert = (int32_t *) malloc((size_t) n_layers * sizeof(int32_t));
    s->expert_bytes = (uint64_t *) malloc((size_t) n_layers * sizeof(uint64_t));
    s->slot_of = (int32_t *) malloc(cells * sizeof(int32_t));
    s->states = (int8_t *) calloc(cells, 1);
    s->sources = (spice_store_source *) calloc((size_t) n_layers, sizeof(spice_store_source));
    s->slots = (spice_slot *) malloc((size_t) s->n_slots * sizeof(spice_slot));
    s->free_slots = (int32_t *) malloc((size_t) s->n_slots * sizeof(int32_t));
    s->copies = (spice_copy *) malloc((size_t) s->n_slots * sizeof(spice_copy));
    s->counters = (spice_counters *) calloc((size_t) n_layers, sizeof(spice_counters));
    if (!s->n_expert || !s->expert_bytes || !s->slot_of || !s->states || !s->sources || !s->slots ||
        !s->free_slots || !s->copies || !s->counters) {
        spice_store_free(s);
        return SPICE_ERR_NO_MEMORY;
    }
    memcpy(s->n_expert, n_expert, (size_t) n_layers * sizeof(int32_t));
    memcpy(s->expert_bytes, expert_bytes, (size_t) n_layers * sizeof(uint64_t));
    for (size_t i = 0; i < cells; ++i) {
        s->slot_of[i] = -1;
    }
    for (int32_t i = 0; i < s->n_slots; ++i) {
        s->slots[i] = (spice_slot) { -1, -1, 0, -1, 0, 0, NULL, 0 };
        s->free_slots[i] = s->n_slots - 1 - i; /* pop from the end: slot 0 first */
    }
    s->n_free = s->n_slots;
    *out = s;
    return SPICE_OK;
}

void spice_store_free(spice_store * s) {
    if (s == NULL) {
        return;
    }
    spice_cuda_free(s->cuda);
    free(s->n_expert);
    free(s->expert_bytes);
    free(s->slot_of);
    free(s->states);
    free(s->sources);
    free(s->slots);
    free(s->free_slots);
    free(s->copies);
    free(s->counters);
    for (int32_t i = 0; s->slots != NULL && i < s->n_slots; ++i) {
        free(s->slots[i].memory);
    }
    free(s);
}

int32_t spice_store_n_slots(const spice_store * s) {
    return s ? s->n_slots : 0;
}

uint64_t spice_store_slot_bytes(const spice_store * s) {
    return s ? s->slot_bytes : 0;
}

int32_t spice_store_n_free(const spice_store * s) {
    return s ? s->n_free : 0;
}

int spice_store_bind(spice_store * s, int32_t il, const spice_store_source * source) {
    if (s == NULL || il < 0 || il >= s->n_layers || source == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (source->size[0] + source->size[1] + source->size[2] > s->expert_bytes[il]) {
        return SPICE_ERR_INVALID_ARG;
    }
    s->sources[il] = *source;
    return SPICE_OK;
}

int spice_store_request(spice_store * s, int32_t il, int32_t e, int32_t priority) {
    if (!valid(s, il, e) || (priority != SPICE_PRIORITY_PREFETCH && priority != SPICE_PRIORITY_DEMAND)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const uint64_t now = refresh(s);
    const int32_t slot = *slot_ref(s, il, e);
    if (slot >= 0) {
        const int32_t ci = s->slots[slot].copy;
        if (ci >= 0 && priority == SPICE_PRIORITY_DEMAND && s->copies[ci].priority == SPICE_PRIORITY_PREFETCH &&
            (s->copies[ci].start_ns == NOT_STARTED || s->copies[ci].start_ns > now)) {
            s->copies[ci].priority = SPICE_PRIORITY_DEMAND; /* overtakes the other queued prefetches */
            reschedule(s);
        }
        return SPICE_OK;
    }
    if (s->params.device_kind == SPICE_DEVICE_CUDA && s->cuda == NULL) {
        return SPICE_ERR_STATE; /* no device attached (spice_store_attach_cuda) */
    }
    if (priority == SPICE_PRIORITY_PREFETCH && queued_prefetches(s, now) >= s->params.prefetch_queue_max) {
        return SPICE_ERR_STATE;
    }
    if (s->n_free == 0 || s->used_bytes + s->expert_bytes[il] > s->params.budget_bytes) {
        return SPICE_ERR_BUDGET;
    }
    const int32_t slot_new = s->free_slots[--s->n_free];
    s->used_bytes += s->expert_bytes[il];
    spice_copy * c = &s->copies[s->n_copies];
    c->il = il;
    c->e = e;
    c->slot = slot_new;
    c->priority = priority;
    c->was_prefetch = priority == SPICE_PRIORITY_PREFETCH;
    c->bytes = s->expert_bytes[il];
    c->issue_ns = now;
    c->start_ns = NOT_STARTED;
    c->end_ns = NOT_STARTED;
    spice_slot * fresh = &s->slots[slot_new];
    fresh->il = il;
    fresh->e = e;
    fresh->pins = 0;
    fresh->copy = s->n_copies;
    fresh->from_prefetch = 0;
    fresh->filled = 0; /* memory (if any) is kept for reuse */
    s->n_copies++;
    *slot_ref(s, il, e) = slot_new;
    *state_ref(s, il, e) = SPICE_RES_QUEUED;

    spice_counters * k = &s->counters[il];
    k->bytes_h2d += c->bytes;
    if (s->cuda == NULL) {
        k->copy_ns += occupancy_ns(s, c->bytes); /* a CUDA copy adds its measured time when it lands */
    }
    if (priority == SPICE_PRIORITY_PREFETCH) {
        k->prefetch_issued++;
    }
    reschedule(s);
    return SPICE_OK;
}

int spice_store_evict(spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const uint64_t now = refresh(s);
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0) {
        return SPICE_OK;
    }
    spice_slot * sl = &s->slots[slot];
    if (sl->pins > 0) {
        return SPICE_ERR_STATE;
    }
    if (sl->copy >= 0) {
        const spice_copy * c = &s->copies[sl->copy];
        if (c->start_ns != NOT_STARTED && c->start_ns <= now) {
            return SPICE_ERR_STATE; /* in flight: a bus transfer cannot be taken back */
        }
        spice_counters * k = &s->counters[il];
        k->bytes_h2d -= c->bytes;
        if (s->cuda == NULL) {
            k->copy_ns -= occupancy_ns(s, c->bytes);
        }
        if (c->was_prefetch) {
            k->prefetch_cancelled++;
        }
        remove_copy(s, sl->copy);
        reschedule(s);
    }
    s->used_bytes -= s->expert_bytes[il];
    sl->il = sl->e = sl->copy = -1;
    sl->pins = sl->from_prefetch = sl->filled = 0;
    s->free_slots[s->n_free++] = slot;
    *slot_ref(s, il, e) = -1;
    *state_ref(s, il, e) = SPICE_RES_ABSENT;
    return SPICE_OK;
}

int spice_store_reserve(spice_store * s, int64_t bytes) {
    if (s == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (bytes < 0) {
        const uint64_t release = (uint64_t) -bytes;
        if (release > s->reserved_bytes) {
            return SPICE_ERR_INVALID_ARG;
        }
        s->reserved_bytes -= release;
        s->used_bytes -= release;
        return SPICE_OK;
    }
    if (s->used_bytes + (uint64_t) bytes > s->params.budget_bytes) {
        return SPICE_ERR_BUDGET;
    }
    s->reserved_bytes += (uint64_t) bytes;
    s->used_bytes += (uint64_t) bytes;
    return SPICE_OK;
}

int spice_store_pin(spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0) {
        return SPICE_ERR_STATE;
    }
    s->slots[slot].pins++;
    return SPICE_OK;
}

int spice_store_unpin(spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0 || s->slots[slot].pins == 0) {
        return SPICE_ERR_STATE;
    }
    s->slots[slot].pins--;
    return SPICE_OK;
}

int spice_store_state(spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return -1;
    }
    const uint64_t now = refresh(s);
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0) {
        return SPICE_RES_ABSENT;
    }
    const int32_t ci = s->slots[slot].copy;
    if (ci < 0) {
        return SPICE_RES_RESIDENT;
    }
    const spice_copy * c = &s->copies[ci];
    return (c->start_ns == NOT_STARTED || c->start_ns > now) ? SPICE_RES_QUEUED : SPICE_RES_COPYING;
}

uint64_t spice_store_ready_at(const spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return 0;
    }
    const int32_t slot = s->slot_of[(size_t) il * (size_t) s->max_expert + (size_t) e];
    if (slot < 0 || s->slots[slot].copy < 0) {
        return 0;
    }
    const spice_copy * c = &s->copies[s->slots[slot].copy];
    if (c->end_ns == NOT_STARTED) { /* a CUDA prefetch still in our queue: a guess */
        return monotonic_ns() - s->epoch_ns + occupancy_ns(s, c->bytes);
    }
    return c->end_ns;
}

static void fill_slot(spice_store * s, int32_t slot) {
    spice_slot * sl = &s->slots[slot];
    const spice_store_source * src = &s->sources[sl->il];
    if (sl->filled || src->base[0] == NULL || s->cuda != NULL) {
        return;
    }
    const size_t need = src->size[0] + src->size[1] + src->size[2];
    if (sl->memory_size < need) {
        char * mem = (char *) realloc(sl->memory, need);
        if (mem == NULL) {
            return; /* slot_data() stays NULL: the expert runs on the host */
        }
        sl->memory = mem;
        sl->memory_size = need;
    }
    char * dst = sl->memory;
    for (int k = 0; k < 3; ++k) {
        memcpy(dst, src->base[k] + (size_t) sl->e * src->stride[k], src->size[k]);
        dst += src->size[k];
    }
    sl->filled = 1;
}

int spice_store_wait(spice_store * s, int32_t il, int32_t e, uint64_t * stall_ns) {
    if (!valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    uint64_t now = refresh(s);
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0) {
        return SPICE_ERR_STATE;
    }
    uint64_t stall = 0;
    const int32_t ci = s->slots[slot].copy;
    if (ci >= 0 && s->cuda != NULL) {
        spice_copy * c = &s->copies[ci];
        if (c->start_ns == NOT_STARTED) { /* needed now: it leaves our queue as a demand copy */
            c->priority = SPICE_PRIORITY_DEMAND;
            if (cuda_issue(s, c, now) != SPICE_OK) {
                return SPICE_ERR_INTERNAL;
            }
        }
        const uint64_t t0 = monotonic_ns();
        if (spice_cuda_copy_wait(s->cuda, slot) != SPICE_OK) {
            return SPICE_ERR_INTERNAL;
        }
        stall = monotonic_ns() - t0;
        now = refresh(s);
    } else if (ci >= 0) {
        const uint64_t end = s->copies[ci].end_ns;
        if (end == NOT_STARTED) {
            return SPICE_ERR_NO_MEMORY; /* never scheduled: reschedule ran out of memory */
        }
        stall = end > now ? end - now : 0;
        fill_slot(s, slot); /* the emulated transfer's real bytes move while we wait */
        sleep_until(s, end);
        now = refresh(s);
    }
    fill_slot(s, slot);
    spice_slot * sl = &s->slots[slot];
    spice_counters * k = &s->counters[il];
    k->stall_ns += stall;
    if (sl->from_prefetch) {
        k->prefetch_used++;
        sl->from_prefetch = 0;
    }
    if (stall_ns) {
        *stall_ns = stall;
    }
    (void) now;
    return SPICE_OK;
}

const char * spice_store_slot_data(const spice_store * s, int32_t il, int32_t e) {
    if (!valid(s, il, e)) {
        return NULL;
    }
    const int32_t slot = s->slot_of[(size_t) il * (size_t) s->max_expert + (size_t) e];
    if (slot < 0 || s->slots[slot].copy >= 0 || !s->slots[slot].filled) {
        return NULL;
    }
    return s->cuda != NULL ? spice_cuda_slot(s->cuda, slot) : s->slots[slot].memory;
}

uint64_t spice_store_used_bytes(const spice_store * s) {
    return s ? s->used_bytes : 0;
}

uint64_t spice_store_budget_bytes(const spice_store * s) {
    return s ? s->params.budget_bytes : 0;
}

uint64_t spice_store_now(spice_store * s) {
    return s ? refresh(s) : 0;
}

int spice_store_advance(spice_store * s, uint64_t ns) {
    if (s == NULL || !s->params.manual_clock) {
        return SPICE_ERR_STATE;
    }
    s->now_ns += ns;
    refresh(s);
    return SPICE_OK;
}

int spice_store_get_counters(const spice_store * s, int32_t il, spice_counters * out) {
    if (s == NULL || out == NULL || il < -1 || il >= s->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    for (int32_t l = (il < 0 ? 0 : il); l < (il < 0 ? s->n_layers : il + 1); ++l) {
        const spice_counters * k = &s->counters[l];
        out->bytes_h2d += k->bytes_h2d;
        out->copy_ns += k->copy_ns;
        out->stall_ns += k->stall_ns;
        out->prefetch_issued += k->prefetch_issued;
        out->prefetch_used += k->prefetch_used;
        out->prefetch_cancelled += k->prefetch_cancelled;
    }
    return SPICE_OK;
}

const int8_t * spice_store_states(spice_store * s, int32_t * n_layers, int32_t * max_expert) {
    if (s == NULL) {
        return NULL;
    }
    const uint64_t now = refresh(s);
    for (int32_t i = 0; i < s->n_copies; ++i) {
        const spice_copy * c = &s->copies[i];
        *state_ref(s, c->il, c->e) =
            (int8_t) ((c->start_ns == NOT_STARTED || c->start_ns > now) ? SPICE_RES_QUEUED : SPICE_RES_COPYING);
    }
    if (n_layers) {
        *n_layers = s->n_layers;
    }
    if (max_expert) {
        *max_expert = s->max_expert;
    }
    return s->states;
}

int spice_store_attach_cuda(spice_store * s, size_t slot_stride, char * err, size_t err_len) {
    if (s == NULL || s->params.device_kind != SPICE_DEVICE_CUDA || s->cuda != NULL) {
        return SPICE_ERR_STATE;
    }
    return spice_cuda_create(s->params.device_index, s->n_slots, slot_stride, &s->cuda, err, err_len);
}

int spice_store_is_real(const spice_store * s) {
    return s != NULL && s->cuda != NULL;
}

int spice_store_read_slot(spice_store * s, int32_t il, int32_t e, void * dst, size_t size) {
    if (!valid(s, il, e) || dst == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    refresh(s);
    const int32_t slot = *slot_ref(s, il, e);
    const spice_store_source * src = &s->sources[il];
    if (slot < 0 || s->slots[slot].copy >= 0 || src->base[0] == NULL) {
        return SPICE_ERR_STATE;
    }
    if (size > src->size[0] + src->size[1] + src->size[2]) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (s->cuda == NULL) {
        fill_slot(s, slot);
        if (s->slots[slot].memory == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        memcpy(dst, s->slots[slot].memory, size);
        return SPICE_OK;
    }
    char * out = (char *) dst;
    for (int k = 0; k < 3 && size > 0; ++k) {
        const size_t n = size < src->size[k] ? size : src->size[k];
        if (spice_cuda_read(s->cuda, slot, src->dst_offset[k], out, n) != SPICE_OK) {
            return SPICE_ERR_INTERNAL;
        }
        out += n;
        size -= n;
    }
    return SPICE_OK;
}

int spice_device_count(void) {
    return spice_cuda_device_count();
}

int spice_device_memory(int32_t device, uint64_t * free_bytes, uint64_t * total_bytes) {
    return spice_cuda_device_memory(device, free_bytes, total_bytes);
}
