/* The emulated device (CPU-only builds, and any build asked to emulate):
 * slots are host memory and the bus is a virtual serial timeline on the
 * store's clock. A copy started at s lands at s + latency + bytes /
 * bandwidth; the next one starts when the bus is free, which may be in the
 * past of the moment it is handed over (the store catches the timeline up
 * lazily, whenever it looks). No thread is added: whoever needs a copy
 * before it lands sleeps until then. The bytes move into slot memory when
 * the expert is first needed, so the emulation's cost falls where the data
 * is used. */
#include "spice-device.h"
#include "spice.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct emulated_slot {
    char * memory;           /* kept across reuse */
    size_t memory_size;
    spice_device_copy copy;  /* the last copy started into this slot */
    uint64_t start_ns, end_ns;
    int filled;              /* copy's bytes are in memory */
} emulated_slot;

/* How often a copy wait looks at the cancel flag: Ctrl-C latency on a slow bus. */
#define EMULATED_WAIT_SLICE_NS 10000000ull

typedef struct emulated {
    spice_clock * clock;
    atomic_int * cancel;     /* see spice_device_params */
    double bandwidth_gbps;
    double latency_us;
    uint64_t bus_free_ns;    /* when the last copy started lands */
    int32_t n_slots;
    emulated_slot * slots;
} emulated;

static emulated * ctx_of(spice_device * dev) {
    return (emulated *) dev->context;
}

static void emulated_free(spice_device * dev) {
    emulated * em = ctx_of(dev);
    for (int32_t i = 0; i < em->n_slots; ++i) {
        free(em->slots[i].memory);
    }
    free(em->slots);
    free(em);
    free(dev);
}

/* Move the slot's bytes in (once per copy). 0 when memory ran out. */
static int fill(emulated_slot * s) {
    if (s->filled) {
        return 1;
    }
    size_t need = 0;
    for (int k = 0; k < 3; ++k) {
        if (s->copy.dst_offset[k] + s->copy.size[k] > need) {
            need = s->copy.dst_offset[k] + s->copy.size[k];
        }
    }
    if (s->memory_size < need) {
        char * mem = (char *) realloc(s->memory, need);
        if (mem == NULL) {
            return 0;
        }
        s->memory = mem;
        s->memory_size = need;
    }
    for (int k = 0; k < 3; ++k) {
        if (s->copy.src[k] != NULL) {
            memcpy(s->memory + s->copy.dst_offset[k], s->copy.src[k], s->copy.size[k]);
        }
    }
    s->filled = 1;
    return 1;
}

static const char * emulated_slot_data(spice_device * dev, int32_t slot) {
    emulated_slot * s = &ctx_of(dev)->slots[slot];
    if (s->copy.src[0] == NULL || !fill(s)) {
        return NULL; /* nothing bound (no bytes move), or no memory: the expert runs on the host */
    }
    return s->memory;
}

static int emulated_slot_read(spice_device * dev, int32_t slot, size_t offset, void * dst, size_t n) {
    emulated_slot * s = &ctx_of(dev)->slots[slot];
    if (!fill(s)) {
        return SPICE_ERR_NO_MEMORY;
    }
    if (offset + n > s->memory_size) {
        return SPICE_ERR_INVALID_ARG;
    }
    memcpy(dst, s->memory + offset, n);
    return SPICE_OK;
}

static int emulated_can_start(spice_device * dev, uint64_t now, int32_t n_in_flight) {
    (void) n_in_flight; /* one bus: the timeline itself serializes copies */
    return ctx_of(dev)->bus_free_ns <= now;
}

static int emulated_issue(spice_device * dev, int32_t slot, const spice_device_copy * copy, uint64_t not_before,
                          uint64_t * start_ns, uint64_t * end_ns) {
    emulated * em = ctx_of(dev);
    emulated_slot * s = &em->slots[slot];
    s->copy = *copy;
    s->filled = 0;
    s->start_ns = em->bus_free_ns > not_before ? em->bus_free_ns : not_before;
    s->end_ns = s->start_ns + (uint64_t) (em->latency_us * 1e3 + (double) copy->bytes / em->bandwidth_gbps);
    em->bus_free_ns = s->end_ns;
    *start_ns = s->start_ns;
    *end_ns = s->end_ns;
    return SPICE_OK;
}

