/* Expert store: slots under a pooled byte budget, the residency table, the
 * copy queue with two priorities, and recency. Bookkeeping only: the bytes
 * and the bus are the device's (spice-device.h), reached through its
 * interface, so nothing here depends on which device it is.
 *
 * Copies wait in the store's queue (demand first, then prefetches, each in
 * the order they were asked for) until the device can start one; a queued
 * copy can still be overtaken by a demand copy or cancelled, a started one
 * cannot. The queue is moved on by every operation (copies start when the
 * device can take them), and landed copies are noticed by ONE device poll
 * (spice_store_poll: the runtime polls once per hook call) or by a wait.
 * The residency table is therefore current as of the last poll plus the
 * store's own changes since, without asking the device on every lookup. */
#include "spice-store-impl.h"
#include "spice-counters.h"

#include <stdlib.h>
#include <string.h>

#define SPICE_PREFETCH_QUEUE_DEFAULT 64

static uint64_t occupancy_ns(const spice_store * s, uint64_t bytes) {
    return (uint64_t) (s->params.latency_us * 1e3 + (double) bytes / s->params.bandwidth_gbps);
}

static int32_t * slot_ref(spice_store * s, int32_t il, int32_t e) {
    return &s->slot_of[spice_store_cell(s, il, e)];
}

static void set_state(spice_store * s, int32_t il, int32_t e, int state) {
    int8_t * st = &s->states[spice_store_cell(s, il, e)];
    s->layer_held[il] += (state != SPICE_RES_ABSENT) - (*st != SPICE_RES_ABSENT);
    s->layer_changed[il] = 1;
    s->row_version[il]++;
    *st = (int8_t) state;
}

/* ---- the queue ------------------------------------------------------------------ */

static void remove_copy(spice_store * s, int32_t index) {
    const int32_t last = s->n_copies - 1;
    if (s->copies[index].started) {
        s->n_started--;
    }
    s->slots[s->copies[index].slot].copy = -1;
    if (index != last) {
        s->copies[index] = s->copies[last];
        s->slots[s->copies[index].slot].copy = index;
    }
    s->n_copies--;
}

/* Queue order: demand first, then in the order asked for. */
static int copy_before(const spice_copy * x, const spice_copy * y) {
    if (x->priority != y->priority) {
        return x->priority > y->priority;
    }
    if (x->issue_ns != y->issue_ns) {
        return x->issue_ns < y->issue_ns;
    }
    return x->seq < y->seq;
}

static int32_t next_queued(const spice_store * s) {
    int32_t best = -1;
    for (int32_t i = 0; i < s->n_copies; ++i) {
        if (!s->copies[i].started && (best < 0 || copy_before(&s->copies[i], &s->copies[best]))) {
            best = i;
        }
    }
    return best;
}

void spice_store_expert_copy(const spice_store * s, int32_t il, int32_t e, spice_device_copy * dc) {
    const spice_store_source * src = &s->sources[il];
    memset(dc, 0, sizeof(*dc));
    for (int k = 0; k < 3; ++k) {
        if (src->base[k] != NULL) { /* unbound layers (standalone stores) move no bytes from memory */
            dc->src[k] = src->base[k] + (size_t) e * src->stride[k];
        }
        dc->file_offset[k] = src->file_offset[k] + (uint64_t) e * src->stride[k];
        dc->size[k] = src->size[k];
        dc->dst_offset[k] = src->dst_offset[k];
        dc->pad[k] = src->pad[k];
    }
    dc->bytes = s->expert_bytes[il];
    dc->priority = SPICE_PRIORITY_DEMAND;
}

static spice_device_copy device_copy(const spice_store * s, const spice_copy * c) {
    spice_device_copy dc;
    spice_store_expert_copy(s, c->il, c->e, &dc);
    dc.bytes = c->bytes;
    dc.priority = c->priority;
    return dc;
}

/* Hand the device the queued copies it can start by now, in queue order. */
static void start_copies(spice_store * s, uint64_t now) {
    spice_device * dev = s->device;
    while (dev != NULL && s->n_started < s->n_copies && dev->iface->copy_can_start(dev, now, s->n_started)) {
        spice_copy * c = &s->copies[next_queued(s)];
        const spice_device_copy dc = device_copy(s, c);
        if (dev->iface->copy_issue(dev, c->slot, &dc, c->issue_ns, &c->start_ns, &c->end_ns) != SPICE_OK) {
            return; /* stays queued; a wait on it reports the failure */
        }
        c->started = 1;
        s->n_started++;
        set_state(s, c->il, c->e, SPICE_RES_COPYING);
        spice_store_op_counters(s)->device_copies++;
    }
}

