/* A hook call as the runtime's steps read it: llama.cpp's call (one packed
 * graph input per MoE layer -- hidden rows, gate weights, the selected ids
 * as floats, then the router probabilities, the shared-expert output and the
 * next layer's router logits when the registration asked for them),
 * unpacked, with the ids as int32 in a buffer the runtime owns. */
#ifndef SPICE_HOOK_CALL_H
#define SPICE_HOOK_CALL_H

#include <stddef.h>
#include <stdint.h>

struct llama_moe_hook_call;

typedef struct spice_hook_call {
    int32_t il;
    int32_t n_tokens;
    int32_t n_embd;
    int32_t n_expert;
    int32_t n_expert_used;
    int32_t ith;
    int32_t nth;

    const float   * inp;     size_t inp_nb1;     /* [n_tokens][n_embd] */
    const float   * probs;   size_t probs_nb1;   /* [n_tokens][n_expert] or NULL (not asked for) */
    const int32_t * ids;     size_t ids_nb1;     /* [n_tokens][n_expert_used]; NULL until converted */
    const float   * weights; size_t weights_nb1; /* [n_tokens][n_expert_used] */
    const float   * shexp;   size_t shexp_nb1;   /* [n_tokens][n_embd] or NULL */
    float         * out;     size_t out_nb1;     /* [n_tokens][n_embd], written */
    int32_t il_next;                             /* next_logits' layer, or -1 */
    int32_t n_expert_next;
    const float   * next_logits; size_t next_logits_nb1; /* [n_tokens][n_expert_next] or NULL */
} spice_hook_call;

/* The int32 ids of the call in progress (grown as calls need, never shrunk). */
typedef struct spice_hook_ids {
    int32_t * buf;
    size_t cap; /* in ids */
} spice_hook_ids;

/* Any thread: the call's views, ids not converted yet (NULL). */
void spice_hook_call_view(const struct llama_moe_hook_call * in, spice_hook_call * out);

/* One thread (thread 0, before every other reader): converts the call's
 * float ids into ids->buf, compact rows of n_expert_used, and points
 * call->ids there. A value that is not an integer in [0, 2^24) -- where an
 * F32 holds every integer exactly -- becomes -1, an id out of every layer's
 * range. SPICE_ERR_NO_MEMORY (call->ids stays NULL) when the buffer cannot
 * grow. */
int spice_hook_call_ids(spice_hook_call * call, const struct llama_moe_hook_call * in, spice_hook_ids * ids);

void spice_hook_ids_free(spice_hook_ids * ids);

#endif /* SPICE_HOOK_CALL_H */
