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
#include "spice-pool-exec.h"
#include "spice.h"

#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef struct emulated_slot {
    char * memory;           /* kept across reuse (own memory; NULL in pool mode) */
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

    /* pool mode (an executor that computes was asked for): slots live in one
     * pool laid out as a CUDA device's, and device pairs run through the
     * slot-pool graph on ggml's CPU backend, on the hook's thread 0 */
    spice_pool_layout layout;
    char * pool;             /* NULL: own memory per slot, no executor */
    size_t pool_size;
    ggml_backend_t cpu;
    ggml_backend_buffer_t pool_buf;
    spice_pool_exec * exec;
} emulated;

static emulated * ctx_of(spice_device * dev) {
    return (emulated *) dev->context;
}

static void emulated_free(spice_device * dev) {
    emulated * em = ctx_of(dev);
    for (int32_t i = 0; i < em->n_slots; ++i) {
        free(em->slots[i].memory);
    }
    spice_pool_exec_free(em->exec);
    if (em->pool_buf) {
        ggml_backend_buffer_free(em->pool_buf);
    }
    if (em->cpu) {
        ggml_backend_free(em->cpu);
    }
    if (em->pool) {
        munmap(em->pool, em->pool_size);
    }
    free(em->slots);
    free(em);
    free(dev);
}

/* Where matrix k of the copy in slot `slot` goes (see spice_pool_offset). */
static char * matrix_addr(emulated * em, int32_t slot, int k) {
    const emulated_slot * s = &em->slots[slot];
    if (em->pool != NULL) {
        return em->pool + spice_pool_copy_offset(&em->layout, slot, k, s->copy.dst_offset[k]);
    }
    return s->memory + s->copy.dst_offset[k];
}

/* Move the slot's bytes in (once per copy). 0 when memory ran out. */
static int fill(emulated * em, int32_t slot) {
    emulated_slot * s = &em->slots[slot];
    if (s->filled) {
        return 1;
    }
    size_t need = 0;
    for (int k = 0; em->pool == NULL && k < 3; ++k) {
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
            char * dst = matrix_addr(em, slot, k);
            memcpy(dst, s->copy.src[k], s->copy.size[k]);
            if (em->pool != NULL) { /* a larger previous occupant's bytes must not show through */
                memset(dst + s->copy.size[k], 0, s->copy.pad[k]);
            }
        }
    }
    s->filled = 1;
    return 1;
}

static const char * emulated_slot_data(spice_device * dev, int32_t slot) {
    emulated * em = ctx_of(dev);
    emulated_slot * s = &em->slots[slot];
    if (s->copy.src[0] == NULL || !fill(em, slot)) {
        return NULL; /* nothing bound (no bytes move), or no memory: the expert runs on the host */
    }
    return em->pool != NULL ? matrix_addr(em, slot, 0) : s->memory;
}

static int emulated_slot_read(spice_device * dev, int32_t slot, size_t offset, void * dst, size_t n) {
    emulated * em = ctx_of(dev);
    emulated_slot * s = &em->slots[slot];
    if (!fill(em, slot)) {
        return SPICE_ERR_NO_MEMORY;
    }
    if (em->pool != NULL) {
        const int64_t at = spice_pool_slot_range(&em->layout, slot, offset, n);
        if (at < 0) {
            return SPICE_ERR_INVALID_ARG;
        }
        memcpy(dst, em->pool + at, n);
        return SPICE_OK;
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
    fill(em, slot); /* the transfer's real bytes move while we wait */
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

/* Pool mode: the job's slots hold their bytes, then the pool graph runs
 * (synchronously: the CPU backend computes inside begin, on thread 0). */
static int emulated_exec_begin(spice_device * dev, const spice_device_job * job, char * err, size_t err_len) {
    emulated * em = ctx_of(dev);
    for (int32_t e = 0; e < job->layer->n_expert; ++e) {
        if (job->slot_of[e] >= 0 && !fill(em, job->slot_of[e])) {
            snprintf(err, err_len, "emulated device: out of memory filling slot %d", job->slot_of[e]);
            return SPICE_ERR_NO_MEMORY;
        }
    }
    return spice_pool_exec_begin(em->exec, job, err, err_len);
}

static int emulated_exec_end(spice_device * dev, float * y, char * err, size_t err_len) {
    return spice_pool_exec_end(ctx_of(dev)->exec, y, err, err_len);
}

static int emulated_exec_supports(spice_device * dev, const spice_expert_layer * L, int32_t n_tokens,
                                  int32_t n_used) {
    return spice_pool_exec_ready(ctx_of(dev)->exec, L, n_tokens, n_used) == SPICE_OK;
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
    /* .exec_supports  = */ NULL,
    /* .host_prepare   = */ NULL,
    /* .host_read      = */ NULL,
    /* .io_totals      = */ NULL,
    /* .last_error     = */ NULL,
};

static const spice_device_i emulated_pool_iface = {
    /* .name           = */ "emulated",
    /* .free           = */ emulated_free,
    /* .slot_data      = */ emulated_slot_data,
    /* .slot_read      = */ emulated_slot_read,
    /* .copy_can_start = */ emulated_can_start,
    /* .copy_issue     = */ emulated_issue,
    /* .copy_poll      = */ emulated_poll,
    /* .copy_wait      = */ emulated_wait,
    /* .copy_ns        = */ emulated_copy_ns,
    /* .exec_begin     = */ emulated_exec_begin,
    /* .exec_end       = */ emulated_exec_end,
    /* .exec_supports  = */ emulated_exec_supports,
    /* .host_prepare   = */ NULL,
    /* .host_read      = */ NULL,
    /* .io_totals      = */ NULL,
    /* .last_error     = */ NULL,
};

/* The pool, ggml's CPU backend on one thread (the caller's) and the executor. */
static int emulated_pool_init(emulated * em, const spice_pool_layout * layout, char * err, size_t err_len) {
    em->layout = *layout;
    em->pool_size = spice_pool_alloc_bytes(layout);
    void * mem = mmap(NULL, em->pool_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        snprintf(err, err_len, "emulated device: could not map a %zu-byte slot pool", em->pool_size);
        return SPICE_ERR_NO_MEMORY;
    }
    em->pool = (char *) mem; /* zero, and committed only where copies land */
    em->cpu = ggml_backend_cpu_init();
    em->pool_buf = ggml_backend_cpu_buffer_from_ptr(em->pool, em->pool_size);
    if (em->cpu == NULL || em->pool_buf == NULL) {
        snprintf(err, err_len, "emulated device: could not start ggml's CPU backend for the pool executor");
        return SPICE_ERR_NO_MEMORY;
    }
    ggml_backend_cpu_set_n_threads(em->cpu, 1);
    return spice_pool_exec_create(em->cpu, em->pool_buf, &em->layout, &em->exec, err, err_len);
}

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
    if (p->pool != NULL) {
        dev->iface = &emulated_pool_iface;
        const int rc = emulated_pool_init(em, p->pool, err, err_len);
        if (rc != SPICE_OK) {
            emulated_free(dev);
            return rc;
        }
    }
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

/* Only an executor that computes asks for a pool: by default the host
 * executor reads the experts' own slots (packed, no waste). */
static int emulated_uses_pool(int32_t executor) {
    return executor == SPICE_EXECUTOR_POOL;
}

const spice_device_type spice_device_type_emulated = {
    /* .name        = */ "emulated",
    /* .slot_layout = */ spice_device_packed_layout,
    /* .uses_pool   = */ emulated_uses_pool,
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
