/* Expert store internals: device slots, residency table and the copy engine
 * (see the store section of spice.h for the contract). */
#ifndef SPICE_STORE_H
#define SPICE_STORE_H

#include "spice.h"
#include "spice-cuda.h"

#include <stdint.h>

/* One copy on the bus: queued (start in the future), in flight
 * (start <= now < end) or landed (end <= now, then retired). */
typedef struct spice_copy {
    int32_t  il, e, slot;
    int32_t  priority;   /* SPICE_PRIORITY_* */
    int32_t  was_prefetch; /* issued as a prefetch (possibly upgraded since) */
    uint64_t bytes;
    uint64_t issue_ns, start_ns, end_ns;
} spice_copy;

typedef struct spice_slot {
    int32_t  il, e;      /* -1 when free */
    int32_t  pins;
    int32_t  copy;       /* index into copies while a copy is pending, else -1 */
    int32_t  from_prefetch; /* landed from a prefetch not yet used */
    int32_t  filled;     /* bytes were memcpy'd from the host source */
    char    *memory;     /* emulated device memory of this slot (kept across reuse) */
    size_t   memory_size;
} spice_slot;

/* Host source of one layer's experts: expert e of kind k starts at
 * base[k] + e * stride[k] and is size[k] bytes. In slot memory the emulated
 * device packs the three back to back; a CUDA slot puts kind k at
 * dst_offset[k] followed by pad[k] zero bytes (ggml's CUDA kernels read
 * past a matrix's last row). */
typedef struct spice_store_source {
    const char * base[3];
    size_t stride[3];
    size_t size[3];
    size_t dst_offset[3];
    size_t pad[3];
} spice_store_source;

struct spice_store {
    spice_store_params params;
    int32_t  n_layers;
    int32_t  max_expert;
    int32_t *n_expert;        /* [n_layers] */
    uint64_t *expert_bytes;   /* [n_layers] */
    int32_t *slot_of;         /* [n_layers * max_expert], -1 = absent */
    int8_t  *states;          /* [n_layers * max_expert], spice_residency as of the last refresh */
    spice_store_source *sources; /* [n_layers]; base NULL = not bound (no bytes move) */

    uint64_t slot_bytes;      /* the largest expert */
    uint64_t used_bytes;      /* experts on the device or on their way, plus reserved bytes */
    uint64_t reserved_bytes;  /* non-expert data charged to the budget (spice_store_reserve) */
    int32_t  n_slots;         /* slot records: the most experts the budget can hold */
    spice_slot *slots;
    int32_t *free_slots;
    int32_t  n_free;

    spice_copy *copies;       /* pending copies (queued or in flight), unordered */
    int32_t  n_copies;

    uint64_t now_ns;          /* the manual clock */
    uint64_t epoch_ns;        /* real clock origin */

    spice_counters *counters; /* [n_layers]: bytes_h2d, copy_ns, stall_ns, prefetch_* */

    spice_cuda *cuda;         /* real device (SPICE_DEVICE_CUDA), else NULL */
};

/* Give a CUDA store its device: slots of slot_stride bytes (the largest
 * bound layer layout). Call after every layer is bound. */
int spice_store_attach_cuda(spice_store * store, size_t slot_stride, char * err, size_t err_len);

/* Slot memory of a resident expert, or NULL (not resident, or nothing bound). */
const char * spice_store_slot_data(const spice_store * store, int32_t il, int32_t e);

/* Bind a layer's host weights so copies move real bytes into slot memory. */
int spice_store_bind(spice_store * store, int32_t il, const spice_store_source * source);

#endif /* SPICE_STORE_H */
