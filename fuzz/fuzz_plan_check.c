/* Fuzz harness: spice_plan_check (native/src/spice-plan.c) on arbitrary plans.
 *
 * The input is split as the engine and a policy split a hook call: the
 * engine's part (layers and their expert counts, loaded surrogates, the
 * call's layer, tokens, selected ids, and list capacities with buffers of
 * exactly that size, so ASan sees any read past them) and the policy's part
 * (every count and value it writes, any int32). The contract: the check
 * returns SPICE_OK or SPICE_ERR_INVALID_PLAN, a NUL-terminated message for
 * the latter, reads nothing out of bounds, and a plan it accepts really is in
 * range (re-checked here: an accepted plan that indexes out of the tier is
 * the bug the check exists to prevent).
 *
 * Built by fuzz/CMakeLists.txt: with clang's -fsanitize=fuzzer,address,undefined
 * as a libFuzzer target (`spice-fuzz-plan-check CORPUS_DIR fuzz/corpus/plan_check
 * -runs=1000000`); otherwise with SPICE_FUZZ_STANDALONE, a driver that replays
 * the files and folders given and, with -runs=N, N byte-flip mutations of each
 * (under ASan and UBSan where the compiler has them). */
#include "spice.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bytes {
    const uint8_t * p;
    size_t n;
} bytes;

static uint8_t u8(bytes * b) {
    if (b->n == 0) {
        return 0;
    }
    b->n--;
    return *b->p++;
}

static int32_t i32(bytes * b) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
        v = (v << 8) | u8(b);
    }
    return (int32_t) v;
}

/* A policy's value for a field valid in 0..hi-1: mostly in 0..hi (the first invalid value
 * included), else small, negative included, or any int32 -- so whole plans are often valid
 * and every check down the list gets reached. */
static int32_t value(bytes * b, int32_t hi) {
    const uint8_t tag = u8(b);
    if (tag < 200) {
        return hi >= 0 ? (int32_t) (u8(b) % (uint32_t) (hi + 1)) : (int32_t) (int8_t) u8(b);
    }
    return tag < 240 ? (int32_t) (int8_t) u8(b) : i32(b);
}

/* A policy's count for a list of capacity cap: usually within it, sometimes just past, sometimes anything. */
static int32_t count(bytes * b, int32_t cap) {
    const uint8_t tag = u8(b);
    if (tag < 192) {
        return cap > 0 ? (int32_t) (u8(b) % (uint32_t) (cap + 1)) : 0;
    }
    if (tag < 240) {
        return cap + (int32_t) (u8(b) % 3) - 1 + (tag & 1) * 2; /* cap-1 .. cap+3 */
    }
    return i32(b);
}

#define REQUIRE(cond)                                                                  \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "fuzz_plan_check: %s:%d: %s does not hold\n", __FILE__, __LINE__, #cond); \
            abort();                                                                   \
        }                                                                              \
    } while (0)

static int is_moe(int32_t n_layers, const int32_t * n_expert, int32_t il) {
    return il >= 0 && il < n_layers && n_expert[il] > 0;
}

static void require_pairs_in_range(int32_t n_layers, const int32_t * n_expert, const int32_t * pairs, int32_t n,
                                   int32_t cap) {
    REQUIRE(n >= 0 && n <= cap && n % 2 == 0);
    for (int32_t i = 0; i < n; i += 2) {
        REQUIRE(is_moe(n_layers, n_expert, pairs[i]));
        REQUIRE(pairs[i + 1] >= 0 && pairs[i + 1] < n_expert[pairs[i]]);
    }
}

