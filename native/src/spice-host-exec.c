/* Exact host executor (see spice-host-exec.h).
 *
 * Exactness rules, each mirroring what ggml's CPU backend does for the
 * stock graph (mul_mat_id gate, mul_mat_id up, swiglu, mul_mat_id down, mul
 * by gate weights, then a chain of adds):
 *   - activations are quantized to the weight type's vec_dot_type with that
 *     type's from_float, block by block;
 *   - each output element is one vec_dot call over a weight row and an
 *     activation row;
 *   - SwiGLU uses ggml's own row kernel (ggml_cpu_swiglu_f32);
 *   - the weighted sum is ((y0*w0 + y1*w1) + y2*w2) ..., each product and sum
 *     rounded to float, never contracted into an FMA (-ffp-contract=off). */
#include "spice-host-exec.h"

#include "spice.h"

#include <stdlib.h>
#include <string.h>

#define SPICE_ROW_CHUNK 16
#define SPICE_ALIGN 64

static size_t align_up(size_t n) {
    return (n + SPICE_ALIGN - 1) & ~(size_t) (SPICE_ALIGN - 1);
}

void spice_host_exec_init(spice_host_exec * ex) {
    memset(ex, 0, sizeof(*ex));
    atomic_init(&ex->next_quant, 0);
    atomic_init(&ex->next_ff, 0);
    atomic_init(&ex->next_embd, 0);
}

void spice_host_exec_free(spice_host_exec * ex) {
    free(ex->buf);
    ex->buf = NULL;
    ex->cap = 0;
}

static const float * inp_row(const spice_host_job * job, int32_t t) {
    return (const float *) ((const char *) job->inp + (size_t) t * job->inp_nb1);
}

static const int32_t * ids_row(const spice_host_job * job, int32_t t) {
    return (const int32_t *) ((const char *) job->ids + (size_t) t * job->ids_nb1);
}

static const float * weights_row(const spice_host_job * job, int32_t t) {
    return (const float *) ((const char *) job->weights + (size_t) t * job->weights_nb1);
}

static float * out_row(const spice_host_job * job, int32_t t) {
    return (float *) ((char *) job->out + (size_t) t * job->out_nb1);
}

