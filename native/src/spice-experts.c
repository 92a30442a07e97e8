/* Checks expert tensors and binds them to ggml's CPU kernels. */
#include "spice-experts.h"

#include "spice.h"

#include "ggml-backend.h"

#include <stdio.h>
#include <string.h>

static int matrix_init(spice_expert_matrix * m, int32_t il, const char * what,
                       const struct ggml_tensor * t, char * err, size_t err_len) {
    memset(m, 0, sizeof(*m));
    m->tensor = t;
    m->type = t->type;
    m->n_cols = t->ne[0];
    m->n_rows = t->ne[1];

    const char * buft = t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : "none";
    /* the CPU backend's "extra" buffer types (CPU_REPACK, AMX, KleidiAI) hold
     * weights in their own layout: not host-readable, or tagged via extra */
    const int repacked = t->extra != NULL || strstr(buft, "REPACK") != NULL || strstr(buft, "AMX") != NULL ||
                         strstr(buft, "KLEIDI") != NULL;
    if (repacked) {
        snprintf(err, err_len,
                 "layer %d %s experts (%s) were repacked by the CPU backend (buffer type %s); load the "
                 "model with pyspice.Llama, which keeps routed experts unrepacked in host memory",
                 il, what, t->name, buft);
        return SPICE_ERR_INCOMPATIBLE;
    }
    if (t->data == NULL || t->buffer == NULL || !ggml_backend_buffer_is_host(t->buffer)) {
        snprintf(err, err_len,
                 "layer %d %s experts (%s) are not in host memory (buffer type %s); load the model with "
                 "pyspice.Llama, which keeps routed experts in host memory", il, what, t->name, buft);
        return SPICE_ERR_INCOMPATIBLE;
    }
    const struct ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(t->type);
    if (traits == NULL || traits->vec_dot == NULL) {
        snprintf(err, err_len, "layer %d %s experts have type %s, which the ggml CPU backend cannot multiply",
                 il, what, ggml_type_name(t->type));
        return SPICE_ERR_UNSUPPORTED;
    }
    m->vec_dot = traits->vec_dot;
    m->vec_dot_type = traits->vec_dot_type;
    if (m->vec_dot_type != GGML_TYPE_F32) {
        const struct ggml_type_traits_cpu * q = ggml_get_type_traits_cpu(m->vec_dot_type);
        if (q == NULL || q->from_float == NULL) {
            snprintf(err, err_len, "layer %d %s experts: no quantizer for activation type %s", il, what,
                     ggml_type_name(m->vec_dot_type));
            return SPICE_ERR_UNSUPPORTED;
        }
        m->quantize = q->from_float;
    }
    if (t->nb[0] != ggml_type_size(t->type) || t->ne[3] != 1) {
        snprintf(err, err_len, "layer %d %s experts (%s) have an unexpected layout", il, what, t->name);
        return SPICE_ERR_UNSUPPORTED;
    }
    m->act_row_size = ggml_row_size(m->vec_dot_type, m->n_cols);
    return SPICE_OK;
}

int spice_expert_layer_init(spice_expert_layer * layer, int32_t il,
                            const struct ggml_tensor * gate,
                            const struct ggml_tensor * up,
                            const struct ggml_tensor * down,
                            char * err, size_t err_len) {
    memset(layer, 0, sizeof(*layer));
    int status;
    if ((status = matrix_init(&layer->gate, il, "gate", gate, err, err_len)) != SPICE_OK) return status;
    if ((status = matrix_init(&layer->up,   il, "up",   up,   err, err_len)) != SPICE_OK) return status;
    if ((status = matrix_init(&layer->down, il, "down", down, err, err_len)) != SPICE_OK) return status;

    const int64_t n_embd = gate->ne[0], n_ff = gate->ne[1], n_expert = gate->ne[2];
    if (up->ne[0] != n_embd || up->ne[1] != n_ff || up->ne[2] != n_expert ||
        down->ne[0] != n_ff || down->ne[1] != n_embd || down->ne[2] != n_expert) {
        snprintf(err, err_len, "layer %d: expert tensors disagree on shape (gate %lldx%lldx%lld, down %lldx%lldx%lld)",
                 il, (long long) gate->ne[0], (long long) gate->ne[1], (long long) gate->ne[2],
                 (long long) down->ne[0], (long long) down->ne[1], (long long) down->ne[2]);
        return SPICE_ERR_UNSUPPORTED;
    }
    layer->is_moe = 1;
    layer->n_expert = (int32_t) n_expert;
    layer->n_embd = (int32_t) n_embd;
    layer->n_ff = (int32_t) n_ff;
    layer->bytes_per_expert = (uint64_t) (gate->nb[2] + up->nb[2] + down->nb[2]);
    return SPICE_OK;
}
