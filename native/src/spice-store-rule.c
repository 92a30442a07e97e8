/* The per-activation rule (see spice_rule in spice.h): the plan the engine
 * writes by itself for the calls no policy decides. It reads what the store
 * knows -- the residency table as of this call's poll, recency, when copies
 * land -- and writes a plan like a policy's, which spice_store_apply_plan
 * then carries out. Its twin is pyspice/sim/rule.py (tests/native/
 * test_rule_twin.py holds the two equal). */
#include "spice-store-impl.h"

#include <float.h>
#include <math.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

/* A router as the rule keeps it: each row [n_embd] in int16 with its own
 * scale (w ~ scale * q), half the f32 bytes. The next layer's router is read
 * once per call on caches ggml's kernels have just emptied, so its bytes, not
 * its arithmetic, are most of the rule's time
 * (docs/results/cpu-overhead.md). Each hidden row is
 * scaled to 15 bits the same way, so a logit is an exact integer sum times
 * the two scales: every build, and the twin in numpy, get the same number
 * (pyspice/sim/rule.py). Fewer bits lose experts: routers' rows have weights
 * 40-200x their median, and int8 rows changed a quarter of some layers'
 * top-4 on smolmoe-b (docs/results/cpu-overhead.md). */
typedef struct spice_router_q {
    int16_t * q;   /* [n_expert][n_embd] */
    float * scale; /* [n_expert] */
} spice_router_q;

/* The installed per-activation rule (spice_rule, with store-owned copies of
 * its arrays) and its running state. */
typedef struct spice_store_rule {
    spice_rule rule;
    uint8_t * surrogate_set; /* [n_layers * max_expert] or NULL */
    uint8_t * whole_layers;  /* [n_layers] or NULL */
    uint8_t * next_layers;   /* [n_layers] or NULL (prefetch_next at every layer) */
    int32_t * capacity;      /* [n_layers] (LAYER_LRU) or NULL */
    spice_router_q * routers; /* [n_layers] int16 copies of the routers (entries with q NULL: none); the
                                array NULL without prefetch_next */
    int16_t * hidden_q;       /* [n_embd] scratch: one hidden row in int16, with prefetch_next */
    int32_t * misses;        /* [n_layers] misses since the last resize */
    int64_t calls;           /* calls planned by the rule */
    int32_t * host_tokens;   /* [n_host_points] copies of the rule's host cost points, or NULL */
    double * host_per_act;   /* [n_host_points] */
    int32_t * sel;           /* [max_expert] scratch: the experts this call selects, in first-use order */
    int32_t * count;         /* [max_expert] scratch: the call's activations per selected expert */
    int32_t * left;          /* [max_expert] scratch: ... of them no fixed action took (miss_actions') */
    int32_t * order;         /* [max_expert] scratch: COST's misses, the most activations first, then
                                the experts whose device work is due, by id */
    int32_t * act;           /* [max_expert] scratch: the action an expert's left activations get */
    uint8_t * incoming;      /* [max_expert] scratch: absent experts this call fetches */
    uint8_t * selected;      /* [max_expert] scratch: experts this call selects (never victims) */
    uint8_t * chosen;        /* [n_layers * max_expert] scratch: victims already listed */
    double * logits;         /* [max_expert] scratch */
    int32_t * oldest;        /* [n_layers] KEEP_LRU (DECAYED): the layer's least recently selected (least
                                used) evictable expert
                                (-1: none) as of the last look, valid while layer_changed says so */
    uint8_t * predicted;     /* [max_expert] scratch */
    double * uses;           /* [n_layers * max_expert] KEEP_DECAYED: decayed use counts, zero at set_rule */
} spice_store_rule;

static void rule_free(spice_store * s);

/* The store's rule state, made on first use with the default rule: the store
 * itself knows nothing of rules but how to free their state (free_rule). NULL
 * when it cannot be allocated. */
static spice_store_rule * rule_of(spice_store * s) {
    if (s->rule != NULL) {
        return s->rule;
    }
    spice_store_rule * r = (spice_store_rule *) calloc(1, sizeof(*r));
    if (r == NULL) {
        return NULL;
    }
    s->rule = r;
    s->free_rule = rule_free;
    r->rule.resident_action = SPICE_ACTION_DEVICE;
    const size_t width = (size_t) (s->max_expert > 0 ? s->max_expert : 1);
    const size_t cells = (size_t) s->n_layers * width;
    r->misses = (int32_t *) calloc((size_t) s->n_layers, sizeof(int32_t));
    r->sel = (int32_t *) calloc(width, sizeof(int32_t));
    r->count = (int32_t *) calloc(width, sizeof(int32_t));
    r->left = (int32_t *) calloc(width, sizeof(int32_t));
    r->order = (int32_t *) calloc(width, sizeof(int32_t));
    r->act = (int32_t *) calloc(width, sizeof(int32_t));
    r->incoming = (uint8_t *) calloc(width, 1);
    r->selected = (uint8_t *) calloc(width, 1);
    r->predicted = (uint8_t *) calloc(width, 1);
    r->chosen = (uint8_t *) calloc(cells, 1);
    r->logits = (double *) calloc(width, sizeof(double));
    r->oldest = (int32_t *) calloc((size_t) s->n_layers, sizeof(int32_t));
    r->uses = (double *) calloc(cells > 0 ? cells : 1, sizeof(double));
    if (!(r->misses && r->sel && r->count && r->left && r->order && r->act && r->incoming && r->selected &&
          r->predicted && r->chosen && r->logits && r->oldest && r->uses)) {
        rule_free(s);
        return NULL;
    }
    return r;
}

static void release_arrays(spice_store * s) {
    spice_store_rule * r = s->rule;
    free(r->surrogate_set);
    free(r->whole_layers);
    free(r->next_layers);
    free(r->capacity);
    free(r->host_tokens);
    free(r->host_per_act);
    r->host_tokens = NULL;
    r->host_per_act = NULL;
    for (int32_t il = 0; r->routers != NULL && il < s->n_layers; ++il) {
        free(r->routers[il].q);
        free(r->routers[il].scale);
    }
    free(r->routers);
    free(r->hidden_q);
    r->hidden_q = NULL;
    r->surrogate_set = r->whole_layers = r->next_layers = NULL;
    r->capacity = NULL;
    r->routers = NULL;
}