int spice_host_exec_prepare(spice_host_exec * ex, const spice_host_job * job) {
    const spice_expert_layer * L = job->layer;
    const size_t n_tokens = (size_t) job->n_tokens;
    const size_t n_pairs = n_tokens * (size_t) job->n_used;
    const size_t n_ff = (size_t) L->n_ff, n_embd = (size_t) L->n_embd;
    const int up_shares_gate_input = L->up.vec_dot_type == L->gate.vec_dot_type;

    ex->job = *job;
    ex->failed = 0;

    size_t sz_xq_gate = L->gate.quantize ? align_up(n_tokens * L->gate.act_row_size) : 0;
    size_t sz_xq_up = (L->up.quantize && !up_shares_gate_input) ? align_up(n_tokens * L->up.act_row_size) : 0;
    size_t sz_ff = align_up(n_pairs * n_ff * sizeof(float));
    size_t sz_actq = L->down.quantize ? align_up(n_pairs * L->down.act_row_size) : 0;
    size_t sz_y = align_up(n_pairs * n_embd * sizeof(float));
    size_t sz_start = align_up(((size_t) L->n_expert + 1) * sizeof(int32_t));
    size_t sz_pairs = align_up(n_pairs * sizeof(int32_t));
    size_t sz_active = align_up((size_t) L->n_expert * sizeof(int32_t));
    size_t sz_wbase = align_up(3 * (size_t) L->n_expert * sizeof(const char *));
    size_t sz_wlayer = align_up((size_t) L->n_expert * sizeof(const spice_expert_layer *));
    size_t total = sz_xq_gate + sz_xq_up + 3 * sz_ff + sz_actq + sz_y + sz_start + sz_pairs + sz_active + sz_wbase +
                   sz_wlayer;

    if (total > ex->cap) {
        void * nbuf = NULL;
        size_t ncap = total + total / 4;
        if (posix_memalign(&nbuf, SPICE_ALIGN, ncap) != 0) {
            ex->failed = 1;
            return SPICE_ERR_NO_MEMORY;
        }
        free(ex->buf);
        ex->buf = nbuf;
        ex->cap = ncap;
    }
    char * p = (char *) ex->buf;
    ex->xq_gate = sz_xq_gate ? p : NULL;                  p += sz_xq_gate;
    ex->xq_up = sz_xq_up ? p : (up_shares_gate_input ? ex->xq_gate : NULL); p += sz_xq_up;
    ex->gate = (float *) p;                               p += sz_ff;
    ex->up = (float *) p;                                 p += sz_ff;
    ex->act = (float *) p;                                p += sz_ff;
    ex->actq = sz_actq ? p : NULL;                        p += sz_actq;
    ex->y = (float *) p;                                  p += sz_y;
    ex->expert_start = (int32_t *) p;                     p += sz_start;
    ex->pairs_by_expert = (int32_t *) p;                  p += sz_pairs;
    ex->active = (int32_t *) p;                           p += sz_active;
    ex->wbase = (const char **) p;                        p += sz_wbase;
    ex->wlayer = (const spice_expert_layer **) p;

    /* where each expert's rows come from: its slot on the device tier (the
     * matrices packed as the slots hold them: job->device_layer) or the host
     * tensor */
    const spice_expert_layer * DL = job->device_layer != NULL ? job->device_layer : L;
    for (int32_t e = 0; e < L->n_expert; ++e) {
        const char * dev = job->device ? job->device[e] : NULL;
        const spice_expert_layer * W = dev ? DL : L;
        const spice_expert_matrix * mats[3] = { &W->gate, &W->up, &W->down };
        ex->wlayer[e] = W;
        size_t offset = 0;
        for (int k = 0; k < 3; ++k) {
            const struct ggml_tensor * t = mats[k]->tensor;
            ex->wbase[(size_t) k * (size_t) L->n_expert + (size_t) e] =
                dev ? dev + offset : (const char *) t->data + (size_t) e * t->nb[2];
            offset += t->nb[2];
        }
    }

    /* counting sort of the executed pairs by expert */
    int32_t * start = ex->expert_start;
    memset(start, 0, ((size_t) L->n_expert + 1) * sizeof(int32_t));
    for (int32_t t = 0; t < job->n_tokens; ++t) {
        const int32_t * ids = ids_row(job, t);
        for (int32_t k = 0; k < job->n_used; ++k) {
            if (job->exec[(size_t) t * job->n_used + k] == SPICE_EXEC_HOST) {
                start[ids[k] + 1]++;
            }
        }
    }
    ex->n_active = 0;
    for (int32_t e = 0; e < L->n_expert; ++e) {
        if (start[e + 1] > 0) {
            ex->active[ex->n_active++] = e;
        }
        start[e + 1] += start[e];
    }
    ex->n_exec = start[L->n_expert];
    /* fill, using active[] slots temporarily would clobber it: walk with a cursor per expert */
    for (int32_t t = 0; t < job->n_tokens; ++t) {
        const int32_t * ids = ids_row(job, t);
        for (int32_t k = 0; k < job->n_used; ++k) {
            const int32_t pair = t * job->n_used + k;
            if (job->exec[pair] == SPICE_EXEC_HOST) {
                ex->pairs_by_expert[start[ids[k]]++] = pair;
            }
        }
    }
    /* the fill advanced start[e] to the end of e's run; shift back */
    for (int32_t e = L->n_expert; e > 0; --e) {
        start[e] = start[e - 1];
    }
    start[0] = 0;

    ex->chunks_ff = (int32_t) ((n_ff + SPICE_ROW_CHUNK - 1) / SPICE_ROW_CHUNK);
    ex->chunks_embd = (int32_t) ((n_embd + SPICE_ROW_CHUNK - 1) / SPICE_ROW_CHUNK);
    atomic_store_explicit(&ex->next_quant, 0, memory_order_relaxed);
    atomic_store_explicit(&ex->next_ff, 0, memory_order_relaxed);
    atomic_store_explicit(&ex->next_embd, 0, memory_order_relaxed);
    return SPICE_OK;
}

/* Quantize row x into y with m's activation quantizer, the share of blocks
 * thread ith of nth would convert in ggml (same blocks, same results). */
static void quantize_part(const spice_expert_matrix * m, const float * x, char * y, int ith, int nth) {
    const int64_t bs = ggml_blck_size(m->vec_dot_type);
    const int64_t nblocks = m->n_cols / bs;
    const int64_t b0 = (ith * nblocks) / nth;
    const int64_t b1 = ((ith + 1) * nblocks) / nth;
    if (b1 > b0) {
        m->quantize(x + b0 * bs, y + (size_t) b0 * ggml_type_size(m->vec_dot_type), (b1 - b0) * bs);
    }
}

