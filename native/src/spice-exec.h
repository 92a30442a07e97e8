/* What the host executor does with each (token, selected expert) pair of a
 * hook call (spice_host_job.exec, spice_cuda_job.run). */
#ifndef SPICE_EXEC_H
#define SPICE_EXEC_H

#define SPICE_EXEC_NONE   0 /* contributes nothing here (dropped, or added by the surrogate executor) */
#define SPICE_EXEC_HOST   1 /* computed by the host executor (host weights, or host-readable slots) */
#define SPICE_EXEC_DEVICE 2 /* computed by a device that computes; the host sums its row */

#endif /* SPICE_EXEC_H */
