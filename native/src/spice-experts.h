/* The routed-expert tensors of one layer and the ggml CPU kernels that
 * execute them exactly as ggml's mul_mat_id does. */
#ifndef SPICE_EXPERTS_H
#define SPICE_EXPERTS_H

#include "ggml.h"
#include "ggml-cpu.h"

#include <stddef.h>
#include <stdint.h>

/* One expert matrix kind (gate, up or down) of one layer. */
typedef struct spice_expert_matrix {
    const struct ggml_tensor * tensor;
    enum ggml_type   type;
    enum ggml_type   vec_dot_type;  /* what activations are quantized to */
    ggml_vec_dot_t   vec_dot;
    ggml_from_float_t quantize;     /* NULL when vec_dot_type is F32 (used as is) */
    int64_t          n_cols;        /* ne[0]: input width */
    int64_t          n_rows;        /* ne[1]: output width */
    size_t           act_row_size;  /* bytes of one quantized activation row */
} spice_expert_matrix;

typedef struct spice_expert_layer {
    int is_moe;
    int32_t n_expert;
    int32_t n_embd;
    int32_t n_ff;
    spice_expert_matrix gate, up, down;
    uint64_t bytes_per_expert;
} spice_expert_layer;

/* Fills a layer from its three tensors; returns a spice_status and writes a
 * reason into err on failure (unsupported type, not host memory, repacked). */
int spice_expert_layer_init(spice_expert_layer * layer, int32_t il,
                            const struct ggml_tensor * gate,
                            const struct ggml_tensor * up,
                            const struct ggml_tensor * down,
                            char * err, size_t err_len);

#endif /* SPICE_EXPERTS_H */
