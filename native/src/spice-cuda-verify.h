/* SPICE_CUDA_VERIFY=1: a diagnosis for the CUDA device executor. Device
 * pairs also run on the host; the device's rows are compared with the
 * host's (which are the ones used) and the largest difference is printed
 * when the runtime is freed. Kept out of the hook's own state. */
#ifndef SPICE_CUDA_VERIFY_H
#define SPICE_CUDA_VERIFY_H

#include <stdint.h>

typedef struct spice_cuda_verify spice_cuda_verify;

/* NULL unless the environment asks for verification. */
spice_cuda_verify * spice_cuda_verify_from_env(void);
void spice_cuda_verify_free(spice_cuda_verify * v);

/* Before launching: keep the device's run list (its pairs still go to the
 * device) and turn exec's device pairs into host pairs; returns the run
 * list to give the device, and *y_out the buffer its rows go to. NULL when
 * out of memory (then nothing is compared this call). */
const uint8_t * spice_cuda_verify_begin(spice_cuda_verify * v, uint8_t * exec, int32_t n_pairs, int32_t n_embd,
                                        float ** y_out);

/* After the host rows are complete: compare the device's rows with them. */
void spice_cuda_verify_rows(spice_cuda_verify * v, const float * host_y, int32_t n_pairs, int32_t n_embd);

/* Print the comparison so far (nothing if no row was compared). */
void spice_cuda_verify_report(const spice_cuda_verify * v);

#endif /* SPICE_CUDA_VERIFY_H */
