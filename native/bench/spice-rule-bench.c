/* spice-rule-bench: the engine's per-activation rule alone, no model. Times
 * spice_store_rule_plan -- the hook thread's deciding time for the shipped
 * baselines (3 us per call is the bar) -- for the rules `ondemand` (KEEP_NONE),
 * `lru` (KEEP_LRU) and `adapmoe` (LAYER_LRU + the next layer's router), over
 * a decode-like stream of one-token calls with skewed routing on a store of
 * L layers x E experts, half the experts' bytes as budget.
 *
 *   spice-rule-bench [--layers L] [--experts E] [--used K] [--embd D]
 *                    [--budget SHARE] [--calls N] [--cold] [--cold-mib M]
 *                    [--only RULE]
 *
 * --cold touches 8 MiB between calls (--cold-mib: M MiB), as ggml's kernels
 * do between two hook calls in a real graph, so the rule runs on cold
 * caches; this machine's rule times grow with M up to about 100 MiB, what a
 * decode step of a real-shape model reads between two calls
 * (docs/results/cpu-overhead.md). Prints the median and the
 * mean ns per call of the rule alone and of begin_call + apply, and
 * the hit rate (selected experts resident when their call began). --only
 * runs one rule (ondemand, lru, adapmoe, adapmoe-g: adapmoe with the next
 * layer's logits from the graph, as on a model; cost: spice:exact's
 * asynchronous rule on a GPU), for a profiler. */
#include "spice.h"

#include "bench-util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void) { /* xorshift64*: reproducible, no libc state */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double) ((rng_state * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

typedef struct options {
    int32_t layers, experts, used, embd, calls;
    double budget;
    int cold;
    int32_t cold_mib; /* MiB touched between calls with --cold */
    const char * only; /* one rule's name, or NULL: all (to profile one) */
} options;

/* k distinct experts, the lower ids more likely (a Zipf-like skew, per layer
 * shifted so the layers do not share their favourites) */
static void route(const options * o, int32_t il, int32_t * ids, float * weights) {
    for (int32_t k = 0; k < o->used; ++k) {
        for (;;) {
            const int32_t e = ((int32_t) (pow(uniform(), 2.0) * o->experts) + il * 7) % o->experts;
            int dup = 0;
            for (int32_t j = 0; j < k; ++j) {
                dup |= ids[j] == e;
            }
            if (!dup) {
                ids[k] = e;
                weights[k] = 1.0f / (float) (k + 2);
                break;
            }
        }
    }
}

/* graph_logits: each call carries the next MoE layer's router logits, as the
 * patched graph hands them over (LLAMA_MOE_HOOK_WANT_NEXT_LOGITS; adapmoe on a
 * model), so the rule ranks them instead of reading its router */
