/* The CUDA device: spice-cuda.c's slots, copy stream and executor behind the
 * device interface. Compiled in every build; on a CPU-only build
 * spice_cuda_create reports that CUDA is missing, so no such device exists.
 *
 * The store hands it a copy when fewer than SPICE_CUDA_IN_FLIGHT are on the
 * GPU's copy stream: enough to keep the bus busy between two hook calls, few
 * enough that the prefetches still in the store's queue can be overtaken by
 * demand copies or cancelled (one on the stream cannot). */
#include "spice-device.h"
#include "spice.h"

#include <stdlib.h>
#include <unistd.h>

#define SPICE_CUDA_IN_FLIGHT 4

typedef struct cuda_device {
    spice_cuda * cu;
    spice_clock * clock;
    double bandwidth_gbps; /* only for the estimate of when a copy lands */
    double latency_us;
} cuda_device;

static cuda_device * ctx_of(spice_device * dev) {
    return (cuda_device *) dev->context;
}

static void cuda_free(spice_device * dev) {
    cuda_device * cd = ctx_of(dev);
    spice_cuda_free(cd->cu);
    free(cd);
    free(dev);
}

static const char * cuda_slot_data(spice_device * dev, int32_t slot) {
    return spice_cuda_slot(ctx_of(dev)->cu, slot);
}

static int cuda_slot_read(spice_device * dev, int32_t slot, size_t offset, void * dst, size_t n) {
    return spice_cuda_read(ctx_of(dev)->cu, slot, offset, dst, n);
}

static int cuda_can_start(spice_device * dev, uint64_t now, int32_t n_in_flight) {
    (void) dev;
    (void) now;
    return n_in_flight < SPICE_CUDA_IN_FLIGHT;
}

static int cuda_issue(spice_device * dev, int32_t slot, const spice_device_copy * copy, uint64_t not_before,
                      uint64_t * start_ns, uint64_t * end_ns) {
    cuda_device * cd = ctx_of(dev);
    (void) not_before; /* a real bus starts it now */
    spice_cuda_segment seg[3];
    for (int k = 0; k < 3; ++k) {
        seg[k].src = copy->src[k];
        seg[k].dst_offset = copy->dst_offset[k];
        seg[k].size = copy->src[k] != NULL ? copy->size[k] : 0; /* unbound: no bytes move */
        seg[k].pad = copy->pad[k];
    }
    if (spice_cuda_copy_issue(cd->cu, slot, seg) != SPICE_OK) {
        return SPICE_ERR_INTERNAL;
    }
    *start_ns = spice_clock_now(cd->clock);
    *end_ns = *start_ns + (uint64_t) (cd->latency_us * 1e3 + (double) copy->bytes / cd->bandwidth_gbps);
    return SPICE_OK;
}

static int cuda_poll(spice_device * dev, uint64_t now, const int32_t * slots, int32_t n, uint8_t * landed) {
    (void) now;
    return spice_cuda_copy_poll(ctx_of(dev)->cu, slots, n, landed);
}

static int cuda_wait(spice_device * dev, int32_t slot, uint64_t * stall_ns) {
    const uint64_t t0 = spice_monotonic_ns();
    const int rc = spice_cuda_copy_wait(ctx_of(dev)->cu, slot);
    *stall_ns = spice_monotonic_ns() - t0;
    return rc;
}

static uint64_t cuda_copy_ns(spice_device * dev, int32_t slot) {
    return spice_cuda_copy_ns(ctx_of(dev)->cu, slot);
}

static int cuda_exec_begin(spice_device * dev, const spice_device_job * job, char * err, size_t err_len) {
    return spice_cuda_exec_begin(ctx_of(dev)->cu, job, err, err_len);
}

static int cuda_exec_end(spice_device * dev, float * y, char * err, size_t err_len) {
    return spice_cuda_exec_end(ctx_of(dev)->cu, y, err, err_len);
}

static int cuda_exec_supports(spice_device * dev, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used) {
    return spice_cuda_exec_supports(ctx_of(dev)->cu, L, n_tokens, n_used);
}

typedef struct host_range {
    uintptr_t begin, end;
} host_range;

static int range_order(const void * a, const void * b) {
    const host_range * x = (const host_range *) a;
    const host_range * y = (const host_range *) b;
    return x->begin < y->begin ? -1 : (x->begin > y->begin);
}

