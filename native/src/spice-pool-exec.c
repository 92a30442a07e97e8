/* Slot-pool executor (see spice-pool-exec.h). */
#include "spice-pool-exec.h"

#include "spice-clock.h"
#include "spice-pool-ids.h"
#include "spice.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"
#include "ggml-impl.h" /* struct ggml_cgraph: a persistent graph gets a uid, so ggml-cuda skips re-checking it */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One persistent graph: a class of layers (matrix types, widths, experts
 * per token) at one token bucket. */
typedef struct pool_graph {
    enum ggml_type type[3];
    int32_t n_embd, n_ff, n_used, bucket;
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    ggml_backend_buffer_t in_buf;   /* x rows then sid: one upload */
    struct ggml_tensor * in;        /* the whole input buffer as bytes */
    struct ggml_tensor * y;         /* [n_embd, n_used, bucket] */
    size_t in_bytes, sid_offset, y_bytes;
    ggml_gallocr_t galloc;
} pool_graph;

struct spice_pool_exec {
    ggml_backend_t backend;
    ggml_backend_buffer_t pool;
    char * base;
    spice_pool_layout layout;
    int on_cpu;                     /* the CPU backend: every op computes exactly as the host executor */

    pool_graph * graphs;
    int32_t n_graphs, cap_graphs;
    uint64_t n_launches;

    ggml_backend_buffer_type_t staging_buft; /* pinned host memory where the backend has it */
    ggml_backend_buffer_t in_stage, y_stage;
    char * in_host; char * y_host;

    /* the queued call */
    int pending;
    const pool_graph * g;
    int32_t n_embd;
    int32_t * rows;                 /* device pairs, in order */
    int32_t n_rows, cap_rows, n_used;

    /* a chunk's expert ids (spice-pool-ids.h): each pair's slot or -1, and scratch */
    int32_t * want; int32_t * listed;
    int32_t cap_want;
    uint8_t * mark;                 /* [n_slots], zero between calls */

    /* SPICE_CUDA_PROFILE=1: where a launch's time goes, printed when freed (on an H200
     * spice:exact's launches took 60-110 us against 12-20 for the other rows, in the graph
     * launch; likely its debug log line taking the GIL: spice-log-filter.h) */
    int profile;
    uint64_t prof_begins, prof_chunks, prof_unfinished;
    uint64_t prof_ns[4];            /* staging (rows, ids), upload, graph launch, download queued */
};

static int fail(char * err, size_t err_len, const char * msg, int status) {
    if (err && err_len) {
        snprintf(err, err_len, "pool executor: %s", msg);
    }
    return status;
}

int spice_pool_exec_create(ggml_backend_t backend, ggml_backend_buffer_t pool, const spice_pool_layout * layout,
                           spice_pool_exec ** out, char * err, size_t err_len) {
    if (backend == NULL || pool == NULL || layout == NULL || out == NULL) {
        return fail(err, err_len, "missing backend, pool or layout", SPICE_ERR_INVALID_ARG);
    }
    *out = NULL;
    spice_pool_exec * px = (spice_pool_exec *) calloc(1, sizeof(*px));
    if (px == NULL) {
        return fail(err, err_len, "out of memory", SPICE_ERR_NO_MEMORY);
    }
    px->backend = backend;
    px->pool = pool;
    px->base = (char *) ggml_backend_buffer_get_base(pool);
    px->layout = *layout;
    px->on_cpu = ggml_backend_is_cpu(backend);
    const char * profile = getenv("SPICE_CUDA_PROFILE");
    px->profile = profile != NULL && profile[0] == '1';
    px->mark = (uint8_t *) calloc((size_t) (layout->n_slots > 0 ? layout->n_slots : 1), 1);
    if (px->mark == NULL) {
        free(px);
        return fail(err, err_len, "out of memory", SPICE_ERR_NO_MEMORY);
    }
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    px->staging_buft = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
    if (px->staging_buft == NULL) {
        px->staging_buft = ggml_backend_cpu_buffer_type();
    }
    *out = px;
    return SPICE_OK;
}

