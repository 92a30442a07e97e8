/* The slot-pool executor: a layer call's device pairs computed by ONE ggml
 * graph per (matrix types and widths, token bucket), built once and
 * replayed, over the whole slot pool (spice-pool-layout.h):
 *
 *   g = mul_mat_id(gate_pool, x, sid)   up likewise   a = swiglu(g, u)
 *   y = mul_mat_id(down_pool, a, sid)
 *
 * sid[t][k] is the slot of pair (t, k)'s expert when the pair runs here and
 * the zero slot otherwise, or, in a launch of several tokens, a slot the
 * token does not use once the zero slot is taken (MUL_MAT_ID wants a token's
 * ids distinct: spice-pool-ids.h); buckets (1, 2, 4, ... SPICE_POOL_MAX_BUCKET
 * tokens) are padded with rows of no device pair, so a graph's shapes and addresses
 * never change and ggml-cuda captures and replays it as a CUDA graph. Per
 * call: one upload (x rows and sid in one buffer), one launch, one download
 * of y; the host weights and sums the device pairs' rows with its own, in
 * selection order, so calls without device pairs launch nothing and stay
 * bit-identical to the host executor.
 *
 * Backend-agnostic: the CUDA device runs it on ggml's CUDA backend; the
 * emulated device runs the same graphs on ggml's CPU backend (one thread,
 * the hook's thread 0), where its rows are bit-identical to the host
 * executor's (same from_float and vec_dot per row; tests compare them). */
#ifndef SPICE_POOL_EXEC_H
#define SPICE_POOL_EXEC_H

#include "spice-exec.h"
#include "spice-pool-layout.h"

#include "ggml-backend.h"

#include <stddef.h>
#include <stdint.h>

#define SPICE_POOL_MAX_BUCKET 32 /* larger calls run as several 32-token launches */

typedef struct spice_pool_exec spice_pool_exec;

/* Graphs on `backend` over the slots of `pool` (a buffer of at least
 * layout->bytes plus the largest pad, laid out as `layout`; its base is the
 * layout's base). Nothing is built until a call needs it. */
int spice_pool_exec_create(ggml_backend_t backend, ggml_backend_buffer_t pool, const spice_pool_layout * layout,
                           spice_pool_exec ** out, char * err, size_t err_len);
void spice_pool_exec_free(spice_pool_exec * px);

/* 1 when this executor can run layer L (the layout's strides fit its block
 * sizes and the backend supports its ops). */
int spice_pool_exec_supports(spice_pool_exec * px, const spice_expert_layer * L);

/* Build what a call of n_tokens x n_used on layer L needs (its graph and
 * staging), ahead of begin: SPICE_OK, or why it cannot run here. */
int spice_pool_exec_ready(spice_pool_exec * px, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used);

/* Queue the job's device pairs (at least one); returns at once on an
 * asynchronous backend. */
int spice_pool_exec_begin(spice_pool_exec * px, const spice_device_job * job, char * err, size_t err_len);
/* Wait for the queued work and write each device pair's row to y[pair * n_embd]. */
int spice_pool_exec_end(spice_pool_exec * px, float * y, char * err, size_t err_len);

/* Graphs built so far, and launches (graph computes) so far. */
void spice_pool_exec_stats(const spice_pool_exec * px, int32_t * n_graphs, uint64_t * n_launches);

#endif /* SPICE_POOL_EXEC_H */
