/* spice-planner-check: the planner thread and its ring (src/spice-planner.c)
 * under a hook's-side loop, with a policy in C. Each post carries its number
 * in its ids and in every value of its lent hidden row; the hook's side
 * overwrites the row once the post is settled, as the next call would. Run
 * free-running and deterministic (lag 1 and 3), with the planner polling
 * (params.idle_poll: the post does not fence, the planner fences every thread
 * before it parks) and parking at once (the post fences). The check build
 * shrinks the idle budget to tens of microseconds (SPICE_PLANNER_IDLE_*_NS),
 * so the planner parks thousands of times and posts race its parking.
 *
 * Checks: every plan is for the call it came back with, built from that
 * call's own ids and rows (never a row overwritten after settle); plans come
 * back in posting order; deterministic mode hands back exactly call c - lag
 * at call c; every post not written over is planned; and no post's wake-up
 * is lost (a lost one leaves a wait hanging: a watchdog names it). Prints one
 * line and exits 0, or names the first failure and exits 1.
 *
 *   spice-planner-check [posts] [seed] */
#include "spice-planner.h"
#include "spice.h"

#include "bench-util.h"
#include "check-rng.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { N_LAYERS = 3, N_EXPERT = 64, N_USED = 6, N_EMBD = 512 };

typedef struct check_policy {
    atomic_int bad;
    char why[256];
    check_rng rng; /* the planner thread's own */
} check_policy;

static int32_t id_of(uint64_t seq, int32_t k) {
    return (int32_t) ((seq * 7 + (uint64_t) k * 11) % N_EXPERT); /* distinct over k < 6 */
}

static void spin_ns(uint64_t ns) {
    for (const uint64_t t0 = now_ns(); now_ns() - t0 < ns;) {
    }
}

static void fail_policy(check_policy * cp, const char * why, uint64_t seq) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&cp->bad, &expected, 1)) {
        snprintf(cp->why, sizeof(cp->why), "the policy got a call (%llu) with %s", (unsigned long long) seq, why);
    }
}

/* The plan: prefetch (il, the call's first id). It checks what it was given first. */
static int check_policy_fn(spice_policy_call * c, void * user_data) {
    check_policy * cp = (check_policy *) user_data;
    if (c->inp[0] < 0.0f) { /* what the hook's thread wrote over the row once the post was settled */
        fail_policy(cp, "a hidden row overwritten after its post was settled", 0);
        return SPICE_POLICY_FAILED;
    }
    const uint64_t seq = (uint64_t) c->inp[0];
    for (int32_t j = 0; j < c->n_embd; ++j) {
        if (c->inp[j] != (float) seq) {
            fail_policy(cp, "a hidden row that is not its own (overwritten after settle?)", seq);
            break;
        }
    }
    for (int32_t k = 0; k < c->n_expert_used; ++k) {
        if (c->ids[k] != id_of(seq, k) || c->weights[k] != (float) k) {
            fail_policy(cp, "ids or weights that are not its own", seq);
            break;
        }
    }
    if (c->il != (int32_t) (seq % N_LAYERS)) {
        fail_policy(cp, "another call's layer", seq);
    }
    if (check_rng_below(&cp->rng, 4) == 0) {
        spin_ns(check_rng_below(&cp->rng, 30000)); /* a slow plan now and then: the ring fills */
    }
    c->prefetch[0] = c->il;
    c->prefetch[1] = c->ids[0];
    c->n_prefetch = 2;
    return SPICE_POLICY_OK;
}

static void on_alarm(int sig) {
    (void) sig;
    static const char msg[] = "spice-planner-check: no progress for 20 s: a post's wake-up was lost "
                              "(the planner parked, the hook's thread waits for its plan)\n";
    (void) !write(2, msg, sizeof(msg) - 1);
    _exit(1);
}

typedef struct run_params {
    int deterministic, lag, idle_poll;
} run_params;

/* A plan handed back for call `seq`: the one its call asked for. */
static int check_plan(const spice_async_entry * e, uint64_t seq, const char * how) {
    if (e->rc != SPICE_POLICY_OK || !e->valid) {
        fprintf(stderr, "spice-planner-check: %s: call %llu's plan failed or was refused (%s)\n", how,
                (unsigned long long) seq, e->err);
        return 1;
    }
    if (e->call.n_prefetch != 2 || e->call.prefetch[0] != (int32_t) (seq % N_LAYERS) ||
        e->call.prefetch[1] != id_of(seq, 0)) {
        fprintf(stderr, "spice-planner-check: %s: call %llu came back with another call's plan\n", how,
                (unsigned long long) seq);
        return 1;
    }
    return 0;
}

