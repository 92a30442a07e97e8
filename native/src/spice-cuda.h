/* The CUDA device tier: slot memory on the GPU, a copy engine on its own
 * stream fed from pinned host weights, completion events, and a device
 * executor that runs resident experts with ggml's CUDA kernels.
 *
 * Built only with -DGGML_CUDA=ON (spice-cuda.c); a CPU-only build links
 * spice-cuda-none.c, whose functions all report SPICE_ERR_UNSUPPORTED, so
 * the store and the runtime need no #ifdefs.
 *
 * Ownership: the store owns one spice_cuda (slots + copies); the runtime asks
 * it to execute a layer's device pairs. Every call comes from thread 0 of the
 * graph (the thread that runs the hook's planning), never from two threads. */
#ifndef SPICE_CUDA_H
#define SPICE_CUDA_H

#include "spice-exec.h"
#include "spice-experts.h"
#include "spice-pool-layout.h"

#include <stddef.h>
#include <stdint.h>

typedef struct spice_cuda spice_cuda;

/* Number of CUDA devices this build can use (0 on a CPU-only build). */
int spice_cuda_device_count(void);

/* Free and total memory of a device, bytes. */
int spice_cuda_device_memory(int device, uint64_t * free_bytes, uint64_t * total_bytes);

/* A slot pool laid out as `layout` on `device` (zeroed: the padding ggml's
 * CUDA kernels may read past a matrix must hold zeros, and the zero slot is
 * never written), a copy stream, one pair of timing events per slot, and the
 * executors `executor` (spice_executor) asks for. */
int spice_cuda_create(int device, const spice_pool_layout * layout, int32_t executor, spice_cuda ** out, char * err,
                      size_t err_len);
void spice_cuda_free(spice_cuda * cu);

/* Device address of a slot (its gate matrix). */
char * spice_cuda_slot(spice_cuda * cu, int32_t slot);

/* Page-lock host memory the copies read from (so they are real DMA,
 * asynchronous to the host). Already-registered pages are not an error; a
 * range that cannot be registered is copied from pageable memory (slower,
 * still correct), and the function returns SPICE_ERR_UNSUPPORTED. */
int spice_cuda_register_host(spice_cuda * cu, const void * data, size_t size);

/* 1 when both ends of [data, data + size) are page-locked already (e.g. the
 * CUDA host buffer type llama.cpp loads host weights into). Registering such
 * memory again, or pages around it, breaks llama.cpp's own copies from it. */
int spice_cuda_is_pinned(const void * data, size_t size);

/* One host -> slot copy of up to three segments on the copy stream, plus
 * zeroing `pad` bytes after each segment; completion recorded on the slot's
 * events. */
typedef struct spice_cuda_segment {
    const void * src;
    size_t dst_offset;
    size_t size;
    size_t pad;
} spice_cuda_segment;

int spice_cuda_copy_issue(spice_cuda * cu, int32_t slot, const spice_cuda_segment seg[3]);
/* 1 when the slot's last issued copy has landed, 0 when not yet, <0 on error. */
int spice_cuda_copy_done(spice_cuda * cu, int32_t slot);
/* landed[i]: whether the copy into slots[i] has landed, for n slots with a copy
 * issued; asks CUDA about the oldest unfinished copy and no later one (copies
 * finish in issue order: spice-fifo-poll.h). */
int spice_cuda_copy_poll(spice_cuda * cu, const int32_t * slots, int32_t n, uint8_t * landed);
/* Block until the slot's last issued copy has landed. */
int spice_cuda_copy_wait(spice_cuda * cu, int32_t slot);
/* Synchronous device -> host read of n bytes at offset inside a slot (tests). */
int spice_cuda_read(spice_cuda * cu, int32_t slot, size_t offset, void * dst, size_t n);
/* Bus time of the slot's landed copy, ns (0 if unknown). */
uint64_t spice_cuda_copy_ns(spice_cuda * cu, int32_t slot);

/* Device executor for one layer call (spice_device_job in spice-exec.h):
 * the slot-pool graph (spice-pool-exec.h) when the layout allows it and
 * SPICE_DEVICE_EXEC is not "legacy", else one small graph per expert. */
/* Whether this call can run on the GPU (it always can: the per-expert
 * executor runs every type); readies the pool graph it will use, if any. */
int spice_cuda_exec_supports(spice_cuda * cu, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used);
int spice_cuda_exec_begin(spice_cuda * cu, const spice_device_job * job, char * err, size_t err_len);
int spice_cuda_exec_end(spice_cuda * cu, float * y, char * err, size_t err_len);


#endif /* SPICE_CUDA_H */
