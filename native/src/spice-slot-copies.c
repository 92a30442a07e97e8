/* Low-precision copies of the routed experts (spice-slot-copies.h). */
#define _GNU_SOURCE /* sched_getaffinity: the cores this process may use */
#include "spice-slot-copies.h"

#include "spice-clock.h"
#include "spice-slot-cache.h"
#include "spice.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The types a precision may re-quantize to, best first. IQ4_NL leads the
 * 4-bit list: the best of the measured 4-bit types on smolmoe-b, and its
 * 32-wide blocks fit any width llama.cpp models use. The 5-bit list has one
 * type per activation format (Q5_0 beside Q8_0-style models, Q5_K beside
 * K-quants); measured on smolmoe-b, Q5_0 everywhere moves perplexity by
 * -0.30..+0.33% where IQ4_NL moves it by -0.62..+1.49% (docs/results/
 * quality-levels-per-model.md). */
static const enum ggml_type slot_types_4bit[] = { GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_Q4_K };
static const enum ggml_type slot_types_5bit[] = { GGML_TYPE_Q5_0, GGML_TYPE_Q5_K };

typedef struct slot_types {
    const enum ggml_type * types;
    size_t n;
} slot_types;

static slot_types slot_types_of(int32_t precision) {
    switch (precision) {
        case SPICE_SLOT_4BIT:
            return (slot_types) { slot_types_4bit, sizeof(slot_types_4bit) / sizeof(slot_types_4bit[0]) };
        case SPICE_SLOT_5BIT:
            return (slot_types) { slot_types_5bit, sizeof(slot_types_5bit) / sizeof(slot_types_5bit[0]) };
        default:
            return (slot_types) { NULL, 0 };
    }
}

bool spice_slot_precision_valid(int32_t precision) {
    return precision == SPICE_SLOT_EXACT || slot_types_of(precision).n > 0;
}

enum ggml_type spice_slot_type(const spice_expert_matrix * m, int32_t precision) {
    const slot_types candidates = slot_types_of(precision);
    const size_t own = ggml_row_size(m->type, m->n_cols);
    for (size_t i = 0; i < candidates.n; ++i) {
        const enum ggml_type t = candidates.types[i];
        const struct ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(t);
        if (traits == NULL || traits->vec_dot == NULL || traits->vec_dot_type != m->vec_dot_type ||
            m->n_cols % ggml_blck_size(t) != 0 || ggml_row_size(t, m->n_cols) >= own) {
            continue;
        }
        return t;
    }
    return m->type;
}

uint64_t spice_slot_copies_size(const spice_expert_layer * host, int32_t n_layers, int32_t precision) {
    uint64_t total = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        const spice_expert_layer * L = &host[il];
        if (!L->is_moe) {
            continue;
        }
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; k < 3; ++k) {
            const enum ggml_type type = spice_slot_type(mats[k], precision);
            if (type != mats[k]->type) {
                const struct ggml_tensor * t = mats[k]->tensor;
                total += (uint64_t) ggml_row_size(type, t->ne[0]) * (uint64_t) (t->ne[1] * t->ne[2]);
            }
        }
    }
    return total;
}

/* One expert matrix to convert: source rows and where the copy goes. */
typedef struct convert_item {
    const struct ggml_tensor * src;
    struct ggml_tensor * dst;
    int32_t e;
} convert_item;

typedef struct convert_work {
    const convert_item * items; /* one per (matrix, expert) */
    int32_t n_items;
    atomic_int next;
    atomic_int failed;
    _Atomic uint64_t * progress; /* bytes of copies made (NULL: not counted) */
} convert_work;

/* Dequantize an expert's matrix, then quantize it to the copy's type, row by
 * row as llama-quantize does (no importance matrix). */
static void * convert_thread(void * arg) {
    convert_work * w = (convert_work *) arg;
    float * rows = NULL;
    size_t cap = 0;
    int32_t i;
    while ((i = atomic_fetch_add_explicit(&w->next, 1, memory_order_relaxed)) < w->n_items) {
        const convert_item * it = &w->items[i];
        const int64_t n_cols = it->src->ne[0], n_rows = it->src->ne[1];
        const size_t need = (size_t) (n_cols * n_rows);
        if (need > cap) {
            free(rows);
            rows = (float *) malloc(need * sizeof(float));
            cap = rows != NULL ? need : 0;
            if (rows == NULL) {
                atomic_store(&w->failed, 1);
                break;
            }
        }
        const struct ggml_type_traits * from = ggml_get_type_traits(it->src->type);
        const char * src = (const char *) it->src->data + (size_t) it->e * it->src->nb[2];
        for (int64_t r = 0; r < n_rows; ++r) {
            from->to_float(src + (size_t) r * it->src->nb[1], rows + r * n_cols, n_cols);
        }
        char * dst = (char *) it->dst->data + (size_t) it->e * it->dst->nb[2];
        ggml_quantize_chunk(it->dst->type, rows, dst, 0, n_rows, n_cols, NULL);
        if (w->progress != NULL) {
            atomic_fetch_add_explicit(w->progress, (uint64_t) it->dst->nb[2], memory_order_relaxed);
        }
    }
    free(rows);
    return NULL;
}

