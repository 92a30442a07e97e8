/* Routing replay's step in a hook call (spice-runtime-replay.c), called by
 * the hook's snapshot (spice-runtime.c). */
#ifndef SPICE_RUNTIME_REPLAY_H
#define SPICE_RUNTIME_REPLAY_H

#include "spice-runtime-internal.h"

/* The first thing of a hook call's snapshot (thread 0, before anything reads
 * the ids): with a replay set, overwrite the call's id rows with the recorded
 * ones of its tokens and move the position on. */
void spice_runtime_replay_routing(spice_runtime * rt, const spice_hook_call * hc);

#endif /* SPICE_RUNTIME_REPLAY_H */
