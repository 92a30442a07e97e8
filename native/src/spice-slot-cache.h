/* The low-precision slot copies kept on disk between runs.
 *
 * Why: making them re-quantizes every routed expert (IQ4_NL searches its
 * scales), about 5 MiB/s on two cores: 164 s for the 858 MiB of a 3-MoE-layer
 * DeepSeek-V2-Lite slice, so tens of minutes for a whole model at every start.
 * Reading them back runs at the disk's speed.
 *
 * The file is a GGUF (gguf-dump reads it): one tensor per copied matrix, named
 * after its source with ".slot" appended, and three keys --
 *   spice.slot_copies.precision  i32  the spice_slot_precision they were made for
 *   spice.slot_copies.model      str  the caller's name for the model they were made from
 *   spice.slot_copies.quantizer  str  ggml's version and commit that quantized them
 * A file is used only where all three match and every tensor the copies take
 * is there with the same type and size; the quantizer key makes a rebuilt
 * llama.cpp make its own copies rather than read another's. */
#ifndef SPICE_SLOT_CACHE_H
#define SPICE_SLOT_CACHE_H

#include "ggml.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Fill the n tensors (allocated, in host memory) from `path`, adding each
 * tensor's bytes to *progress (NULL: not counted) once read. SPICE_OK, or
 * SPICE_ERR_INVALID_ARG where the file is missing, unreadable, truncated or
 * for other copies (err says which); tensors may then hold partial bytes. */
int spice_slot_cache_read(const char * path, const char * model_key, int32_t precision,
                          struct ggml_tensor * const * tensors, int32_t n, _Atomic uint64_t * progress, char * err,
                          size_t err_len);

/* Write every tensor of ctx (allocated) to `path` with the keys above. The
 * file appears whole or not at all: it is written beside `path` under a
 * temporary name and renamed. SPICE_ERR_INVALID_ARG (err: why) where it
 * cannot be written. */
int spice_slot_cache_write(const char * path, const char * model_key, int32_t precision,
                           struct ggml_context * ctx, char * err, size_t err_len);

#endif /* SPICE_SLOT_CACHE_H */
