/* CPU-only builds: no CUDA device tier (see spice-cuda.h). Every entry point
 * says so, and the store keeps to its emulated device. */
#include "spice-cuda.h"
#include "spice.h"

#include <stdio.h>

int spice_cuda_device_count(void) {
    return 0;
}

int spice_cuda_device_memory(int device, uint64_t * free_bytes, uint64_t * total_bytes) {
    (void) device;
    (void) free_bytes;
    (void) total_bytes;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_create(int device, const spice_pool_layout * layout, int32_t executor, spice_cuda ** out, char * err,
                      size_t err_len) {
    (void) device;
    (void) layout;
    (void) executor;
    if (out) {
        *out = NULL;
    }
    if (err && err_len) {
        snprintf(err, err_len, "this libspice was built without CUDA (configure with -DGGML_CUDA=ON)");
    }
    return SPICE_ERR_UNSUPPORTED;
}

void spice_cuda_free(spice_cuda * cu) {
    (void) cu;
}

char * spice_cuda_slot(spice_cuda * cu, int32_t slot) {
    (void) cu;
    (void) slot;
    return NULL;
}

int spice_cuda_register_host(spice_cuda * cu, const void * data, size_t size) {
    (void) cu;
    (void) data;
    (void) size;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_is_pinned(const void * data, size_t size) {
    (void) data;
    (void) size;
    return 0;
}

int spice_cuda_copy_issue(spice_cuda * cu, int32_t slot, const spice_cuda_segment seg[3]) {
    (void) cu;
    (void) slot;
    (void) seg;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_copy_done(spice_cuda * cu, int32_t slot) {
    (void) cu;
    (void) slot;
    return -1;
}

int spice_cuda_copy_poll(spice_cuda * cu, const int32_t * slots, int32_t n, uint8_t * landed) {
    (void) cu;
    (void) slots;
    (void) n;
    (void) landed;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_copy_wait(spice_cuda * cu, int32_t slot) {
    (void) cu;
    (void) slot;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_read(spice_cuda * cu, int32_t slot, size_t offset, void * dst, size_t n) {
    (void) cu;
    (void) slot;
    (void) offset;
    (void) dst;
    (void) n;
    return SPICE_ERR_UNSUPPORTED;
}

uint64_t spice_cuda_copy_ns(spice_cuda * cu, int32_t slot) {
    (void) cu;
    (void) slot;
    return 0;
}

int spice_cuda_exec_supports(spice_cuda * cu, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used) {
    (void) cu;
    (void) L;
    (void) n_tokens;
    (void) n_used;
    return 0;
}

int spice_cuda_exec_begin(spice_cuda * cu, const spice_device_job * job, char * err, size_t err_len) {
    (void) cu;
    (void) job;
    (void) err;
    (void) err_len;
    return SPICE_ERR_UNSUPPORTED;
}

int spice_cuda_exec_end(spice_cuda * cu, float * y, char * err, size_t err_len) {
    (void) cu;
    (void) y;
    (void) err;
    (void) err_len;
    return SPICE_ERR_UNSUPPORTED;
}
