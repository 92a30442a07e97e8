/* A table copy that takes only the changed rows (spice-row-snapshot.h). */
#include "spice-row-snapshot.h"

#include "spice-grow.h"

#include <stdlib.h>
#include <string.h>

int32_t spice_row_snapshot_take(spice_row_snapshot * snap, const int8_t * src, const uint32_t * version,
                                uint64_t epoch, int32_t n_layers, int32_t width) {
    const size_t bytes = (size_t) (n_layers > 0 ? n_layers : 0) * (size_t) (width > 0 ? width : 0);
    if (spice_grow_bytes((void **) &snap->rows, &snap->cap_rows, bytes + 1) != 0 ||
        spice_grow_bytes((void **) &snap->version, &snap->cap_version,
                         (size_t) (n_layers > 0 ? n_layers : 0) * 4 + 4) != 0) {
        snap->epoch = 0;
        return -1;
    }
    const int whole = version == NULL || epoch == 0 || snap->epoch != epoch || snap->n_layers != n_layers ||
                      snap->width != width;
    if (whole) {
        memcpy(snap->rows, src, bytes);
        if (version != NULL) {
            memcpy(snap->version, version, (size_t) n_layers * sizeof(uint32_t));
        }
        snap->epoch = version != NULL ? epoch : 0;
        snap->n_layers = n_layers;
        snap->width = width;
        return n_layers;
    }
    int32_t copied = 0;
    for (int32_t l = 0; l < n_layers; ++l) {
        if (snap->version[l] != version[l]) {
            const size_t at = (size_t) l * (size_t) width;
            memcpy(snap->rows + at, src + at, (size_t) width);
            snap->version[l] = version[l];
            copied++;
        }
    }
    return copied;
}

void spice_row_snapshot_free(spice_row_snapshot * snap) {
    free(snap->rows);
    free(snap->version);
    memset(snap, 0, sizeof(*snap));
}
