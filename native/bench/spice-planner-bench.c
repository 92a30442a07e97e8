/* spice-planner-bench: the hook thread's side of asynchronous planning alone,
 * no model. Times what a decode call spends handing work to the planner
 * thread (src/spice-planner.c): taking back finished plans, then taking an
 * entry and posting the call into it (ids, gate weights, the residency rows
 * that changed, the hidden row lent), and settling the lent row once the
 * call's experts have run (30 us of spinning here). The planner runs a
 * policy in C that writes one prefetch, so the policy's own time is not in
 * it, and it polls (idle_poll) as on a machine where it has a core.
 *
 *   spice-planner-bench [--layers L] [--experts E] [--used K] [--embd D]
 *                       [--calls N] [--cold-mib M]
 *
 * --cold-mib touches M MiB between calls (default 0: warm), as ggml's
 * kernels do between two hook calls (spice-rule-bench's --cold-mib, the
 * same meaning). Prints the median and the 90th percentile ns per call of
 * take, of post + settle, and of both: the take_us and post_us of the
 * bench's per_call_decode, less the rule and applying plans. */
#include "spice-planner.h"
#include "spice.h"

#include "bench-util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct options {
    int32_t layers, experts, used, embd, calls, cold_mib;
} options;

/* The plan of a policy that costs nothing: prefetch the next layer's expert of the first id. */
static int prefetch_one(spice_policy_call * c, void * user_data) {
    const options * o = (const options *) user_data;
    c->prefetch[0] = (c->il + 1) % o->layers;
    c->prefetch[1] = c->ids[0];
    c->n_prefetch = 2;
    return SPICE_POLICY_OK;
}

static void print_row(const char * name, uint64_t * ns, int32_t n) {
    qsort(ns, (size_t) n, sizeof(uint64_t), cmp_u64);
    printf("%-13s %8llu %8llu\n", name, (unsigned long long) ns[n / 2], (unsigned long long) ns[(n * 9) / 10]);
}

