/* The expert store's entry points for the rest of libspice (the public ones
 * are in spice.h). The store's struct is private to its own files
 * (spice-store-impl.h): the runtime talks to it only through functions. */
#ifndef SPICE_STORE_H
#define SPICE_STORE_H

#include "spice.h"
#include "spice-device.h"

#include <stdint.h>

/* A store without a device; spice_store_attach_device gives it one after
 * its layers are bound (a device's slot size depends on their layout). */
int spice_store_create_unattached(const spice_store_params * params, int32_t n_layers, const int32_t * n_expert,
                                  const uint64_t * expert_bytes, spice_store ** out);

/* A slot's bytes for these layers: the largest expert of an MoE layer (0:
 * none). Every slot is this size and every expert held takes this much of
 * the budget (spice_store_create in spice.h). */
uint64_t spice_store_slot_bytes_for(int32_t n_layers, const int32_t * n_expert, const uint64_t * expert_bytes);

/* Bind a layer's host weights and slot layout so copies move real bytes. */
int spice_store_bind(spice_store * store, int32_t il, const spice_store_source * source);

/* The store takes ownership of dev. SPICE_ERR_STATE if it has one. */
int spice_store_attach_device(spice_store * store, spice_device * dev);

/* 1 when the installed rule prefetches by the next layer's router: the
 * runtime then asks llama.cpp for those logits (SPICE_HOOK_WANT_NEXT_LOGITS). */
int spice_store_rule_prefetches_next(const spice_store * store);

/* The residency table's row versions ([n_layers]; each state change of a layer
 * bumps its row's) and the store's epoch (spice-row-snapshot.h); NULL without a store. */
const uint32_t * spice_store_row_versions(const spice_store * store, uint64_t * epoch);

/* The store's device (NULL: none attached) and clock. */
spice_device * spice_store_device(spice_store * store);
spice_clock * spice_store_clock(spice_store * store);

/* Slot memory of a resident expert, or NULL (not resident, nothing bound, or
 * no memory: then the host executor reads the host weights instead). */
const char * spice_store_slot_data(spice_store * store, int32_t il, int32_t e);
/* spice_store_apply_plan without its waits: every device action whose
 * expert got a slot stays a device action, its copy possibly still queued
 * or on the bus. The caller waits for those experts (spice_store_wait)
 * before the device computes them, with no store operation in between
 * (nothing is pinned any more). For devices that compute: the waits then
 * overlap the host executor's work. */
int spice_store_apply_plan_nowait(spice_store * store, const spice_policy_call * call);
/* The slot of a resident (il, e) whose copy has landed, or -1. */
int32_t spice_store_slot_index(const spice_store * store, int32_t il, int32_t e);
/* The copy that would bring expert (il, e) in: its sources, sizes and
 * packed slot layout, demand priority (for reads outside the queue). */
void spice_store_expert_copy(const spice_store * store, int32_t il, int32_t e, spice_device_copy * copy);

/* Forget every counter (a preload is set-up, not service). */
void spice_store_reset_counters(spice_store * store);

#endif /* SPICE_STORE_H */
