/* LoRE surrogate executor: for the (token, selected expert) pairs a plan
 * marks SPICE_ACTION_SURROGATE, the routed output gets
 *     w[t,k] * (alpha * shexp[t] + B (A h[t]))
 * with the shared-expert output before its gate (shexp; no alpha term without
 * one) and a rank-r map B A fitted offline (the sidecar).
 *
 * Storage is f16 (A as [rank][n_embd], B transposed, also [rank][n_embd]):
 * the matrices sit on the device tier and are charged to its byte budget, so
 * half the bytes means twice the experts that fit beside them, and f16's
 * relative rounding (~5e-4) is far below a rank-8 fit's error. Arithmetic is
 * f32: rows are widened into per-thread scratch with ggml's converter.
 *
 * Thread 0 prepares a job (the surrogate pairs of the call, scratch sized for
 * the threads); then every graph thread runs two phases with a barrier
 * between them: project (z = A h for the pairs, split by pair, so a decode
 * step's k surrogates spread over the threads) and combine (out += w (alpha S
 * + B z), whole tokens per thread for batches, column ranges for decode).
 */
#ifndef SPICE_SURROGATE_H
#define SPICE_SURROGATE_H

#include "ggml.h"

#include <stddef.h>
#include <stdint.h>

typedef struct spice_surrogate {
    int32_t loaded;
    int32_t rank;       /* 0: alpha term only */
    float alpha;
    ggml_fp16_t * a;    /* [rank][n_embd] */
    ggml_fp16_t * bt;   /* [rank][n_embd]: B transposed, so B z is a sum of rows */
} spice_surrogate;

/* Surrogates of every (layer, expert), owned by the runtime. */
typedef struct spice_surrogate_table {
    int32_t n_layers;
    int32_t max_expert;
    spice_surrogate * entries; /* [n_layers * max_expert]; NULL until the first load */
    uint64_t bytes;            /* charged to the device budget */
    int32_t n_loaded;
} spice_surrogate_table;

/* Every surrogate of the table released and its entries freed; the table
 * left empty. Its bytes stay charged to a budget until the caller releases them. */
void spice_surrogate_table_free(spice_surrogate_table * tab);

/* Device bytes of one surrogate: its two f16 matrices and alpha. */
uint64_t spice_surrogate_bytes_of(int32_t rank, int32_t n_embd);

/* Fill s from f32 A [rank][n_embd] and B [n_embd][rank] (row-major, as numpy
 * writes them); s must be empty. Returns a spice_status. */
int spice_surrogate_init(spice_surrogate * s, int32_t n_embd, int32_t rank, float alpha,
                         const float * a, const float * b);
void spice_surrogate_release(spice_surrogate * s);

typedef struct spice_surrogate_job {
    int32_t n_tokens;
    int32_t n_used;
    int32_t n_embd;
    const float   * inp;     size_t inp_nb1;
    const int32_t * ids;     size_t ids_nb1;
    const float   * weights; size_t weights_nb1;
    const float   * shexp;   size_t shexp_nb1;  /* NULL: no alpha term */
    const int32_t * actions;                    /* [n_tokens*n_used]; SPICE_ACTION_SURROGATE pairs run */
    const spice_surrogate * table;              /* [n_expert] of this layer; every marked one loaded */
    float * out;             size_t out_nb1;    /* accumulated into */
} spice_surrogate_job;

typedef struct spice_surrogate_exec {
    spice_surrogate_job job;
    int32_t n_pairs;     /* surrogate pairs of the current job; 0: nothing to run */
    int32_t max_rank;
    int32_t * pairs;     /* [n_pairs] pair ids (t * n_used + k), in order */
    int32_t * z_of;      /* [n_tokens * n_used] index into pairs, or -1 */
    float * z;           /* [n_pairs][max_rank] A h of each pair */
    float * scratch;     /* per thread: row [n_embd], y [n_embd] */
    size_t scratch_per_thread;
    void * buf;          /* holds pairs, z_of, z and scratch */
    size_t cap;
} spice_surrogate_exec;

void spice_surrogate_exec_init(spice_surrogate_exec * ex);
void spice_surrogate_exec_free(spice_surrogate_exec * ex);

/* Thread 0, before the barrier the graph threads pass before running. nth is
 * the number of threads that will run it. Returns a spice_status; on failure
 * n_pairs is 0 (nothing runs). */
int spice_surrogate_exec_prepare(spice_surrogate_exec * ex, const spice_surrogate_job * job, int nth);

/* Every thread (ith of nth, the nth given to prepare): project, then after a
 * barrier over all nth threads, combine, which adds the contributions to the
 * rows/columns of out that this thread owns. */
void spice_surrogate_exec_project(spice_surrogate_exec * ex, int ith, int nth);
void spice_surrogate_exec_combine(spice_surrogate_exec * ex, int ith, int nth);

#endif /* SPICE_SURROGATE_H */
