/* What the executors do with each (token, selected expert) pair of a hook
 * call (spice_host_job.exec, spice_device_job.run), and the job a device
 * that computes is handed. */
#ifndef SPICE_EXEC_H
#define SPICE_EXEC_H

#include "spice-experts.h"

#include <stddef.h>
#include <stdint.h>

#define SPICE_EXEC_NONE   0 /* contributes nothing here (dropped, or added by the surrogate executor) */
#define SPICE_EXEC_HOST   1 /* computed by the host executor (host weights, or host-readable slots) */
#define SPICE_EXEC_DEVICE 2 /* computed by a device that computes; the host sums its row */

/* One layer call's device pairs: pairs with run[pair] == SPICE_EXEC_DEVICE
 * are computed by the device from their expert's slot (slot_of[e]):
 * y = down(swiglu(gate x, up x)), unweighted. exec_begin queues the work and
 * returns at once; exec_end waits and writes each device pair's row into
 * y[pair * n_embd]. The host executor weights and sums them with its own
 * rows, in selection order. */
typedef struct spice_device_job {
    const spice_expert_layer * layer;
    int32_t n_tokens, n_used;
    const float   * inp; size_t inp_nb1;
    const int32_t * ids; size_t ids_nb1;
    const uint8_t * run;       /* [n_tokens * n_used] SPICE_EXEC_* values */
    const int32_t * slot_of;   /* [n_expert] the slot of each expert a device pair uses (-1: none) */
} spice_device_job;

#endif /* SPICE_EXEC_H */
