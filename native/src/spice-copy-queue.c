/* The copier thread and its queue (see spice-copy-queue.h). */
#include "spice-copy-queue.h"

#include "spice.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct spice_copy_queue {
    spice_copy_issue_fn issue;
    void * ctx;

    pthread_mutex_t ring_mu;  /* the ring; held briefly */
    pthread_cond_t work;      /* a copy was queued, or stop */
    int32_t * slots;
    uint64_t * seqs;
    int32_t cap, head, count;
    int stop;

    pthread_mutex_t issue_mu; /* taking a copy off the ring and issuing it: one thread at a time */
    atomic_uint_fast64_t issued;
    atomic_int failed;

    pthread_t copier;
};

/* Take the oldest queued copy off the ring and issue it: 1 when one was
 * issued, 0 when the ring was empty. */
static int issue_one(spice_copy_queue * q) {
    pthread_mutex_lock(&q->issue_mu);
    pthread_mutex_lock(&q->ring_mu);
    if (q->count == 0) {
        pthread_mutex_unlock(&q->ring_mu);
        pthread_mutex_unlock(&q->issue_mu);
        return 0;
    }
    const int32_t slot = q->slots[q->head];
    const uint64_t seq = q->seqs[q->head];
    q->head = (q->head + 1) % q->cap;
    q->count--;
    pthread_mutex_unlock(&q->ring_mu);
    if (q->issue(q->ctx, slot) != 0) {
        atomic_store(&q->failed, 1);
    }
    atomic_store(&q->issued, seq); /* after the issue: a reader of `issued` may query its events */
    pthread_mutex_unlock(&q->issue_mu);
    return 1;
}

static void * copier_main(void * arg) {
    spice_copy_queue * q = (spice_copy_queue *) arg;
    for (;;) {
        pthread_mutex_lock(&q->ring_mu);
        while (q->count == 0 && !q->stop) {
            pthread_cond_wait(&q->work, &q->ring_mu);
        }
        const int done = q->count == 0 && q->stop;
        pthread_mutex_unlock(&q->ring_mu);
        if (done) {
            return NULL;
        }
        issue_one(q);
    }
}

/* Everything but the thread (stopped already, or never started). */
static void destroy(spice_copy_queue * q, int synced) {
    if (synced) {
        pthread_cond_destroy(&q->work);
        pthread_mutex_destroy(&q->issue_mu);
        pthread_mutex_destroy(&q->ring_mu);
    }
    free(q->slots);
    free(q->seqs);
    free(q);
}

int spice_copy_queue_create(int32_t cap, spice_copy_issue_fn issue, void * ctx, spice_copy_queue ** out) {
    *out = NULL;
    if (cap <= 0 || issue == NULL) {
        return SPICE_ERR_INVALID_ARG;
    }
    spice_copy_queue * q = (spice_copy_queue *) calloc(1, sizeof(*q));
    if (q == NULL) {
        return SPICE_ERR_NO_MEMORY;
    }
    q->slots = (int32_t *) calloc((size_t) cap, sizeof(int32_t));
    q->seqs = (uint64_t *) calloc((size_t) cap, sizeof(uint64_t));
    if (q->slots == NULL || q->seqs == NULL) {
        destroy(q, 0);
        return SPICE_ERR_NO_MEMORY;
    }
    q->issue = issue;
    q->ctx = ctx;
    q->cap = cap;
    atomic_init(&q->issued, 0);
    atomic_init(&q->failed, 0);
    pthread_mutex_init(&q->ring_mu, NULL);
    pthread_mutex_init(&q->issue_mu, NULL);
    pthread_cond_init(&q->work, NULL);
    if (pthread_create(&q->copier, NULL, copier_main, q) != 0) {
        destroy(q, 1);
        return SPICE_ERR_UNSUPPORTED;
    }
    *out = q;
    return SPICE_OK;
}

void spice_copy_queue_free(spice_copy_queue * q) {
    if (q == NULL) {
        return;
    }
    pthread_mutex_lock(&q->ring_mu);
    q->stop = 1;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->ring_mu);
    pthread_join(q->copier, NULL); /* it issues what is queued first */
    destroy(q, 1);
}

int spice_copy_queue_push(spice_copy_queue * q, int32_t slot, uint64_t seq) {
    pthread_mutex_lock(&q->ring_mu);
    if (q->count == q->cap) {
        pthread_mutex_unlock(&q->ring_mu);
        return SPICE_ERR_STATE;
    }
    const int32_t at = (q->head + q->count) % q->cap;
    q->slots[at] = slot;
    q->seqs[at] = seq;
    q->count++;
    pthread_cond_signal(&q->work); /* no system call unless the copier is parked */
    pthread_mutex_unlock(&q->ring_mu);
    return SPICE_OK;
}

uint64_t spice_copy_queue_issued(spice_copy_queue * q) {
    return (uint64_t) atomic_load(&q->issued);
}

int spice_copy_queue_issue_through(spice_copy_queue * q, uint64_t seq) {
    while ((uint64_t) atomic_load(&q->issued) < seq) {
        if (!issue_one(q) && (uint64_t) atomic_load(&q->issued) < seq) {
            return SPICE_ERR_INTERNAL; /* nothing queued, and seq not issued: it never was queued */
        }
    }
    return atomic_load(&q->failed) ? SPICE_ERR_INTERNAL : SPICE_OK;
}

int spice_copy_queue_failed(spice_copy_queue * q) {
    return atomic_load(&q->failed);
}