static void * alloc(size_t n) {
    void * p = malloc(n > 0 ? n : 1);
    if (p == NULL) {
        abort();
    }
    return p;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

static long accepted = 0; /* plans the check let through (the standalone driver reports them) */

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    (void) accepted;
    bytes b = { data, size };
    /* ---- the engine's part: always consistent, as libspice builds it ---- */
    const int32_t n_layers = 1 + u8(&b) % 6;
    int32_t n_expert[6] = { 0 };
    int32_t max_expert = 0, first_moe = -1;
    for (int32_t il = 0; il < n_layers; ++il) {
        n_expert[il] = u8(&b) % 9; /* 0: a dense layer */
        max_expert = n_expert[il] > max_expert ? n_expert[il] : max_expert;
        first_moe = first_moe < 0 && n_expert[il] > 0 ? il : first_moe;
    }
    if (first_moe < 0) {
        n_expert[0] = 1 + u8(&b) % 8; /* a runtime serves at least one MoE layer */
        max_expert = n_expert[0];
        first_moe = 0;
    }
    uint8_t * has_surrogate = NULL;
    if (u8(&b) & 1) {
        has_surrogate = (uint8_t *) alloc((size_t) n_layers * (size_t) max_expert);
        for (int32_t i = 0; i < n_layers * max_expert; ++i) {
            has_surrogate[i] = u8(&b) & 1;
        }
    }
    const spice_plan_limits lim = { n_layers, n_expert, max_expert, has_surrogate };

    int32_t il = (int32_t) (u8(&b) % (uint32_t) n_layers);
    il = n_expert[il] > 0 ? il : first_moe; /* the hook is called for MoE layers only */
    const int32_t n_tokens = 1 + u8(&b) % 4;
    const int32_t n_used = 1 + (int32_t) (u8(&b) % (uint32_t) n_expert[il]);
    const int32_t n_pairs = n_tokens * n_used;
    int32_t * ids = (int32_t *) alloc((size_t) n_pairs * sizeof(int32_t));
    for (int32_t i = 0; i < n_pairs; ++i) {
        /* the graph's top-k (a bad id is dropped later, so the check must not trust it) */
        ids[i] = (u8(&b) & 7) != 0 ? (int32_t) (u8(&b) % (uint32_t) n_expert[il]) : (int32_t) (int8_t) u8(&b);
    }

    spice_policy_call call;
    memset(&call, 0, sizeof(call));
    call.il = il;
    call.n_tokens = n_tokens;
    call.n_expert_used = n_used;
    call.n_expert = n_expert[il];
    call.ids = ids;
    call.ids_nb1 = (size_t) n_used * sizeof(int32_t);
    call.cap_actions = n_pairs;
    call.cap_fetch = n_expert[il];
    call.cap_prefetch = call.cap_evict = 2 * n_layers * max_expert;
    call.cap_evict_from = n_layers;
    call.actions = (int32_t *) alloc((size_t) call.cap_actions * sizeof(int32_t));
    call.fetch = (int32_t *) alloc((size_t) call.cap_fetch * sizeof(int32_t));
    call.prefetch = (int32_t *) alloc((size_t) call.cap_prefetch * sizeof(int32_t));
    call.evict = (int32_t *) alloc((size_t) call.cap_evict * sizeof(int32_t));
    call.evict_from = (int32_t *) alloc((size_t) call.cap_evict_from * sizeof(int32_t));

    /* ---- the policy's part: anything ---- */
    const uint8_t shape = u8(&b);
    call.n_actions = shape < 200 ? n_pairs : (shape < 250 ? n_pairs + (int32_t) (shape % 5) - 2 : i32(&b));
    for (int32_t i = 0; i < call.cap_actions; ++i) {
        call.actions[i] = value(&b, SPICE_ACTION_COUNT_);
    }
    call.n_fetch = count(&b, call.cap_fetch);
    for (int32_t i = 0; i < call.cap_fetch; ++i) {
        call.fetch[i] = value(&b, n_expert[il]);
    }
    call.n_prefetch = count(&b, call.cap_prefetch);
    for (int32_t i = 0; i < call.cap_prefetch; ++i) {
        call.prefetch[i] = value(&b, i % 2 == 0 ? n_layers : max_expert);
    }
    call.n_evict = count(&b, call.cap_evict);
    for (int32_t i = 0; i < call.cap_evict; ++i) {
        call.evict[i] = value(&b, i % 2 == 0 ? n_layers : max_expert);
    }
    call.n_evict_from = count(&b, call.cap_evict_from);
    for (int32_t i = 0; i < call.cap_evict_from; ++i) {
        call.evict_from[i] = value(&b, n_layers);
    }
    call.resume_il = (u8(&b) & 3) == 0 ? value(&b, n_layers) : -1;

    /* a short message buffer too: the message is cut, never overrun */
    const size_t err_len = 1 + (size_t) u8(&b) * 2;
    char * err = (char *) alloc(err_len);
    memset(err, 'x', err_len);

    const int status = spice_plan_check(&lim, &call, err, err_len);

    REQUIRE(status == SPICE_OK || status == SPICE_ERR_INVALID_PLAN);
    if (status == SPICE_ERR_INVALID_PLAN) {
        REQUIRE(memchr(err, '\0', err_len) != NULL);
        REQUIRE(err_len == 1 || err[0] != '\0');
    } else {
        accepted++;
        REQUIRE(call.n_actions == n_pairs);
        for (int32_t i = 0; i < n_pairs; ++i) {
            const int32_t a = call.actions[i];
            REQUIRE(a >= 0 && a < SPICE_ACTION_COUNT_);
            if (a == SPICE_ACTION_SURROGATE) {
                REQUIRE(has_surrogate != NULL && ids[i] >= 0 && ids[i] < n_expert[il]);
                REQUIRE(has_surrogate[(size_t) il * (size_t) max_expert + (size_t) ids[i]]);
            }
        }
        REQUIRE(call.n_fetch >= 0 && call.n_fetch <= call.cap_fetch);
        for (int32_t i = 0; i < call.n_fetch; ++i) {
            REQUIRE(call.fetch[i] >= 0 && call.fetch[i] < n_expert[il]);
        }
        require_pairs_in_range(n_layers, n_expert, call.prefetch, call.n_prefetch, call.cap_prefetch);
        require_pairs_in_range(n_layers, n_expert, call.evict, call.n_evict, call.cap_evict);
        REQUIRE(call.n_evict_from >= 0 && call.n_evict_from <= call.cap_evict_from);
        for (int32_t i = 0; i < call.n_evict_from; ++i) {
            REQUIRE(is_moe(n_layers, n_expert, call.evict_from[i]));
        }
        REQUIRE(call.resume_il == -1 || is_moe(n_layers, n_expert, call.resume_il));
    }

    free(err);
    free(call.actions);
    free(call.fetch);
    free(call.prefetch);
    free(call.evict);
    free(call.evict_from);
    free(ids);
    free(has_surrogate);
    return 0;
}