static int run_conversion(const convert_item * items, int32_t n_items, int32_t n_threads,
                          _Atomic uint64_t * progress) {
    convert_work w;
    w.items = items;
    w.n_items = n_items;
    w.progress = progress;
    atomic_init(&w.next, 0);
    atomic_init(&w.failed, 0);
    pthread_t threads[16];
    int32_t started = 0;
    for (int32_t t = 1; t < n_threads && t < 16; ++t) {
        if (pthread_create(&threads[started], NULL, convert_thread, &w) == 0) {
            started++;
        }
    }
    convert_thread(&w); /* this thread works too: the conversion finishes even if none started */
    for (int32_t t = 0; t < started; ++t) {
        pthread_join(threads[t], NULL);
    }
    return atomic_load(&w.failed) ? SPICE_ERR_NO_MEMORY : SPICE_OK;
}

/* How a copy's bytes are filled, once its tensors are allocated: made[i] is
 * the copy of made_from[i], each ne[2] experts deep; *progress counts the
 * bytes filled (NULL: not counted). */
typedef int (*fill_copies_fn)(struct ggml_tensor * const * made, const struct ggml_tensor * const * made_from,
                              int32_t n_made, const void * arg, _Atomic uint64_t * progress, char * err,
                              size_t err_len);

static int fill_by_converting(struct ggml_tensor * const * made, const struct ggml_tensor * const * made_from,
                              int32_t n_made, const void * arg, _Atomic uint64_t * progress, char * err,
                              size_t err_len) {
    int32_t n_threads = *(const int32_t *) arg;
    int32_t n_items = 0;
    for (int32_t m = 0; m < n_made; ++m) {
        n_items += (int32_t) made[m]->ne[2];
    }
    convert_item * items = (convert_item *) calloc((size_t) n_items, sizeof(*items));
    if (items == NULL) {
        snprintf(err, err_len, "out of memory converting experts to low precision");
        return SPICE_ERR_NO_MEMORY;
    }
    int32_t n = 0;
    for (int32_t m = 0; m < n_made; ++m) {
        ggml_quantize_init(made[m]->type); /* once, before threads share its tables */
        for (int32_t e = 0; e < (int32_t) made[m]->ne[2]; ++e) {
            items[n].src = made_from[m];
            items[n].dst = made[m];
            items[n].e = e;
            n++;
        }
    }
    if (n_threads <= 0) {
        /* the cores this process may use (taskset, cpusets), as pyspice's estimate counts them */
        cpu_set_t allowed;
        const long online = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed)
                    : online > 0                                          ? (int32_t) online
                                                                          : 1;
    }
    const int status = run_conversion(items, n_items, n_threads, progress);
    free(items);
    if (status != SPICE_OK) {
        snprintf(err, err_len, "out of memory converting experts to low precision");
    }
    return status;
}

typedef struct read_args {
    const char * path;
    const char * model_key;
    int32_t precision;
} read_args;

static int fill_from_file(struct ggml_tensor * const * made, const struct ggml_tensor * const * made_from,
                          int32_t n_made, const void * arg, _Atomic uint64_t * progress, char * err,
                          size_t err_len) {
    (void) made_from;
    const read_args * a = (const read_args *) arg;
    return spice_slot_cache_read(a->path, a->model_key, a->precision, made, n_made, progress, err, err_len);
}

/* The copies of `precision` for host's MoE layers: their tensors in one host
 * buffer, filled by `fill`, then bound to each layer as its slots' experts. */
