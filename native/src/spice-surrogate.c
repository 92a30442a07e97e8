/* LoRE surrogate executor (see spice-surrogate.h), its standalone entry
 * point spice_surrogate_apply, and the table surrogates are kept in (the
 * runtime's loaded ones: spice-runtime-surrogates.c). */
#include "spice-surrogate.h"

#include "spice.h"

#include "ggml-cpu.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SPICE_SURROGATE_ALIGN ((size_t) 64)

uint64_t spice_surrogate_bytes_of(int32_t rank, int32_t n_embd) {
    return 2u * (uint64_t) rank * (uint64_t) n_embd * sizeof(ggml_fp16_t) + sizeof(float);
}

int spice_surrogate_init(spice_surrogate * s, int32_t n_embd, int32_t rank, float alpha,
                         const float * a, const float * b) {
    if (n_embd <= 0 || rank < 0 || (rank > 0 && (a == NULL || b == NULL))) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(s, 0, sizeof(*s));
    if (rank > 0) {
        const size_t n = (size_t) rank * (size_t) n_embd;
        s->a = (ggml_fp16_t *) malloc(n * sizeof(ggml_fp16_t));
        s->bt = (ggml_fp16_t *) malloc(n * sizeof(ggml_fp16_t));
        float * col = (float *) malloc((size_t) n_embd * sizeof(float));
        if (s->a == NULL || s->bt == NULL || col == NULL) {
            free(col);
            spice_surrogate_release(s);
            return SPICE_ERR_NO_MEMORY;
        }
        /* the converters need ggml's CPU tables on builds without F16C */
        ggml_cpu_init();
        ggml_cpu_fp32_to_fp16(a, s->a, (int64_t) n);
        for (int32_t j = 0; j < rank; ++j) {
            for (int32_t c = 0; c < n_embd; ++c) {
                col[c] = b[(size_t) c * (size_t) rank + (size_t) j];
            }
            ggml_cpu_fp32_to_fp16(col, s->bt + (size_t) j * (size_t) n_embd, n_embd);
        }
        free(col);
    }
    s->rank = rank;
    s->alpha = alpha;
    s->loaded = 1;
    return SPICE_OK;
}

void spice_surrogate_release(spice_surrogate * s) {
    free(s->a);
    free(s->bt);
    memset(s, 0, sizeof(*s));
}

void spice_surrogate_table_free(spice_surrogate_table * tab) {
    if (tab->entries != NULL) {
        for (size_t i = 0; i < (size_t) tab->n_layers * (size_t) tab->max_expert; ++i) {
            spice_surrogate_release(&tab->entries[i]);
        }
        free(tab->entries);
    }
    memset(tab, 0, sizeof(*tab));
}

void spice_surrogate_exec_init(spice_surrogate_exec * ex) {
    memset(ex, 0, sizeof(*ex));
}

void spice_surrogate_exec_free(spice_surrogate_exec * ex) {
    free(ex->buf);
    memset(ex, 0, sizeof(*ex));
}

static size_t round_up(size_t n, size_t to) {
    return (n + to - 1) / to * to;
}