/* Page-lock the host expert weights so copies are DMA and asynchronous:
 * every range's pages not locked already, merged into as few ranges as
 * touch. On a CUDA build the experts are normally loaded into llama.cpp's
 * CUDA host buffer type (spice-expert-buft.c), which is pinned already;
 * registering around it would overlap those allocations and make llama.cpp's
 * own copies from neighbouring weights fail. Returns how many bytes could not
 * be registered (copied from pageable memory). */
static uint64_t cuda_host_prepare(spice_device * dev, const void * const * data, const size_t * size,
                                  int32_t n_ranges) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    host_range * r = (host_range *) malloc((size_t) (n_ranges > 0 ? n_ranges : 1) * sizeof(host_range));
    if (r == NULL) {
        return 1;
    }
    int32_t n = 0;
    for (int32_t i = 0; i < n_ranges; ++i) {
        if (spice_cuda_is_pinned(data[i], size[i])) {
            continue;
        }
        const uintptr_t b = (uintptr_t) data[i];
        r[n].begin = b & ~(page - 1);
        r[n].end = (b + size[i] + page - 1) & ~(page - 1);
        n++;
    }
    qsort(r, (size_t) n, sizeof(*r), range_order);
    uint64_t unpinned = 0;
    for (int32_t i = 0; i < n;) {
        host_range m = r[i++];
        while (i < n && r[i].begin <= m.end) {
            if (r[i].end > m.end) {
                m.end = r[i].end;
            }
            i++;
        }
        if (spice_cuda_register_host(ctx_of(dev)->cu, (const void *) m.begin, m.end - m.begin) != SPICE_OK) {
            unpinned += m.end - m.begin;
        }
    }
    free(r);
    return unpinned;
}

static const spice_device_i cuda_iface = {
    /* .name           = */ "cuda",
    /* .free           = */ cuda_free,
    /* .slot_data      = */ cuda_slot_data,
    /* .slot_read      = */ cuda_slot_read,
    /* .copy_can_start = */ cuda_can_start,
    /* .copy_issue     = */ cuda_issue,
    /* .copy_poll      = */ cuda_poll,
    /* .copy_wait      = */ cuda_wait,
    /* .copy_ns        = */ cuda_copy_ns,
    /* .exec_begin     = */ cuda_exec_begin,
    /* .exec_end       = */ cuda_exec_end,
    /* .exec_supports  = */ cuda_exec_supports,
    /* .host_prepare   = */ cuda_host_prepare,
    /* .host_read      = */ NULL,
    /* .io_totals      = */ NULL,
    /* .last_error     = */ NULL,
};

static int cuda_create(const spice_device_params * p, spice_clock * clock, spice_device ** out, char * err,
                       size_t err_len) {
    *out = NULL;
    spice_device * dev = (spice_device *) calloc(1, sizeof(*dev));
    cuda_device * cd = (cuda_device *) calloc(1, sizeof(*cd));
    if (dev == NULL || cd == NULL) {
        free(dev);
        free(cd);
        return SPICE_ERR_NO_MEMORY;
    }
    spice_pool_layout interleaved; /* a store without layer shapes: slots of slot_stride bytes */
    if (p->pool == NULL) {
        spice_pool_layout_interleaved(p->n_slots, (p->slot_stride + 255) & ~(size_t) 255, &interleaved);
    }
    const int rc = spice_cuda_create(p->device_index, p->pool != NULL ? p->pool : &interleaved, p->executor, &cd->cu,
                                     err, err_len);
    if (rc != SPICE_OK) {
        free(dev);
        free(cd);
        return rc;
    }
    cd->clock = clock;
    cd->bandwidth_gbps = p->bandwidth_gbps;
    cd->latency_us = p->latency_us;
    dev->iface = &cuda_iface;
    dev->context = cd;
    *out = dev;
    return SPICE_OK;
}

/* Both executors run on the pool layout. */
static int cuda_uses_pool(int32_t executor) {
    (void) executor;
    return 1;
}

const spice_device_type spice_device_type_cuda = {
    /* .name        = */ "cuda",
    /* .slot_layout = */ spice_device_packed_layout, /* unused: a runtime's CUDA tier is always a pool */
    /* .uses_pool   = */ cuda_uses_pool,
    /* .create      = */ cuda_create,
};