static int build_copies(spice_slot_copies * sc, const spice_expert_layer * host, int32_t n_layers, int32_t precision,
                        fill_copies_fn fill, const void * fill_arg, _Atomic uint64_t * progress, char * err,
                        size_t err_len) {
    memset(sc, 0, sizeof(*sc));
    if (!spice_slot_precision_valid(precision)) {
        snprintf(err, err_len, "slot_precision %d is not a spice_slot_precision (0 exact, 1 4-bit, 2 5-bit)",
                 precision);
        return SPICE_ERR_INVALID_ARG;
    }
    sc->precision = precision;
    sc->n_layers = n_layers;
    if (precision == SPICE_SLOT_EXACT) {
        return SPICE_OK;
    }
    const uint64_t t0 = spice_monotonic_ns();
    sc->layers = (spice_expert_layer *) calloc((size_t) (n_layers > 0 ? n_layers : 1), sizeof(*sc->layers));
    struct ggml_init_params ip = { /* .mem_size = */ ggml_tensor_overhead() * (size_t) (3 * n_layers + 1),
                                   /* .mem_buffer = */ NULL, /* .no_alloc = */ true };
    sc->ctx = ggml_init(ip);
    if (sc->layers == NULL || sc->ctx == NULL) {
        snprintf(err, err_len, "out of memory for the slots' low-precision expert copies");
        spice_slot_copies_free(sc);
        return SPICE_ERR_NO_MEMORY;
    }
    /* the copies' tensors first (one buffer holds them all), then their bytes */
    const struct ggml_tensor * made_from[3 * (n_layers > 0 ? n_layers : 1)];
    struct ggml_tensor * made[3 * (n_layers > 0 ? n_layers : 1)];
    int32_t n_made = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        const spice_expert_layer * L = &host[il];
        sc->layers[il] = *L;
        if (!L->is_moe) {
            continue;
        }
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; k < 3; ++k) {
            const enum ggml_type type = spice_slot_type(mats[k], precision);
            if (type == mats[k]->type) {
                continue; /* no smaller type fits: the slots hold this matrix as it is */
            }
            const struct ggml_tensor * t = mats[k]->tensor;
            struct ggml_tensor * c = ggml_new_tensor_3d(sc->ctx, type, t->ne[0], t->ne[1], t->ne[2]);
            ggml_format_name(c, "%s.slot", t->name);
            made_from[n_made] = t;
            made[n_made++] = c;
        }
    }
    if (n_made == 0) {
        sc->seconds = 0;
        return SPICE_OK; /* every matrix is already 4-bit or smaller */
    }
    sc->buf = ggml_backend_alloc_ctx_tensors_from_buft(sc->ctx, ggml_backend_cpu_buffer_type());
    if (sc->buf == NULL) {
        snprintf(err, err_len, "out of host memory for the slots' low-precision expert copies (%zu bytes)",
                 ggml_backend_alloc_ctx_tensors_from_buft_size(sc->ctx, ggml_backend_cpu_buffer_type()));
        spice_slot_copies_free(sc);
        return SPICE_ERR_NO_MEMORY;
    }
    sc->bytes = ggml_backend_buffer_get_size(sc->buf);
    int status = fill(made, made_from, n_made, fill_arg, progress, err, err_len);
    /* bind each layer to its copies (matrices without one keep the host tensor) */
    int32_t m = 0;
    for (int32_t il = 0; il < n_layers && status == SPICE_OK; ++il) {
        const spice_expert_layer * L = &host[il];
        if (!L->is_moe) {
            continue;
        }
        const struct ggml_tensor * t[3] = { L->gate.tensor, L->up.tensor, L->down.tensor };
        for (int k = 0; k < 3; ++k) {
            if (m < n_made && made_from[m] == t[k]) {
                t[k] = made[m++];
            }
        }
        status = spice_expert_layer_init(&sc->layers[il], il, t[0], t[1], t[2], err, err_len);
    }
    if (status != SPICE_OK) {
        spice_slot_copies_free(sc);
        return status;
    }
    sc->seconds = (double) (spice_monotonic_ns() - t0) * 1e-9;
    return SPICE_OK;
}

int spice_slot_copies_make(spice_slot_copies * sc, const spice_expert_layer * host, int32_t n_layers,
                           int32_t precision, int32_t n_threads, _Atomic uint64_t * progress, char * err,
                           size_t err_len) {
    return build_copies(sc, host, n_layers, precision, fill_by_converting, &n_threads, progress, err, err_len);
}

int spice_slot_copies_read(spice_slot_copies * sc, const spice_expert_layer * host, int32_t n_layers,
                           int32_t precision, const char * path, const char * model_key,
                           _Atomic uint64_t * progress, char * err, size_t err_len) {
    if (precision == SPICE_SLOT_EXACT) {
        memset(sc, 0, sizeof(*sc));
        snprintf(err, err_len, "exact slots hold the model's own bytes: there are no copies to read");
        return SPICE_ERR_INVALID_ARG;
    }
    const read_args a = { path, model_key, precision };
    const int status = build_copies(sc, host, n_layers, precision, fill_from_file, &a, progress, err, err_len);
    if (status == SPICE_OK && sc->bytes == 0) {
        snprintf(err, err_len, "this model's experts have no matrix that %d-bit slots shrink: nothing to read",
                 precision == SPICE_SLOT_4BIT ? 4 : 5);
        spice_slot_copies_free(sc);
        return SPICE_ERR_INVALID_ARG;
    }
    return status;
}

int spice_slot_copies_write(const spice_slot_copies * sc, const char * path, const char * model_key, char * err,
                            size_t err_len) {
    if (sc->bytes == 0 || sc->ctx == NULL) {
        snprintf(err, err_len, "no low-precision slot copies are held: nothing to save");
        return SPICE_ERR_STATE;
    }
    return spice_slot_cache_write(path, model_key, sc->precision, sc->ctx, err, err_len);
}

void spice_slot_copies_free(spice_slot_copies * sc) {
    if (sc->buf != NULL) {
        ggml_backend_buffer_free(sc->buf);
    }
    if (sc->ctx != NULL) {
        ggml_free(sc->ctx);
    }
    free(sc->layers);
    memset(sc, 0, sizeof(*sc));
}