int spice_surrogate_exec_prepare(spice_surrogate_exec * ex, const spice_surrogate_job * job, int nth) {
    ex->job = *job;
    ex->n_pairs = 0;
    const size_t n_all = (size_t) job->n_tokens * (size_t) job->n_used;
    int32_t max_rank = 0, n_pairs = 0;
    for (int32_t t = 0; t < job->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) job->ids + (size_t) t * job->ids_nb1);
        for (int32_t k = 0; k < job->n_used; ++k) {
            if (job->actions[(size_t) t * job->n_used + k] == SPICE_ACTION_SURROGATE) {
                const int32_t r = job->table[ids[k]].rank;
                max_rank = r > max_rank ? r : max_rank;
                n_pairs++;
            }
        }
    }
    if (n_pairs == 0) {
        return SPICE_OK;
    }
    /* each thread's row and y start on their own cache line */
    const size_t al = SPICE_SURROGATE_ALIGN;
    const size_t per = 2 * round_up((size_t) job->n_embd * sizeof(float), al);
    const size_t sz_pairs = round_up((size_t) n_pairs * sizeof(int32_t), al);
    const size_t sz_z_of = round_up(n_all * sizeof(int32_t), al);
    const size_t sz_z = round_up((size_t) n_pairs * (size_t) (max_rank > 0 ? max_rank : 1) * sizeof(float), al);
    const size_t need = sz_pairs + sz_z_of + sz_z + per * (size_t) (nth > 0 ? nth : 1);
    if (need > ex->cap) {
        void * buf = NULL;
        if (posix_memalign(&buf, al, need + need / 4) != 0) {
            return SPICE_ERR_NO_MEMORY;
        }
        free(ex->buf);
        ex->buf = buf;
        ex->cap = need + need / 4;
    }
    char * p = (char *) ex->buf;
    ex->pairs = (int32_t *) p;  p += sz_pairs;
    ex->z_of = (int32_t *) p;   p += sz_z_of;
    ex->z = (float *) p;        p += sz_z;
    ex->scratch = (float *) p;
    ex->scratch_per_thread = per / sizeof(float);
    int32_t n = 0;
    for (size_t i = 0; i < n_all; ++i) {
        const int is_surrogate = job->actions[i] == SPICE_ACTION_SURROGATE;
        ex->z_of[i] = is_surrogate ? n : -1;
        if (is_surrogate) {
            ex->pairs[n++] = (int32_t) i;
        }
    }
    ex->max_rank = max_rank;
    ex->n_pairs = n_pairs;
    return SPICE_OK;
}

static const spice_surrogate * surrogate_of(const spice_surrogate_job * job, int32_t pair) {
    const int32_t t = pair / job->n_used, k = pair % job->n_used;
    const int32_t * ids = (const int32_t *) ((const char *) job->ids + (size_t) t * job->ids_nb1);
    return &job->table[ids[k]];
}

void spice_surrogate_exec_project(spice_surrogate_exec * ex, int ith, int nth) {
    const spice_surrogate_job * job = &ex->job;
    if (ex->n_pairs == 0 || ex->max_rank == 0) {
        return;
    }
    const ggml_vec_dot_t dot_f32 = ggml_get_type_traits_cpu(GGML_TYPE_F32)->vec_dot;
    const int32_t n_embd = job->n_embd;
    float * row = ex->scratch + (size_t) ith * ex->scratch_per_thread;
    for (int32_t i = ith; i < ex->n_pairs; i += nth) {
        const int32_t pair = ex->pairs[i];
        const spice_surrogate * s = surrogate_of(job, pair);
        const float * h = (const float *) ((const char *) job->inp + (size_t) (pair / job->n_used) * job->inp_nb1);
        float * z = ex->z + (size_t) i * (size_t) ex->max_rank;
        for (int32_t j = 0; j < s->rank; ++j) {
            ggml_cpu_fp16_to_fp32(s->a + (size_t) j * (size_t) n_embd, row, n_embd);
            dot_f32(n_embd, &z[j], 0, row, 0, h, 0, 1);
        }
    }
}

/* out[t][c0:c1] += w * (alpha * shexp[t][c0:c1] + (B z)[c0:c1]) */
static void combine_pair(const spice_surrogate_exec * ex, int32_t i, int32_t c0, int32_t c1, float * scratch) {
    const spice_surrogate_job * job = &ex->job;
    const int32_t pair = ex->pairs[i];
    const int32_t t = pair / job->n_used, k = pair % job->n_used;
    const spice_surrogate * s = surrogate_of(job, pair);
    const int32_t n = c1 - c0;
    if (s->rank == 0 && job->shexp == NULL) {
        return; /* contributes exactly nothing: same as a drop */
    }
    float * row = scratch;
    float * y = scratch + ex->scratch_per_thread / 2;
    if (job->shexp != NULL) {
        const float * sh = (const float *) ((const char *) job->shexp + (size_t) t * job->shexp_nb1);
        for (int32_t c = 0; c < n; ++c) {
            y[c] = s->alpha * sh[c0 + c];
        }
    } else {
        memset(y, 0, (size_t) n * sizeof(float));
    }
    const float * z = ex->z + (size_t) i * (size_t) ex->max_rank;
    for (int32_t j = 0; j < s->rank; ++j) {
        ggml_cpu_fp16_to_fp32(s->bt + (size_t) j * (size_t) job->n_embd + c0, row, n);
        const float zj = z[j];
        for (int32_t c = 0; c < n; ++c) {
            y[c] = y[c] + zj * row[c];
        }
    }
    const float w = ((const float *) ((const char *) job->weights + (size_t) t * job->weights_nb1))[k];
    float * o = (float *) ((char *) job->out + (size_t) t * job->out_nb1) + c0;
    for (int32_t c = 0; c < n; ++c) {
        o[c] = o[c] + y[c] * w;
    }
}

