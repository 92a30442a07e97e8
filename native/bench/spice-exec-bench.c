/* spice-exec-bench: the device executors alone, no model. Times one layer
 * call of DeepSeek-V2-Lite-shaped experts (2048 x 1408, gate/up Q4_K, down
 * Q5_0 on even layers and Q8_0 on odd ones, as Q4_K_M quantizes
 * DeepSeek-V2-Lite's 1408-wide down matrices), alternating two layers as a
 * decode does, for 1, 2, 4, 6 device experts at 1 and 8 tokens, and 2 at 32 tokens
 * (a chat turn's prompt).
 *
 * CUDA builds: the slot-pool graph ("pool") against one graph per expert
 * ("legacy"), slots in GPU memory. CPU builds: the slot-pool graph on ggml's
 * CPU backend ("pool-cpu", what an emulated tier with executor=pool runs)
 * against the host executor on one thread ("host"); their rows are compared
 * bit for bit. Prints a table, and JSON with --json PATH.
 *
 *   spice-exec-bench [--iters N] [--experts E] [--json PATH] [--only pool|legacy]
 *
 * Per variant and case: host time in begin (launch), in end (collect) and
 * wall per call, medians over N calls after 20 warm-up calls (2 below 20 calls). */
#include "spice-cuda.h"
#include "spice-exec.h"
#include "spice-experts.h"
#include "spice-host-exec.h"
#include "spice-pool-exec.h"
#include "spice-pool-layout.h"
#include "spice.h"

#include "bench-util.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N_EMBD 2048
#define N_FF 1408
#define N_USED 6
#define N_LAYERS 2

static double median_us(uint64_t * v, int n) {
    qsort(v, (size_t) n, sizeof(*v), cmp_u64);
    return (double) v[n / 2] / 1e3;
}

/* xorshift: reproducible weights without a model */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float frand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float) ((double) (rng_state >> 11) / 9007199254740992.0 - 0.5);
}

/* A [cols, rows, n_expert] tensor of `type`, quantized from random values. */
static struct ggml_tensor * random_experts(struct ggml_context * ctx, enum ggml_type type, int64_t cols,
                                           int64_t rows, int64_t n_expert, float * scratch) {
    struct ggml_tensor * t = ggml_new_tensor_3d(ctx, type, cols, rows, n_expert);
    for (int64_t e = 0; e < n_expert; ++e) {
        for (int64_t i = 0; i < cols * rows; ++i) {
            scratch[i] = frand() * 0.05f;
        }
        ggml_quantize_chunk(type, scratch, (char *) t->data + (size_t) e * t->nb[2], 0, rows, cols, NULL);
    }
    return t;
}

typedef struct bench_case {
    int32_t n_dev, n_tokens;
} bench_case;

typedef struct result {
    const char * variant;
    bench_case c;
    double launch_us, collect_us, wall_us;
    int identical; /* -1: not compared */
} result;

/* The executor under test, behind one pair of calls. */
typedef struct executor {
    const char * name;
    int (*begin)(void * self, const spice_device_job * job);
    int (*end)(void * self, float * y);
    void * self;
} executor;

/* ---- CPU: the host executor on one thread ---- */
typedef struct host_exec_state {
    spice_host_exec ex;
    spice_barrier barrier;
    float * out;
    const spice_device_job * job;
    float * weights;
    uint8_t * exec;
} host_exec_state;

static int host_begin(void * self, const spice_device_job * job) {
    host_exec_state * h = (host_exec_state *) self;
    h->job = job;
    return SPICE_OK;
}