/* The input rows quantized for gate (and for up where its activation type
 * differs), as items (matrix, token, part of the row) taken off a counter:
 * a thread that arrives late -- thread 0, launching device work after the
 * barrier -- leaves its share to the others instead of holding them at the
 * next barrier. Parts are the same block ranges ggml's threads would take,
 * so the bytes are the same whoever converts them. */
static void phase_quantize(spice_host_exec * ex, int nth) {
    const spice_host_job * job = &ex->job;
    const spice_expert_layer * L = job->layer;
    const spice_expert_matrix * mats[2] = { &L->gate, &L->up };
    char * dsts[2] = { ex->xq_gate, ex->xq_up != ex->xq_gate ? ex->xq_up : NULL };
    const int32_t parts = job->n_tokens >= nth ? 1 : nth;
    const int32_t per_matrix = job->n_tokens * parts;
    int32_t item;
    while ((item = atomic_fetch_add_explicit(&ex->next_quant, 1, memory_order_relaxed)) < 2 * per_matrix) {
        const int k = item / per_matrix;
        if (dsts[k] == NULL) {
            continue;
        }
        const int32_t t = (item % per_matrix) / parts, part = item % parts;
        quantize_part(mats[k], inp_row(job, t), dsts[k] + (size_t) t * mats[k]->act_row_size, part, parts);
    }
}

static const void * gate_input(const spice_host_exec * ex, int32_t t) {
    const spice_expert_matrix * m = &ex->job.layer->gate;
    return ex->xq_gate ? (const void *) (ex->xq_gate + (size_t) t * m->act_row_size) : (const void *) inp_row(&ex->job, t);
}

static const void * up_input(const spice_host_exec * ex, int32_t t) {
    const spice_expert_matrix * m = &ex->job.layer->up;
    return ex->xq_up ? (const void *) (ex->xq_up + (size_t) t * m->act_row_size) : (const void *) inp_row(&ex->job, t);
}

/* One unit of matmul work: rows [r0, r1) of expert e. */
typedef struct work_item {
    int32_t e;
    int64_t r0, r1;
} work_item;

/* Takes the next (expert, row chunk) item off a shared counter; 0 when done.
 * Items walk experts in order, so a prompt batch streams each expert's
 * weights once for all the tokens routed to it. */
static int next_item(const spice_host_exec * ex, atomic_int * counter, int32_t chunks, int64_t n_rows,
                     work_item * out) {
    const int32_t item = atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
    if (item >= ex->n_active * chunks) {
        return 0;
    }
    out->e = ex->active[item / chunks];
    out->r0 = (int64_t) (item % chunks) * SPICE_ROW_CHUNK;
    out->r1 = out->r0 + SPICE_ROW_CHUNK < n_rows ? out->r0 + SPICE_ROW_CHUNK : n_rows;
    return 1;
}

static void phase_gate_up(spice_host_exec * ex) {
    const spice_host_job * job = &ex->job;
    const spice_expert_layer * L = job->layer;
    const int n_embd = L->n_embd;
    const int64_t n_ff = L->n_ff;
    work_item w;
    while (next_item(ex, &ex->next_ff, ex->chunks_ff, n_ff, &w)) {
        const int32_t p0 = ex->expert_start[w.e], p1 = ex->expert_start[w.e + 1];
        const spice_expert_layer * W = ex->wlayer[w.e];
        for (int64_t r = w.r0; r < w.r1; ++r) {
            const char * wg = ex->wbase[w.e] + (size_t) r * W->gate.tensor->nb[1];
            const char * wu = ex->wbase[L->n_expert + w.e] + (size_t) r * W->up.tensor->nb[1];
            for (int32_t i = p0; i < p1; ++i) {
                const int32_t pair = ex->pairs_by_expert[i];
                const int32_t t = pair / job->n_used;
                W->gate.vec_dot(n_embd, &ex->gate[(size_t) pair * n_ff + r], 0, wg, 0, gate_input(ex, t), 0, 1);
                W->up.vec_dot(n_embd, &ex->up[(size_t) pair * n_ff + r], 0, wu, 0, up_input(ex, t), 0, 1);
            }
        }
    }
}