static void rule_free(spice_store * s) {
    spice_store_rule * r = s->rule;
    if (r == NULL) {
        return;
    }
    release_arrays(s);
    free(r->misses);
    free(r->sel);
    free(r->count);
    free(r->left);
    free(r->order);
    free(r->act);
    free(r->incoming);
    free(r->selected);
    free(r->predicted);
    free(r->chosen);
    free(r->logits);
    free(r->oldest);
    free(r->uses);
    free(r);
    s->rule = NULL;
    s->free_rule = NULL;
}

#if defined(__SSE2__)
/* |x| and whether x is finite, four lanes: SSE2 has no abs, so the sign bit
 * is masked off and the rest compared as integers against +inf's bits. */
static __m128 abs4(__m128 x) {
    return _mm_and_ps(x, _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff)));
}

static __m128 finite4(__m128 a) {
    return _mm_castsi128_ps(_mm_cmplt_epi32(_mm_castps_si128(a), _mm_set1_epi32(0x7f800000)));
}
#endif

/* One row to integers: scale = max |x| / limit over the finite values,
 * q = x * (1 / scale) in float, rounded to nearest even (adding and taking
 * away 1.5 x 2^23 does that in the default rounding mode, with no libm
 * call), clamped to +-limit; not finite counts as 0. A row of zeros has
 * scale 0; a row whose scale is subnormal, q all 0. The twin
 * (pyspice/sim/rule.py quantize_rows) must stay the same rule, operation
 * for operation: the two are compared bit for bit (test_rule_twin.py). */
static float quantize_row(const float * x, int32_t n, float limit, int16_t * q) {
    float amax = 0.0f;
    int32_t j = 0;
#if defined(__SSE2__)
    __m128 m = _mm_setzero_ps();
    for (; j + 4 <= n; j += 4) { /* max is exact, so lanes then the tail give the scalar loop's result */
        const __m128 a = abs4(_mm_loadu_ps(x + j));
        m = _mm_max_ps(m, _mm_and_ps(a, finite4(a)));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, m);
    for (int l = 0; l < 4; ++l) {
        amax = lanes[l] > amax ? lanes[l] : amax;
    }
#endif
    for (; j < n; ++j) {
        const float a = fabsf(x[j]);
        amax = a > amax && a <= FLT_MAX ? a : amax;
    }
    const float d = amax / limit;
    const float inv = d >= FLT_MIN ? 1.0f / d : 0.0f; /* a subnormal scale: all zeros */
    j = 0;
#if defined(__SSE2__)
    /* min_ps(v, lim) is `v < lim ? v : lim` and max_ps(v, -lim) `v > -lim ? v : -lim`
     * to the bit, NaN included: the scalar loop's clamps */
    const __m128 vinv = _mm_set1_ps(inv), lim = _mm_set1_ps(limit), nlim = _mm_set1_ps(-limit);
    const __m128 round = _mm_set1_ps(12582912.0f);
    for (; j + 8 <= n; j += 8) {
        __m128i w[2];
        for (int h = 0; h < 2; ++h) {
            const __m128 xv = _mm_loadu_ps(x + j + 4 * h);
            __m128 v = _mm_and_ps(_mm_mul_ps(xv, vinv), finite4(abs4(xv)));
            v = _mm_max_ps(_mm_min_ps(v, lim), nlim);
            w[h] = _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(v, round), round));
        }
        _mm_storeu_si128((__m128i *) (q + j), _mm_packs_epi32(w[0], w[1]));
    }
#endif
    for (; j < n; ++j) {
        float v = fabsf(x[j]) <= FLT_MAX ? x[j] * inv : 0.0f;
        v = v < limit ? v : limit;
        v = v > -limit ? v : -limit;
        q[j] = (int16_t) ((v + 12582912.0f) - 12582912.0f);
    }
    return d;
}

/* The rule's two integer widths: routers' rows in int16, hidden rows in 15
 * bits, so that one pmaddwd pair (2 x 32767 x 16383) and two pairs added
 * stay within int32. */
#define SPICE_ROUTER_Q_LIMIT 32767.0f
#define SPICE_HIDDEN_Q_LIMIT 16383.0f

static int quantize_router(const float * w, int32_t n_expert, int32_t n_embd, spice_router_q * out) {
    out->q = (int16_t *) malloc((size_t) n_expert * (size_t) n_embd * sizeof(int16_t));
    out->scale = (float *) malloc((size_t) n_expert * sizeof(float));
    const int ok = out->q != NULL && out->scale != NULL;
    for (int32_t e = 0; ok && e < n_expert; ++e) {
        out->scale[e] = quantize_row(w + (size_t) e * (size_t) n_embd, n_embd, SPICE_ROUTER_Q_LIMIT,
                                     out->q + (size_t) e * (size_t) n_embd);
    }
    return ok;
}

static void * copy_of(const void * src, size_t bytes) {
    void * dst = malloc(bytes > 0 ? bytes : 1);
    if (dst != NULL && bytes > 0) {
        memcpy(dst, src, bytes);
    }
    return dst;
}

/* host(n)'s points: at most SPICE_RULE_MAX_HOST_POINTS, tokens ascending and > 0, times > 0 */
static int host_points_valid(const spice_rule * in) {
    if (in->n_host_points == 0) {
        return 1;
    }
    if (in->n_host_points < 0 || in->n_host_points > SPICE_RULE_MAX_HOST_POINTS || in->host_point_tokens == NULL ||
        in->host_point_us == NULL) {
        return 0;
    }
    for (int32_t i = 0; i < in->n_host_points; ++i) {
        if (in->host_point_tokens[i] <= (i > 0 ? in->host_point_tokens[i - 1] : 0) ||
            !(in->host_point_us[i] > 0.0 && in->host_point_us[i] < DBL_MAX)) {
            return 0;
        }
    }
    return 1;
}

