/* Host reads on a tier whose host weights are not in memory (a disk tier),
 * spice-runtime-host-read.c: called by the hook (spice-runtime.c) and by the
 * tier's set-up (spice-runtime-store.c). */
#ifndef SPICE_RUNTIME_HOST_READ_H
#define SPICE_RUNTIME_HOST_READ_H

#include "spice-runtime-internal.h"

/* Reads the experts this call runs on the host into scratch when the tier's
 * host weights are not in memory, and books the tier's reads; not SPICE_OK
 * when the call cannot run exactly (last_error says why). */
int spice_runtime_read_host_experts(spice_runtime * rt, int32_t il, const spice_policy_call * call);
/* The tier's reads since the last booking, into layer il's counters (il < 0:
 * only move the baseline, e.g. after a preload or a new tier). */
void spice_runtime_book_io(spice_runtime * rt, int32_t il);
int spice_runtime_host_read_init(spice_runtime * rt);
void spice_runtime_host_read_free(spice_runtime * rt);

#endif /* SPICE_RUNTIME_HOST_READ_H */
