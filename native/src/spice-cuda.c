/* CUDA device tier (see spice-cuda.h). Built only with -DGGML_CUDA=ON.
 *
 * Slots live in one ggml CUDA buffer, so the device executor can point ggml
 * tensors straight at them and run ggml's own CUDA kernels (mmvq/mmq, the
 * same ones llama.cpp uses for experts on the GPU). Copies go on a stream
 * of our own, created non-blocking so it never serializes with ggml's
 * compute streams; each slot has a start/end event pair, which gives both
 * completion (query/synchronize) and the copy's bus time. */
#include "spice-cuda.h"
#include "spice-clock.h"
#include "spice-copy-queue.h"
#include "spice-fifo-poll.h"
#include "spice-pool-exec.h"
#include "spice.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cuda.h"

#include <cuda_runtime_api.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A slot's copy as the hook's thread planned it: what each of its three
 * cudaMemcpyAsync moves, and the stale padding to clear after it. */
typedef struct planned_copy {
    char * dst[3];
    const void * src[3];
    size_t size[3];
    size_t clear[3]; /* bytes to zero from dst + size */
} planned_copy;

struct spice_cuda {
    int device;
    ggml_backend_t backend;          /* compute: ggml's CUDA stream */
    ggml_backend_buffer_t pool;      /* slot memory */
    char * base;
    spice_pool_layout layout;        /* where each slot's matrices live; layout.n_slots slots */
    cudaStream_t copy_stream;
    cudaEvent_t * ev_start;          /* [n_slots] */
    cudaEvent_t * ev_end;            /* [n_slots] */
    size_t (*written)[3];            /* [n_slots]: where kind k of the slot is zero from (0: all zero) */
    uint64_t * seq;                  /* [n_slots]: the slot's last copy's issue number on copy_stream */
    uint64_t next_seq, done_seq;     /* issued so far; the latest known landed (spice-fifo-poll.h) */
    int32_t * poll_order;            /* [n_slots]: scratch for a poll */
    planned_copy * planned;          /* [n_slots]: the copy issued or queued into each slot */
    spice_copy_queue * copier;       /* issues copies off the hook's thread; NULL: inline */

    /* device executors, one layer call at a time: the slot-pool graph, and
     * per-expert graphs (legacy) for layers it cannot run or when asked */
    spice_pool_exec * pool_exec;     /* NULL when the layout has no kind regions */
    int pending_pool;                /* the queued call went to pool_exec */
    int use_pool;                    /* exec_supports readied pool_exec for the coming call */
    ggml_gallocr_t galloc;
    struct ggml_context * ctx;
    float * x_host;  size_t x_cap;   /* pinned staging: gathered input rows */
    float * y_host;  size_t y_cap;   /* pinned staging: output rows */
    int32_t * row_pair; size_t row_cap; /* staging row -> pair */
    int32_t n_rows;
    int32_t n_embd;
    int pending;

    /* SPICE_CUDA_PROFILE=1: calls and time per executor's begin, printed when freed (the
     * pool executor prints its own breakdown) */
    int profile;
    uint64_t prof_begins[2], prof_ns[2]; /* [0] pool, [1] per-expert graphs */

    void ** registered;              /* host ranges we page-locked (unlocked on free) */
    int32_t n_registered, cap_registered;
};

static int issue_planned(void * ctx, int32_t slot); /* a planned copy's CUDA calls */

/* Our failed CUDA calls must not leave their error behind: ggml checks
 * cudaGetLastError() after its own launches and aborts on anything it finds. */
static cudaError_t cleared(cudaError_t rc) {
    if (rc != cudaSuccess) {
        (void) cudaGetLastError();
    }
    return rc;
}

static int fail(char * err, size_t err_len, const char * what, cudaError_t rc) {
    if (err && err_len) {
        snprintf(err, err_len, "CUDA: %s: %s", what, cudaGetErrorString(rc));
    }
    return SPICE_ERR_INTERNAL;
}

int spice_cuda_device_count(void) {
    return ggml_backend_cuda_get_device_count();
}