static void phase_swiglu(spice_host_exec * ex, int ith, int nth) {
    const spice_expert_layer * L = ex->job.layer;
    const size_t n_ff = (size_t) L->n_ff;
    for (int32_t i = ith; i < ex->n_exec; i += nth) {
        const int32_t pair = ex->pairs_by_expert[i];
        float * act = ex->act + (size_t) pair * n_ff;
        ggml_cpu_swiglu_f32((int) n_ff, act, ex->gate + (size_t) pair * n_ff, ex->up + (size_t) pair * n_ff);
        if (ex->actq) {
            L->down.quantize(act, ex->actq + (size_t) pair * L->down.act_row_size, (int64_t) n_ff);
        }
    }
}

static void phase_down(spice_host_exec * ex) {
    const spice_expert_layer * L = ex->job.layer;
    const int64_t n_embd = L->n_embd;
    const int n_ff = L->n_ff;
    work_item w;
    while (next_item(ex, &ex->next_embd, ex->chunks_embd, n_embd, &w)) {
        const int32_t p0 = ex->expert_start[w.e], p1 = ex->expert_start[w.e + 1];
        const spice_expert_layer * W = ex->wlayer[w.e];
        for (int64_t r = w.r0; r < w.r1; ++r) {
            const char * wd = ex->wbase[2 * L->n_expert + w.e] + (size_t) r * W->down.tensor->nb[1];
            for (int32_t i = p0; i < p1; ++i) {
                const int32_t pair = ex->pairs_by_expert[i];
                const void * a = ex->actq ? (const void *) (ex->actq + (size_t) pair * L->down.act_row_size)
                                          : (const void *) (ex->act + (size_t) pair * (size_t) n_ff);
                W->down.vec_dot(n_ff, &ex->y[(size_t) pair * n_embd + r], 0, wd, 0, a, 0, 1);
            }
        }
    }
}

/* out[t][c0:c1] = sum over executed k, in selection order, of y[t,k] * w[t,k] */
static void combine_token(const spice_host_exec * ex, int32_t t, int64_t c0, int64_t c1) {
    const spice_host_job * job = &ex->job;
    const size_t n_embd = (size_t) job->layer->n_embd;
    const float * w = weights_row(job, t);
    float * o = out_row(job, t);
    int first = 1;
    for (int32_t k = 0; k < job->n_used; ++k) {
        const int32_t pair = t * job->n_used + k;
        if (!job->exec[pair]) {
            continue;
        }
        const float * y = ex->y + (size_t) pair * n_embd;
        const float wk = w[k];
        if (first) {
            for (int64_t c = c0; c < c1; ++c) {
                o[c] = y[c] * wk;
            }
            first = 0;
        } else {
            for (int64_t c = c0; c < c1; ++c) {
                const float prod = y[c] * wk;
                o[c] = o[c] + prod;
            }
        }
    }
    if (first) {
        memset(o + c0, 0, (size_t) (c1 - c0) * sizeof(float));
    }
}

static void phase_combine(const spice_host_exec * ex, int ith, int nth) {
    const spice_host_job * job = &ex->job;
    const int64_t n_embd = job->layer->n_embd;
    if (job->n_tokens >= nth) {
        for (int32_t t = ith; t < job->n_tokens; t += nth) {
            combine_token(ex, t, 0, n_embd);
        }
    } else {
        const int64_t c0 = (n_embd * ith) / nth, c1 = (n_embd * (ith + 1)) / nth;
        for (int32_t t = 0; t < job->n_tokens; ++t) {
            combine_token(ex, t, c0, c1);
        }
    }
}

void spice_host_exec_run(spice_host_exec * ex, int ith, int nth, spice_barrier * barrier) {
    const spice_host_job * job = &ex->job;
    const spice_expert_layer * L = job->layer;

    if (ex->failed) {
        for (int32_t t = ith; t < job->n_tokens; t += nth) {
            memset(out_row(job, t), 0, (size_t) L->n_embd * sizeof(float));
        }
        return;
    }

    phase_quantize(ex, nth);
    spice_barrier_wait(barrier, nth);

    phase_gate_up(ex);
    spice_barrier_wait(barrier, nth);

    phase_swiglu(ex, ith, nth);
    spice_barrier_wait(barrier, nth);

    phase_down(ex);
    if (ith == 0 && job->before_combine != NULL) {
        job->before_combine(job->before_combine_data, ex->y);
    }
    spice_barrier_wait(barrier, nth);

    phase_combine(ex, ith, nth);
    /* no barrier: ggml synchronizes all threads before the next graph node */
}
