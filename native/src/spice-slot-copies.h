/* Low-precision copies of the routed experts, for a device tier whose slots
 * hold experts at about 4.5 or 5.5 bits (spice_store_params.slot_precision).
 *
 * Why: an expert re-quantized from Q8_0 to IQ4_NL is 0.53x the bytes, so the
 * same device budget holds 1.89x the experts, and each copy carries 0.53x
 * the bytes over the bus. Measured on smolmoe-b (docs/results/
 * quality-levels-per-model.md): every routed expert at IQ4_NL moves
 * perplexity by -0.62..+1.49% over three texts, at Q5_0 by -0.30..+0.33%,
 * token by token. That is a loss a lossy level may spend (spice:fast 4-bit,
 * spice:balanced 5-bit); lossless ones never use these copies.
 *
 * The copies live in host memory (the bus copies from them); the host keeps
 * executing its own activations on the original weights. Each matrix kind
 * takes the first type of its precision's list (4-bit: IQ4_NL, IQ4_XS, Q4_K;
 * 5-bit: Q5_0, Q5_K) that is smaller than its own,
 * whose rows its width divides into blocks, and whose activations quantize
 * as the original's do (the same vec_dot_type): so a call's quantized input
 * rows serve both, and an executor needs no second conversion. A matrix no
 * type fits keeps its own bytes (no copy is made). */
#ifndef SPICE_SLOT_COPIES_H
#define SPICE_SLOT_COPIES_H

#include "spice-experts.h"

#include "ggml-backend.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct spice_slot_copies {
    int32_t precision;           /* spice_slot_precision they were made for; 0 (exact): none made */
    int32_t n_layers;
    spice_expert_layer * layers; /* [n_layers] each layer's experts as the slots hold them */
    struct ggml_context * ctx;   /* the copies' tensors */
    ggml_backend_buffer_t buf;   /* and their bytes (host memory) */
    uint64_t bytes;              /* bytes of the copies made */
    double seconds;              /* how long making them took */
} spice_slot_copies;

/* Whether `precision` is a spice_slot_precision. */
bool spice_slot_precision_valid(int32_t precision);

/* The type matrix m takes in slots of `precision` (its own type where none fits). */
enum ggml_type spice_slot_type(const spice_expert_matrix * m, int32_t precision);

/* Bytes the copies of `precision` of host's MoE layers take (before
 * alignment padding), 0 where none would be made. */
uint64_t spice_slot_copies_size(const spice_expert_layer * host, int32_t n_layers, int32_t precision);

/* Make the copies of every MoE layer of `host` for `precision`, on up to
 * n_threads threads (<= 0: the cores this process may use). SPICE_OK, or a
 * status with the reason in err. Each expert matrix finished adds its bytes
 * to *progress (NULL: not counted), which another thread may read meanwhile;
 * at the end it holds spice_slot_copies_size. */
int spice_slot_copies_make(spice_slot_copies * sc, const spice_expert_layer * host, int32_t n_layers,
                           int32_t precision, int32_t n_threads, _Atomic uint64_t * progress, char * err,
                           size_t err_len);

/* The same copies read back from `path`, a file spice_slot_copies_write wrote
 * for this model: the caller's `model_key` names the model (pyspice: its
 * sidecar fingerprint), and the file must hold exactly the tensors, types and
 * sizes these copies take, made by this build's quantizers
 * (spice-slot-cache.h). Where it does not, nothing is kept and err says why:
 * the caller makes them instead. `seconds` is then the time reading took;
 * *progress counts the bytes read as make's counts those made. */
int spice_slot_copies_read(spice_slot_copies * sc, const spice_expert_layer * host, int32_t n_layers,
                           int32_t precision, const char * path, const char * model_key,
                           _Atomic uint64_t * progress, char * err, size_t err_len);

/* Write the copies sc holds to `path` for spice_slot_copies_read, under
 * `model_key`. SPICE_ERR_STATE where it holds none. */
int spice_slot_copies_write(const spice_slot_copies * sc, const char * path, const char * model_key, char * err,
                            size_t err_len);

void spice_slot_copies_free(spice_slot_copies * sc);

#endif /* SPICE_SLOT_COPIES_H */