static int host_end(void * self, float * y) {
    host_exec_state * h = (host_exec_state *) self;
    const spice_device_job * job = h->job;
    const int32_t n_pairs = job->n_tokens * job->n_used;
    for (int32_t i = 0; i < n_pairs; ++i) {
        h->exec[i] = job->run[i] == SPICE_EXEC_DEVICE ? SPICE_EXEC_HOST : SPICE_EXEC_NONE;
    }
    spice_host_job hj;
    memset(&hj, 0, sizeof(hj));
    hj.layer = job->layer;
    hj.n_tokens = job->n_tokens;
    hj.n_used = job->n_used;
    hj.inp = job->inp; hj.inp_nb1 = job->inp_nb1;
    hj.ids = job->ids; hj.ids_nb1 = job->ids_nb1;
    hj.weights = h->weights; hj.weights_nb1 = (size_t) job->n_used * sizeof(float);
    hj.exec = h->exec;
    hj.out = h->out; hj.out_nb1 = (size_t) job->layer->n_embd * sizeof(float);
    if (spice_host_exec_prepare(&h->ex, &hj) != SPICE_OK) {
        return SPICE_ERR_NO_MEMORY;
    }
    spice_host_exec_run(&h->ex, 0, 1, &h->barrier);
    memcpy(y, h->ex.y, (size_t) n_pairs * (size_t) job->layer->n_embd * sizeof(float));
    return SPICE_OK;
}

/* ---- the slot-pool graph on any backend ---- */
static int pool_begin(void * self, const spice_device_job * job) {
    char err[256];
    const int rc = spice_pool_exec_begin((spice_pool_exec *) self, job, err, sizeof(err));
    if (rc != SPICE_OK) {
        fprintf(stderr, "%s\n", err);
    }
    return rc;
}

static int pool_end(void * self, float * y) {
    char err[256];
    return spice_pool_exec_end((spice_pool_exec *) self, y, err, sizeof(err));
}

/* ---- CUDA: both executors of spice_cuda ---- */
static int cuda_begin(void * self, const spice_device_job * job) {
    char err[256];
    /* as the runtime does before every call: this readies the pool graph (and picks it);
     * without it spice_cuda ran its per-expert graphs for both rows (until 2026-12-04) */
    spice_cuda_exec_supports((spice_cuda *) self, job->layer, job->n_tokens, job->n_used);
    const int rc = spice_cuda_exec_begin((spice_cuda *) self, job, err, sizeof(err));
    if (rc != SPICE_OK) {
        fprintf(stderr, "%s\n", err);
    }
    return rc;
}

static int cuda_end(void * self, float * y) {
    char err[256];
    return spice_cuda_exec_end((spice_cuda *) self, y, err, sizeof(err));
}

static int run_case(const executor * x, spice_expert_layer * layers, const bench_case * c, int iters,
                    const float * inp, int32_t * const ids[N_LAYERS], const int32_t * slot_of[N_LAYERS],
                    float * y_out, result * r) {
    uint8_t run[64 * N_USED];
    const int32_t n_pairs = c->n_tokens * N_USED;
    for (int32_t i = 0; i < n_pairs; ++i) {
        run[i] = (i % N_USED) < c->n_dev ? SPICE_EXEC_DEVICE : SPICE_EXEC_NONE;
    }
    uint64_t * launch = (uint64_t *) malloc((size_t) iters * sizeof(uint64_t));
    uint64_t * collect = (uint64_t *) malloc((size_t) iters * sizeof(uint64_t));
    uint64_t * wall = (uint64_t *) malloc((size_t) iters * sizeof(uint64_t));
    const int warm = iters < 20 ? 2 : 20; /* a correctness run (--iters 3) need not warm up long */
    int status = SPICE_OK;
    for (int it = -warm; it < iters && status == SPICE_OK; ++it) {
        const int il = (it + warm) % N_LAYERS;
        spice_device_job job;
        memset(&job, 0, sizeof(job));
        job.layer = &layers[il];
        job.n_tokens = c->n_tokens;
        job.n_used = N_USED;
        job.inp = inp; job.inp_nb1 = N_EMBD * sizeof(float);
        job.ids = ids[il]; job.ids_nb1 = N_USED * sizeof(int32_t);
        job.run = run;
        job.slot_of = slot_of[il];
        const uint64_t t0 = now_ns();
        status = x->begin(x->self, &job);
        const uint64_t t1 = now_ns();
        if (status == SPICE_OK) {
            status = x->end(x->self, y_out + (size_t) il * 64 * N_USED * N_EMBD);
        }
        const uint64_t t2 = now_ns();
        if (it >= 0) {
            launch[it] = t1 - t0;
            collect[it] = t2 - t1;
            wall[it] = t2 - t0;
        }
    }
    if (status == SPICE_OK) {
        r->variant = x->name;
        r->c = *c;
        r->launch_us = median_us(launch, iters);
        r->collect_us = median_us(collect, iters);
        r->wall_us = median_us(wall, iters);
        r->identical = -1;
    }
    free(launch);
    free(collect);
    free(wall);
    return status;
}