static void graph_free(pool_graph * g) {
    if (g->galloc) {
        ggml_gallocr_free(g->galloc);
    }
    if (g->in_buf) {
        ggml_backend_buffer_free(g->in_buf);
    }
    if (g->ctx) {
        ggml_free(g->ctx);
    }
    memset(g, 0, sizeof(*g));
}

void spice_pool_exec_free(spice_pool_exec * px) {
    if (px == NULL) {
        return;
    }
    if (px->pending) {
        ggml_backend_synchronize(px->backend);
    }
    if (px->profile && px->prof_chunks > 0) {
        const double n = (double) px->prof_chunks;
        fprintf(stderr,
                "libspice: SPICE_CUDA_PROFILE: pool executor: %llu calls, %llu launches; per launch: staging %.1f us, "
                "upload %.1f, graph %.1f, download %.1f; %llu calls first finished an uncollected one\n",
                (unsigned long long) px->prof_begins, (unsigned long long) px->prof_chunks, 1e-3 * px->prof_ns[0] / n,
                1e-3 * px->prof_ns[1] / n, 1e-3 * px->prof_ns[2] / n, 1e-3 * px->prof_ns[3] / n,
                (unsigned long long) px->prof_unfinished);
    }
    for (int32_t i = 0; i < px->n_graphs; ++i) {
        graph_free(&px->graphs[i]);
    }
    free(px->graphs);
    if (px->in_stage) {
        ggml_backend_buffer_free(px->in_stage);
    }
    if (px->y_stage) {
        ggml_backend_buffer_free(px->y_stage);
    }
    free(px->rows);
    free(px->want);
    free(px->listed);
    free(px->mark);
    free(px);
}

int spice_pool_exec_supports(spice_pool_exec * px, const spice_expert_layer * L) {
    if (px == NULL || L == NULL || !L->is_moe || !px->layout.graph_ok) {
        return 0;
    }
    const enum ggml_type types[3] = { L->gate.type, L->up.type, L->down.type };
    for (int k = 0; k < 3; ++k) {
        /* CUDA's mul_mat_id on unquantized weights may sync the host to sort ids, which a
         * captured graph cannot do: those layers keep the per-expert executor there */
        if (!px->on_cpu && !ggml_is_quantized(types[k])) {
            return 0;
        }
        if (px->layout.stride[k] % ggml_type_size(types[k]) != 0) {
            return 0;
        }
    }
    return 1;
}

/* A view of kind k's region as [n_cols, n_rows, n_slots + 1] experts; it
 * bypasses init_tensor: the pool's padding is zero (cleared at allocation,
 * and copies zero what a larger previous occupant left). */
static struct ggml_tensor * region_tensor(spice_pool_exec * px, struct ggml_context * ctx, int k, enum ggml_type type,
                                          int64_t n_cols, int64_t n_rows) {
    struct ggml_tensor * t = ggml_new_tensor_3d(ctx, type, n_cols, n_rows, (int64_t) px->layout.n_slots + 1);
    t->nb[2] = px->layout.stride[k];
    t->nb[3] = t->nb[2] * (size_t) t->ne[2];
    t->data = px->base + px->layout.region[k];
    t->buffer = px->pool;
    return t;
}

static size_t align_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

