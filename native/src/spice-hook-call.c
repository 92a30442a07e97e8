/* Unpacking llama.cpp's hook call (spice-hook-call.h). */
#include "spice-hook-call.h"

#include "spice.h"

#include "llama.h"

#include <stdlib.h>
#include <string.h>

void spice_hook_call_view(const struct llama_moe_hook_call * in, spice_hook_call * out) {
    memset(out, 0, sizeof(*out));
    out->il = in->il;
    out->n_tokens = in->n_tokens;
    out->n_embd = in->n_embd;
    out->n_expert = in->n_expert;
    out->n_expert_used = in->n_expert_used;
    out->ith = in->ith;
    out->nth = in->nth;
    out->inp = in->inp;         out->inp_nb1 = in->inp_nb1;
    out->probs = in->probs;     out->probs_nb1 = in->probs != NULL ? in->probs_nb1 : 0;
    out->weights = in->weights; out->weights_nb1 = in->weights_nb1;
    out->shexp = in->shexp;     out->shexp_nb1 = in->shexp != NULL ? in->shexp_nb1 : 0;
    out->out = in->out;         out->out_nb1 = in->out_nb1;
    out->il_next = in->next_logits != NULL ? in->il_next : -1;
    out->n_expert_next = in->next_logits != NULL ? in->n_expert_next : 0;
    out->next_logits = in->next_logits;
    out->next_logits_nb1 = in->next_logits != NULL ? in->next_logits_nb1 : 0;
}

int spice_hook_call_ids(spice_hook_call * call, const struct llama_moe_hook_call * in, spice_hook_ids * ids) {
    const int32_t rows = in->n_tokens > 0 ? in->n_tokens : 0;
    const int32_t used = in->n_expert_used > 0 ? in->n_expert_used : 0;
    const size_t need = (size_t) rows * (size_t) used;
    if (need > ids->cap) {
        int32_t * nbuf = (int32_t *) realloc(ids->buf, need * sizeof(int32_t));
        if (nbuf == NULL) {
            call->ids = NULL;
            return SPICE_ERR_NO_MEMORY;
        }
        ids->buf = nbuf;
        ids->cap = need;
    }
    for (int32_t t = 0; t < rows; ++t) {
        const float * src = (const float *) ((const char *) in->ids_f32 + (size_t) t * in->ids_nb1);
        int32_t * dst = ids->buf + (size_t) t * (size_t) used;
        for (int32_t k = 0; k < used; ++k) {
            const float f = src[k];
            /* NaN fails both comparisons */
            dst[k] = (f >= 0.0f && f < 16777216.0f && f == (float) (int32_t) f) ? (int32_t) f : -1;
        }
    }
    call->ids = ids->buf;
    call->ids_nb1 = (size_t) used * sizeof(int32_t);
    return SPICE_OK;
}

void spice_hook_ids_free(spice_hook_ids * ids) {
    free(ids->buf);
    ids->buf = NULL;
    ids->cap = 0;
}