void spice_surrogate_exec_combine(spice_surrogate_exec * ex, int ith, int nth) {
    const spice_surrogate_job * job = &ex->job;
    if (ex->n_pairs == 0) {
        return;
    }
    float * scratch = ex->scratch + (size_t) ith * ex->scratch_per_thread;
    /* batches: whole tokens per thread; decode: a column range of each token */
    const int by_token = job->n_tokens >= nth;
    const int32_t c0 = by_token ? 0 : (int32_t) (((int64_t) job->n_embd * ith) / nth);
    const int32_t c1 = by_token ? job->n_embd : (int32_t) (((int64_t) job->n_embd * (ith + 1)) / nth);
    if (c1 <= c0) {
        return;
    }
    for (int32_t t = by_token ? ith : 0; t < job->n_tokens; t += by_token ? nth : 1) {
        for (int32_t k = 0; k < job->n_used; ++k) {
            const int32_t i = ex->z_of[(size_t) t * job->n_used + k];
            if (i >= 0) {
                combine_pair(ex, i, c0, c1, scratch);
            }
        }
    }
}

int spice_surrogate_apply(int32_t n_embd, int32_t rank, float alpha, const float * a, const float * b,
                          int32_t n_rows, const float * h, size_t h_nb1, const float * shexp, size_t shexp_nb1,
                          const float * weights, float * out, size_t out_nb1, int32_t n_threads) {
    if (n_embd <= 0 || rank < 0 || n_rows < 0 || n_threads <= 0 || h == NULL || weights == NULL ||
        out == NULL || (rank > 0 && (a == NULL || b == NULL)) || h_nb1 < (size_t) n_embd * sizeof(float) ||
        out_nb1 < (size_t) n_embd * sizeof(float) || (shexp != NULL && shexp_nb1 < (size_t) n_embd * sizeof(float))) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (n_rows == 0) {
        return SPICE_OK;
    }
    spice_surrogate s;
    int status = spice_surrogate_init(&s, n_embd, rank, alpha, a, b);
    if (status != SPICE_OK) {
        return status;
    }
    /* one selected expert per row, every one a surrogate of the same (A, B) */
    int32_t * ids = (int32_t *) calloc((size_t) n_rows, sizeof(int32_t));
    int32_t * actions = (int32_t *) malloc((size_t) n_rows * sizeof(int32_t));
    if (ids == NULL || actions == NULL) {
        free(ids);
        free(actions);
        spice_surrogate_release(&s);
        return SPICE_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < n_rows; ++i) {
        actions[i] = SPICE_ACTION_SURROGATE;
    }
    spice_surrogate_job job;
    memset(&job, 0, sizeof(job));
    job.n_tokens = n_rows;
    job.n_used = 1;
    job.n_embd = n_embd;
    job.inp = h;             job.inp_nb1 = h_nb1;
    job.ids = ids;           job.ids_nb1 = sizeof(int32_t);
    job.weights = weights;   job.weights_nb1 = sizeof(float);
    job.shexp = shexp;       job.shexp_nb1 = shexp_nb1;
    job.actions = actions;
    job.table = &s;
    job.out = out;           job.out_nb1 = out_nb1;

    spice_surrogate_exec ex;
    spice_surrogate_exec_init(&ex);
    status = spice_surrogate_exec_prepare(&ex, &job, n_threads);
    if (status == SPICE_OK) {
        /* the threads' shares one after another, phase by phase (where the
         * graph threads have a barrier): exactly what n_threads threads compute */
        for (int32_t ith = 0; ith < n_threads; ++ith) {
            spice_surrogate_exec_project(&ex, ith, n_threads);
        }
        for (int32_t ith = 0; ith < n_threads; ++ith) {
            spice_surrogate_exec_combine(&ex, ith, n_threads);
        }
    }
    spice_surrogate_exec_free(&ex);
    free(ids);
    free(actions);
    spice_surrogate_release(&s);
    return status;
}