int spice_store_set_rule(spice_store * s, const spice_rule * rule) {
    if (s == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_rule plain;
    memset(&plain, 0, sizeof(plain));
    plain.resident_action = SPICE_ACTION_DEVICE;
    const spice_rule * in = rule != NULL ? rule : &plain;
    if ((in->resident_action != SPICE_ACTION_DEVICE && in->resident_action != SPICE_ACTION_HOST) ||
        in->miss < SPICE_MISS_HOST || in->miss > SPICE_MISS_COST || in->keep < SPICE_KEEP_ALL ||
        in->keep > SPICE_KEEP_DECAYED || in->resize_every < 0 || (in->keep == SPICE_KEEP_LAYER_LRU && in->capacity == NULL) ||
        (in->keep == SPICE_KEEP_DECAYED && !(in->decay > 0.0 && in->decay <= 1.0)) ||
        (in->prefetch_next && (in->routers == NULL || in->n_embd <= 0)) ||
        (in->next_room && (!in->prefetch_next || in->keep == SPICE_KEEP_LAYER_LRU)) || !(in->surrogate_weight >= 0.0f) ||
        !host_points_valid(in)) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_store_rule * r = rule_of(s);
    if (r == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    release_arrays(s);
    const size_t cells = (size_t) s->n_layers * (size_t) s->max_expert;
    r->rule = *in;
    int ok = 1;
    if (in->surrogate_set != NULL) {
        ok &= (r->surrogate_set = (uint8_t *) copy_of(in->surrogate_set, cells)) != NULL;
    }
    if (in->whole_layers != NULL) {
        ok &= (r->whole_layers = (uint8_t *) copy_of(in->whole_layers, (size_t) s->n_layers)) != NULL;
    }
    if (in->next_layers != NULL) {
        ok &= (r->next_layers = (uint8_t *) copy_of(in->next_layers, (size_t) s->n_layers)) != NULL;
    }
    if (in->n_host_points > 0) {
        const size_t n = (size_t) in->n_host_points;
        ok &= (r->host_tokens = (int32_t *) copy_of(in->host_point_tokens, n * sizeof(int32_t))) != NULL;
        ok &= (r->host_per_act = (double *) copy_of(in->host_point_us, n * sizeof(double))) != NULL;
    }
    if (in->capacity != NULL) {
        ok &= (r->capacity = (int32_t *) copy_of(in->capacity, (size_t) s->n_layers * sizeof(int32_t))) != NULL;
    }
    if (in->prefetch_next) {
        ok &= (r->routers = (spice_router_q *) calloc((size_t) s->n_layers, sizeof(spice_router_q))) != NULL;
        ok &= (r->hidden_q = (int16_t *) calloc((size_t) in->n_embd, sizeof(int16_t))) != NULL;
        for (int32_t il = 0; ok && il < s->n_layers; ++il) {
            if (in->routers[il] != NULL && s->n_expert[il] > 0) {
                ok &= quantize_router(in->routers[il], s->n_expert[il], in->n_embd, &r->routers[il]);
            }
        }
    }
    r->rule.surrogate_set = r->surrogate_set;
    r->rule.whole_layers = r->whole_layers;
    r->rule.next_layers = r->next_layers;
    r->rule.capacity = r->capacity;
    r->rule.host_point_tokens = r->host_tokens;
    r->rule.host_point_us = r->host_per_act;
    r->rule.routers = NULL; /* the rule reads its int16 copies (r->routers), not the caller's */
    memset(r->misses, 0, (size_t) s->n_layers * sizeof(int32_t));
    memset(r->uses, 0, cells * sizeof(double));
    /* fit_pool's cached candidates were ranked by the rule before: look again */
    memset(s->layer_changed, 1, (size_t) s->n_layers);
    r->calls = 0;
    if (!ok) { /* back to the default rule, not half of this one */
        release_arrays(s);
        r->rule = plain;
        return SPICE_ERR_NO_MEMORY;
    }
    return SPICE_OK;
}

/* ---- pieces ---------------------------------------------------------------- */

static int state_of(const spice_store * s, int32_t il, int32_t e) {
    return s->states[spice_store_cell(s, il, e)];
}

/* microseconds one copy of layer il's expert takes on the bus */
static double copy_us(const spice_store * s, int32_t il) {
    return s->params.latency_us + (double) s->expert_bytes[il] / (s->params.bandwidth_gbps * 1e3);
}

static int32_t * list_slot(int32_t * list, int32_t * n, int32_t cap, int32_t count) {
    if (*n + count > cap) {
        return NULL;
    }
    int32_t * at = list + *n;
    *n += count;
    return at;
}

static void add_evict(spice_policy_call * call, uint8_t * chosen, const spice_store * s, int32_t il, int32_t e) {
    int32_t * at = list_slot(call->evict, &call->n_evict, call->cap_evict, 2);
    if (at != NULL) {
        at[0] = il;
        at[1] = e;
        chosen[spice_store_cell(s, il, e)] = 1;
    }
}

/* a held expert the rule may evict: resident, or a copy that has not started */
static int evictable(const spice_store * s, int32_t il, int32_t e) {
    const int st = state_of(s, il, e);
    return st == SPICE_RES_RESIDENT || st == SPICE_RES_QUEUED;
}

/* Layer il's held experts over its capacity, least recently selected first,
 * never one in `keep` or on the bus. */
static void fit_layer(spice_store * s, spice_policy_call * call, int32_t il, int32_t incoming, const uint8_t * keep) {
    spice_store_rule * r = s->rule;
    const int32_t n_e = s->n_expert[il];
    const size_t base = spice_store_cell(s, il, 0);
    const int8_t * states = s->states + base;
    const uint8_t * chosen = r->chosen + base;
    const uint64_t * last_use = s->last_use + base;
    /* one pass: the layer's count and its candidates; then each victim is the
     * oldest candidate left, the lowest id on a tie (the order of one scan of
     * the layer per victim, as the simulator's twin takes them, at a fraction
     * of the reads: on DeepSeek-V2-Lite's 64 experts a call evicts up to 6) */
    int32_t cand[n_e > 0 ? n_e : 1];
    int32_t held = 0, n_cand = 0;
    for (int32_t e = 0; e < n_e; ++e) {
        const int st = states[e];
        held += st != SPICE_RES_ABSENT && !chosen[e];
        if (!keep[e] && !chosen[e] && evictable(s, il, e)) {
            cand[n_cand++] = e;
        }
    }
    for (int32_t over = held + incoming - r->capacity[il]; over > 0 && n_cand > 0; --over) {
        int32_t at = 0;
        for (int32_t i = 1; i < n_cand; ++i) {
            const int32_t e = cand[i], v = cand[at];
            if (last_use[e] < last_use[v] || (last_use[e] == last_use[v] && e < v)) {
                at = i;
            }
        }
        add_evict(call, r->chosen, s, il, cand[at]);
        cand[at] = cand[--n_cand];
    }
}

/* Whether the pooled cache gives up cell a before cell b: it was selected
 * less recently (KEEP_LRU), or its decayed use count is lower (KEEP_DECAYED). */
static int goes_before(const spice_store * s, size_t a, size_t b) {
    if (s->rule->rule.keep == SPICE_KEEP_DECAYED) {
        return s->rule->uses[a] < s->rule->uses[b];
    }
    return s->last_use[a] < s->last_use[b];
}

/* KEEP_DECAYED: a call of layer il decays the layer's counts once and counts
 * each expert it selects once more (in two roundings, as the twin's numpy). */
static void note_uses(spice_store * s, int32_t il) {
    spice_store_rule * r = s->rule;
    double * uses = r->uses + spice_store_cell(s, il, 0);
    for (int32_t e = 0; e < s->n_expert[il]; ++e) {
        uses[e] *= r->rule.decay;
        if (r->selected[e]) {
            uses[e] += 1.0;
        }
    }
}

/* KEEP_LRU's oldest_in_layer: the evictable expert (resident or queued) with
 * the oldest stamp, the lowest id on a tie, neither chosen nor in skip; -1
 * when none. Without branches, every load made whatever the expert: whether
 * an expert may go is a coin toss at a partial budget, and a pooled cache
 * scans several layers a call. `spice-rule-bench --only lru`, DeepSeek-V2-Lite's
 * shape (26 x 64, top-6), 25% and 50%, rule p50 over two runs: 1.61-2.23 ->
 * 0.70-1.38 us warm, 1.92-2.14 -> 1.30-1.82 cold; same decisions. An expert
 * that may not go gets the key UINT64_MAX, which no stamp reaches (one per
 * hook call). */
static int32_t least_recent_in_layer(const int8_t * states, const uint8_t * chosen, const uint8_t * skip,
                                     const uint64_t * last_use, int32_t n_e) {
    int32_t best = -1;
    uint64_t best_k = UINT64_MAX;
    for (int32_t e = 0; e < n_e; ++e) {
        const int8_t st = states[e];
        const int held = (st == SPICE_RES_RESIDENT) | (st == SPICE_RES_QUEUED);
        const uint64_t may = (uint64_t) (held & ((chosen[e] | skip[e]) == 0));
        const uint64_t k = last_use[e] | (may - 1); /* may 0: all ones */
        best = k < best_k ? e : best;
        best_k = k < best_k ? k : best_k;
    }
    return best;
}

/* Layer l's first evictable expert to go (goes_before; ties: the lower id),
 * not listed as a victim yet nor in `skip` (NULL: none); -1 when none. */
static int32_t oldest_in_layer(const spice_store * s, int32_t l, const uint8_t * skip) {
    const spice_store_rule * r = s->rule;
    const size_t base = spice_store_cell(s, l, 0);
    const int8_t * states = s->states + base;
    const uint8_t * chosen = r->chosen + base;
    if (r->rule.keep != SPICE_KEEP_DECAYED) {
        return least_recent_in_layer(states, chosen, skip != NULL ? skip : chosen, s->last_use + base,
                                     s->n_expert[l]);
    }
    int32_t best = -1;
    for (int32_t e = 0; e < s->n_expert[l]; ++e) {
        if ((states[e] == SPICE_RES_RESIDENT || states[e] == SPICE_RES_QUEUED) && !chosen[e] &&
            (skip == NULL || !skip[e]) && (best < 0 || goes_before(s, base + (size_t) e, base + (size_t) best))) {
            best = e;
        }
    }
    return best;
}

/* One pooled cache: least recently selected (KEEP_DECAYED: least used) out
 * first -- by (goes_before, layer, expert), never an expert this call
 * selects -- until `need` bytes fit, a slot's bytes per victim. Each
 * layer's first candidate is cached between calls (r->oldest) and looked
 * for again only where a state or a stamp changed (s->layer_changed): a
 * layer's decayed counts change only at its own call, which stamps it. So a
 * call scans the layers it touched, not the whole table: this runs on the
 * hook's thread, on caches ggml's kernels have just emptied. */
static void fit_pool(spice_store * s, spice_policy_call * call, uint64_t need) {
    spice_store_rule * r = s->rule;
    const uint64_t used = s->used_bytes;
    if (used + need <= s->params.budget_bytes) {
        return;
    }
    const uint64_t over = used + need - s->params.budget_bytes;
    int64_t want = (int64_t) ((over + s->slot_bytes - 1) / s->slot_bytes);
    want = want < s->n_slots ? want : s->n_slots;
    for (int32_t l = 0; l < s->n_layers; ++l) {
        if (l != call->il && s->layer_changed[l]) {
            r->oldest[l] = s->n_expert[l] > 0 ? oldest_in_layer(s, l, NULL) : -1;
            s->layer_changed[l] = 0;
        }
    }
    /* the call's own layer spares what it selects: never cached */
    int32_t own = oldest_in_layer(s, call->il, r->selected);
    uint64_t freed = 0;
    for (int64_t taken = 0; taken < want && used + need - freed > s->params.budget_bytes; ++taken) {
        int32_t best_l = -1, best_e = -1;
        for (int32_t l = 0; l < s->n_layers; ++l) {
            const int32_t e = l == call->il ? own : r->oldest[l];
            if (e >= 0 && (best_l < 0 || goes_before(s, spice_store_cell(s, l, e), spice_store_cell(s, best_l, best_e)))) {
                best_l = l;
                best_e = e;
            }
        }
        if (best_l < 0) {
            return;
        }
        add_evict(call, r->chosen, s, best_l, best_e);
        freed += s->slot_bytes;
        if (best_l == call->il) {
            own = oldest_in_layer(s, best_l, r->selected);
        } else { /* the next oldest there; looked for again next call (chosen is this call's) */
            r->oldest[best_l] = oldest_in_layer(s, best_l, NULL);
            s->layer_changed[best_l] = 1;
        }
    }
}

/* Python's float floor division for positive operands, so the simulator's
 * twin re-splits capacities to the same integers. */
static double py_floordiv(double a, double b) {
    const double mod = fmod(a, b);
    const double div = (a - mod) / b;
    double floordiv = floor(div);
    if (div - floordiv > 0.5) {
        floordiv += 1.0;
    }
    return floordiv;
}

/* LAYER_LRU: each layer's share of the budget by (misses + 1) x copy time. */
static void resize(spice_store * s) {
    spice_store_rule * r = s->rule;
    double total = 0.0;
    for (int32_t il = 0; il < s->n_layers; ++il) {
        if (s->n_expert[il] > 0) {
            total += (double) (r->misses[il] + 1) * copy_us(s, il);
        }
    }
    for (int32_t il = 0; il < s->n_layers; ++il) {
        if (s->n_expert[il] == 0) {
            continue;
        }
        const double share = (double) s->params.budget_bytes * ((double) (r->misses[il] + 1) * copy_us(s, il)) / total;
        double n = py_floordiv(share, (double) s->slot_bytes);
        n = n < (double) s->n_expert[il] ? n : (double) s->n_expert[il];
        r->capacity[il] = n > 1.0 ? (int32_t) n : 1;
        r->misses[il] = 0;
    }
}

static int32_t next_moe_layer(const spice_store * s, int32_t il) {
    for (int32_t l = il + 1; l < s->n_layers; ++l) {
        if (s->n_expert[l] > 0) {
            return l;
        }
    }
    return -1;
}

/* The hook runs on caches ggml's kernels have just emptied, and one expert's
 * row is too short a stream for the hardware prefetcher to ramp up on: the
 * plan asks for the router's first bytes as it starts, and dot4_i16 for the
 * next rows as it reads these (spice-rule-bench --cold). */
static void prefetch_bytes(const void * p, size_t n) {
    for (size_t j = 0; j < n; j += 64) { /* one 64-byte line */
        __builtin_prefetch((const char *) p + j);
    }
}

#if defined(__SSE2__)
/* the four int32 lanes of x added into two int64 pairs (SSE2 has no
 * sign extension: the high halves are x's sign) */
static void add_wide(__m128i x, __m128i * lo, __m128i * hi) {
    const __m128i sign = _mm_srai_epi32(x, 31);
    *lo = _mm_add_epi64(*lo, _mm_unpacklo_epi32(x, sign));
    *hi = _mm_add_epi64(*hi, _mm_unpackhi_epi32(x, sign));
}
#endif

/* out[x] = sum_j rows[x][j] * h[j] exactly, for x < 4 (the caller points
 * unused rows at a real one); rows within SPICE_ROUTER_Q_LIMIT, h within
 * SPICE_HIDDEN_Q_LIMIT. Four rows at a time share each load of h. SSE2
 * (every x86-64): pmaddwd makes eight products into four int32 pair sums,
 * two of which still fit int32, then int64; elsewhere plain C, which
 * compilers vectorize. The same integers either way. `next` (NULL: none):
 * the n_next rows after these, asked for as these are read. */
static void dot4_i16(const int16_t * const rows[4], const int16_t * h, int32_t n, const int16_t * next,
                     int32_t n_next, int64_t out[4]) {
    for (int x = 0; x < 4; ++x) {
        out[x] = 0;
    }
    int32_t j = 0;
#if defined(__SSE2__)
    __m128i lo[4], hi[4];
    for (int x = 0; x < 4; ++x) {
        lo[x] = hi[x] = _mm_setzero_si128();
    }
    for (; j + 16 <= n; j += 16) {
        if (next != NULL && j % 32 == 0) { /* 32 int16: one 64-byte line */
            for (int32_t x = 0; x < n_next; ++x) {
                __builtin_prefetch(next + (size_t) x * (size_t) n + j);
            }
        }
        const __m128i h0 = _mm_loadu_si128((const __m128i *) (h + j));
        const __m128i h1 = _mm_loadu_si128((const __m128i *) (h + j + 8));
        for (int x = 0; x < 4; ++x) {
            const __m128i p0 = _mm_madd_epi16(_mm_loadu_si128((const __m128i *) (rows[x] + j)), h0);
            const __m128i p1 = _mm_madd_epi16(_mm_loadu_si128((const __m128i *) (rows[x] + j + 8)), h1);
            add_wide(_mm_add_epi32(p0, p1), &lo[x], &hi[x]);
        }
    }
    for (int x = 0; x < 4; ++x) {
        int64_t lanes[4];
        _mm_storeu_si128((__m128i *) lanes, lo[x]);
        _mm_storeu_si128((__m128i *) (lanes + 2), hi[x]);
        out[x] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
#else
    (void) next;
    (void) n_next;
#endif
    for (; j < n; ++j) {
        for (int x = 0; x < 4; ++x) {
            out[x] += (int64_t) rows[x][j] * h[j];
        }
    }
}

/* Router logits of every expert of a layer for one hidden row (already in
 * int16 with scale h_scale): the exact integer dot times the row's and the
 * hidden row's scales, in double, in that order (the twin's order). */
static void router_logits(const spice_router_q * router, int32_t n_e, int32_t n_embd, const int16_t * h,
                          float h_scale, double * out) {
    for (int32_t e = 0; e < n_e; e += 4) {
        const int32_t n = n_e - e < 4 ? n_e - e : 4, n_next = n_e - e - n < 4 ? n_e - e - n : 4;
        const int16_t * rows[4];
        for (int32_t x = 0; x < 4; ++x) {
            rows[x] = router->q + (size_t) (e + (x < n ? x : 0)) * (size_t) n_embd;
        }
        int64_t dots[4];
        const int16_t * next = n_next > 0 ? router->q + (size_t) (e + n) * (size_t) n_embd : NULL;
        dot4_i16(rows, h, n_embd, next, n_next, dots);
        for (int32_t x = 0; x < n; ++x) {
            out[e + x] = (double) dots[x] * (double) router->scale[e + x] * (double) h_scale;
        }
    }
}

int spice_rule_router_logits(int32_t n_expert, int32_t n_embd, const float * router, int32_t n_rows,
                             const float * hidden, double * logits) {
    if (n_expert <= 0 || n_embd <= 0 || n_rows < 0 || router == NULL ||
        (n_rows > 0 && (hidden == NULL || logits == NULL))) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_router_q q = { NULL, NULL };
    int16_t * h = (int16_t *) malloc((size_t) n_embd * sizeof(int16_t));
    const int ok = h != NULL && quantize_router(router, n_expert, n_embd, &q);
    for (int32_t i = 0; ok && i < n_rows; ++i) {
        const float h_scale = quantize_row(hidden + (size_t) i * (size_t) n_embd, n_embd, SPICE_HIDDEN_Q_LIMIT, h);
        router_logits(&q, n_expert, n_embd, h, h_scale, logits + (size_t) i * (size_t) n_expert);
    }
    free(q.q);
    free(q.scale);
    free(h);
    return ok ? SPICE_OK : SPICE_ERR_NO_MEMORY;
}

int spice_store_rule_prefetches_next(const spice_store * s) {
    return s->rule != NULL && s->rule->rule.prefetch_next != 0;
}

/* Whether the call carries layer nxt's router logits from the graph. */
static int has_next_logits(const spice_store * s, const spice_policy_call * call, int32_t nxt) {
    return call->next_logits != NULL && call->il_next == nxt && call->n_expert_next == s->n_expert[nxt];
}

/* Mark the k largest of n logits (ties to the lower id; -inf never picked) in
 * one pass, keeping the best so far in order. k passes over the row took
 * 0.36 us per decode call at a planning layer (smolmoe-b, 32 experts, top-4,
 * the graph's logits), a third of the rule's time when every layer plans; one
 * pass took spice:exact's deciding time at every layer from 1.79 to 1.61 us
 * (docs/results/planning.md; the same picks, checked against the k-pass form on 200000
 * random rows with ties and -inf). */
static void mark_top_k(const double * logits, int32_t n, int32_t k, uint8_t * picked) {
    if (k <= 0) {
        return;
    }
    int32_t top[k];
    double val[k];
    int32_t m = 0;
    for (int32_t e = 0; e < n; ++e) {
        const double x = logits[e];
        if (!(x > -(double) INFINITY)) { /* -inf (and NaN) never picked */
            continue;
        }
        if (m == k && !(x > val[k - 1])) {
            continue; /* not above the k-th: ties keep the lower id */
        }
        int32_t at = m < k ? m++ : k - 1;
        for (; at > 0 && x > val[at - 1]; --at) {
            val[at] = val[at - 1];
            top[at] = top[at - 1];
        }
        val[at] = x;
        top[at] = e;
    }
    for (int32_t i = 0; i < m; ++i) {
        picked[top[i]] = 1;
    }
}

/* The experts the next layer's router picks for this call's rows (top
 * n_expert_used per row, ties to the lower id), into r->predicted: from the
 * logits the graph computed when the call carries them, else from the
 * rule's int16 router. */
static void predict_next(spice_store * s, const spice_policy_call * call, int32_t nxt) {
    spice_store_rule * r = s->rule;
    const spice_router_q * router = &r->routers[nxt];
    const int32_t n_e = s->n_expert[nxt], n_embd = r->rule.n_embd;
    const int32_t k = call->n_expert_used < n_e ? call->n_expert_used : n_e;
    const int graph = has_next_logits(s, call, nxt);
    memset(r->predicted, 0, (size_t) n_e);
    for (int32_t t = 0; t < call->n_tokens; ++t) {
        if (graph) {
            const float * l = (const float *) ((const char *) call->next_logits + (size_t) t * call->next_logits_nb1);
            for (int32_t e = 0; e < n_e; ++e) {
                r->logits[e] = (double) l[e];
            }
        } else {
            const float * h = (const float *) ((const char *) call->inp + (size_t) t * call->inp_nb1);
            const float h_scale = quantize_row(h, n_embd, SPICE_HIDDEN_Q_LIMIT, r->hidden_q);
            router_logits(router, n_e, n_embd, r->hidden_q, h_scale, r->logits);
        }
        mark_top_k(r->logits, n_e, k, r->predicted);
    }
}

/* host(n): the host's time per activation for n tokens of one expert, from the
 * rule's points (linear between, flat beyond either end) or host_us; the same
 * arithmetic as pyspice's CostModel.host_us, so the simulator's twin agrees. */
static double host_per_activation(const spice_store_rule * r, int32_t n) {
    const int32_t m = r->rule.n_host_points;
    if (m == 0) {
        return r->rule.host_us;
    }
    const int32_t * t = r->host_tokens;
    const double * c = r->host_per_act;
    if (n <= t[0]) {
        return c[0];
    }
    int32_t i = 1;
    while (i < m && t[i] < n) {
        ++i;
    }
    if (i == m) {
        return c[m - 1];
    }
    return c[i - 1] + (c[i] - c[i - 1]) * (double) (n - t[i - 1]) / (double) (t[i] - t[i - 1]);
}

static double host_total(const spice_store_rule * r, int32_t n) {
    return host_per_activation(r, n) * (double) n;
}

static double device_total(const spice_store_rule * r, int32_t n) {
    return r->rule.device_us * (double) n;
}

/* An activation's action when no cost decides it, else -1 (its expert's: miss_actions). */
static int32_t fixed_action(const spice_store_rule * r, int whole, int st, size_t cell, float weight) {
    const spice_rule * rule = &r->rule;
    if (whole) {
        return SPICE_ACTION_DEVICE;
    }
    if (st == SPICE_RES_RESIDENT) {
        return rule->resident_action;
    }
    if (rule->surrogate_weight > 0.0f && r->surrogate_set != NULL && r->surrogate_set[cell] &&
        weight < rule->surrogate_weight) {
        return SPICE_ACTION_SURROGATE;
    }
    return rule->resident_action == SPICE_ACTION_HOST ? SPICE_ACTION_HOST : -1;
}

/* An in-flight miss with n activations left, where the rule weighs costs: wait for its
 * copy when that and the device beat the host, else run them on the host meanwhile. */
static int32_t in_flight_action(spice_store * s, int32_t il, int32_t e, uint64_t now, int32_t n) {
    const spice_store_rule * r = s->rule;
    if (r->rule.host_us <= 0.0) {
        return SPICE_ACTION_HOST;
    }
    const uint64_t ready = spice_store_ready_at(s, il, e);
    const double remaining_us = ready > now ? (double) (ready - now) / 1e3 : 0.0;
    return remaining_us + device_total(r, n) < host_total(r, n) ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
}

/* COST's choice among a call's n_miss absent misses (r->order: the most activations
 * first, ties to the lower id; r->left[e] each) on a device beside the host: how many
 * of them are fetched rather than run on the host. The count with the least layer
 * time -- the bus copies them one after another behind `bus_ahead`, the device runs
 * each as it lands after the work already due there, the host runs the rest meanwhile
 * -- and only one that beats all-host by the margin (paper section 4.3). It is
 * pyspice.policy.rule.choose_fetches step for step, which the policy's own decisions
 * use too; one copy is weighed against every token of a batch that waits for it.
 * Where the device's work is the host's (!overlap) a fetch only adds its copy, so
 * miss_actions runs every miss on the host without asking. */
static int32_t choose_fetches(const spice_store * s, int32_t il, int32_t n_miss, double device_due, double bus_ahead) {
    const spice_store_rule * r = s->rule;
    const double copy = copy_us(s, il);
    double host_left = 0.0;
    for (int32_t i = 0; i < n_miss; ++i) {
        host_left += host_total(r, r->left[r->order[i]]);
    }
    const double all_host = host_left > device_due ? host_left : device_due;
    int32_t best_j = 0;
    double best_t = all_host, device = device_due;
    for (int32_t j = 1; j <= n_miss; ++j) {
        const int32_t n = r->left[r->order[j - 1]];
        host_left -= host_total(r, n);
        const double lands = bus_ahead + copy * (double) j;
        device = (device > lands ? device : lands) + device_total(r, n);
        const double t = host_left > device ? host_left : device;
        if (t < best_t) {
            best_j = j;
            best_t = t;
        }
    }
    return best_j > 0 && best_t <= all_host * (1.0 - r->rule.margin) ? best_j : 0;
}

/* The actions of the activations no fixed action took (call->actions -1), per expert
 * for all its activations left (r->sel: the n_sel experts the call selects), where
 * the rule weighs costs: HOST runs them on the host or waits for a copy that lands
 * sooner; COST waits for a copy by its remaining time, and fetches the misses
 * choose_fetches picks. */
static void miss_actions(spice_store * s, spice_policy_call * call, int32_t il, uint64_t now, int32_t n_sel) {
    spice_store_rule * r = s->rule;
    const spice_rule * rule = &r->rule;
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n_sel; ++i) {
        const int32_t e = r->sel[i];
        if (r->left[e] == 0) {
            continue;
        }
        if (state_of(s, il, e) != SPICE_RES_ABSENT) {
            r->act[e] = in_flight_action(s, il, e, now, r->left[e]);
        } else if (rule->miss == SPICE_MISS_COST) {
            int32_t m = n_miss++; /* insertion: the most activations first, ties to the lower id */
            for (; m > 0 && (r->left[r->order[m - 1]] < r->left[e] ||
                             (r->left[r->order[m - 1]] == r->left[e] && r->order[m - 1] > e));
                 --m) {
                r->order[m] = r->order[m - 1];
            }
            r->order[m] = e;
        } else {
            r->act[e] = SPICE_ACTION_HOST;
        }
    }
    if (n_miss > 0) {
        /* what the device runs anyway (resident experts, awaited copies), added by id as
         * the twin adds them */
        int32_t * due = r->order + n_miss;
        int32_t n_due = 0;
        for (int32_t i = 0; i < n_sel; ++i) {
            const int32_t e = r->sel[i];
            const int st = state_of(s, il, e);
            if (st == SPICE_RES_RESIDENT ? rule->resident_action == SPICE_ACTION_DEVICE
                                         : st != SPICE_RES_ABSENT && r->left[e] > 0 && r->act[e] == SPICE_ACTION_DEVICE) {
                int32_t m = n_due++;
                for (; m > 0 && due[m - 1] > e; --m) {
                    due[m] = due[m - 1];
                }
                due[m] = e;
            }
        }
        double device_due = 0.0;
        for (int32_t i = 0; i < n_due; ++i) {
            device_due += device_total(r, r->count[due[i]]);
        }
        const double bus_ahead = s->n_started > 0 ? copy_us(s, il) : 0.0; /* a copy on the bus */
        const int32_t j = choose_fetches(s, il, n_miss, device_due, bus_ahead);
        for (int32_t i = 0; i < n_miss; ++i) {
            r->act[r->order[i]] = i < j ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
            r->incoming[r->order[i]] = i < j; /* comes now, on demand */
        }
    }
    const int32_t n_used = call->n_expert_used;
    for (int32_t t = 0; t < call->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) call->ids + (size_t) t * call->ids_nb1);
        for (int32_t k = 0; k < n_used; ++k) {
            int32_t * a = &call->actions[t * n_used + k];
            if (*a < 0) {
                *a = r->act[ids[k]];
            }
        }
    }
}