static int graph_build(spice_pool_exec * px, pool_graph * g, const spice_expert_layer * L, int32_t n_used,
                       int32_t bucket) {
    memset(g, 0, sizeof(*g));
    g->type[0] = L->gate.type; g->type[1] = L->up.type; g->type[2] = L->down.type;
    g->n_embd = L->n_embd; g->n_ff = L->n_ff; g->n_used = n_used; g->bucket = bucket;
    const size_t n_nodes = 16;
    struct ggml_init_params ip = {
        /* .mem_size   = */ 16 * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_nodes, false),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    g->ctx = ggml_init(ip);
    if (g->ctx == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    struct ggml_context * ctx = g->ctx;
    const size_t align = ggml_backend_get_alignment(px->backend);
    g->sid_offset = align_up((size_t) L->n_embd * (size_t) bucket * sizeof(float), align);
    g->in_bytes = g->sid_offset + (size_t) n_used * (size_t) bucket * sizeof(int32_t);
    g->in_buf = ggml_backend_alloc_buffer(px->backend, g->in_bytes);
    if (g->in_buf == NULL) {
        graph_free(g);
        return SPICE_ERR_NO_MEMORY;
    }
    char * in_base = (char *) ggml_backend_buffer_get_base(g->in_buf);
    g->in = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) g->in_bytes);
    g->in->data = in_base;
    g->in->buffer = g->in_buf;
    struct ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, L->n_embd, 1, bucket);
    x->data = in_base;
    x->buffer = g->in_buf;
    struct ggml_tensor * sid = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, bucket);
    sid->data = in_base + g->sid_offset;
    sid->buffer = g->in_buf;

    struct ggml_tensor * gate = region_tensor(px, ctx, 0, L->gate.type, L->n_embd, L->n_ff);
    struct ggml_tensor * up = region_tensor(px, ctx, 1, L->up.type, L->n_embd, L->n_ff);
    struct ggml_tensor * down = region_tensor(px, ctx, 2, L->down.type, L->n_ff, L->n_embd);
    struct ggml_tensor * gv = ggml_mul_mat_id(ctx, gate, x, sid);
    struct ggml_tensor * uv = ggml_mul_mat_id(ctx, up, x, sid);
    struct ggml_tensor * a = ggml_swiglu_split(ctx, gv, uv);
    g->y = ggml_mul_mat_id(ctx, down, a, sid);
    ggml_set_output(g->y);
    g->y_bytes = ggml_nbytes(g->y);
    g->gf = ggml_new_graph_custom(ctx, n_nodes, false);
    ggml_build_forward_expand(g->gf, g->y);
    for (int i = 0; i < ggml_graph_n_nodes(g->gf); ++i) {
        if (!ggml_backend_supports_op(px->backend, ggml_graph_node(g->gf, i))) {
            graph_free(g);
            return SPICE_ERR_UNSUPPORTED;
        }
    }
    g->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(px->backend));
    if (g->galloc == NULL || !ggml_gallocr_alloc_graph(g->galloc, g->gf)) {
        graph_free(g);
        return SPICE_ERR_NO_MEMORY;
    }
    g->gf->uid = ggml_graph_next_uid(); /* never changes: ggml-cuda replays its capture without re-checking */
    return SPICE_OK;
}

static const pool_graph * graph_for(spice_pool_exec * px, const spice_expert_layer * L, int32_t n_used,
                                    int32_t bucket, int * status) {
    for (int32_t i = 0; i < px->n_graphs; ++i) {
        const pool_graph * g = &px->graphs[i];
        if (g->type[0] == L->gate.type && g->type[1] == L->up.type && g->type[2] == L->down.type &&
            g->n_embd == L->n_embd && g->n_ff == L->n_ff && g->n_used == n_used && g->bucket == bucket) {
            return g;
        }
    }
    if (px->n_graphs == px->cap_graphs) {
        const int32_t cap = px->cap_graphs ? 2 * px->cap_graphs : 8;
        pool_graph * grown = (pool_graph *) realloc(px->graphs, (size_t) cap * sizeof(*grown));
        if (grown == NULL) {
            *status = SPICE_ERR_NO_MEMORY;
            return NULL;
        }
        px->graphs = grown;
        px->cap_graphs = cap;
    }
    *status = graph_build(px, &px->graphs[px->n_graphs], L, n_used, bucket);
    return *status == SPICE_OK ? &px->graphs[px->n_graphs++] : NULL;
}

