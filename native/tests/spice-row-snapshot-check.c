/* spice-row-snapshot-check: spice_row_snapshot_take (src/spice-row-snapshot.c)
 * against a simulated store. A table of rows changes at random, each change
 * bumping its row's version as the store's set_state does; a ring of
 * snapshots takes it in turn (as the planner's entries do) or at random;
 * sometimes the store is replaced (a new epoch, sometimes a new shape) or
 * posts without versions. After every take the snapshot must equal the table
 * and have copied no row that had not changed since it last took it. Prints
 * one line and exits 0, or names the first wrong take and exits 1.
 *
 *   spice-row-snapshot-check [takes] [seed] */
#include "spice-row-snapshot.h"

#include "check-rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_LAYERS = 40, MAX_WIDTH = 80, RING = 5 };

int main(int argc, char ** argv) {
    const long n_takes = argc > 1 ? atol(argv[1]) : 20000;
    check_rng rng = check_rng_from(argc > 2 ? argv[2] : NULL);
    static int8_t table[MAX_LAYERS * MAX_WIDTH];
    uint32_t version[MAX_LAYERS];
    /* per ring entry, which rows changed since it last took the table (-1: a whole copy is due) */
    static int changed[RING][MAX_LAYERS];
    spice_row_snapshot ring[RING];
    memset(ring, 0, sizeof(ring));
    int32_t n_layers = 27, width = 64;
    uint64_t epoch = 1;
    memset(table, 0, sizeof(table));
    memset(version, 0, sizeof(version));
    for (int i = 0; i < RING; ++i) {
        for (int l = 0; l < MAX_LAYERS; ++l) {
            changed[i][l] = -1;
        }
    }
    long copied_rows = 0, whole = 0;
    for (long t = 0; t < n_takes; ++t) {
        const uint32_t what = check_rng_below(&rng, 1000);
        if (what < 3) { /* another store: new epoch, maybe another shape, fresh versions */
            epoch++;
            if (check_rng_below(&rng, 2)) {
                n_layers = 1 + (int32_t) check_rng_below(&rng, MAX_LAYERS);
                width = 1 + (int32_t) check_rng_below(&rng, MAX_WIDTH);
            }
            memset(version, 0, sizeof(version));
            for (int i = 0; i < RING; ++i) {
                for (int l = 0; l < MAX_LAYERS; ++l) {
                    changed[i][l] = -1;
                }
            }
        }
        /* a few state changes, each bumping its layer's version */
        const uint32_t n_changes = check_rng_below(&rng, 8);
        for (uint32_t c = 0; c < n_changes; ++c) {
            const int32_t l = (int32_t) check_rng_below(&rng, (uint32_t) n_layers);
            const int32_t e = (int32_t) check_rng_below(&rng, (uint32_t) width);
            table[l * width + e] = (int8_t) check_rng_below(&rng, 4);
            version[l]++;
            for (int i = 0; i < RING; ++i) {
                if (changed[i][l] == 0) {
                    changed[i][l] = 1;
                }
            }
        }
        const int i = check_rng_below(&rng, 4) ? (int) (t % RING) : (int) check_rng_below(&rng, RING);
        const int no_versions = check_rng_below(&rng, 100) == 0;
        int expect = 0, expect_whole = no_versions;
        for (int l = 0; l < n_layers; ++l) {
            expect_whole |= changed[i][l] < 0;
            expect += changed[i][l] != 0;
        }
        const int32_t got = spice_row_snapshot_take(&ring[i], table, no_versions ? NULL : version, epoch, n_layers,
                                                    width);
        if (memcmp(ring[i].rows, table, (size_t) n_layers * (size_t) width) != 0) {
            printf("take %ld (seed %s): entry %d differs from the table (%d x %d)\n", t, argc > 2 ? argv[2] : "-",
                   i, n_layers, width);
            return 1;
        }
        if (got != (expect_whole ? n_layers : expect)) {
            printf("take %ld (seed %s): entry %d copied %d rows, expected %d\n", t, argc > 2 ? argv[2] : "-", i,
                   got, expect_whole ? n_layers : expect);
            return 1;
        }
        copied_rows += got;
        whole += expect_whole;
        for (int l = 0; l < MAX_LAYERS; ++l) {
            changed[i][l] = no_versions ? -1 : 0;
        }
    }
    for (int i = 0; i < RING; ++i) {
        spice_row_snapshot_free(&ring[i]);
    }
    printf("all checks passed: %ld takes, %.2f rows copied a take, %ld whole\n", n_takes,
           (double) copied_rows / (double) (n_takes > 0 ? n_takes : 1), whole);
    return 0;
}