static int run(const options * o, const char * name, spice_rule * rule, int graph_logits, volatile uint8_t * sink,
               size_t sink_bytes) {
    if (o->only != NULL && strcmp(o->only, name) != 0) {
        return 0;
    }
    int32_t n_expert[o->layers];
    uint64_t expert_bytes[o->layers];
    for (int32_t il = 0; il < o->layers; ++il) {
        n_expert[il] = o->experts;
        expert_bytes[il] = 1u << 20;
    }
    spice_store_params params;
    memset(&params, 0, sizeof(params));
    params.budget_bytes = (uint64_t) (o->budget * (double) o->layers * (double) o->experts) << 20;
    params.bandwidth_gbps = 1e6; /* copies land at once: the rule, not the bus, is timed */
    params.latency_us = 0.0;
    params.manual_clock = 1;
    spice_store * store = NULL;
    if (spice_store_create(&params, o->layers, n_expert, expert_bytes, &store) != SPICE_OK ||
        spice_store_set_rule(store, rule) != SPICE_OK) {
        fprintf(stderr, "spice-rule-bench: could not create the store for %s\n", name);
        return 1;
    }
    const int32_t cap = 2 * o->layers * o->experts;
    int32_t * actions = calloc((size_t) o->used, sizeof(int32_t));
    int32_t * fetch = calloc((size_t) o->experts, sizeof(int32_t));
    int32_t * prefetch = calloc((size_t) cap, sizeof(int32_t));
    int32_t * evict = calloc((size_t) cap, sizeof(int32_t));
    int32_t * evict_from = calloc((size_t) o->layers, sizeof(int32_t));
    float * hidden = calloc((size_t) o->embd, sizeof(float));
    float * next_logits = calloc((size_t) o->experts, sizeof(float));
    uint64_t * rule_ns = calloc((size_t) o->calls, sizeof(uint64_t));
    uint64_t * store_ns = calloc((size_t) o->calls, sizeof(uint64_t));
    uint8_t hit[64];
    int32_t ids[64];
    float weights[64];
    for (int32_t j = 0; j < o->embd; ++j) {
        hidden[j] = (float) (uniform() - 0.5);
    }
    const int32_t warmup = o->calls / 10;
    uint64_t hits = 0, activations = 0;
    for (int32_t c = 0; c < warmup + o->calls; ++c) {
        const int32_t il = c % o->layers;
        route(o, il, ids, weights);
        hidden[c % o->embd] = (float) (uniform() - 0.5); /* a new token now and then */
        spice_policy_call call;
        bench_one_token_call(&call, il, o->embd, o->experts, o->used, hidden, ids, weights);
        call.actions = actions; call.cap_actions = o->used;
        call.fetch = fetch;     call.cap_fetch = o->experts;
        call.prefetch = prefetch; call.cap_prefetch = cap;
        call.evict = evict;     call.cap_evict = cap;
        call.evict_from = evict_from; call.cap_evict_from = o->layers;
        call.resume_il = -1;
        call.il_next = -1;
        if (graph_logits && il + 1 < o->layers) {
            for (int32_t e = 0; e < o->experts; ++e) {
                next_logits[e] = (float) uniform();
            }
            call.next_logits = next_logits;
            call.next_logits_nb1 = (size_t) o->experts * sizeof(float);
            call.il_next = il + 1;
            call.n_expert_next = o->experts;
        }
        if (o->cold) {
            for (size_t i = 0; i < sink_bytes; i += 64) {
                sink[i]++;
            }
        }
        const uint64_t t0 = now_ns();
        spice_store_begin_call(store, il, 1, o->used, ids, call.ids_nb1, hit);
        const uint64_t t1 = now_ns();
        spice_store_rule_plan(store, &call);
        const uint64_t t2 = now_ns();
        spice_store_apply_plan(store, &call, NULL);
        const uint64_t t3 = now_ns();
        spice_store_advance(store, 1000);
        if (c >= warmup) {
            for (int32_t k = 0; k < o->used; ++k) {
                hits += hit[k];
            }
            activations += (uint64_t) o->used;
            rule_ns[c - warmup] = t2 - t1;
            store_ns[c - warmup] = (t1 - t0) + (t3 - t2);
        }
    }
    double rule_mean = 0.0, store_mean = 0.0;
    for (int32_t c = 0; c < o->calls; ++c) {
        rule_mean += (double) rule_ns[c] / o->calls;
        store_mean += (double) store_ns[c] / o->calls;
    }
    qsort(rule_ns, (size_t) o->calls, sizeof(uint64_t), cmp_u64);
    qsort(store_ns, (size_t) o->calls, sizeof(uint64_t), cmp_u64);
    printf("%-9s %10.0f %10.0f %12.0f %12.0f %9.3f\n", name, (double) rule_ns[o->calls / 2], rule_mean,
           (double) store_ns[o->calls / 2], store_mean,
           (double) hits / (double) activations);
    spice_store_free(store);
    free(actions); free(fetch); free(prefetch); free(evict); free(evict_from); free(hidden); free(next_logits);
    free(rule_ns); free(store_ns);
    return 0;
}