static int grow_stage(spice_pool_exec * px, ggml_backend_buffer_t * buf, char ** host, size_t need) {
    if (*buf != NULL && ggml_backend_buffer_get_size(*buf) >= need) {
        return SPICE_OK;
    }
    if (*buf != NULL) {
        ggml_backend_buffer_free(*buf);
        *buf = NULL;
        *host = NULL;
    }
    *buf = ggml_backend_buft_alloc_buffer(px->staging_buft, need + need / 2);
    if (*buf == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    *host = (char *) ggml_backend_buffer_get_base(*buf);
    return SPICE_OK;
}

static int32_t bucket_of(int32_t n_tokens) {
    int32_t b = 1;
    while (b < n_tokens && b < SPICE_POOL_MAX_BUCKET) {
        b *= 2;
    }
    return b;
}

/* The graph a call of n_tokens x n_used on L runs, built if new, with staging
 * for its chunks; NULL with *status when it cannot be had. */
static const pool_graph * prepare(spice_pool_exec * px, const spice_expert_layer * L, int32_t n_tokens,
                                  int32_t n_used, int * status) {
    const int32_t bucket = bucket_of(n_tokens);
    const int32_t n_chunks = (n_tokens + bucket - 1) / bucket;
    const pool_graph * g = graph_for(px, L, n_used, bucket, status);
    if (g != NULL && (grow_stage(px, &px->in_stage, &px->in_host, (size_t) n_chunks * g->in_bytes) != SPICE_OK ||
                      grow_stage(px, &px->y_stage, &px->y_host, (size_t) n_chunks * g->y_bytes) != SPICE_OK)) {
        *status = SPICE_ERR_NO_MEMORY;
        return NULL;
    }
    return g;
}

int spice_pool_exec_ready(spice_pool_exec * px, const spice_expert_layer * L, int32_t n_tokens, int32_t n_used) {
    if (!spice_pool_exec_supports(px, L) || n_tokens < 1 || n_used < 1) {
        return SPICE_ERR_UNSUPPORTED;
    }
    if (bucket_of(n_tokens) > 1 && px->layout.n_slots + 1 < n_used) {
        return SPICE_ERR_UNSUPPORTED; /* too few slots for distinct ids per token (spice-pool-ids.h) */
    }
    int status = SPICE_OK;
    prepare(px, L, n_tokens, n_used, &status);
    return status;
}

int spice_pool_exec_begin(spice_pool_exec * px, const spice_device_job * job, char * err, size_t err_len) {
    if (px->pending) { /* the last call's work was never collected (its layer failed): finish it first */
        ggml_backend_synchronize(px->backend);
        px->pending = 0;
        px->prof_unfinished++;
    }
    px->prof_begins++;
    const spice_expert_layer * L = job->layer;
    const int32_t n_pairs = job->n_tokens * job->n_used;
    if (n_pairs > px->cap_rows) {
        int32_t * rows = (int32_t *) realloc(px->rows, (size_t) n_pairs * sizeof(int32_t));
        if (rows == NULL) {
            return fail(err, err_len, "out of memory for the call's rows", SPICE_ERR_NO_MEMORY);
        }
        px->rows = rows;
        px->cap_rows = n_pairs;
    }
    px->n_rows = 0;
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (job->run[i] == SPICE_EXEC_DEVICE) {
            px->rows[px->n_rows++] = i;
        }
    }
    if (px->n_rows == 0) {
        return SPICE_OK;
    }
    int status = SPICE_OK;
    const pool_graph * g = prepare(px, L, job->n_tokens, job->n_used, &status); /* ready() built it: a lookup */
    if (g == NULL) {
        return fail(err, err_len, status == SPICE_ERR_UNSUPPORTED ? "the backend lacks an op of the pool graph"
                                                                  : "out of memory for a pool graph or its staging",
                    status);
    }
    const int32_t bucket = g->bucket;
    const int32_t n_chunks = (job->n_tokens + bucket - 1) / bucket;
    const size_t row_bytes = (size_t) L->n_embd * sizeof(float);
    const int32_t n_slots = px->layout.n_slots;
    const int32_t cap = bucket * job->n_used;
    if (cap > px->cap_want) {
        int32_t * want = (int32_t *) realloc(px->want, (size_t) cap * sizeof(int32_t));
        int32_t * listed = want != NULL ? (int32_t *) realloc(px->listed, (size_t) cap * sizeof(int32_t)) : NULL;
        if (want != NULL) {
            px->want = want;
        }
        if (listed == NULL) {
            return fail(err, err_len, "out of memory for the call's expert ids", SPICE_ERR_NO_MEMORY);
        }
        px->listed = listed;
        px->cap_want = cap;
    }
    uint64_t at[5] = { 0 }; /* SPICE_CUDA_PROFILE's timestamps */
    for (int32_t c = 0; c < n_chunks; ++c) {
        at[0] = px->profile ? spice_monotonic_ns() : 0;
        char * in = px->in_host + (size_t) c * g->in_bytes;
        int32_t * sid = (int32_t *) (in + g->sid_offset);
        int32_t n_in_chunk = 0;
        for (int32_t tt = 0; tt < bucket; ++tt) {
            const int32_t t = c * bucket + tt;
            float * x = (float *) (in + (size_t) tt * row_bytes);
            if (t >= job->n_tokens) {
                memset(x, 0, row_bytes);
                continue;
            }
            n_in_chunk++;
            memcpy(x, (const char *) job->inp + (size_t) t * job->inp_nb1, row_bytes);
            const int32_t * ids = (const int32_t *) ((const char *) job->ids + (size_t) t * job->ids_nb1);
            for (int32_t k = 0; k < job->n_used; ++k) {
                const int32_t pair = t * job->n_used + k;
                const int32_t slot = job->run[pair] == SPICE_EXEC_DEVICE ? job->slot_of[ids[k]] : -1;
                px->want[tt * job->n_used + k] = slot >= 0 && slot < n_slots ? slot : -1;
            }
        }
        if (spice_pool_fill_ids(sid, px->want, n_in_chunk, bucket, job->n_used, n_slots, px->mark, px->listed) != 0) {
            return fail(err, err_len, "too few slots for distinct expert ids per token", SPICE_ERR_UNSUPPORTED);
        }
        at[1] = px->profile ? spice_monotonic_ns() : 0;
        ggml_backend_tensor_set_async(px->backend, g->in, in, 0, g->in_bytes);
        at[2] = px->profile ? spice_monotonic_ns() : 0;
        if (ggml_backend_graph_compute_async(px->backend, g->gf) != GGML_STATUS_SUCCESS) {
            ggml_backend_synchronize(px->backend);
            return fail(err, err_len, "the pool graph failed", SPICE_ERR_INTERNAL);
        }
        px->n_launches++;
        at[3] = px->profile ? spice_monotonic_ns() : 0;
        ggml_backend_tensor_get_async(px->backend, g->y, px->y_host + (size_t) c * g->y_bytes, 0, g->y_bytes);
        if (px->profile) {
            at[4] = spice_monotonic_ns();
            for (int k = 0; k < 4; ++k) {
                px->prof_ns[k] += at[k + 1] - at[k];
            }
            px->prof_chunks++;
        }
    }
    px->g = g;
    px->n_embd = L->n_embd;
    px->n_used = job->n_used;
    px->pending = 1;
    return SPICE_OK;
}

int spice_pool_exec_end(spice_pool_exec * px, float * y, char * err, size_t err_len) {
    (void) err;
    (void) err_len;
    if (!px->pending) {
        return SPICE_OK;
    }
    ggml_backend_synchronize(px->backend);
    px->pending = 0;
    const pool_graph * g = px->g;
    const size_t row_bytes = (size_t) px->n_embd * sizeof(float);
    for (int32_t r = 0; r < px->n_rows; ++r) {
        const int32_t pair = px->rows[r];
        const int32_t t = pair / px->n_used, k = pair % px->n_used;
        const int32_t c = t / g->bucket, tt = t % g->bucket;
        const char * src = px->y_host + (size_t) c * g->y_bytes + ((size_t) tt * (size_t) px->n_used + (size_t) k) * row_bytes;
        memcpy((char *) y + (size_t) pair * row_bytes, src, row_bytes);
    }
    return SPICE_OK;
}

void spice_pool_exec_stats(const spice_pool_exec * px, int32_t * n_graphs, uint64_t * n_launches) {
    if (n_graphs) {
        *n_graphs = px ? px->n_graphs : 0;
    }
    if (n_launches) {
        *n_launches = px ? px->n_launches : 0;
    }
}
