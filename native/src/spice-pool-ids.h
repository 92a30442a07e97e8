/* The expert ids of one pool-graph launch (spice-pool-exec.h): which slot
 * each (token, k) row of the chunk multiplies with.
 *
 * MUL_MAT_ID expects a token's experts to be distinct, as a router's top-k
 * always are. ggml-cuda relies on it in its batched path (mmq, above the
 * vector kernel's batch limit: 9 or more tokens on Hopper, 5 or more for
 * some types on older GPUs): with the activations broadcast over a token's
 * experts it maps each (token, expert) to one compact row, and a repeated
 * expert's other rows keep a stale mapping, through which the token's
 * activations are scattered into another pair's row. So a device pair takes
 * its expert's slot; the token's other pairs take the zero slot once, then
 * slots the token does not use, whose rows are computed and never read,
 * preferring slots the chunk runs anyway (their weights are read regardless).
 * A one-token launch always runs the vector kernel, which computes every row
 * on its own: there the other pairs all take the zero slot (no real expert's
 * weights are read for them). */
#ifndef SPICE_POOL_IDS_H
#define SPICE_POOL_IDS_H

#include <stdint.h>

/* sid[t * n_used + k] for t < bucket from want[t * n_used + k] for t <
 * n_tokens (the slot of a device pair, -1 for any other pair; the rows from
 * n_tokens to bucket are padding, with no device pair). Scratch: mark, n_slots
 * bytes, all zero on entry and on return; listed, n_tokens * n_used. Returns 0,
 * or -1 when the slots cannot give a multi-token launch distinct ids
 * (n_slots + 1 < n_used): then the caller runs the call another way. */
int spice_pool_fill_ids(int32_t * sid, const int32_t * want, int32_t n_tokens, int32_t bucket, int32_t n_used,
                        int32_t n_slots, uint8_t * mark, int32_t * listed);

#endif /* SPICE_POOL_IDS_H */
