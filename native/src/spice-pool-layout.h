/* The slot pool's layout for devices that execute a layer's device pairs
 * with one mul_mat_id per matrix kind (spice-pool-exec.h).
 *
 * Per kind (gate, up, down) one region of n_slots + 1 slots with a fixed
 * stride: kind k of slot s lives at region[k] + s * stride[k]. Seen from
 * ggml, a region is one 3-D tensor [n_cols, n_rows, n_slots + 1] with
 * nb[2] = stride[k], so every layer whose matrices fit the stride is a view
 * of the same memory. The last slot (n_slots) is the zero slot: never
 * written, zero from allocation, so a pair pointed at it computes exactly 0
 * for every quant type and costs no branch in the kernels.
 *
 * Why one region per kind rather than [gate|up|down] per slot: ggml's CUDA
 * kernels index experts by nb[2] / type_size, so the stride must be a
 * multiple of every block size the kind uses; a shared stride would have to
 * be a multiple of all kinds' blocks at once (for DeepSeek-V2-Lite Q4_K_M,
 * 420 KiB of waste per slot instead of under 50 KiB). */
#ifndef SPICE_POOL_LAYOUT_H
#define SPICE_POOL_LAYOUT_H

#include "spice-experts.h"

#include <stddef.h>
#include <stdint.h>

typedef struct spice_pool_layout {
    int32_t n_slots;   /* usable slots; slot n_slots is the zero slot */
    size_t stride[3];  /* bytes of one slot in kind k's region */
    size_t region[3];  /* kind k's region, from the pool's base */
    size_t pad[3];     /* zero bytes the largest matrix of the kind is followed by (kernels read past rows) */
    size_t bytes;      /* the whole pool: (n_slots + 1) * (stride[0] + stride[1] + stride[2]) */
    int graph_ok;      /* 1: the strides are multiples of every block size used, so the
                          pool graph can run; 0: only per-expert execution can */
} spice_pool_layout;

/* Zero bytes ggml's CUDA kernels may read past the end of a matrix whose
 * rows are n_cols wide (they round quantized rows up to 512 columns,
 * MATRIX_ROW_PADDING in ggml-cuda/common.cuh). Every pool keeps this
 * padding, the emulated one too, so CPU builds exercise the GPU's layout. */
size_t spice_pool_matrix_pad(enum ggml_type type, int64_t n_cols);

/* The layout for n_slots slots of the MoE layers among layers[0..n_layers).
 * SPICE_ERR_INVALID_ARG without MoE layers or slots. */
int spice_pool_layout_make(const spice_expert_layer * layers, int32_t n_layers, int32_t n_slots,
                           spice_pool_layout * out);

/* A pool without kind regions: n_slots slots of slot_stride bytes, each
 * holding its three matrices at offsets inside it (for stores without
 * layer shapes; graph_ok = 0). */
void spice_pool_layout_interleaved(int32_t n_slots, size_t slot_stride, spice_pool_layout * out);

/* Bytes to allocate for the pool: the layout, plus the padding a kernel may
 * read past the last region's zero slot. */
static inline size_t spice_pool_alloc_bytes(const spice_pool_layout * p) {
    return p->bytes + p->pad[0] + p->pad[1] + p->pad[2];
}

/* Where kind k of slot s starts, from the pool's base (interleaved: where
 * the slot starts). A copy's matrix k goes to dst_offset[k] + s * stride[k]. */
static inline size_t spice_pool_offset(const spice_pool_layout * p, int32_t slot, int k) {
    return p->region[k] + (size_t) slot * p->stride[k];
}

/* Where a copy's matrix k lands in slot s, from the pool's base (dst_offset:
 * the copy's dst_offset[k], which is for slot 0). */
static inline size_t spice_pool_copy_offset(const spice_pool_layout * p, int32_t slot, int k, size_t dst_offset) {
    return dst_offset + (size_t) slot * p->stride[k];
}

/* The n bytes at `offset` as slot 0 lays them out (region[k] plus an offset
 * inside kind k) in slot s instead, from the pool's base; -1 when they are
 * not inside one kind of one existing slot. */
int64_t spice_pool_slot_range(const spice_pool_layout * p, int32_t slot, size_t offset, size_t n);

#endif /* SPICE_POOL_LAYOUT_H */