#ifdef SPICE_FUZZ_STANDALONE
/* No libFuzzer: replay the inputs given (files, or folders of files), each
 * then mutated -runs=N times (deterministic byte flips, inserts and cuts). */
#include <dirent.h>
#include <sys/stat.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static long executions = 0;

static void run_one(const uint8_t * data, size_t size, long runs) {
    LLVMFuzzerTestOneInput(data, size);
    executions++;
    uint8_t * m = (uint8_t *) alloc(size + 64);
    for (long r = 0; r < runs; ++r) {
        memcpy(m, data, size);
        size_t n = size;
        const int edits = 1 + (int) (next_random() % 8);
        for (int e = 0; e < edits; ++e) {
            const uint64_t x = next_random();
            if (n > 0 && (x & 3) != 3) {
                m[(x >> 8) % n] = (uint8_t) (x >> 32); /* overwrite a byte */
            } else if ((x & 4) && n < size + 64) {
                m[n++] = (uint8_t) (x >> 40); /* grow */
            } else if (n > 0) {
                n -= 1 + (size_t) ((x >> 16) % n); /* cut */
            }
        }
        LLVMFuzzerTestOneInput(m, n);
        executions++;
    }
    free(m);
}

static int replay_file(const char * path, long runs) {
    FILE * f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "fuzz_plan_check: cannot read %s\n", path);
        return 1;
    }
    uint8_t buf[1 << 16];
    const size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    run_one(buf, n, runs);
    return 0;
}

int main(int argc, char ** argv) {
    long runs = 0, inputs = 0;
    int failed = 0;
    for (int i = 1; i < argc; ++i) {
        if (strncmp(argv[i], "-runs=", 6) == 0) {
            runs = strtol(argv[i] + 6, NULL, 10);
        }
    }
    for (int i = 1; i < argc; ++i) {
        if (argv[i][0] == '-') {
            continue; /* libFuzzer's flags: ignored, but for -runs */
        }
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "fuzz_plan_check: no such input %s\n", argv[i]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed |= replay_file(argv[i], runs);
            inputs++;
            continue;
        }
        DIR * dir = opendir(argv[i]);
        for (struct dirent * ent = dir ? readdir(dir) : NULL; ent != NULL; ent = readdir(dir)) {
            if (ent->d_name[0] == '.') {
                continue;
            }
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], ent->d_name);
            failed |= replay_file(path, runs);
            inputs++;
        }
        if (dir) {
            closedir(dir);
        }
    }
    if (inputs == 0) {
        fprintf(stderr, "usage: %s [-runs=N] FILE_OR_DIR...\n", argv[0]);
        return 2;
    }
    printf("fuzz_plan_check: %ld inputs, %ld executions (%ld plans accepted), no failure\n", inputs, executions,
           accepted);
    return failed;
}
#endif