/* next_room: the plan's evict_from is this layer, then the MoE layers before
 * it (wrapping): every MoE layer, the one a decode step needs again last first,
 * as SPICE's planner lists them (pyspice/policy/spice/planner.py). The next
 * layer comes last, so its prefetches take from every other one; the store
 * takes the least recently selected expert, not pinned by this call, of the
 * first listed layer that has one. When only half the layers were listed,
 * on a model of 3 MoE layers that was this layer alone, which its
 * own call had emptied, and the first failed prefetch dropped the lagged plan's
 * after it (docs/results/cpu-overhead.md). */
static void room_from_past_layers(const spice_store * s, spice_policy_call * call, int32_t il) {
    call->n_evict_from = 0;
    for (int32_t i = 0, l = il; i < s->n_layers; ++i, l = l > 0 ? l - 1 : s->n_layers - 1) {
        if (s->n_expert[l] > 0) {
            int32_t * at = list_slot(call->evict_from, &call->n_evict_from, call->cap_evict_from, 1);
            if (at == NULL) {
                break;
            }
            *at = l;
        }
    }
}

/* ---- the plan ---------------------------------------------------------------- */

int spice_store_rule_plan(spice_store * s, spice_policy_call * call) {
    if (s == NULL || call == NULL || call->il < 0 || call->il >= s->n_layers || s->n_expert[call->il] == 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_store_rule * r = rule_of(s);
    if (r == NULL) {
        return SPICE_ERR_NO_MEMORY; /* the call keeps the plan it had */
    }
    const spice_rule * rule = &r->rule;
    const int32_t il = call->il, n_e = s->n_expert[il], n_used = call->n_expert_used;
    const uint64_t now = spice_clock_now(&s->clock);
    const int whole = r->whole_layers != NULL && r->whole_layers[il];
    call->n_fetch = call->n_prefetch = call->n_evict = call->n_evict_from = 0;
    call->n_actions = call->n_tokens * n_used;
    memset(r->incoming, 0, (size_t) n_e);
    memset(r->selected, 0, (size_t) n_e); /* r->chosen is all zero: each plan clears what it set */
    const int32_t nxt =
        rule->prefetch_next && (r->next_layers == NULL || r->next_layers[il]) ? next_moe_layer(s, il) : -1;
    if (nxt >= 0 && r->routers[nxt].q != NULL && !has_next_logits(s, call, nxt)) {
        /* its first 8 KiB come in while the actions are decided */
        const size_t bytes = (size_t) s->n_expert[nxt] * (size_t) rule->n_embd * sizeof(int16_t);
        prefetch_bytes(r->routers[nxt].q, bytes < 8192 ? bytes : 8192);
    }

    /* per activation, the action no cost decides, and where no cost is weighed the
     * miss's too: FETCH fetches or waits; HOST without a cost table, and any miss where
     * the device's work is the host's time (!overlap: waiting or fetching only adds a
     * copy), runs on the host. The rest per expert (miss_actions) */
    const int weighs =
        rule->overlap && (rule->miss == SPICE_MISS_COST || (rule->miss == SPICE_MISS_HOST && rule->host_us > 0.0));
    const int32_t plain_miss = rule->miss == SPICE_MISS_FETCH ? SPICE_ACTION_DEVICE : SPICE_ACTION_HOST;
    int32_t absent_selected = 0, n_sel = 0, n_left = 0;
    for (int32_t t = 0; t < call->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) call->ids + (size_t) t * call->ids_nb1);
        const float * weights = (const float *) ((const char *) call->weights + (size_t) t * call->weights_nb1);
        for (int32_t k = 0; k < n_used; ++k) {
            const int32_t e = ids[k];
            int32_t * a = &call->actions[t * n_used + k];
            if (e < 0 || e >= n_e) {
                *a = SPICE_ACTION_HOST; /* dropped by the runtime before anything acts */
                continue;
            }
            const int st = state_of(s, il, e);
            if (!r->selected[e]) {
                r->selected[e] = 1;
                absent_selected += st == SPICE_RES_ABSENT;
                if (weighs) {
                    r->sel[n_sel++] = e;
                    r->count[e] = r->left[e] = 0;
                }
            }
            if (weighs) {
                r->count[e]++;
            }
            *a = fixed_action(r, whole, st, spice_store_cell(s, il, e), weights[k]);
            if (*a < 0) {
                if (weighs) {
                    r->left[e]++;
                    n_left++;
                    continue; /* miss_actions */
                }
                *a = plain_miss;
            }
            if (*a == SPICE_ACTION_DEVICE && st == SPICE_RES_ABSENT) {
                r->incoming[e] = 1; /* comes now, on demand */
            }
        }
    }
    if (n_left > 0) {
        miss_actions(s, call, il, now, n_sel);
    }
    if (whole) { /* the layer's absent experts all come now (and stay: nothing evicts them) */
        for (int32_t e = 0; e < n_e; ++e) {
            if (state_of(s, il, e) == SPICE_RES_ABSENT) {
                int32_t * at = list_slot(call->fetch, &call->n_fetch, call->cap_fetch, 1);
                if (at != NULL) {
                    *at = e;
                }
            }
        }
    }
    int32_t n_incoming = 0;
    for (int32_t e = 0; e < n_e; ++e) {
        n_incoming += r->incoming[e];
    }

    switch (rule->keep) {
        case SPICE_KEEP_NONE:
            for (int32_t l = 0; l < s->n_layers; ++l) {
                for (int32_t e = 0; s->layer_held[l] > 0 && e < s->n_expert[l]; ++e) {
                    if (!(l == il && r->selected[e]) && evictable(s, l, e)) {
                        add_evict(call, r->chosen, s, l, e);
                    }
                }
            }
            break;
        case SPICE_KEEP_DECAYED:
            note_uses(s, il);
            fit_pool(s, call, (uint64_t) n_incoming * s->slot_bytes);
            break;
        case SPICE_KEEP_LRU:
            fit_pool(s, call, (uint64_t) n_incoming * s->slot_bytes);
            break;
        case SPICE_KEEP_LAYER_LRU:
            r->calls++;
            if (rule->resize_every > 0 && r->calls % rule->resize_every == 0) {
                resize(s);
            }
            r->misses[il] += absent_selected;
            fit_layer(s, call, il, n_incoming, r->selected);
            break;
        default: break;
    }

    if (nxt >= 0 && r->routers[nxt].q != NULL) {
        predict_next(s, call, nxt);
        const int32_t limit = rule->keep == SPICE_KEEP_LAYER_LRU ? r->capacity[nxt] : s->n_expert[nxt];
        int32_t n_wanted = 0;
        int32_t wanted[s->n_expert[nxt] > 0 ? s->n_expert[nxt] : 1];
        for (int32_t e = 0; e < s->n_expert[nxt] && n_wanted < limit; ++e) {
            if (r->predicted[e] && state_of(s, nxt, e) == SPICE_RES_ABSENT) {
                wanted[n_wanted++] = e;
            }
        }
        if (n_wanted > 0 && rule->keep == SPICE_KEEP_LAYER_LRU) {
            fit_layer(s, call, nxt, n_wanted, r->predicted);
        }
        for (int32_t i = 0; i < n_wanted; ++i) {
            int32_t * at = list_slot(call->prefetch, &call->n_prefetch, call->cap_prefetch, 2);
            if (at != NULL) {
                at[0] = nxt;
                at[1] = wanted[i];
            }
        }
        if (n_wanted > 0 && rule->next_room) {
            room_from_past_layers(s, call, il);
        }
    }
    for (int32_t i = 0; i + 1 < call->n_evict; i += 2) { /* add_evict marked exactly these */
        r->chosen[spice_store_cell(s, call->evict[i], call->evict[i + 1])] = 0;
    }
    return SPICE_OK;
}
