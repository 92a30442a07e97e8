/* The runtime's device tier: the store for a model (its device made by the
 * device type the parameters name, each layer laid out as that device
 * wants), page-locking the host weights where copies need it, preloading.
 * Plans are applied by the store itself (spice_store_apply_plan). */
#include "spice-runtime-internal.h"
#include "spice-runtime-host-read.h"

#include "gguf.h"
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Every host range copies read from (the routed-expert tensors, or their
 * low-precision copies), for the device to make fast to copy from (a CUDA
 * device page-locks them); returns the bytes it could not. */
static uint64_t prepare_host_weights(const spice_runtime * rt, spice_device * dev) {
    const void * data[3 * (rt->n_layers > 0 ? rt->n_layers : 1)];
    size_t size[3 * (rt->n_layers > 0 ? rt->n_layers : 1)];
    int32_t n = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        const spice_expert_layer * L = spice_runtime_slot_layer(rt, il);
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; L->is_moe && k < 3; ++k) {
            data[n] = mats[k]->tensor->data;
            size[n] = ggml_nbytes(mats[k]->tensor);
            n++;
        }
    }
    return dev->iface->host_prepare(dev, data, size, n);
}

/* A disk tier reads experts from the model file: where each layer's expert
 * tensors start in it, from the file's own header (gguf), checked against
 * the tensors llama.cpp made. */
static int bind_file_offsets(spice_runtime * rt, const char * path, spice_store_source * sources) {
    struct gguf_init_params gp = { /* .no_alloc = */ true, /* .ctx = */ NULL };
    struct gguf_context * g = path != NULL ? gguf_init_from_file(path, gp) : NULL;
    if (g == NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error), "a disk tier cannot read the GGUF header of %s",
                 path ? path : "(no path given)");
        return SPICE_ERR_INVALID_ARG;
    }
    int status = SPICE_OK;
    for (int32_t il = 0; il < rt->n_layers && status == SPICE_OK; ++il) {
        const spice_expert_layer * L = &rt->layers[il];
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; L->is_moe && k < 3 && status == SPICE_OK; ++k) {
            const struct ggml_tensor * t = mats[k]->tensor;
            const int64_t id = gguf_find_tensor(g, t->name);
            if (id < 0 || gguf_get_tensor_size(g, id) != ggml_nbytes(t)) {
                snprintf(rt->last_error, sizeof(rt->last_error),
                         "%s does not hold tensor %s as loaded (a split GGUF? a disk tier reads experts from "
                         "one file: merge it with llama-gguf-split --merge)", path, t->name);
                status = SPICE_ERR_INCOMPATIBLE;
                break;
            }
            sources[il].file_offset[k] = (uint64_t) (gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id));
        }
    }
    gguf_free(g);
    return status;
}

/* Whether SPICE_CUDA_VERIFY rules out copies of `precision` (said in last_error). */
static int verify_refuses(spice_runtime * rt, int32_t precision) {
    if (precision == SPICE_SLOT_EXACT || rt->verify == NULL) {
        return 0;
    }
    snprintf(rt->last_error, sizeof(rt->last_error),
             "SPICE_CUDA_VERIFY compares device rows with the exact host rows: it cannot check "
             "low-precision slots; unset it or use exact slots");
    return 1;
}

/* Copies of `precision` about to be made or read: none done of all their bytes. */
static void start_progress(spice_runtime * rt, int32_t precision) {
    atomic_store(&rt->copies_done, 0);
    atomic_store(&rt->copies_total, spice_slot_copies_size(rt->layers, rt->n_layers, precision));
}

/* The slots' expert copies for the tier's precision: made once, kept while
 * later tiers ask for the same precision. */
static int make_slot_copies(spice_runtime * rt, const spice_store_params * params) {
    const int32_t precision = params->slot_precision;
    if (precision != SPICE_SLOT_EXACT && params->device_kind == SPICE_DEVICE_DISK) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "low-precision slots are not supported on a disk tier (its slots hold the file's bytes); "
                 "use exact slots there");
        return SPICE_ERR_UNSUPPORTED;
    }
    if (verify_refuses(rt, precision)) {
        return SPICE_ERR_UNSUPPORTED;
    }
    if (precision == rt->slot_copies.precision) {
        return SPICE_OK;
    }
    spice_slot_copies_free(&rt->slot_copies);
    start_progress(rt, precision);
    return spice_slot_copies_make(&rt->slot_copies, rt->layers, rt->n_layers, precision, 0, &rt->copies_done,
                                  rt->last_error, sizeof(rt->last_error));
}