static int run(options * o) {
    int32_t * n_expert = (int32_t *) malloc((size_t) o->layers * sizeof(int32_t));
    for (int32_t l = 0; l < o->layers; ++l) {
        n_expert[l] = o->experts;
    }
    const spice_plan_limits limits = { o->layers, n_expert, o->experts, NULL };
    const spice_async_params params = { 8, 0, 1, 0, 0, 1 }; /* free-running, polling */
    spice_planner p;
    if (spice_planner_start(&p, prefetch_one, o, &params, o->used, 2 * o->experts * o->layers, o->layers,
                            &limits) != SPICE_OK) {
        fprintf(stderr, "spice-planner-bench: the planner did not start\n");
        free(n_expert);
        return 1;
    }
    const size_t sink_bytes = (size_t) o->cold_mib << 20;
    char * sink_buf = sink_bytes > 0 ? (char *) calloc(sink_bytes, 1) : NULL;
    volatile char * sink = sink_buf; /* every line written, every call */
    float * row = (float *) calloc((size_t) o->embd, sizeof(float));
    int32_t * ids = (int32_t *) malloc((size_t) o->used * sizeof(int32_t));
    int32_t * actions = (int32_t *) malloc((size_t) o->used * sizeof(int32_t));
    float * weights = (float *) malloc((size_t) o->used * sizeof(float));
    int8_t * residency = (int8_t *) calloc((size_t) o->layers * (size_t) o->experts, 1);
    uint32_t * version = (uint32_t *) calloc((size_t) o->layers, sizeof(uint32_t));
    uint64_t * take = (uint64_t *) malloc((size_t) o->calls * sizeof(uint64_t));
    uint64_t * post = (uint64_t *) malloc((size_t) o->calls * sizeof(uint64_t));
    uint64_t * both = (uint64_t *) malloc((size_t) o->calls * sizeof(uint64_t));
    for (int32_t c = 0; c < o->calls; ++c) {
        for (size_t i = 0; i < sink_bytes; i += 64) {
            sink[i]++;
        }
        const uint64_t seq = (uint64_t) c + 1;
        const int32_t il = c % o->layers;
        residency[il * o->experts + (int32_t) (seq % (uint64_t) o->experts)] ^= 1; /* the store changed this layer */
        version[il]++;
        for (int32_t k = 0; k < o->used; ++k) {
            ids[k] = (int32_t) ((seq * 7 + (uint64_t) k * 11) % (uint64_t) o->experts);
            weights[k] = 1.0f / (float) o->used;
            actions[k] = SPICE_ACTION_HOST;
        }
        for (int32_t j = 0; j < o->embd; ++j) { /* as the graph wrote the row just before the call */
            row[j] = (float) seq;
        }
        const uint64_t t0 = now_ns();
        for (spice_async_entry * e; (e = spice_planner_take_done(&p)) != NULL;) {
            spice_planner_release(&p, e);
        }
        const uint64_t t1 = now_ns();
        int replaced = 0;
        spice_async_entry * e = spice_planner_acquire(&p, &replaced);
        if (e != NULL) {
            spice_policy_call call;
            bench_one_token_call(&call, il, o->embd, o->experts, o->used, row, ids, weights);
            call.residency = residency;
            call.res_layers = o->layers;
            call.res_width = o->experts;
            int woke = 0;
            spice_planner_post(&p, e, seq, &call, actions, version, 1, &woke);
        }
        const uint64_t t2 = now_ns();
        while (now_ns() - t2 < 30000) { /* the call's experts */
        }
        const uint64_t t3 = now_ns();
        spice_planner_settle(&p);
        const uint64_t t4 = now_ns();
        take[c] = t1 - t0;
        post[c] = (t2 - t1) + (t4 - t3);
        both[c] = take[c] + post[c];
    }
    spice_planner_stop(&p);
    printf("spice-planner-bench: %d layers x %d experts, top-%d, %d floats a row, %d calls, %d MiB touched "
           "between calls\n", o->layers, o->experts, o->used, o->embd, o->calls, o->cold_mib);
    printf("%-13s %8s %8s\n", "ns per call", "p50", "p90");
    print_row("take", take, o->calls);
    print_row("post+settle", post, o->calls);
    print_row("both", both, o->calls);
    free(sink_buf);
    free(row);
    free(ids);
    free(actions);
    free(weights);
    free(residency);
    free(version);
    free(take);
    free(post);
    free(both);
    free(n_expert);
    return 0;
}

int main(int argc, char ** argv) {
    options o = { 3, 64, 6, 2048, 3000, 0 }; /* DeepSeek-V2-Lite's shape, the real-shape model's 3 MoE layers */
    for (int i = 1; i < argc; i += 2) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        int32_t * field = v == NULL                          ? NULL
                          : strcmp(a, "--layers") == 0       ? &o.layers
                          : strcmp(a, "--experts") == 0      ? &o.experts
                          : strcmp(a, "--used") == 0         ? &o.used
                          : strcmp(a, "--embd") == 0         ? &o.embd
                          : strcmp(a, "--calls") == 0        ? &o.calls
                          : strcmp(a, "--cold-mib") == 0     ? &o.cold_mib
                                                             : NULL;
        if (field == NULL) {
            fprintf(stderr, "usage: spice-planner-bench [--layers L] [--experts E] [--used K] [--embd D] "
                            "[--calls N] [--cold-mib M]\n");
            return 2;
        }
        *field = atoi(v);
    }
    if (o.layers < 1 || o.experts < 1 || o.used < 1 || o.used > o.experts || o.embd < 1 || o.calls < 1 ||
        o.cold_mib < 0 || o.cold_mib > 4096) {
        fprintf(stderr, "spice-planner-bench: want L, E, D, N >= 1, 1 <= K <= E, 0 <= --cold-mib <= 4096\n");
        return 2;
    }
    return run(&o);
}