static void land(spice_store * s, int32_t index) {
    const spice_copy * c = &s->copies[index];
    s->slots[c->slot].from_prefetch = c->was_prefetch;
    s->counters[c->il].copy_ns += s->device->iface->copy_ns(s->device, c->slot);
    set_state(s, c->il, c->e, SPICE_RES_RESIDENT);
    remove_copy(s, index);
}

static int32_t queued_prefetches(const spice_store * s) {
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_copies; ++i) {
        n += s->copies[i].priority == SPICE_PRIORITY_PREFETCH && !s->copies[i].started;
    }
    return n;
}

/* ---- life cycle --------------------------------------------------------------------- */

uint64_t spice_store_slot_bytes_for(int32_t n_layers, const int32_t * n_expert, const uint64_t * expert_bytes) {
    uint64_t largest = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        if (n_expert[il] > 0 && expert_bytes[il] > largest) {
            largest = expert_bytes[il];
        }
    }
    return largest;
}

int spice_store_default_params(spice_store_params * out) {
    if (out == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    out->bandwidth_gbps = 16.0;
    out->latency_us = 10.0;
    out->prefetch_queue_max = SPICE_PREFETCH_QUEUE_DEFAULT;
    out->device_kind = SPICE_DEVICE_EMULATED;
    out->path = NULL;
    out->io_threads = SPICE_DISK_THREADS_DEFAULT;
    out->executor = SPICE_EXECUTOR_AUTO;
    out->slot_precision = SPICE_SLOT_EXACT;
    return SPICE_OK;
}

int spice_store_create_unattached(const spice_store_params * params, int32_t n_layers, const int32_t * n_expert,
                                  const uint64_t * expert_bytes, spice_store ** out) {
    if (out == NULL || params == NULL || n_layers <= 0 || n_expert == NULL || expert_bytes == NULL ||
        !(params->bandwidth_gbps > 0.0) || params->latency_us < 0.0 || spice_device_type_of(params->device_kind) == NULL ||
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
    s->call_il = -1;
    spice_clock_init(&s->clock, params->manual_clock);
    uint64_t total_experts = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        if (n_expert[il] < 0) {
            free(s);
            return SPICE_ERR_INVALID_ARG;
        }
        if (n_expert[il] > s->max_expert) {
            s->max_expert = n_expert[il];
        }
        total_experts += (uint64_t) n_expert[il];
    }
    s->slot_bytes = spice_store_slot_bytes_for(n_layers, n_expert, expert_bytes);
    if (s->slot_bytes == 0 || params->budget_bytes < s->slot_bytes) {
        free(s);
        return SPICE_ERR_BUDGET;
    }
    /* Slots are all the largest expert's size (a device lays them out at one
     * stride), so the budget bounds slots, not the experts' own bytes:
     * counting a smaller expert at its size would let the slots outgrow the
     * budget on a model whose layers mix quantization types (by 19% on
     * DeepSeek-V2-Lite Q4_K_M, whose down projections are Q5_0 or Q8_0). */
    uint64_t n_slots = params->budget_bytes / s->slot_bytes;
    if (n_slots > total_experts) {
        n_slots = total_experts; /* a budget above the whole model holds all of it */
    }
    s->n_slots = (int32_t) n_slots;

    const size_t cells = (size_t) n_layers * (size_t) s->max_expert;
    const size_t width = (size_t) (s->max_expert > 0 ? s->max_expert : 1);
    s->n_expert = (int32_t *) malloc((size_t) n_layers * sizeof(int32_t));
    s->expert_bytes = (uint64_t *) malloc((size_t) n_layers * sizeof(uint64_t));
    s->slot_of = (int32_t *) malloc(cells * sizeof(int32_t));
    s->states = (int8_t *) calloc(cells, 1);
    s->sources = (spice_store_source *) calloc((size_t) n_layers, sizeof(spice_store_source));
    s->slots = (spice_slot *) malloc((size_t) s->n_slots * sizeof(spice_slot));
    s->free_slots = (int32_t *) malloc((size_t) s->n_slots * sizeof(int32_t));
    s->copies = (spice_copy *) malloc((size_t) s->n_slots * sizeof(spice_copy));
    s->counters = (spice_counters *) calloc((size_t) n_layers, sizeof(spice_counters));
    s->last_use = (uint64_t *) calloc(cells, sizeof(uint64_t));
    s->layer_held = (int32_t *) calloc((size_t) n_layers, sizeof(int32_t));
    s->layer_changed = (uint8_t *) calloc((size_t) n_layers, 1);
    s->row_version = (uint32_t *) calloc((size_t) n_layers, sizeof(uint32_t));
    s->scratch.need = (uint8_t *) calloc(width, 1);
    s->scratch.pinned = (uint8_t *) calloc(width, 1);
    s->scratch.kept = (uint8_t *) calloc(cells, 1);
    s->scratch.rank = (int32_t *) calloc((size_t) n_layers, sizeof(int32_t));
    s->scratch.started = (int32_t *) calloc((size_t) s->n_slots, sizeof(int32_t));
    s->scratch.landed = (uint8_t *) calloc((size_t) s->n_slots, 1);
    if (!s->n_expert || !s->expert_bytes || !s->slot_of || !s->states || !s->sources || !s->slots ||
        !s->free_slots || !s->copies || !s->counters || !s->last_use || !s->layer_held || !s->layer_changed ||
        !s->row_version || !s->scratch.need || !s->scratch.pinned || !s->scratch.kept || !s->scratch.rank ||
        !s->scratch.started || !s->scratch.landed) {
        spice_store_free(s);
        return SPICE_ERR_NO_MEMORY;
    }
    memcpy(s->n_expert, n_expert, (size_t) n_layers * sizeof(int32_t));
    memset(s->layer_changed, 1, (size_t) n_layers); /* no rule has looked yet */
    s->epoch = spice_monotonic_ns() | 1u; /* nonzero, and another store's (created at another time) */
    memcpy(s->expert_bytes, expert_bytes, (size_t) n_layers * sizeof(uint64_t));
    for (size_t i = 0; i < cells; ++i) {
        s->slot_of[i] = -1;
    }
    for (int32_t i = 0; i < s->n_slots; ++i) {
        s->slots[i] = (spice_slot) { -1, -1, 0, -1, 0 };
        s->free_slots[i] = s->n_slots - 1 - i; /* pop from the end: slot 0 first */
    }
    s->n_free = s->n_slots;
    *out = s;
    return SPICE_OK;
}

int spice_store_create(const spice_store_params * params, int32_t n_layers, const int32_t * n_expert,
                       const uint64_t * expert_bytes, spice_store ** out) {
    spice_store * s = NULL;
    int status = spice_store_create_unattached(params, n_layers, n_expert, expert_bytes, &s);
    if (status != SPICE_OK) {
        return status;
    }
    /* no host weights bound: slots hold experts back to back and no bytes
     * move, except on a disk device, which reads the file as if it held the
     * layers' experts back to back from offset 0 */
    if (params->device_kind == SPICE_DEVICE_DISK) {
        uint64_t offset = 0;
        for (int32_t il = 0; il < n_layers; ++il) {
            spice_store_source src;
            memset(&src, 0, sizeof(src));
            src.file_offset[0] = offset;
            src.stride[0] = (size_t) expert_bytes[il];
            src.size[0] = (size_t) expert_bytes[il];
            s->sources[il] = src;
            offset += (uint64_t) n_expert[il] * expert_bytes[il];
        }
    }
    const spice_device_params dp = { params->bandwidth_gbps, params->latency_us, params->device_index, s->n_slots,
                                     (size_t) s->slot_bytes, params->path, params->io_threads,
                                     params->io_fault_after, NULL /* a bare store's waits run to the end */,
                                     NULL /* no layer shapes: no pool */, params->executor };
    spice_device * dev = NULL;
    status = spice_device_type_of(params->device_kind)->create(&dp, &s->clock, &dev, NULL, 0);
    if (status == SPICE_OK) {
        status = spice_store_attach_device(s, dev);
    }
    if (status != SPICE_OK) {
        spice_device_free(dev);
        spice_store_free(s);
        return status;
    }
    *out = s;
    return SPICE_OK;
}

void spice_store_free(spice_store * s) {
    if (s == NULL) {
        return;
    }
    spice_device_free(s->device);
    if (s->free_rule != NULL) {
        s->free_rule(s);
    }
    free(s->n_expert);
    free(s->expert_bytes);
    free(s->slot_of);
    free(s->states);
    free(s->sources);
    free(s->slots);
    free(s->free_slots);
    free(s->copies);
    free(s->counters);
    free(s->last_use);
    free(s->layer_held);
    free(s->layer_changed);
    free(s->row_version);
    free(s->scratch.need);
    free(s->scratch.pinned);
    free(s->scratch.kept);
    free(s->scratch.rank);
    free(s->scratch.started);
    free(s->scratch.landed);
    free(s);
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

int spice_store_attach_device(spice_store * s, spice_device * dev) {
    if (s == NULL || dev == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (s->device != NULL) {
        return SPICE_ERR_STATE;
    }
    s->device = dev;
    return SPICE_OK;
}

spice_device * spice_store_device(spice_store * s) {
    return s ? s->device : NULL;
}

spice_clock * spice_store_clock(spice_store * s) {
    return s ? &s->clock : NULL;
}

/* ---- sizes ---------------------------------------------------------------------- */

int32_t spice_store_n_slots(const spice_store * s) {
    return s ? s->n_slots : 0;
}

uint64_t spice_store_slot_bytes(const spice_store * s) {
    return s ? s->slot_bytes : 0;
}

uint64_t spice_store_expert_bytes(const spice_store * s, int32_t il) {
    return s != NULL && il >= 0 && il < s->n_layers ? s->expert_bytes[il] : 0;
}

int32_t spice_store_n_free(const spice_store * s) {
    return s ? s->n_free : 0;
}

uint64_t spice_store_used_bytes(const spice_store * s) {
    return s ? s->used_bytes : 0;
}

uint64_t spice_store_budget_bytes(const spice_store * s) {
    return s ? s->params.budget_bytes : 0;
}

/* ---- operations ----------------------------------------------------------------- */

int spice_store_poll(spice_store * s) {
    if (s == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_counters * k = spice_store_op_counters(s);
    k->store_polls++;
    if (s->device == NULL) {
        return SPICE_OK;
    }
    const uint64_t now = spice_clock_now(&s->clock);
    start_copies(s, now);
    if (s->n_started > 0) {
        int32_t n = 0;
        for (int32_t i = 0; i < s->n_copies; ++i) {
            if (s->copies[i].started) {
                s->scratch.started[n++] = s->copies[i].slot;
            }
        }
        if (s->device->iface->copy_poll(s->device, now, s->scratch.started, n, s->scratch.landed) != SPICE_OK) {
            return SPICE_ERR_INTERNAL;
        }
        for (int32_t i = 0; i < n; ++i) {
            if (s->scratch.landed[i]) {
                land(s, s->slots[s->scratch.started[i]].copy);
            }
        }
        start_copies(s, now); /* room on the device again */
    }
    return SPICE_OK;
}

int spice_store_request(spice_store * s, int32_t il, int32_t e, int32_t priority) {
    if (!spice_store_valid(s, il, e) || (priority != SPICE_PRIORITY_PREFETCH && priority != SPICE_PRIORITY_DEMAND)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const uint64_t now = spice_clock_now(&s->clock);
    start_copies(s, now); /* what has started by now can no longer be overtaken */
    const int32_t slot = *slot_ref(s, il, e);
    if (slot >= 0) {
        const int32_t ci = s->slots[slot].copy;
        if (ci >= 0 && priority == SPICE_PRIORITY_DEMAND && !s->copies[ci].started) {
            s->copies[ci].priority = SPICE_PRIORITY_DEMAND; /* overtakes the other queued prefetches */
        }
        return SPICE_OK;
    }
    if (s->device == NULL) {
        return SPICE_ERR_STATE; /* nothing to copy into (a CUDA store before its device is attached) */
    }
    if (priority == SPICE_PRIORITY_PREFETCH && queued_prefetches(s) >= s->params.prefetch_queue_max) {
        return SPICE_ERR_STATE;
    }
    if (s->n_free == 0 || s->used_bytes + s->slot_bytes > s->params.budget_bytes) {
        return SPICE_ERR_BUDGET;
    }
    const int32_t slot_new = s->free_slots[--s->n_free];
    s->used_bytes += s->slot_bytes;
    spice_copy * c = &s->copies[s->n_copies];
    memset(c, 0, sizeof(*c));
    c->il = il;
    c->e = e;
    c->slot = slot_new;
    c->priority = priority;
    c->was_prefetch = priority == SPICE_PRIORITY_PREFETCH;
    c->bytes = s->expert_bytes[il];
    c->issue_ns = now;
    c->seq = ++s->n_requested;
    s->slots[slot_new] = (spice_slot) { il, e, 0, s->n_copies, 0 };
    s->n_copies++;
    *slot_ref(s, il, e) = slot_new;
    set_state(s, il, e, SPICE_RES_QUEUED);

    spice_counters * k = &s->counters[il];
    k->bytes_h2d += c->bytes;
    if (priority == SPICE_PRIORITY_PREFETCH) {
        k->prefetch_issued++;
    }
    start_copies(s, now);
    return SPICE_OK;
}

int spice_store_evict(spice_store * s, int32_t il, int32_t e) {
    if (!spice_store_valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    start_copies(s, spice_clock_now(&s->clock));
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
        if (c->started) {
            return SPICE_ERR_STATE; /* on the bus (or landed unseen): a transfer cannot be taken back */
        }
        spice_counters * k = &s->counters[il];
        k->bytes_h2d -= c->bytes;
        if (c->was_prefetch) {
            k->prefetch_cancelled++;
        }
        remove_copy(s, sl->copy);
    }
    s->used_bytes -= s->slot_bytes;
    *sl = (spice_slot) { -1, -1, 0, -1, 0 };
    s->free_slots[s->n_free++] = slot;
    *slot_ref(s, il, e) = -1;
    set_state(s, il, e, SPICE_RES_ABSENT);
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
    if (!spice_store_valid(s, il, e)) {
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
    if (!spice_store_valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0 || s->slots[slot].pins == 0) {
        return SPICE_ERR_STATE;
    }
    s->slots[slot].pins--;
    return SPICE_OK;
}

int spice_store_state(const spice_store * s, int32_t il, int32_t e) {
    if (!spice_store_valid(s, il, e)) {
        return -1;
    }
    return s->states[spice_store_cell(s, il, e)];
}

uint64_t spice_store_ready_at(spice_store * s, int32_t il, int32_t e) {
    if (!spice_store_valid(s, il, e)) {
        return 0;
    }
    const uint64_t now = spice_clock_now(&s->clock);
    start_copies(s, now);
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0 || s->slots[slot].copy < 0) {
        return 0;
    }
    const spice_copy * target = &s->copies[s->slots[slot].copy];
    if (target->started) {
        return target->end_ns;
    }
    /* queued: it lands after the started copies and the queued ones ahead of it */
    uint64_t cursor = now;
    for (int32_t i = 0; i < s->n_copies; ++i) {
        if (s->copies[i].started && s->copies[i].end_ns > cursor) {
            cursor = s->copies[i].end_ns;
        }
    }
    for (int32_t i = 0; i < s->n_copies; ++i) {
        const spice_copy * c = &s->copies[i];
        if (!c->started && (c == target || copy_before(c, target))) {
            cursor += occupancy_ns(s, c->bytes);
        }
    }
    return cursor;
}

int spice_store_wait(spice_store * s, int32_t il, int32_t e, uint64_t * stall_ns) {
    if (!spice_store_valid(s, il, e)) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0) {
        return SPICE_ERR_STATE; /* refused without side effects: the queue does not move */
    }
    start_copies(s, spice_clock_now(&s->clock));
    spice_device * dev = s->device;
    uint64_t stall = 0;
    if (s->slots[slot].copy >= 0) {
        /* queued: the copies ahead of it go first (a caller that needs it sooner asks
         * for it as demand first, as a plan does), so the wait is what ready_at said;
         * the device is busy with them: wait them out one by one */
        while (!s->copies[s->slots[slot].copy].started) {
            int32_t first = -1;
            for (int32_t i = 0; i < s->n_copies; ++i) {
                if (s->copies[i].started && (first < 0 || s->copies[i].start_ns < s->copies[first].start_ns)) {
                    first = i;
                }
            }
            if (first < 0) {
                return SPICE_ERR_INTERNAL; /* nothing on the device, and it would not start ours */
            }
            uint64_t waited = 0;
            spice_store_op_counters(s)->device_waits++;
            if (dev->iface->copy_wait(dev, s->copies[first].slot, &waited) != SPICE_OK) {
                return SPICE_ERR_INTERNAL;
            }
            stall += waited;
            land(s, first);
            start_copies(s, spice_clock_now(&s->clock));
        }
        uint64_t waited = 0;
        spice_store_op_counters(s)->device_waits++;
        if (dev->iface->copy_wait(dev, slot, &waited) != SPICE_OK) {
            return SPICE_ERR_INTERNAL;
        }
        stall += waited;
        land(s, s->slots[slot].copy);
        start_copies(s, spice_clock_now(&s->clock)); /* room on the device again, as after a poll */
    }
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
    return SPICE_OK;
}

const char * spice_store_slot_data(spice_store * s, int32_t il, int32_t e) {
    if (!spice_store_valid(s, il, e) || s->device == NULL) {
        return NULL;
    }
    const int32_t slot = *slot_ref(s, il, e);
    if (slot < 0 || s->slots[slot].copy >= 0) {
        return NULL;
    }
    return s->device->iface->slot_data(s->device, slot);
}

int32_t spice_store_slot_index(const spice_store * s, int32_t il, int32_t e) {
    if (!spice_store_valid(s, il, e)) {
        return -1;
    }
    const int32_t slot = s->slot_of[spice_store_cell(s, il, e)];
    return slot >= 0 && s->slots[slot].copy < 0 ? slot : -1;
}

uint64_t spice_store_now(spice_store * s) {
    return s ? spice_clock_now(&s->clock) : 0;
}

int spice_store_advance(spice_store * s, uint64_t ns) {
    if (s == NULL || !s->clock.manual) {
        return SPICE_ERR_STATE;
    }
    s->clock.now_ns += ns;
    return spice_store_poll(s);
}

int spice_store_get_counters(const spice_store * s, int32_t il, spice_counters * out) {
    if (s == NULL || out == NULL || il < -1 || il >= s->n_layers) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    for (int32_t l = (il < 0 ? 0 : il); l < (il < 0 ? s->n_layers : il + 1); ++l) {
        spice_counters_accumulate(out, &s->counters[l]);
    }
    return SPICE_OK;
}

void spice_store_reset_counters(spice_store * s) {
    if (s != NULL) {
        memset(s->counters, 0, (size_t) s->n_layers * sizeof(spice_counters));
    }
}

const int8_t * spice_store_states(const spice_store * s, int32_t * n_layers, int32_t * max_expert) {
    if (s == NULL) {
        return NULL;
    }
    if (n_layers) {
        *n_layers = s->n_layers;
    }
    if (max_expert) {
        *max_expert = s->max_expert;
    }
    return s->states;
}

const uint32_t * spice_store_row_versions(const spice_store * s, uint64_t * epoch) {
    if (s == NULL) {
        return NULL;
    }
    *epoch = s->epoch;
    return s->row_version;
}

int spice_store_is_real(const spice_store * s) {
    return s != NULL && spice_device_can_execute(s->device);
}

int spice_store_set_virtual_clock(spice_store * s, int virtual_clock) {
    if (s == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (s->params.device_kind != SPICE_DEVICE_EMULATED) {
        return SPICE_ERR_STATE;
    }
    spice_clock_set_manual(&s->clock, virtual_clock);
    return SPICE_OK;
}

int spice_store_read_slot(spice_store * s, int32_t il, int32_t e, void * dst, size_t size) {
    if (!spice_store_valid(s, il, e) || dst == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t slot = *slot_ref(s, il, e);
    const spice_store_source * src = &s->sources[il];
    if (slot < 0 || s->slots[slot].copy >= 0 || src->size[0] == 0 || s->device == NULL) {
        return SPICE_ERR_STATE;
    }
    if (size > src->size[0] + src->size[1] + src->size[2]) {
        return SPICE_ERR_INVALID_ARG;
    }
    char * out = (char *) dst;
    for (int k = 0; k < 3 && size > 0; ++k) {
        const size_t n = size < src->size[k] ? size : src->size[k];
        const int rc = s->device->iface->slot_read(s->device, slot, src->dst_offset[k], out, n);
        if (rc != SPICE_OK) {
            return rc;
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