int spice_runtime_slot_copies(const spice_runtime * rt, int32_t * precision, uint64_t * bytes, double * seconds) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (precision) {
        *precision = rt->slot_copies.bytes > 0 ? rt->slot_copies.precision : SPICE_SLOT_EXACT;
    }
    if (bytes) {
        *bytes = rt->slot_copies.bytes;
    }
    if (seconds) {
        *seconds = rt->slot_copies.seconds;
    }
    return SPICE_OK;
}

int spice_runtime_slot_copies_load(spice_runtime * rt, int32_t precision, const char * path, const char * model_key) {
    if (rt == NULL || path == NULL || model_key == NULL || !spice_slot_precision_valid(precision)) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (rt->store != NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "slot copies are loaded before a device tier is set (its slots may read the copies held now): "
                 "remove the tier first");
        return SPICE_ERR_STATE;
    }
    if (verify_refuses(rt, precision)) {
        return SPICE_ERR_UNSUPPORTED;
    }
    spice_slot_copies_free(&rt->slot_copies);
    start_progress(rt, precision);
    return spice_slot_copies_read(&rt->slot_copies, rt->layers, rt->n_layers, precision, path, model_key,
                                  &rt->copies_done, rt->last_error, sizeof(rt->last_error));
}

int spice_runtime_slot_copies_save(spice_runtime * rt, const char * path, const char * model_key) {
    if (rt == NULL || path == NULL || model_key == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    return spice_slot_copies_write(&rt->slot_copies, path, model_key, rt->last_error, sizeof(rt->last_error));
}

int spice_runtime_slot_copies_progress(const spice_runtime * rt, uint64_t * done, uint64_t * total) {
    if (rt == NULL || done == NULL || total == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    *done = atomic_load(&rt->copies_done);
    *total = atomic_load(&rt->copies_total);
    return SPICE_OK;
}

int spice_runtime_slot_copies_size(const spice_runtime * rt, int32_t precision, uint64_t * bytes) {
    if (rt == NULL || bytes == NULL || !spice_slot_precision_valid(precision)) {
        return SPICE_ERR_INVALID_ARG;
    }
    *bytes = spice_slot_copies_size(rt->layers, rt->n_layers, precision);
    return SPICE_OK;
}

int spice_runtime_set_store(spice_runtime * rt, const spice_store_params * params) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_store_free(rt->store);
    rt->store = NULL;
    rt->resume_il = -1; /* a new tier: the policy decides the next call afresh */
    rt->clock_step_ns = 0; /* and runs on real time */
    rt->plan_rule = NULL; /* and it starts with the default rule */
    if (params == NULL) {
        return SPICE_OK;
    }
    int status = make_slot_copies(rt, params);
    if (status != SPICE_OK) {
        return status;
    }
    int32_t n_expert[rt->n_layers > 0 ? rt->n_layers : 1];
    uint64_t bytes[rt->n_layers > 0 ? rt->n_layers : 1];
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        n_expert[il] = rt->layers[il].is_moe ? rt->layers[il].n_expert : 0;
        bytes[il] = spice_runtime_slot_layer(rt, il)->bytes_per_expert;
    }
    spice_store * store = NULL;
    status = spice_device_type_of(params->device_kind) == NULL
                     ? SPICE_ERR_INVALID_ARG
                     : spice_store_create_unattached(params, rt->n_layers, n_expert, bytes, &store);
    if (status == SPICE_ERR_BUDGET) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "the device budget of %llu bytes is smaller than one slot (%llu bytes: the largest expert)",
                 (unsigned long long) params->budget_bytes,
                 (unsigned long long) spice_store_slot_bytes_for(rt->n_layers, n_expert, bytes));
    }
    if (status != SPICE_OK) {
        return status;
    }
    const spice_device_type * type = spice_device_type_of(params->device_kind);
    spice_store_source sources[rt->n_layers > 0 ? rt->n_layers : 1];
    memset(sources, 0, sizeof(sources));
    if (params->device_kind == SPICE_DEVICE_DISK && (status = bind_file_offsets(rt, params->path, sources)) != SPICE_OK) {
        spice_store_free(store);
        return status;
    }
    /* a pooled device: kind regions shared by every layer (spice-pool-layout.h) */
    const int pooled = type->uses_pool != NULL && type->uses_pool(params->executor);
    spice_pool_layout pool;
    const spice_expert_layer * slot_layers = spice_runtime_slot_layer(rt, 0); /* [n_layers] */
    if (pooled && (status = spice_pool_layout_make(slot_layers, rt->n_layers, spice_store_n_slots(store), &pool)) !=
                      SPICE_OK) {
        spice_store_free(store);
        return status;
    }
    size_t slot_stride = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        const spice_expert_layer * L = &slot_layers[il];
        if (!L->is_moe) {
            continue;
        }
        spice_store_source src = sources[il];
        const spice_expert_matrix * mats[3] = { &L->gate, &L->up, &L->down };
        for (int k = 0; k < 3; ++k) {
            src.base[k] = (const char *) mats[k]->tensor->data;
            src.stride[k] = mats[k]->tensor->nb[2];
            src.size[k] = mats[k]->tensor->nb[2];
        }
        if (pooled) {
            for (int k = 0; k < 3; ++k) {
                src.dst_offset[k] = pool.region[k];
                src.pad[k] = spice_pool_matrix_pad(mats[k]->type, mats[k]->n_cols);
            }
        } else {
            const size_t need = type->slot_layout(L, &src);
            slot_stride = need > slot_stride ? need : slot_stride;
        }
        if ((status = spice_store_bind(store, il, &src)) != SPICE_OK) {
            spice_store_free(store);
            return status;
        }
    }
    if (pooled) {
        slot_stride = pool.stride[0] + pool.stride[1] + pool.stride[2];
    }
    const spice_device_params dp = { params->bandwidth_gbps, params->latency_us, params->device_index,
                                     spice_store_n_slots(store), slot_stride, params->path, params->io_threads,
                                     params->io_fault_after, &rt->abort_requested, pooled ? &pool : NULL,
                                     params->executor };
    spice_device * dev = NULL;
    status = type->create(&dp, spice_store_clock(store), &dev, rt->last_error, sizeof(rt->last_error));
    if (status == SPICE_OK && (status = spice_store_attach_device(store, dev)) != SPICE_OK) {
        spice_device_free(dev);
    }
    if (status != SPICE_OK) {
        spice_store_free(store);
        return status;
    }
    const char * no_pin = getenv("SPICE_CUDA_NO_PIN"); /* diagnosis: copies from pageable memory */
    rt->unpinned_bytes = 0;
    if (dev->iface->host_prepare != NULL && !(no_pin != NULL && no_pin[0] == '1')) {
        rt->unpinned_bytes = prepare_host_weights(rt, dev);
        if (rt->unpinned_bytes > 0) {
            fprintf(stderr, "libspice: %llu bytes of expert weights could not be page-locked; "
                            "copies from them are slower (pageable)\n", (unsigned long long) rt->unpinned_bytes);
        }
    }
    /* loaded surrogates live on the device: a new tier holds them first */
    if (rt->surrogates.bytes > 0 && spice_store_reserve(store, (int64_t) rt->surrogates.bytes) != SPICE_OK) {
        snprintf(rt->last_error, sizeof(rt->last_error),
                 "the loaded surrogates need %llu device bytes; the budget is %llu (clear them or raise it)",
                 (unsigned long long) rt->surrogates.bytes, (unsigned long long) params->budget_bytes);
        spice_store_free(store);
        return SPICE_ERR_BUDGET;
    }
    rt->store = store;
    rt->exec_fault_after = params->exec_fault_after;
    rt->n_launches = rt->n_collects = 0;
    rt->host_read.bytes_seen = rt->host_read.reads_seen = 0; /* a new device's totals start at 0 */
    return SPICE_OK;
}