static int run(check_rng * rng, long n_posts, run_params rp, long * parked_posts, long * replaced_posts) {
    static const int32_t n_expert[N_LAYERS] = { N_EXPERT, N_EXPERT, N_EXPERT };
    const spice_plan_limits limits = { N_LAYERS, n_expert, N_EXPERT, NULL };
    const spice_async_params params = { 1 << 20, rp.deterministic, rp.lag, 0, 0, rp.idle_poll };
    check_policy cp;
    memset(&cp, 0, sizeof(cp));
    atomic_init(&cp.bad, 0);
    cp.rng.state = rng->state ^ 0xABCDEFull;
    spice_planner p;
    if (spice_planner_start(&p, check_policy_fn, &cp, &params, 8, 64, N_LAYERS, &limits) != SPICE_OK) {
        fprintf(stderr, "spice-planner-check: the planner did not start\n");
        return 1;
    }
    float * row = (float *) malloc(N_EMBD * sizeof(float));
    int32_t ids[N_USED], actions[N_USED];
    float weights[N_USED];
    uint64_t last_back = 0; /* the newest call whose plan spice_planner_take_done handed back */
    int failed = 0;
    for (uint64_t seq = 1; seq <= (uint64_t) n_posts && !failed; ++seq) {
        alarm(20);
        if (rp.deterministic) {
            if (seq > (uint64_t) rp.lag) {
                spice_async_entry * e = spice_planner_wait(&p, seq - (uint64_t) rp.lag);
                if (e == NULL || atomic_load(&e->seq) != seq - (uint64_t) rp.lag) {
                    fprintf(stderr, "spice-planner-check: deterministic lag %d: call %llu did not get call %llu's "
                                    "plan\n", rp.lag, (unsigned long long) seq, (unsigned long long) (seq - rp.lag));
                    failed = 1;
                    break;
                }
                failed |= check_plan(e, seq - (uint64_t) rp.lag, "deterministic");
                spice_planner_release(&p, e);
            }
        } else {
            for (spice_async_entry * e; (e = spice_planner_take_done(&p)) != NULL;) {
                const uint64_t back = atomic_load(&e->seq);
                if (back <= last_back) {
                    fprintf(stderr, "spice-planner-check: call %llu's plan came back after call %llu's\n",
                            (unsigned long long) back, (unsigned long long) last_back);
                    failed = 1;
                }
                last_back = back;
                failed |= check_plan(e, back, "free-running");
                spice_planner_release(&p, e);
            }
        }
        int replaced = 0;
        spice_async_entry * e = spice_planner_acquire(&p, &replaced);
        *replaced_posts += replaced;
        if (e == NULL) {
            if (rp.deterministic) {
                fprintf(stderr, "spice-planner-check: deterministic: no free entry at call %llu\n",
                        (unsigned long long) seq);
                failed = 1;
            }
            continue;
        }
        for (int32_t k = 0; k < N_USED; ++k) {
            ids[k] = id_of(seq, k);
            weights[k] = (float) k;
            actions[k] = SPICE_ACTION_HOST;
        }
        for (int32_t j = 0; j < N_EMBD; ++j) {
            row[j] = (float) seq;
        }
        spice_policy_call call;
        bench_one_token_call(&call, (int32_t) (seq % N_LAYERS), N_EMBD, N_EXPERT, N_USED, row, ids, weights);
        int woke = 0;
        if (spice_planner_post(&p, e, seq, &call, actions, NULL, 0, &woke) != SPICE_OK) {
            fprintf(stderr, "spice-planner-check: post %llu failed\n", (unsigned long long) seq);
            failed = 1;
            break;
        }
        *parked_posts += woke;
        spin_ns(check_rng_below(rng, 4) == 0 ? check_rng_below(rng, 20000) : 0); /* the call's experts */
        spice_planner_settle(&p);
        for (int32_t j = 0; j < N_EMBD; ++j) {
            row[j] = -1.0f; /* the next call's rows: the planner must not read them for this one */
        }
        const uint32_t gap = check_rng_below(rng, 16);
        if (gap == 0) {
            spin_ns(check_rng_below(rng, 100000)); /* around the (shrunk) idle budget: parks race posts */
        } else if (gap == 1) {
            nanosleep(&(struct timespec) { 0, (long) check_rng_below(rng, 200000) }, NULL);
        }
        if (!rp.deterministic && check_rng_below(rng, 8) == 0) {
            /* wait for this post's plan: a lost wake-up hangs here */
            spice_async_entry * w = spice_planner_wait(&p, seq);
            if (w != NULL) {
                failed |= check_plan(w, seq, "free-running wait"); /* the older ones still come back in order */
                spice_planner_release(&p, w);
            }
        }
        if (atomic_load(&cp.bad)) {
            fprintf(stderr, "spice-planner-check: %s\n", cp.why);
            failed = 1;
        }
    }
    /* free-running: what is still posted gets planned */
    while (!failed && !rp.deterministic && p.n_posted > 0) {
        const uint64_t seq = atomic_load(&p.ring[p.posted[p.posted_head]].seq);
        spice_async_entry * w = spice_planner_wait(&p, seq);
        if (w == NULL) {
            fprintf(stderr, "spice-planner-check: posted call %llu was never planned\n", (unsigned long long) seq);
            failed = 1;
            break;
        }
        failed |= check_plan(w, seq, "free-running drain");
        spice_planner_release(&p, w);
    }
    alarm(0);
    spice_planner_stop(&p);
    free(row);
    return failed;
}

int main(int argc, char ** argv) {
    const long n_posts = argc > 1 ? atol(argv[1]) : 20000;
    check_rng rng = check_rng_from(argc > 2 ? argv[2] : NULL);
    signal(SIGALRM, on_alarm);
    const run_params runs[] = {
        { 0, 1, 1 }, { 0, 1, 0 }, { 1, 1, 1 }, { 1, 1, 0 }, { 1, 3, 1 }, { 1, 3, 0 },
    };
    long parked = 0, replaced = 0;
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); ++i) {
        if (run(&rng, n_posts / 6 + 1, runs[i], &parked, &replaced) != 0) {
            fprintf(stderr, "spice-planner-check: failed in the %s run (lag %d, %s), seed %s\n",
                    runs[i].deterministic ? "deterministic" : "free-running", runs[i].lag,
                    runs[i].idle_poll ? "polling" : "parking at once", argc > 2 ? argv[2] : "(default)");
            return 1;
        }
    }
    printf("spice-planner-check: %ld posts in 6 runs, %ld of them woke a parked planner, %ld wrote over a "
           "queued one; plans their own calls' and in order; all checks passed\n",
           n_posts, parked, replaced);
    return 0;
}
