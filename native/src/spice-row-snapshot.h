/* A copy of a table of rows kept current by copying only the rows that changed
 * since this copy last took them: the residency table an asynchronous
 * snapshot carries (spice-planner.h).
 *
 * The store bumps a layer's row version at every state change of that layer
 * (set_state, the only writer of its table). A ring entry of the planner
 * takes the table again some posts later; only the layers changed since then
 * (the calls in between touched a few) are copied. The rows a post copied
 * were lines the planner's core had read last, each a transfer: 4 lines and
 * 0.63 us of a post on a 4-layer DeepSeek-V2-Lite, one line per layer on the
 * real model's 27 (docs/results/cpu-overhead.md).
 *
 * A source identified by another epoch (another store), another shape, or no
 * versions at all is copied whole. */
#ifndef SPICE_ROW_SNAPSHOT_H
#define SPICE_ROW_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

typedef struct spice_row_snapshot {
    int8_t * rows;     /* [n_layers * width] */
    uint32_t * version; /* [n_layers]: the source's version of each row held */
    size_t cap_rows, cap_version;
    uint64_t epoch;    /* the source's identity (0: none held) */
    int32_t n_layers, width;
} spice_row_snapshot;

/* Take src (n_layers x width) into snap: the rows whose version differs from the
 * one held, or every row (version NULL, or epoch, n_layers or width differ).
 * Returns the rows copied, or -1 when snap cannot grow (then it holds nothing). */
int32_t spice_row_snapshot_take(spice_row_snapshot * snap, const int8_t * src, const uint32_t * version,
                                uint64_t epoch, int32_t n_layers, int32_t width);

void spice_row_snapshot_free(spice_row_snapshot * snap);

#endif /* SPICE_ROW_SNAPSHOT_H */