int main(int argc, char ** argv) {
    options o = { 30, 32, 4, 576, 20000, 0.5, 0, 8, NULL };
    for (int i = 1; i < argc; ++i) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--cold") == 0) {
            o.cold = 1;
        } else if (v != NULL && strcmp(a, "--cold-mib") == 0) {
            o.cold = 1, o.cold_mib = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--layers") == 0) {
            o.layers = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--experts") == 0) {
            o.experts = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--used") == 0) {
            o.used = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--embd") == 0) {
            o.embd = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--calls") == 0) {
            o.calls = atoi(v), ++i;
        } else if (v != NULL && strcmp(a, "--budget") == 0) {
            o.budget = atof(v), ++i;
        } else if (v != NULL && strcmp(a, "--only") == 0) {
            o.only = v, ++i;
        } else {
            fprintf(stderr, "usage: spice-rule-bench [--layers L] [--experts E] [--used K] [--embd D] "
                            "[--budget SHARE] [--calls N] [--cold] [--cold-mib M] [--only RULE]\n");
            return 2;
        }
    }
    if (o.layers < 2 || o.experts < 1 || o.used < 1 || o.used > 64 || o.used > o.experts || o.embd < 1 ||
        o.calls < 10 || !(o.budget > 0.0 && o.budget <= 1.0) || o.cold_mib < 1 || o.cold_mib > 4096) {
        fprintf(stderr, "spice-rule-bench: --layers >= 2, 1 <= --used <= min(64, --experts), --calls >= 10, "
                        "0 < --budget <= 1, 1 <= --cold-mib <= 4096\n");
        return 2;
    }
    const size_t sink_bytes = (size_t) o.cold_mib << 20;
    uint8_t * sink_buf = calloc(sink_bytes, 1);
    volatile uint8_t * sink = sink_buf; /* volatile: the touches must happen */
    float ** routers = calloc((size_t) o.layers, sizeof(float *));
    int32_t * capacity = calloc((size_t) o.layers, sizeof(int32_t));
    for (int32_t il = 0; il < o.layers; ++il) {
        routers[il] = malloc((size_t) o.experts * (size_t) o.embd * sizeof(float));
        for (size_t j = 0; j < (size_t) o.experts * (size_t) o.embd; ++j) {
            routers[il][j] = (float) (uniform() - 0.5);
        }
        capacity[il] = (int32_t) (o.budget * o.experts);
    }
    printf("%d layers x %d experts, top-%d, n_embd %d, budget %.0f%%, %d calls", o.layers, o.experts, o.used, o.embd,
           100.0 * o.budget, o.calls);
    if (o.cold) {
        printf(", cold caches (%d MiB touched between calls)", o.cold_mib);
    }
    printf("\n");
    printf("%-9s %10s %10s %12s %12s %9s\n", "rule", "rule p50", "rule mean", "store p50", "store mean", "hit");
    spice_rule ondemand = { 0 }, lru = { 0 }, adapmoe = { 0 }, cost = { 0 };
    ondemand.resident_action = lru.resident_action = adapmoe.resident_action = SPICE_ACTION_DEVICE;
    ondemand.miss = lru.miss = adapmoe.miss = SPICE_MISS_FETCH;
    ondemand.keep = SPICE_KEEP_NONE;
    lru.keep = SPICE_KEEP_LRU;
    adapmoe.keep = SPICE_KEEP_LAYER_LRU;
    adapmoe.capacity = capacity;
    adapmoe.resize_every = 64;
    adapmoe.prefetch_next = 1;
    adapmoe.routers = (const float * const *) routers;
    adapmoe.n_embd = o.embd;
    /* spice:exact's asynchronous rule on a GPU: misses weighed by a cost table, nothing evicted
     * (its plans evict), so the tier fills once and stays */
    cost.resident_action = SPICE_ACTION_DEVICE;
    cost.miss = SPICE_MISS_COST;
    cost.keep = SPICE_KEEP_ALL;
    cost.host_us = 90.0;
    cost.device_us = 55.0;
    cost.margin = 0.1;
    cost.overlap = 1;
    int rc = run(&o, "ondemand", &ondemand, 0, sink, sink_bytes);
    rc |= run(&o, "lru", &lru, 0, sink, sink_bytes);
    rc |= run(&o, "adapmoe", &adapmoe, 0, sink, sink_bytes);
    rc |= run(&o, "adapmoe-g", &adapmoe, 1, sink, sink_bytes); /* the next layer's logits from the graph */
    rc |= run(&o, "cost", &cost, 0, sink, sink_bytes);
    for (int32_t il = 0; il < o.layers; ++il) {
        free(routers[il]);
    }
    free(routers);
    free(capacity);
    free(sink_buf);
    return rc;
}
