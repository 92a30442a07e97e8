/* Host actions on a tier whose host weights are not in memory (the disk
 * tier of edge mode): the experts a call runs on the host and the tier does
 * not hold are read for that call only, into the runtime's scratch, ahead
 * of every queued copy; the host executor then reads them there as it reads
 * resident experts from their slots. Also books the tier's reads into the
 * counters, and stops the decode with the tier's own message when a read
 * failed (its bytes are not there to run on: no output is made from them). */
#include "spice-runtime-host-read.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int host_weights_missing(const spice_runtime * rt) {
    spice_device * dev = rt->store != NULL ? spice_store_device(rt->store) : NULL;
    return dev != NULL && dev->iface->host_read != NULL;
}

static int reserve_scratch(spice_runtime * rt, size_t need) {
    if (rt->host_read.cap >= need) {
        return SPICE_OK;
    }
    void * p = NULL;
    if (posix_memalign(&p, 64, need) != 0) {
        return SPICE_ERR_NO_MEMORY;
    }
    free(rt->host_read.buf);
    rt->host_read.buf = (char *) p;
    rt->host_read.cap = need;
    return SPICE_OK;
}

int spice_runtime_read_host_experts(spice_runtime * rt, int32_t il, const spice_policy_call * call) {
    if (!host_weights_missing(rt)) {
        return SPICE_OK;
    }
    spice_device * dev = spice_store_device(rt->store);
    const int32_t n_e = rt->layers[il].n_expert;
    const int32_t n_used = call->n_expert_used;
    uint8_t * wanted = rt->host_read.wanted;
    memset(wanted, 0, (size_t) n_e);
    int32_t n = 0;
    for (int32_t t = 0; t < call->n_tokens; ++t) {
        const int32_t * ids = (const int32_t *) ((const char *) call->ids + (size_t) t * call->ids_nb1);
        for (int32_t k = 0; k < n_used; ++k) {
            const int32_t a = call->actions[t * n_used + k];
            const int32_t e = ids[k];
            /* device actions got a slot (or became host actions); host ones have none */
            if ((a == SPICE_ACTION_HOST || a == SPICE_ACTION_DEVICE) && e >= 0 && e < n_e &&
                rt->plan.device[e] == NULL && !wanted[e]) {
                wanted[e] = 1;
                rt->host_read.experts[n++] = e;
            }
        }
    }
    if (n > 0) {
        const size_t stride = (size_t) spice_store_slot_bytes(rt->store);
        if (reserve_scratch(rt, (size_t) n * stride) != SPICE_OK) {
            snprintf(rt->last_error, sizeof(rt->last_error),
                     "layer %d: out of memory for %d experts read for this call (%zu bytes)", il, n,
                     (size_t) n * stride);
            return SPICE_ERR_NO_MEMORY;
        }
        for (int32_t i = 0; i < n; ++i) {
            spice_store_expert_copy(rt->store, il, rt->host_read.experts[i], &rt->host_read.copies[i]);
            rt->host_read.dst[i] = rt->host_read.buf + (size_t) i * stride;
        }
        uint64_t waited = 0;
        const int status = dev->iface->host_read(dev, rt->host_read.copies, rt->host_read.dst, n, &waited);
        spice_counters * c = &rt->counters[il];
        c->scratch_reads += (uint64_t) n;
        c->scratch_ns += waited;
        if (status == SPICE_OK) {
            for (int32_t i = 0; i < n; ++i) {
                rt->plan.device[rt->host_read.experts[i]] = rt->host_read.dst[i];
            }
        }
    }
    spice_runtime_book_io(rt, il);
    const char * failure = dev->iface->last_error(dev);
    if (failure != NULL) {
        snprintf(rt->last_error, sizeof(rt->last_error), "layer %d: %s; generation stopped", il, failure);
        return SPICE_ERR_INTERNAL;
    }
    return SPICE_OK;
}

void spice_runtime_book_io(spice_runtime * rt, int32_t il) {
    spice_device * dev = rt->store != NULL ? spice_store_device(rt->store) : NULL;
    if (dev == NULL || dev->iface->io_totals == NULL) {
        return;
    }
    uint64_t bytes = 0, reads = 0;
    dev->iface->io_totals(dev, &bytes, &reads);
    if (il >= 0) {
        rt->counters[il].disk_read_bytes += bytes - rt->host_read.bytes_seen;
        rt->counters[il].disk_reads += reads - rt->host_read.reads_seen;
    }
    rt->host_read.bytes_seen = bytes;
    rt->host_read.reads_seen = reads;
}

int spice_runtime_host_read_init(spice_runtime * rt) {
    const size_t n = (size_t) (rt->max_n_expert > 0 ? rt->max_n_expert : 1);
    rt->host_read.wanted = (uint8_t *) calloc(n, 1);
    rt->host_read.experts = (int32_t *) calloc(n, sizeof(int32_t));
    rt->host_read.copies = (spice_device_copy *) calloc(n, sizeof(spice_device_copy));
    rt->host_read.dst = (char **) calloc(n, sizeof(char *));
    return rt->host_read.wanted && rt->host_read.experts && rt->host_read.copies && rt->host_read.dst
               ? SPICE_OK
               : SPICE_ERR_NO_MEMORY;
}

void spice_runtime_host_read_free(spice_runtime * rt) {
    free(rt->host_read.wanted);
    free(rt->host_read.experts);
    free(rt->host_read.copies);
    free(rt->host_read.dst);
    free(rt->host_read.buf);
    memset(&rt->host_read, 0, sizeof(rt->host_read));
}
