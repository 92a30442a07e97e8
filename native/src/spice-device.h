/* The device interface: what the expert store needs from the memory its
 * slots live in, in the style of ggml-backend's buffer/backend interfaces.
 *
 * A device owns slot memory and a bus into it. The store decides which
 * copies to make and in what order (its queues, priorities, budget and
 * cancellations are bookkeeping and never depend on the device); a device
 * only starts copies it is handed, says which have landed, blocks on one,
 * and, where it can compute, executes a layer's device pairs from its slots.
 *
 * Implementations (one file each):
 *   emulated  slots in host memory, a virtual serial bus on the store's clock
 *             (spice-device-emulated.c)
 *   cuda      slots in GPU memory, copies on a CUDA stream, ggml's CUDA
 *             kernels for execution (spice-device-cuda.c over spice-cuda.c)
 *   disk      slots in RAM, copies are reads of the model file on reader
 *             threads (spice-device-disk.c); it does not compute, and the
 *             host weights it would copy from are not in memory, so a host
 *             action reads its expert first (host_read)
 *
 * Every call comes from one thread at a time (thread 0 of the graph). */
#ifndef SPICE_DEVICE_H
#define SPICE_DEVICE_H

#include "spice-clock.h"
#include "spice-cuda.h"
#include "spice-exec.h"
#include "spice-experts.h"
#include "spice-pool-layout.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Where one layer's experts come from and go to: expert e's matrix k (gate,
 * up, down) starts at base[k] + e * stride[k] in host memory (at
 * file_offset[k] + e * stride[k] in the model file) and is size[k] bytes;
 * in a slot it goes to dst_offset[k], followed by pad[k] zero bytes (ggml's
 * CUDA kernels read past a matrix's last row). */
typedef struct spice_store_source {
    const char * base[3];
    uint64_t file_offset[3];
    size_t stride[3];
    size_t size[3];
    size_t dst_offset[3];
    size_t pad[3];
} spice_store_source;

/* One expert's copy into a slot. */
typedef struct spice_device_copy {
    const char * src[3];
    uint64_t file_offset[3];
    size_t size[3];
    size_t dst_offset[3];
    size_t pad[3];
    uint64_t bytes; /* what the bus carries (the expert's bytes as the budget charges them) */
    int32_t priority; /* SPICE_PRIORITY_*: a device with its own queue serves demand first */
} spice_device_copy;

typedef struct spice_device spice_device;

typedef struct spice_device_i {
    const char * name;
    void (*free)(spice_device * dev);

    /* ---- slot memory ---- */
    /* Address of a slot whose copy has landed (bytes the host executor can
     * read when the device cannot execute; a device address otherwise), or
     * NULL when it cannot be provided. */
    const char * (*slot_data)(spice_device * dev, int32_t slot);
    /* n bytes at offset inside a landed slot, into host memory (tests). */
    int (*slot_read)(spice_device * dev, int32_t slot, size_t offset, void * dst, size_t n);

    /* ---- copies ---- */
    /* Whether a copy may start at `now`, with n_in_flight copies started
     * and not yet seen landing. */
    int (*copy_can_start)(spice_device * dev, uint64_t now, int32_t n_in_flight);
    /* Start a copy into slot, not before not_before (the moment the store
     * queued it: a virtual bus may start it in the past of `now`). Reports
     * when it started and when it is due to land (an estimate on a real bus). */
    int (*copy_issue)(spice_device * dev, int32_t slot, const spice_device_copy * copy, uint64_t not_before,
                      uint64_t * start_ns, uint64_t * end_ns);
    /* One poll: which of the n started copies (by slot) have landed by now. */
    int (*copy_poll)(spice_device * dev, uint64_t now, const int32_t * slots, int32_t n, uint8_t * landed);
    /* Block until the copy into slot has landed; *stall_ns = time waited. */
    int (*copy_wait)(spice_device * dev, int32_t slot, uint64_t * stall_ns);
    /* Bus time of the landed copy into slot, ns. */
    uint64_t (*copy_ns)(spice_device * dev, int32_t slot);

    /* ---- execution (NULL: the device does not compute; the host executor
     * runs device pairs from slot_data) ---- */
    int (*exec_begin)(spice_device * dev, const spice_device_job * job, char * err, size_t err_len);
    int (*exec_end)(spice_device * dev, float * y, char * err, size_t err_len);
    /* 1 when the device can execute a call of n_tokens x n_used on layer L
     * (NULL: every call), decided before the hook's first barrier: what it
     * needs is built then, so that a launch after the barrier does not fail
     * for want of it. The host executor runs the other calls' pairs. */
    int (*exec_supports)(spice_device * dev, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used);

    /* Make host ranges that copies read from fast to copy (a CUDA device
     * page-locks them); returns the bytes it could not. NULL: nothing to do. */
    uint64_t (*host_prepare)(spice_device * dev, const void * const * data, const size_t * size, int32_t n);

    /* ---- devices whose sources are not in host memory (NULL otherwise) ---- */
    /* Read n experts into host buffers dst[i] (packed layout) now, ahead of
     * every queued copy; blocks until all have landed; *wait_ns = time
     * waited. SPICE_ERR_INTERNAL on a read error (last_error says which). */
    int (*host_read)(spice_device * dev, const spice_device_copy * copies, char * const * dst, int32_t n,
                     uint64_t * wait_ns);
    /* Bytes read and read requests so far (cumulative). */
    void (*io_totals)(spice_device * dev, uint64_t * bytes, uint64_t * reads);
    /* The first failure, or NULL while every copy succeeded. A failed copy
     * never lands: polls leave it in flight and a wait on it fails. */
    const char * (*last_error)(spice_device * dev);
} spice_device_i;

struct spice_device {
    const spice_device_i * iface;
    void * context;
};

/* The disk device's reader threads when params ask for none; here, not in
 * spice-device-disk.c, because spice_store_default_params reports it. */
#define SPICE_DISK_THREADS_DEFAULT 4

typedef struct spice_device_params {
    double  bandwidth_gbps; /* the bus: exact on the emulated device, an estimate on a real one */
    double  latency_us;
    int32_t device_index;   /* which GPU */
    int32_t n_slots;
    size_t  slot_stride;    /* bytes of one slot (the largest layer layout) */
    const char * path;      /* disk: the file copies read from */
    int32_t io_threads;     /* disk: reader threads */
    int32_t io_fault_after; /* disk, tests: reads after this many fail */
    /* Nonzero while the caller gives up on waiting (the runtime's abort
     * request): a copy wait that would block for long returns early. NULL:
     * waits always run to the end. */
    atomic_int * cancel;
    /* A device type that uses_pool: the layout its slots follow (the
     * sources' dst_offset[k] are region[k] plus offsets inside the slot).
     * NULL: n_slots of slot_stride bytes, matrices at dst_offset inside. */
    const spice_pool_layout * pool;
    int32_t executor;       /* spice_executor */
} spice_device_params;

/* A kind of device: how it lays an expert out in a slot, and how to make one. */
typedef struct spice_device_type {
    const char * name;
    /* Fill src's dst_offset and pad for layer L's experts (base, stride and
     * size are set); returns the slot bytes the layer needs. */
    size_t (*slot_layout)(const spice_expert_layer * L, spice_store_source * src);
    /* 1 when the device, with this spice_executor, lays its slots out as a
     * pool (spice-pool-layout.h) rather than by slot_layout; NULL: never. */
    int (*uses_pool)(int32_t executor);
    int (*create)(const spice_device_params * params, spice_clock * clock, spice_device ** out, char * err,
                  size_t err_len);
} spice_device_type;

extern const spice_device_type spice_device_type_emulated;
extern const spice_device_type spice_device_type_cuda;
extern const spice_device_type spice_device_type_disk;

/* The type of a spice_device_kind value, or NULL for an unknown one. */
const spice_device_type * spice_device_type_of(int32_t kind);

/* Matrices back to back, no padding: the layout of a device whose slots the
 * host executor reads. */
size_t spice_device_packed_layout(const spice_expert_layer * L, spice_store_source * src);

static inline int spice_device_can_execute(const spice_device * dev) {
    return dev != NULL && dev->iface->exec_begin != NULL;
}

/* Whether the device executes this call's device pairs itself. */
static inline int spice_device_executes(spice_device * dev, const spice_expert_layer * L, int32_t n_tokens,
                                        int32_t n_used) {
    return spice_device_can_execute(dev) &&
           (dev->iface->exec_supports == NULL || dev->iface->exec_supports(dev, L, n_tokens, n_used));
}


static inline void spice_device_free(spice_device * dev) {
    if (dev != NULL) {
        dev->iface->free(dev);
    }
}

#endif /* SPICE_DEVICE_H */