static int emulated_poll(spice_device * dev, uint64_t now, const int32_t * slots, int32_t n, uint8_t * landed) {
    const emulated * em = ctx_of(dev);
    for (int32_t i = 0; i < n; ++i) {
        landed[i] = em->slots[slots[i]].end_ns <= now;
    }
    return SPICE_OK;
}

static int emulated_wait(spice_device * dev, int32_t slot, uint64_t * stall_ns) {
    emulated * em = ctx_of(dev);
    emulated_slot * s = &em->slots[slot];
    const uint64_t now = spice_clock_now(em->clock);
    fill(s); /* the transfer's real bytes move while we wait */
    if (spice_clock_sleep_until_cancel(em->clock, s->end_ns, em->cancel, EMULATED_WAIT_SLICE_NS)) {
        /* given up on (Ctrl-C): the bytes are in the slot already, so the copy
         * lands now; the bus is free from now if it was the last one on it */
        const uint64_t cut = spice_clock_now(em->clock);
        if (em->bus_free_ns == s->end_ns) {
            em->bus_free_ns = cut;
        }
        s->start_ns = s->start_ns < cut ? s->start_ns : cut;
        s->end_ns = cut;
    }
    *stall_ns = s->end_ns > now ? s->end_ns - now : 0;
    return SPICE_OK;
}

static uint64_t emulated_copy_ns(spice_device * dev, int32_t slot) {
    const emulated_slot * s = &ctx_of(dev)->slots[slot];
    return s->end_ns - s->start_ns;
}

static const spice_device_i emulated_iface = {
    /* .name           = */ "emulated",
    /* .free           = */ emulated_free,
    /* .slot_data      = */ emulated_slot_data,
    /* .slot_read      = */ emulated_slot_read,
    /* .copy_can_start = */ emulated_can_start,
    /* .copy_issue     = */ emulated_issue,
    /* .copy_poll      = */ emulated_poll,
    /* .copy_wait      = */ emulated_wait,
    /* .copy_ns        = */ emulated_copy_ns,
    /* .exec_begin     = */ NULL,
    /* .exec_end       = */ NULL,
    /* .host_prepare   = */ NULL,
    /* .host_read      = */ NULL,
    /* .io_totals      = */ NULL,
    /* .last_error     = */ NULL,
};

static int emulated_create(const spice_device_params * p, spice_clock * clock, spice_device ** out, char * err,
                           size_t err_len) {
    *out = NULL;
    spice_device * dev = (spice_device *) calloc(1, sizeof(*dev));
    emulated * em = (emulated *) calloc(1, sizeof(*em));
    emulated_slot * slots = (emulated_slot *) calloc((size_t) (p->n_slots > 0 ? p->n_slots : 1), sizeof(*slots));
    if (dev == NULL || em == NULL || slots == NULL) {
        free(dev);
        free(em);
        free(slots);
        if (err && err_len) {
            snprintf(err, err_len, "out of memory for %d emulated slots", p->n_slots);
        }
        return SPICE_ERR_NO_MEMORY;
    }
    em->clock = clock;
    em->cancel = p->cancel;
    em->bandwidth_gbps = p->bandwidth_gbps;
    em->latency_us = p->latency_us;
    em->n_slots = p->n_slots;
    em->slots = slots;
    dev->iface = &emulated_iface;
    dev->context = em;
    *out = dev;
    return SPICE_OK;
}

size_t spice_device_packed_layout(const spice_expert_layer * L, spice_store_source * src) {
    (void) L;
    size_t offset = 0;
    for (int k = 0; k < 3; ++k) {
        src->dst_offset[k] = offset;
        src->pad[k] = 0;
        offset += src->size[k];
    }
    return offset;
}

const spice_device_type spice_device_type_emulated = {
    /* .name        = */ "emulated",
    /* .slot_layout = */ spice_device_packed_layout,
    /* .create      = */ emulated_create,
};

const spice_device_type * spice_device_type_of(int32_t kind) {
    switch (kind) {
        case SPICE_DEVICE_EMULATED: return &spice_device_type_emulated;
        case SPICE_DEVICE_CUDA:     return &spice_device_type_cuda;
        case SPICE_DEVICE_DISK:     return &spice_device_type_disk;
        default:                    return NULL;
    }
}