int spice_cuda_device_memory(int device, uint64_t * free_bytes, uint64_t * total_bytes) {
    if (device < 0 || device >= spice_cuda_device_count()) {
        return SPICE_ERR_INVALID_ARG;
    }
    size_t f = 0, t = 0;
    ggml_backend_cuda_get_device_memory(device, &f, &t);
    if (free_bytes) {
        *free_bytes = f;
    }
    if (total_bytes) {
        *total_bytes = t;
    }
    return SPICE_OK;
}

int spice_cuda_create(int device, const spice_pool_layout * layout, int32_t executor, spice_cuda ** out, char * err,
                      size_t err_len) {
    if (out == NULL || layout == NULL || layout->n_slots <= 0 || layout->bytes == 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    const int32_t n_slots = layout->n_slots;
    *out = NULL;
    if (device < 0 || device >= spice_cuda_device_count()) {
        snprintf(err, err_len, "no CUDA device %d (this build sees %d)", device, spice_cuda_device_count());
        return SPICE_ERR_UNSUPPORTED;
    }
    spice_cuda * cu = (spice_cuda *) calloc(1, sizeof(*cu));
    if (cu == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    cu->device = device;
    cu->layout = *layout;
    cudaError_t rc = cleared(cudaSetDevice(device));
    if (rc != cudaSuccess) {
        free(cu);
        return fail(err, err_len, "cudaSetDevice", rc);
    }
    size_t free_b = 0, total_b = 0;
    ggml_backend_cuda_get_device_memory(device, &free_b, &total_b);
    const size_t pool_bytes = spice_pool_alloc_bytes(layout);
    if (pool_bytes > free_b) {
        snprintf(err, err_len, "the device budget needs %zu bytes of slots; CUDA device %d has %zu free",
                 pool_bytes, device, free_b);
        free(cu);
        return SPICE_ERR_BUDGET;
    }
    cu->backend = ggml_backend_cuda_init(device);
    if (cu->backend == NULL) {
        snprintf(err, err_len, "CUDA: could not start ggml's CUDA backend on device %d", device);
        free(cu);
        return SPICE_ERR_UNSUPPORTED;
    }
    cu->pool = ggml_backend_buft_alloc_buffer(ggml_backend_cuda_buffer_type(device), pool_bytes);
    if (cu->pool == NULL) {
        snprintf(err, err_len, "CUDA: could not allocate %zu bytes of slots on device %d", pool_bytes, device);
        spice_cuda_free(cu);
        return SPICE_ERR_NO_MEMORY;
    }
    ggml_backend_buffer_set_usage(cu->pool, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(cu->pool, 0);
    cu->base = (char *) ggml_backend_buffer_get_base(cu->pool);
    if ((rc = cleared(cudaStreamCreateWithFlags(&cu->copy_stream, cudaStreamNonBlocking))) != cudaSuccess) {
        spice_cuda_free(cu);
        return fail(err, err_len, "cudaStreamCreateWithFlags", rc);
    }
    cu->ev_start = (cudaEvent_t *) calloc((size_t) n_slots, sizeof(cudaEvent_t));
    cu->ev_end = (cudaEvent_t *) calloc((size_t) n_slots, sizeof(cudaEvent_t));
    cu->written = (size_t (*)[3]) calloc((size_t) n_slots, sizeof(*cu->written));
    cu->seq = (uint64_t *) calloc((size_t) n_slots, sizeof(uint64_t));
    cu->poll_order = (int32_t *) calloc((size_t) n_slots, sizeof(int32_t));
    cu->planned = (planned_copy *) calloc((size_t) n_slots, sizeof(*cu->planned));
    if (cu->ev_start == NULL || cu->ev_end == NULL || cu->written == NULL || cu->seq == NULL ||
        cu->poll_order == NULL || cu->planned == NULL) {
        spice_cuda_free(cu);
        return SPICE_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < n_slots; ++i) {
        if ((rc = cleared(cudaEventCreate(&cu->ev_start[i]))) != cudaSuccess ||
            (rc = cleared(cudaEventCreate(&cu->ev_end[i]))) != cudaSuccess) {
            spice_cuda_free(cu);
            return fail(err, err_len, "cudaEventCreate", rc);
        }
    }
    /* Copies are issued off the hook's thread (spice-copy-queue.h) unless SPICE_CUDA_COPY_THREAD=0.
     * On the H200 VM of 2026-12-04 issuing took the hook's thread 9-18 us a copy; with the copier
     * the store's time per decode call fell 27-66 -> 4-26 us, with no consistent TPOT change within
     * those runs' noise (docs/results/gpu.md, section 4). The copier parks
     * on a condition variable between copies, so it takes no core while there is nothing to copy.
     * Without it (or without a thread) copies are issued inline, on the hook's thread. */
    const char * profile_env = getenv("SPICE_CUDA_PROFILE");
    cu->profile = profile_env != NULL && profile_env[0] == '1';
    const char * thread_env = getenv("SPICE_CUDA_COPY_THREAD");
    if (thread_env == NULL || thread_env[0] != '0') {
        if (spice_copy_queue_create(n_slots, issue_planned, cu, &cu->copier) != SPICE_OK) {
            cu->copier = NULL;
        }
    }
    cu->galloc = ggml_gallocr_new(ggml_backend_cuda_buffer_type(device));
    if (cu->galloc == NULL) {
        spice_cuda_free(cu);
        return SPICE_ERR_NO_MEMORY;
    }
    if (layout->graph_ok && executor != SPICE_EXECUTOR_LEGACY) {
        const int status = spice_pool_exec_create(cu->backend, cu->pool, &cu->layout, &cu->pool_exec, err, err_len);
        if (status != SPICE_OK) {
            spice_cuda_free(cu);
            return status;
        }
    }
    *out = cu;
    return SPICE_OK;
}

void spice_cuda_free(spice_cuda * cu) {
    if (cu == NULL) {
        return;
    }
    if (cu->profile && cu->prof_begins[0] + cu->prof_begins[1] > 0) {
        fprintf(stderr, "libspice: SPICE_CUDA_PROFILE: begins: pool %llu (%.1f us each), per-expert graphs %llu "
                        "(%.1f us each); copies issued by %s\n",
                (unsigned long long) cu->prof_begins[0],
                cu->prof_begins[0] ? 1e-3 * (double) cu->prof_ns[0] / (double) cu->prof_begins[0] : 0.0,
                (unsigned long long) cu->prof_begins[1],
                cu->prof_begins[1] ? 1e-3 * (double) cu->prof_ns[1] / (double) cu->prof_begins[1] : 0.0,
                cu->copier != NULL ? "the copier thread" : "the hook's thread");
    }
    spice_copy_queue_free(cu->copier); /* issues what is still queued, then stops */
    cu->copier = NULL;
    cleared(cudaSetDevice(cu->device));
    if (cu->copy_stream) {
        cleared(cudaStreamSynchronize(cu->copy_stream));
    }
    if (cu->backend) {
        ggml_backend_synchronize(cu->backend);
    }
    for (int32_t i = 0; cu->ev_start && i < cu->layout.n_slots; ++i) {
        if (cu->ev_start[i]) {
            cudaEventDestroy(cu->ev_start[i]);
        }
        if (cu->ev_end && cu->ev_end[i]) {
            cudaEventDestroy(cu->ev_end[i]);
        }
    }
    free(cu->ev_start);
    free(cu->ev_end);
    free(cu->written);
    free(cu->seq);
    free(cu->poll_order);
    free(cu->planned);
    if (cu->copy_stream) {
        cudaStreamDestroy(cu->copy_stream);
    }
    spice_pool_exec_free(cu->pool_exec);
    if (cu->ctx) {
        ggml_free(cu->ctx);
    }
    if (cu->galloc) {
        ggml_gallocr_free(cu->galloc);
    }
    if (cu->pool) {
        ggml_backend_buffer_free(cu->pool);
    }
    if (cu->backend) {
        ggml_backend_free(cu->backend);
    }
    if (cu->x_host) {
        cudaFreeHost(cu->x_host);
    }
    if (cu->y_host) {
        cudaFreeHost(cu->y_host);
    }
    for (int32_t i = 0; i < cu->n_registered; ++i) {
        cleared(cudaHostUnregister(cu->registered[i]));
    }
    free(cu->registered);
    free(cu->row_pair);
    free(cu);
}

char * spice_cuda_slot(spice_cuda * cu, int32_t slot) {
    return cu->base + spice_pool_offset(&cu->layout, slot, 0);
}


int spice_cuda_register_host(spice_cuda * cu, const void * data, size_t size) {
    cleared(cudaSetDevice(cu->device));
    if (cu->n_registered == cu->cap_registered) {
        const int32_t cap = cu->cap_registered ? 2 * cu->cap_registered : 16;
        void ** grown = (void **) realloc(cu->registered, (size_t) cap * sizeof(void *));
        if (grown == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        cu->registered = grown;
        cu->cap_registered = cap;
    }
    cudaError_t rc = cleared(cudaHostRegister((void *) (uintptr_t) data, size, cudaHostRegisterPortable));
    if (rc != cudaSuccess && rc != cudaErrorHostMemoryAlreadyRegistered) {
        /* a read-only mapping (mmap'd weights) needs the read-only flag */
        rc = cleared(cudaHostRegister((void *) (uintptr_t) data, size, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
    }
    if (rc == cudaSuccess) {
        cu->registered[cu->n_registered++] = (void *) (uintptr_t) data;
        return SPICE_OK;
    }
    if (rc == cudaErrorHostMemoryAlreadyRegistered) {
        return SPICE_OK;
    }
    return SPICE_ERR_UNSUPPORTED;
}

static int pinned_at(const void * p) {
    struct cudaPointerAttributes attr;
    if (cleared(cudaPointerGetAttributes(&attr, p)) != cudaSuccess) {
        return 0;
    }
    return attr.type == cudaMemoryTypeHost;
}

int spice_cuda_is_pinned(const void * data, size_t size) {
    return size > 0 && pinned_at(data) && pinned_at((const char *) data + size - 1);
}

/* The CUDA calls of one planned copy, on whichever thread issues it (the copier,
 * or the hook's thread: spice-copy-queue.h); 0, or 1 when a call failed. */
static int issue_planned(void * ctx, int32_t slot) {
    spice_cuda * cu = (spice_cuda *) ctx;
    const planned_copy * pc = &cu->planned[slot];
    cleared(cudaSetDevice(cu->device));
    cudaError_t rc = cleared(cudaEventRecord(cu->ev_start[slot], cu->copy_stream));
    for (int k = 0; k < 3 && rc == cudaSuccess; ++k) {
        if (pc->size[k] > 0) {
            rc = cleared(
                cudaMemcpyAsync(pc->dst[k], pc->src[k], pc->size[k], cudaMemcpyHostToDevice, cu->copy_stream));
        }
        if (rc == cudaSuccess && pc->clear[k] > 0) {
            rc = cleared(cudaMemsetAsync(pc->dst[k] + pc->size[k], 0, pc->clear[k], cu->copy_stream));
        }
    }
    if (rc == cudaSuccess) {
        rc = cleared(cudaEventRecord(cu->ev_end[slot], cu->copy_stream));
    }
    return rc != cudaSuccess;
}

int spice_cuda_copy_issue(spice_cuda * cu, int32_t slot, const spice_cuda_segment seg[3]) {
    if (slot < 0 || slot >= cu->layout.n_slots) {
        return SPICE_ERR_INVALID_ARG;
    }
    planned_copy * pc = &cu->planned[slot];
    for (int k = 0; k < 3; ++k) {
        pc->dst[k] = cu->base + spice_pool_copy_offset(&cu->layout, slot, k, seg[k].dst_offset);
        pc->src[k] = seg[k].src;
        pc->size[k] = seg[k].size;
        pc->clear[k] = 0;
        if (seg[k].size == 0) {
            continue;
        }
        /* the padding kernels read past the matrix must be zero: it is, unless the slot's
         * last occupant was a larger matrix (another layer class) -- then clear what it left */
        const size_t left = cu->written[slot][k];
        if (seg[k].pad > 0 && left > seg[k].size) {
            const size_t end = left < seg[k].size + seg[k].pad ? left : seg[k].size + seg[k].pad;
            pc->clear[k] = end - seg[k].size;
        }
        /* bytes past size + pad a larger matrix left stay (nothing reads them until a later,
         * larger matrix's padding reaches them: it clears them then) */
        cu->written[slot][k] = left > seg[k].size + seg[k].pad ? left : seg[k].size;
    }
    const uint64_t seq = cu->next_seq + 1; /* copy_stream runs its copies in this order */
    if (cu->copier != NULL) {
        if (spice_copy_queue_push(cu->copier, slot, seq) != SPICE_OK) {
            return SPICE_ERR_INTERNAL;
        }
    } else if (issue_planned(cu, slot) != 0) {
        return SPICE_ERR_INTERNAL;
    }
    cu->next_seq = seq;
    cu->seq[slot] = seq;
    return SPICE_OK;
}

static int query_landed(void * ctx, int32_t slot) {
    return spice_cuda_copy_done((spice_cuda *) ctx, slot);
}

int spice_cuda_copy_poll(spice_cuda * cu, const int32_t * slots, int32_t n, uint8_t * landed) {
    for (int32_t i = 0; i < n; ++i) {
        if (slots[i] < 0 || slots[i] >= cu->layout.n_slots) {
            return SPICE_ERR_INVALID_ARG;
        }
    }
    return spice_fifo_poll(slots, n, cu->seq, &cu->done_seq, cu->poll_order, landed, query_landed, cu) < 0
               ? SPICE_ERR_INTERNAL
               : SPICE_OK;
}

int spice_cuda_copy_done(spice_cuda * cu, int32_t slot) {
    if (cu->copier != NULL) {
        if (spice_copy_queue_failed(cu->copier)) {
            return -1;
        }
        if (cu->seq[slot] > spice_copy_queue_issued(cu->copier)) {
            return 0; /* still queued for the copier */
        }
    }
    const cudaError_t rc = cleared(cudaEventQuery(cu->ev_end[slot]));
    if (rc == cudaSuccess) {
        return 1;
    }
    if (rc == cudaErrorNotReady) {
        return 0;
    }
    return -1;
}

int spice_cuda_copy_wait(spice_cuda * cu, int32_t slot) {
    /* still queued: issued here, with every copy queued before it, rather than waiting for the copier */
    if (cu->copier != NULL && spice_copy_queue_issue_through(cu->copier, cu->seq[slot]) != SPICE_OK) {
        return SPICE_ERR_INTERNAL;
    }
    if (cleared(cudaEventSynchronize(cu->ev_end[slot])) != cudaSuccess) {
        return SPICE_ERR_INTERNAL;
    }
    cu->done_seq = cu->seq[slot] > cu->done_seq ? cu->seq[slot] : cu->done_seq; /* and every copy before it */
    return SPICE_OK;
}

int spice_cuda_read(spice_cuda * cu, int32_t slot, size_t offset, void * dst, size_t n) {
    const int64_t at = spice_pool_slot_range(&cu->layout, slot, offset, n);
    if (at < 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    cleared(cudaSetDevice(cu->device));
    return cleared(cudaMemcpy(dst, cu->base + at, n, cudaMemcpyDeviceToHost)) == cudaSuccess
               ? SPICE_OK
               : SPICE_ERR_INTERNAL;
}

uint64_t spice_cuda_copy_ns(spice_cuda * cu, int32_t slot) {
    float ms = 0.0f;
    if (cleared(cudaEventElapsedTime(&ms, cu->ev_start[slot], cu->ev_end[slot])) != cudaSuccess) {
        return 0;
    }
    return (uint64_t) ((double) ms * 1e6);
}

/* ---- device executor ----------------------------------------------------------- */

static int grow_pinned(float ** p, size_t * cap, size_t need) {
    if (need <= *cap) {
        return SPICE_OK;
    }
    if (*p) {
        cudaFreeHost(*p);
        *p = NULL;
        *cap = 0;
    }
    const size_t n = need + need / 2;
    if (cleared(cudaMallocHost((void **) p, n)) != cudaSuccess) {
        return SPICE_ERR_NO_MEMORY;
    }
    *cap = n;
    return SPICE_OK;
}

/* A weight tensor over slot memory; bypasses init_tensor (its padding was
 * zeroed when the pool was cleared and after every copy). */
static struct ggml_tensor * slot_matrix(spice_cuda * cu, const spice_expert_matrix * m, const char * addr) {
    struct ggml_tensor * t = ggml_new_tensor_2d(cu->ctx, m->type, m->n_cols, m->n_rows);
    t->data = (void *) (uintptr_t) addr;
    t->buffer = cu->pool;
    return t;
}

/* One small graph per device expert, built every call: kept for A/B runs
 * and for layers the pool graph cannot run. */
static int legacy_exec_begin(spice_cuda * cu, const spice_device_job * job, char * err, size_t err_len) {
    const spice_expert_layer * L = job->layer;
    const int32_t n_pairs = job->n_tokens * job->n_used;
    if (cu->pending) { /* the last call's work was never collected (its layer failed): finish it first */
        ggml_backend_synchronize(cu->backend);
    }
    cu->pending = 0;
    cu->n_rows = 0;
    cu->n_embd = L->n_embd;

    /* rows grouped by expert (each expert's weights read once for all its tokens) */
    int32_t n_run = 0;
    for (int32_t i = 0; i < n_pairs; ++i) {
        n_run += job->run[i] == SPICE_EXEC_DEVICE;
    }
    if (n_run == 0) {
        return SPICE_OK;
    }
    if ((size_t) n_run > cu->row_cap) {
        int32_t * rp = (int32_t *) realloc(cu->row_pair, (size_t) n_run * sizeof(int32_t));
        if (rp == NULL) {
            return SPICE_ERR_NO_MEMORY;
        }
        cu->row_pair = rp;
        cu->row_cap = (size_t) n_run;
    }
    const size_t row_bytes = (size_t) L->n_embd * sizeof(float);
    if (grow_pinned(&cu->x_host, &cu->x_cap, (size_t) n_run * row_bytes) != SPICE_OK ||
        grow_pinned(&cu->y_host, &cu->y_cap, (size_t) n_run * row_bytes) != SPICE_OK) {
        snprintf(err, err_len, "CUDA: no pinned host memory for %d staging rows", n_run);
        return SPICE_ERR_NO_MEMORY;
    }

    const size_t max_tensors = 1 + 8 * (size_t) L->n_expert;
    const size_t max_nodes = 8 * (size_t) L->n_expert + 8;
    if (cu->ctx) {
        ggml_free(cu->ctx);
        cu->ctx = NULL;
    }
    struct ggml_init_params ip = {
        /* .mem_size   = */ max_tensors * ggml_tensor_overhead() + ggml_graph_overhead_custom(max_nodes, false),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    cu->ctx = ggml_init(ip);
    if (cu->ctx == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    struct ggml_cgraph * gf = ggml_new_graph_custom(cu->ctx, max_nodes, false);
    struct ggml_tensor * x = ggml_new_tensor_2d(cu->ctx, GGML_TYPE_F32, L->n_embd, n_run);
    ggml_set_input(x);

    struct ggml_tensor * outs[L->n_expert > 0 ? L->n_expert : 1];
    int32_t out_rows[L->n_expert > 0 ? L->n_expert : 1];
    int32_t n_out = 0;
    for (int32_t e = 0; e < L->n_expert; ++e) {
        const int32_t r0 = cu->n_rows;
        for (int32_t t = 0; t < job->n_tokens; ++t) {
            const int32_t * ids = (const int32_t *) ((const char *) job->ids + (size_t) t * job->ids_nb1);
            for (int32_t k = 0; k < job->n_used; ++k) {
                const int32_t pair = t * job->n_used + k;
                if (job->run[pair] == SPICE_EXEC_DEVICE && ids[k] == e) {
                    memcpy((char *) cu->x_host + (size_t) cu->n_rows * row_bytes,
                           (const char *) job->inp + (size_t) t * job->inp_nb1, row_bytes);
                    cu->row_pair[cu->n_rows++] = pair;
                }
            }
        }
        const int32_t n = cu->n_rows - r0;
        if (n == 0) {
            continue;
        }
        const int32_t slot = job->slot_of[e];
        const char * at[3];
        for (int k = 0; k < 3; ++k) {
            at[k] = cu->base + spice_pool_offset(&cu->layout, slot, k);
        }
        struct ggml_tensor * xe = ggml_view_2d(cu->ctx, x, L->n_embd, n, x->nb[1], (size_t) r0 * x->nb[1]);
        struct ggml_tensor * g = ggml_mul_mat(cu->ctx, slot_matrix(cu, &L->gate, at[0]), xe);
        struct ggml_tensor * u = ggml_mul_mat(cu->ctx, slot_matrix(cu, &L->up, at[1]), xe);
        struct ggml_tensor * a = ggml_swiglu_split(cu->ctx, g, u);
        struct ggml_tensor * y = ggml_mul_mat(cu->ctx, slot_matrix(cu, &L->down, at[2]), a);
        ggml_set_output(y);
        ggml_build_forward_expand(gf, y);
        outs[n_out] = y;
        out_rows[n_out++] = r0;
    }
    if (!ggml_gallocr_alloc_graph(cu->galloc, gf)) {
        snprintf(err, err_len, "CUDA: could not allocate the device executor's activations (%d rows)", n_run);
        return SPICE_ERR_NO_MEMORY;
    }
    ggml_backend_tensor_set_async(cu->backend, x, cu->x_host, 0, (size_t) n_run * row_bytes);
    if (ggml_backend_graph_compute_async(cu->backend, gf) != GGML_STATUS_SUCCESS) {
        snprintf(err, err_len, "CUDA: the device executor's graph failed");
        return SPICE_ERR_INTERNAL;
    }
    for (int32_t i = 0; i < n_out; ++i) {
        ggml_backend_tensor_get_async(cu->backend, outs[i], (char *) cu->y_host + (size_t) out_rows[i] * row_bytes,
                                      0, ggml_nbytes(outs[i]));
    }
    cu->pending = 1;
    return SPICE_OK;
}

int spice_cuda_exec_supports(spice_cuda * cu, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used) {
    /* the pool graph when it can be readied now (before the barrier), else the per-expert
     * graphs, which run every type ggml-cuda's mul_mat does */
    cu->use_pool = cu->pool_exec != NULL && spice_pool_exec_ready(cu->pool_exec, L, n_tokens, n_used) == SPICE_OK;
    return 1;
}

int spice_cuda_exec_begin(spice_cuda * cu, const spice_device_job * job, char * err, size_t err_len) {
    cu->pending_pool = 0; /* an uncollected call (its layer failed) is finished by the executor's begin */
    const uint64_t t0 = cu->profile ? spice_monotonic_ns() : 0;
    const int which = cu->use_pool ? 0 : 1;
    int rc;
    if (cu->use_pool) {
        rc = spice_pool_exec_begin(cu->pool_exec, job, err, err_len);
        cu->pending_pool = rc == SPICE_OK;
    } else {
        rc = legacy_exec_begin(cu, job, err, err_len);
    }
    if (cu->profile) {
        cu->prof_begins[which]++;
        cu->prof_ns[which] += spice_monotonic_ns() - t0;
    }
    return rc;
}

static int legacy_exec_end(spice_cuda * cu, float * y) {
    if (!cu->pending) {
        return SPICE_OK;
    }
    ggml_backend_synchronize(cu->backend);
    cu->pending = 0;
    const size_t row_bytes = (size_t) cu->n_embd * sizeof(float);
    for (int32_t r = 0; r < cu->n_rows; ++r) {
        memcpy((char *) y + (size_t) cu->row_pair[r] * row_bytes, (const char *) cu->y_host + (size_t) r * row_bytes,
               row_bytes);
    }
    return SPICE_OK;
}

int spice_cuda_exec_end(spice_cuda * cu, float * y, char * err, size_t err_len) {
    if (cu->pending_pool) {
        cu->pending_pool = 0;
        return spice_pool_exec_end(cu->pool_exec, y, err, err_len);
    }
    return legacy_exec_end(cu, y);
}