spice_store * spice_runtime_get_store(spice_runtime * rt) {
    return rt ? rt->store : NULL;
}

int spice_runtime_preload(spice_runtime * rt, int32_t * n_loaded) {
    if (rt == NULL || rt->store == NULL) {
        return SPICE_ERR_STATE;
    }
    int32_t n = 0;
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        for (int32_t e = 0; rt->layers[il].is_moe && e < rt->layers[il].n_expert; ++e) {
            if (spice_store_request(rt->store, il, e, SPICE_PRIORITY_DEMAND) != SPICE_OK) {
                goto done;
            }
            n++;
        }
    }
done:
    for (int32_t il = 0; il < rt->n_layers; ++il) {
        for (int32_t e = 0; rt->layers[il].is_moe && e < rt->layers[il].n_expert; ++e) {
            if (spice_store_state(rt->store, il, e) != SPICE_RES_ABSENT) {
                spice_store_wait(rt->store, il, e, NULL);
            }
        }
    }
    /* a preload is set-up, not service: it does not count as traffic or stalls */
    spice_store_reset_counters(rt->store);
    spice_runtime_book_io(rt, -1);
    if (n_loaded) {
        *n_loaded = n;
    }
    return SPICE_OK;
}

int spice_runtime_set_clock_step(spice_runtime * rt, uint64_t step_ns) {
    if (rt == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    if (rt->store == NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error), "a clock step moves a device tier's clock: give the "
                 "runtime a tier first");
        return SPICE_ERR_STATE;
    }
    const int status = spice_store_set_virtual_clock(rt->store, step_ns > 0);
    if (status != SPICE_OK) {
        snprintf(rt->last_error, sizeof(rt->last_error), "only an emulated tier's clock can be virtual: a real "
                 "device's copies take the time they take");
        return status;
    }
    rt->clock_step_ns = step_ns;
    return SPICE_OK;
}
