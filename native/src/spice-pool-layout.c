/* Slot pool layout (see spice-pool-layout.h). */
#include "spice-pool-layout.h"

#include "spice.h"

#include <string.h>

/* Above this the lcm of a kind's block sizes wastes too much per slot: the
 * strides fall back to 256-byte alignment and only per-expert execution
 * runs (graph_ok = 0). */
#define SPICE_POOL_MAX_BLOCK_LCM ((size_t) 1 << 20)
#define SPICE_POOL_ALIGN ((size_t) 256) /* what ggml's CUDA buffers give every tensor */

static size_t gcd(size_t a, size_t b) {
    while (b != 0) {
        const size_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* lcm(a, b), or 0 once it passes the cap */
static size_t lcm_capped(size_t a, size_t b) {
    if (a == 0 || b == 0) {
        return 0;
    }
    const size_t l = a / gcd(a, b) * b;
    return l > SPICE_POOL_MAX_BLOCK_LCM ? 0 : l;
}

static size_t round_up(size_t n, size_t m) {
    return (n + m - 1) / m * m;
}

#define SPICE_POOL_ROW_PADDING 512

size_t spice_pool_matrix_pad(enum ggml_type type, int64_t n_cols) {
    if (!ggml_is_quantized(type) || n_cols % SPICE_POOL_ROW_PADDING == 0) {
        return 0;
    }
    return ggml_row_size(type, SPICE_POOL_ROW_PADDING - n_cols % SPICE_POOL_ROW_PADDING);
}

void spice_pool_layout_interleaved(int32_t n_slots, size_t slot_stride, spice_pool_layout * out) {
    memset(out, 0, sizeof(*out));
    out->n_slots = n_slots;
    for (int k = 0; k < 3; ++k) {
        out->stride[k] = slot_stride;
    }
    out->bytes = (size_t) (n_slots > 0 ? n_slots : 0) * slot_stride;
    out->graph_ok = 0;
}

int spice_pool_layout_make(const spice_expert_layer * layers, int32_t n_layers, int32_t n_slots,
                           spice_pool_layout * out) {
    if (layers == NULL || out == NULL || n_slots <= 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    memset(out, 0, sizeof(*out));
    size_t need[3] = { 0, 0, 0 };
    size_t unit[3] = { SPICE_POOL_ALIGN, SPICE_POOL_ALIGN, SPICE_POOL_ALIGN };
    int graph_ok = 1, n_moe = 0;
    for (int32_t il = 0; il < n_layers; ++il) {
        const spice_expert_layer * L = &layers[il];
        if (!L->is_moe) {
            continue;
        }
        n_moe++;
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; k < 3; ++k) {
            const size_t pad = spice_pool_matrix_pad(mats[k]->type, mats[k]->n_cols);
            const size_t bytes = mats[k]->tensor->nb[2] + pad;
            need[k] = bytes > need[k] ? bytes : need[k];
            out->pad[k] = pad > out->pad[k] ? pad : out->pad[k];
            const size_t u = lcm_capped(unit[k], ggml_type_size(mats[k]->type));
            if (u == 0) {
                graph_ok = 0;
            } else {
                unit[k] = u;
            }
        }
    }
    if (n_moe == 0) {
        return SPICE_ERR_INVALID_ARG;
    }
    /* gate and up share one stride: ggml-cuda's fused gate/up kernel reads both with one */
    const size_t gu_unit = lcm_capped(unit[0], unit[1]);
    if (gu_unit == 0) {
        graph_ok = 0;
    }
    const size_t gu = round_up(need[0] > need[1] ? need[0] : need[1], gu_unit ? gu_unit : SPICE_POOL_ALIGN);
    out->stride[0] = out->stride[1] = gu;
    out->stride[2] = round_up(need[2], unit[2]);
    out->n_slots = n_slots;
    const size_t per_region = (size_t) n_slots + 1;
    out->region[0] = 0;
    out->region[1] = per_region * out->stride[0];
    out->region[2] = out->region[1] + per_region * out->stride[1];
    out->bytes = out->region[2] + per_region * out->stride[2];
    out->graph_ok = graph_ok;
    return SPICE_OK;
}

int64_t spice_pool_slot_range(const spice_pool_layout * p, int32_t slot, size_t offset, size_t n) {
    for (int k = 0; slot >= 0 && slot < p->n_slots && k < 3; ++k) {
        if (offset >= p->region[k] && offset < p->region[k] + p->stride[k]) {
            return offset + n <= p->region[k] + p->stride[k] ? (int64_t) spice_pool_copy_offset(p, slot, k, offset) : -1;
        }
    }
    return -1;
}