int main(int argc, char ** argv) {
    int iters = 500, n_expert = 8;
    const char * json = NULL, * only = NULL;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--experts") && i + 1 < argc) {
            n_expert = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--json") && i + 1 < argc) {
            json = argv[++i];
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--iters N] [--experts E>=6] [--json PATH] [--only pool|legacy]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1 || n_expert < N_USED) {
        fprintf(stderr, "spice-exec-bench: --iters must be >= 1 and --experts >= %d\n", N_USED);
        return 2;
    }
    ggml_cpu_init();
    /* weights: two layers, host memory */
    const enum ggml_type down_type[N_LAYERS] = { GGML_TYPE_Q5_0, GGML_TYPE_Q8_0 };
    struct ggml_init_params ip = { (size_t) N_LAYERS * 3 * (size_t) n_expert * N_EMBD * N_FF * 2 + (1 << 20), NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    float * scratch = (float *) malloc((size_t) N_EMBD * N_FF * sizeof(float));
    ggml_backend_buffer_t host_buf = NULL;
    spice_expert_layer layers[N_LAYERS];
    fprintf(stderr, "spice-exec-bench: quantizing %d x %d experts of %dx%d...\n", N_LAYERS, n_expert, N_EMBD, N_FF);
    for (int il = 0; il < N_LAYERS; ++il) {
        struct ggml_tensor * g = random_experts(ctx, GGML_TYPE_Q4_K, N_EMBD, N_FF, n_expert, scratch);
        struct ggml_tensor * u = random_experts(ctx, GGML_TYPE_Q4_K, N_EMBD, N_FF, n_expert, scratch);
        struct ggml_tensor * d = random_experts(ctx, down_type[il], N_FF, N_EMBD, n_expert, scratch);
        if (host_buf == NULL) {
            host_buf = ggml_backend_cpu_buffer_from_ptr(ggml_get_mem_buffer(ctx), ggml_get_mem_size(ctx));
        }
        g->buffer = u->buffer = d->buffer = host_buf;
        char err[256];
        if (spice_expert_layer_init(&layers[il], il, g, u, d, err, sizeof(err)) != SPICE_OK) {
            fprintf(stderr, "spice-exec-bench: %s\n", err);
            return 1;
        }
    }
    /* every expert of both layers has a slot: layer il's expert e in slot il * n_expert + e */
    const int32_t n_slots = N_LAYERS * n_expert;
    spice_pool_layout layout;
    if (spice_pool_layout_make(layers, N_LAYERS, n_slots, &layout) != SPICE_OK) {
        fprintf(stderr, "spice-exec-bench: no pool layout\n");
        return 1;
    }
    int32_t slots[N_LAYERS][64];
    const int32_t * slot_of[N_LAYERS];
    int32_t * ids[N_LAYERS];
    for (int il = 0; il < N_LAYERS; ++il) {
        for (int32_t e = 0; e < n_expert && e < 64; ++e) {
            slots[il][e] = il * n_expert + e;
        }
        slot_of[il] = slots[il];
        ids[il] = (int32_t *) malloc(64 * N_USED * sizeof(int32_t));
        for (int t = 0; t < 64; ++t) {
            for (int k = 0; k < N_USED; ++k) {
                ids[il][t * N_USED + k] = (t * (il + 1) + k) % n_expert; /* distinct per token, as a router's */
            }
        }
    }
    float * inp = (float *) malloc(64 * N_EMBD * sizeof(float));
    for (int i = 0; i < 64 * N_EMBD; ++i) {
        inp[i] = frand();
    }
    const size_t y_size = (size_t) N_LAYERS * 64 * N_USED * N_EMBD;
    float * y_a = (float *) calloc(y_size, sizeof(float));
    float * y_b = (float *) calloc(y_size, sizeof(float));

    executor xs[2];
    int n_x = 0;
    void * cleanup_cuda[2] = { NULL, NULL };
    spice_pool_exec * cpu_pool = NULL;
    ggml_backend_t cpu = NULL;
    ggml_backend_buffer_t cpu_pool_buf = NULL;
    char * pool_mem = NULL;
    host_exec_state host;
    memset(&host, 0, sizeof(host));
    const char * device = "cpu";
    if (spice_cuda_device_count() > 0) {
        device = "cuda";
        const int32_t kinds[2] = { SPICE_EXECUTOR_POOL, SPICE_EXECUTOR_LEGACY };
        const char * names[2] = { "pool", "legacy" };
        for (int v = 0; v < 2; ++v) {
            if (only != NULL && strcmp(only, names[v]) != 0) {
                continue;
            }
            spice_cuda * cu = NULL;
            char err[256];
            if (spice_cuda_create(0, &layout, kinds[v], &cu, err, sizeof(err)) != SPICE_OK) {
                fprintf(stderr, "spice-exec-bench: %s\n", err);
                return 1;
            }
            for (int il = 0; il < N_LAYERS; ++il) {
                const spice_expert_matrix * m[3] = { &layers[il].gate, &layers[il].up, &layers[il].down };
                for (int32_t e = 0; e < n_expert; ++e) {
                    spice_cuda_segment seg[3];
                    for (int k = 0; k < 3; ++k) {
                        seg[k].src = (const char *) m[k]->tensor->data + (size_t) e * m[k]->tensor->nb[2];
                        seg[k].dst_offset = layout.region[k];
                        seg[k].size = m[k]->tensor->nb[2];
                        seg[k].pad = spice_pool_matrix_pad(m[k]->type, m[k]->n_cols);
                    }
                    spice_cuda_copy_issue(cu, slots[il][e], seg);
                    spice_cuda_copy_wait(cu, slots[il][e]);
                }
            }
            cleanup_cuda[n_x] = cu;
            xs[n_x++] = (executor) { names[v], cuda_begin, cuda_end, cu };
        }
    } else {
        /* the pool in host memory, filled as an emulated tier fills it */
        const size_t pool_bytes = spice_pool_alloc_bytes(&layout);
        pool_mem = (char *) calloc(1, pool_bytes + 64);
        char * base = (char *) (((uintptr_t) pool_mem + 63) & ~(uintptr_t) 63);
        for (int il = 0; il < N_LAYERS; ++il) {
            const spice_expert_matrix * m[3] = { &layers[il].gate, &layers[il].up, &layers[il].down };
            for (int32_t e = 0; e < n_expert; ++e) {
                for (int k = 0; k < 3; ++k) {
                    memcpy(base + spice_pool_offset(&layout, slots[il][e], k),
                           (const char *) m[k]->tensor->data + (size_t) e * m[k]->tensor->nb[2], m[k]->tensor->nb[2]);
                }
            }
        }
        cpu = ggml_backend_cpu_init();
        ggml_backend_cpu_set_n_threads(cpu, 1);
        cpu_pool_buf = ggml_backend_cpu_buffer_from_ptr(base, pool_bytes);
        char err[256];
        if (spice_pool_exec_create(cpu, cpu_pool_buf, &layout, &cpu_pool, err, sizeof(err)) != SPICE_OK) {
            fprintf(stderr, "spice-exec-bench: %s\n", err);
            return 1;
        }
        spice_host_exec_init(&host.ex);
        spice_barrier_init(&host.barrier);
        host.out = (float *) malloc(64 * N_EMBD * sizeof(float));
        host.weights = (float *) malloc(64 * N_USED * sizeof(float));
        for (int i = 0; i < 64 * N_USED; ++i) {
            host.weights[i] = 1.0f;
        }
        host.exec = (uint8_t *) malloc(64 * N_USED);
        if (only == NULL || !strcmp(only, "pool")) {
            xs[n_x++] = (executor) { "pool-cpu", pool_begin, pool_end, cpu_pool };
        }
        if (only == NULL || !strcmp(only, "legacy")) {
            xs[n_x++] = (executor) { "host", host_begin, host_end, &host };
        }
    }

    /* 32 tokens: ggml-cuda's batched MUL_MAT_ID (above its vector kernel's limit), with most of
     * each token's pairs off the device (spice-pool-ids.h) */
    const bench_case cases[] = { { 1, 1 }, { 2, 1 }, { 4, 1 }, { 6, 1 }, { 1, 8 }, { 2, 8 }, { 4, 8 }, { 6, 8 }, { 2, 32 } };
    const int n_cases = (int) (sizeof(cases) / sizeof(cases[0]));
    result * res = (result *) calloc((size_t) (n_cases * n_x), sizeof(result));
    int n_res = 0;
    printf("spice-exec-bench: %s, experts %dx%d (Q4_K gate/up; Q5_0 | Q8_0 down), %d iterations per case\n", device,
           N_EMBD, N_FF, iters);
    printf("%-10s %6s %6s %12s %12s %10s %10s\n", "executor", "n_dev", "tokens", "launch_us", "collect_us", "wall_us",
           "identical");
    for (int ci = 0; ci < n_cases; ++ci) {
        for (int v = 0; v < n_x; ++v) {
            float * y = v == 0 ? y_a : y_b;
            memset(y, 0, y_size * sizeof(float));
            result * r = &res[n_res];
            if (run_case(&xs[v], layers, &cases[ci], iters, inp, ids, slot_of, y, r) != SPICE_OK) {
                fprintf(stderr, "spice-exec-bench: %s failed at n_dev %d, %d tokens\n", xs[v].name, cases[ci].n_dev,
                        cases[ci].n_tokens);
                return 1;
            }
            if (v == 1) { /* compare the device pairs' rows of both layers' last calls */
                int same = 1;
                double worst = 0.0;
                for (int il = 0; il < N_LAYERS; ++il) {
                    for (int32_t p = 0; p < cases[ci].n_tokens * N_USED; ++p) {
                        if (p % N_USED >= cases[ci].n_dev) {
                            continue;
                        }
                        const size_t at = ((size_t) il * 64 * N_USED + (size_t) p) * N_EMBD;
                        same &= memcmp(y_a + at, y_b + at, N_EMBD * sizeof(float)) == 0;
                        for (int c = 0; c < N_EMBD; ++c) {
                            const double d = fabs((double) y_a[at + c] - (double) y_b[at + c]);
                            worst = d > worst ? d : worst;
                        }
                    }
                }
                r->identical = same;
                if (!same) {
                    fprintf(stderr, "  %s vs %s: largest difference %.3g\n", xs[0].name, xs[1].name, worst);
                }
            }
            printf("%-10s %6d %6d %12.1f %12.1f %10.1f %10s\n", r->variant, r->c.n_dev, r->c.n_tokens, r->launch_us,
                   r->collect_us, r->wall_us, r->identical < 0 ? "" : r->identical ? "yes" : "NO");
            fflush(stdout);
            n_res++;
        }
    }
    if (json != NULL) {
        FILE * f = fopen(json, "w");
        if (f == NULL) {
            fprintf(stderr, "spice-exec-bench: cannot write %s\n", json);
            return 1;
        }
        fprintf(f, "{\"device\": \"%s\", \"iters\": %d, \"results\": [\n", device, iters);
        for (int i = 0; i < n_res; ++i) {
            fprintf(f, "  {\"executor\": \"%s\", \"n_dev\": %d, \"tokens\": %d, \"launch_us\": %.2f, "
                       "\"collect_us\": %.2f, \"wall_us\": %.2f, \"identical\": %s}%s\n",
                    res[i].variant, res[i].c.n_dev, res[i].c.n_tokens, res[i].launch_us, res[i].collect_us,
                    res[i].wall_us, res[i].identical < 0 ? "null" : res[i].identical ? "true" : "false",
                    i + 1 < n_res ? "," : "");
        }
        fprintf(f, "]}\n");
        fclose(f);
    }
    for (int v = 0; v < 2; ++v) {
        spice_cuda_free((spice_cuda *) cleanup_cuda[v]);
    }
    spice_pool_exec_free(cpu_pool);
    if (cpu_pool_buf) {
        ggml_backend_buffer_free(cpu_pool_buf);
    }
    if (cpu) {
        ggml_backend_free(cpu);
    }
    free(pool_mem);
    ggml_free(ctx);
    return 0;
}
