/* What the hook's file (spice-runtime.c) offers the runtime's feature files
 * (spice-runtime-async.c, spice-runtime-surrogates.c). They call it; it calls
 * none of them by name (spice-runtime-internal.h). */
#ifndef SPICE_RUNTIME_CORE_H
#define SPICE_RUNTIME_CORE_H

#include "spice-runtime-internal.h"

/* Registers the hook again when what it must ask llama.cpp for changed
 * (surrogates loaded or cleared); a no-op while it is not registered. */
void spice_runtime_update_hook(spice_runtime * rt);

/* A plan's rule (call->rule), installed unless it is the one installed last. */
void spice_runtime_take_plan_rule(spice_runtime * rt, const spice_policy_call * call);

/* What a plan is checked against (spice_plan_check): the model's layers and
 * the surrogates loaded now. */
spice_plan_limits spice_runtime_plan_limits(const spice_runtime * rt);

#endif /* SPICE_RUNTIME_CORE_H */
