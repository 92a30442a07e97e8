/* Exact host executor: a layer's routed experts on the GGUF weights with
 * ggml's CPU kernels, bit-identical to ggml's mul_mat_id path.
 *
 * Thread 0 prepares a job (groups the (token, expert) pairs by expert and
 * sizes the scratch); after a barrier every graph thread runs the phases
 * quantize -> gate/up -> SwiGLU -> down -> weighted sum, with its own
 * barriers in between. Work within a phase is handed out by atomic counters
 * over (expert, row chunk) items, so prompt batches are processed expert by
 * expert (GEMM-like weight reuse) and decode spreads rows over threads; the
 * quantize phase's (token, block range) items likewise, so a thread that
 * starts late (thread 0 launching device work) holds nobody up. */
#ifndef SPICE_HOST_EXEC_H
#define SPICE_HOST_EXEC_H

#include "spice-barrier.h"
#include "spice-exec.h"
#include "spice-experts.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct spice_host_job {
    const spice_expert_layer * layer;
    int32_t n_tokens;
    int32_t n_used;
    const float   * inp;     size_t inp_nb1;
    const int32_t * ids;     size_t ids_nb1;
    const float   * weights; size_t weights_nb1;
    const uint8_t * exec;    /* [n_tokens*n_used] SPICE_EXEC_*: HOST = run here, DEVICE = y row computed
                                elsewhere (the device writes it before combine), NONE = contributes nothing */
    const char * const * device; /* [n_expert] slot memory of experts run from the device tier
                                    (gate | up | down bytes), NULL entries (or no array): host weights */
    const spice_expert_layer * device_layer; /* the experts as those slots hold them (types, row
                                    strides; low-precision slots), NULL: as `layer`. Each of its
                                    matrices quantizes activations as layer's does (same rows serve both) */
    float * out;             size_t out_nb1;
    /* thread 0 calls this before the weighted sum, while the others wait:
     * the device executor delivers its rows (exec == 2) into y here */
    void (*before_combine)(void * user_data, float * y);
    void * before_combine_data;
} spice_host_job;

typedef struct spice_host_exec {
    void * buf;
    size_t cap;

    spice_host_job job;
    int failed; /* scratch could not be allocated: outputs are zeroed */

    /* views into buf for the current job */
    char    * xq_gate;         /* quantized input rows for gate (NULL: F32, use inp) */
    char    * xq_up;           /* for up when its activation type differs from gate's */
    float   * gate;            /* [n_pairs][n_ff] */
    float   * up;              /* [n_pairs][n_ff] */
    float   * act;             /* [n_pairs][n_ff] SwiGLU output */
    char    * actq;            /* [n_pairs] quantized act rows (NULL: F32, use act) */
    float   * y;               /* [n_pairs][n_embd] down-projection outputs */
    int32_t * expert_start;    /* [n_expert+1] offsets into pairs_by_expert */
    int32_t * pairs_by_expert; /* executed pairs grouped by expert */
    int32_t * active;          /* experts with at least one executed pair */
    const char ** wbase;       /* [3][n_expert] where expert e's gate/up/down rows start */
    const spice_expert_layer ** wlayer; /* [n_expert] the matrices (types, strides) those rows follow */
    int32_t   n_active;
    int32_t   n_exec;

    int32_t chunks_ff;   /* row chunks per expert in the gate/up phase */
    int32_t chunks_embd; /* row chunks per expert in the down phase */
    atomic_int next_quant;
    atomic_int next_ff;
    atomic_int next_embd;
} spice_host_exec;

void spice_host_exec_init(spice_host_exec * ex);
void spice_host_exec_free(spice_host_exec * ex);

/* Thread 0, before a barrier. Returns a spice_status; on allocation failure
 * the job still runs (outputs zeroed) and the caller reports the error. */
int spice_host_exec_prepare(spice_host_exec * ex, const spice_host_job * job);

/* Every graph thread, after the barrier that follows prepare. */
void spice_host_exec_run(spice_host_exec * ex, int ith, int nth, spice_barrier * barrier);

#endif /* SPICE_HOST_EXEC_H */
