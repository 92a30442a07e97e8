/* See spice-cuda-verify.h. */
#include "spice-cuda-verify.h"
#include "spice-cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct spice_cuda_verify {
    uint8_t * run;  size_t run_cap;
    float * y;      size_t y_cap;
    int active;     /* this call's device rows are to be compared */
    double max_diff, max_abs;
    uint64_t rows;  /* device rows compared so far */
};

spice_cuda_verify * spice_cuda_verify_from_env(void) {
    const char * env = getenv("SPICE_CUDA_VERIFY");
    if (env == NULL || env[0] != '1') {
        return NULL;
    }
    return (spice_cuda_verify *) calloc(1, sizeof(spice_cuda_verify));
}

void spice_cuda_verify_free(spice_cuda_verify * v) {
    if (v != NULL) {
        free(v->run);
        free(v->y);
        free(v);
    }
}

const uint8_t * spice_cuda_verify_begin(spice_cuda_verify * v, uint8_t * exec, int32_t n_pairs, int32_t n_embd,
                                        float ** y_out) {
    v->active = 0;
    const size_t need_y = (size_t) n_pairs * (size_t) n_embd;
    if ((size_t) n_pairs > v->run_cap) {
        free(v->run);
        v->run = (uint8_t *) malloc((size_t) n_pairs);
        v->run_cap = v->run ? (size_t) n_pairs : 0;
    }
    if (need_y > v->y_cap) {
        free(v->y);
        v->y = (float *) malloc(need_y * sizeof(float));
        v->y_cap = v->y ? need_y : 0;
    }
    if (v->run == NULL || v->y == NULL) {
        return NULL;
    }
    memcpy(v->run, exec, (size_t) n_pairs);
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (exec[i] == SPICE_EXEC_DEVICE) {
            exec[i] = SPICE_EXEC_HOST; /* the host computes it too, and its row is the one used */
        }
    }
    v->active = 1;
    *y_out = v->y;
    return v->run;
}

void spice_cuda_verify_rows(spice_cuda_verify * v, const float * host_y, int32_t n_pairs, int32_t n_embd) {
    if (!v->active) {
        return;
    }
    v->active = 0;
    for (int32_t i = 0; i < n_pairs; ++i) {
        if (v->run[i] != SPICE_EXEC_DEVICE) {
            continue;
        }
        const float * dev = v->y + (size_t) i * (size_t) n_embd;
        const float * host = host_y + (size_t) i * (size_t) n_embd;
        for (int32_t c = 0; c < n_embd; ++c) {
            const double d = dev[c] > host[c] ? dev[c] - host[c] : host[c] - dev[c];
            const double a = host[c] >= 0 ? host[c] : -host[c];
            v->max_diff = d > v->max_diff ? d : v->max_diff;
            v->max_abs = a > v->max_abs ? a : v->max_abs;
        }
        v->rows++;
    }
}

void spice_cuda_verify_report(const spice_cuda_verify * v) {
    if (v != NULL && v->rows > 0) {
        fprintf(stderr, "libspice: SPICE_CUDA_VERIFY: %llu device rows vs the host's: max |diff| %.3g, "
                        "max |host| %.3g, relative %.3g\n", (unsigned long long) v->rows, v->max_diff, v->max_abs,
                v->max_abs > 0 ? v->max_diff / v->max_abs : 0.0);
    }
}
