/* The buffer type routed-expert tensors are loaded into (see spice.h).
 *
 * llama.cpp treats an override to ggml_backend_cpu_buffer_type() as "CPU,
 * repacking allowed", so the plain layout needs a buffer type that behaves
 * exactly like the CPU one but is a different object. Its interface is the
 * CPU buffer type's own (same allocation, alignment, host access); only the
 * name differs, so logs show where the experts went. */
#include "spice.h"

#include "ggml-backend-impl.h"
#include "ggml-backend.h"

#include <stdlib.h>
#include <string.h>

struct spice_expert_buft {
    struct ggml_backend_buffer_type plain; /* used when there is no GPU */
    ggml_backend_buffer_type_t chosen;
};

static const char * expert_buft_name(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return "CPU_Experts";
}

int spice_expert_buft_create(spice_expert_buft ** out) {
    if (out == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_expert_buft * b = (spice_expert_buft *) calloc(1, sizeof(*b));
    if (b == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    /* pinned host memory of the first GPU, when the build has one */
    for (size_t i = 0; i < ggml_backend_dev_count() && b->chosen == NULL; ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            b->chosen = ggml_backend_dev_host_buffer_type(dev);
        }
    }
    if (b->chosen == NULL) {
        const struct ggml_backend_buffer_type * cpu = ggml_backend_cpu_buffer_type();
        b->plain = *cpu;
        b->plain.iface.get_name = expert_buft_name;
        b->chosen = &b->plain;
    }
    *out = b;
    return SPICE_OK;
}

void spice_expert_buft_free(spice_expert_buft * buft) {
    free(buft);
}

void * spice_expert_buft_get(const spice_expert_buft * buft) {
    return buft ? (void *) buft->chosen : NULL;
}

const char * spice_expert_buft_name(const spice_expert_buft * buft) {
    return buft ? ggml_backend_buft_name(buft->chosen) : "";
}
