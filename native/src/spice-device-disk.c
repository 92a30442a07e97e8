/* The disk device (edge mode): routed experts stay in the model file and
 * slots are RAM. A copy is a real read of the expert's three matrices from
 * the file, O_DIRECT where the file system allows it (the page cache then
 * holds nothing the budget does not count): each read is widened to the
 * alignment, lands in a reader thread's aligned bounce buffer and is copied
 * into the slot (the widened bytes are counted as read). Reads run on a
 * small pool of reader threads with their own queue, demand first; the
 * store's queue in front of it keeps the prefetch bound and cancellation.
 *
 * The device does not compute: the host executor reads resident experts
 * from slot memory. Host weights are not in memory either, so a host action
 * on an absent expert first reads it into the caller's scratch (host_read),
 * ahead of every queued copy.
 *
 * Time: on a real clock a copy lands when its read is done (the end it
 * reports is an estimate from the configured bandwidth and latency, for
 * policies' ready_at). On a manual clock (the copy-engine property tests)
 * the read still happens, and a copy lands once it is done AND the virtual
 * serial timeline of the emulated device says so, so the same tests hold.
 *
 * A failed read (I/O error, the file truncated after load, the test-only
 * fault hook) never lands: polls leave it in flight, waits fail, and
 * last_error names the file and the cause. */
#define _GNU_SOURCE /* O_DIRECT */
#include "spice-device.h"
#include "spice.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define DISK_ALIGN 4096       /* O_DIRECT alignment: offsets, lengths and buffers */

enum { REQ_IDLE = 0, REQ_QUEUED, REQ_RUNNING, REQ_DONE, REQ_FAILED };

typedef struct disk_req {
    spice_device_copy copy;
    char * dst;               /* slot memory or a host_read buffer */
    uint64_t seq;             /* arrival order within a priority */
    int state;                /* REQ_*, under the device's mutex */
    uint64_t read_start_ns, read_end_ns; /* real, monotonic */
    uint64_t start_ns, end_ns;           /* as reported: the timeline (manual clock) or the estimate */
} disk_req;

typedef struct disk {
    spice_clock * clock;
    double bandwidth_gbps, latency_us;
    char path[512];
    int fd;
    int direct;               /* O_DIRECT in effect */
    int32_t n_slots;
    size_t slot_stride;
    char * pool;              /* n_slots * slot_stride bytes, mapped lazily */
    size_t pool_size;
    disk_req * slots;         /* [n_slots] */
    disk_req * host;          /* [cap_host] for host_read */
    int32_t cap_host;
    uint64_t bus_free_ns;     /* the timeline / estimate: when the reads handed over so far are done */

    pthread_mutex_t mu;
    pthread_cond_t work;      /* a request was queued, or stop */
    pthread_cond_t done;      /* a request finished */
    disk_req ** queue;        /* queued requests, unordered; [n_slots + cap_host] */
    int32_t n_queue, cap_queue;
    uint64_t seq;
    int32_t n_inflight;       /* slot copies queued or running */
    pthread_t * threads;
    int32_t n_threads;
    int stop;

    uint64_t bytes_read, reads; /* under mu */
    int64_t fault_after;      /* set once at create */
    atomic_llong n_read_calls; /* counted only with a fault hook */
    int failed;
    char error[1024];
} disk;

static disk * ctx_of(spice_device * dev) {
    return (disk *) dev->context;
}

static size_t align_down(uint64_t x) {
    return (size_t) (x & ~(uint64_t) (DISK_ALIGN - 1));
}

static size_t align_up(uint64_t x) {
    return (size_t) ((x + DISK_ALIGN - 1) & ~(uint64_t) (DISK_ALIGN - 1));
}

/* ---- reading ------------------------------------------------------------------- */

typedef struct reader_buf {
    char * data;
    size_t cap;
} reader_buf;

static int reserve(reader_buf * b, size_t n) {
    if (b->cap >= n) {
        return 1;
    }
    void * p = NULL;
    if (posix_memalign(&p, DISK_ALIGN, n) != 0) {
        return 0;
    }
    free(b->data);
    b->data = (char *) p;
    b->cap = n;
    return 1;
}

/* One pread loop over [off, off + n); returns bytes read, or -errno. Short
 * only at the end of the file. */
static int64_t read_all(disk * d, char * dst, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        if (d->fault_after > 0 && atomic_fetch_add(&d->n_read_calls, 1) + 1 > d->fault_after) {
            return -EIO; /* the test-only fault hook */
        }
        const ssize_t r = pread(d->fd, dst + got, n - got, (off_t) (off + got));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (r == 0) {
            break;
        }
        got += (size_t) r;
    }
    return (int64_t) got;
}

static void fail(disk * d, const char * fmt, uint64_t off, size_t len, int err) {
    pthread_mutex_lock(&d->mu);
    if (!d->failed) {
        d->failed = 1;
        snprintf(d->error, sizeof(d->error), fmt, d->path, (unsigned long long) off, (unsigned long long) len,
                 err ? strerror(err) : "");
    }
    pthread_mutex_unlock(&d->mu);
}

/* A read of [off, off + len) that returned `got` (-errno, or short of the end). */
static void read_failed(disk * d, int64_t got, uint64_t off, size_t len) {
    if (got < 0) {
        fail(d, "reading %s at %llu (+%llu bytes): %s", off, len, (int) -got);
    } else {
        fail(d, "reading %s at %llu (+%llu bytes): the file ends early (truncated after load?)%s", off, len, 0);
    }
}

/* The copy's matrices into r->dst at their packed offsets. 0 on failure. */
static int read_copy(disk * d, disk_req * r, reader_buf * buf, uint64_t * bytes, uint64_t * reads) {
    for (int k = 0; k < 3; ++k) {
        const size_t len = r->copy.size[k];
        if (len == 0) {
            continue;
        }
        const uint64_t off = r->copy.file_offset[k];
        char * dst = r->dst + r->copy.dst_offset[k];
        if (!d->direct) {
            const int64_t got = read_all(d, dst, len, off);
            *reads += 1;
            if (got < 0 || (size_t) got < len) {
                read_failed(d, got, off, len);
                return 0;
            }
            *bytes += len;
            continue;
        }
        const size_t a0 = align_down(off), a1 = align_up(off + len);
        if (!reserve(buf, a1 - a0)) {
            fail(d, "reading %s at %llu (+%llu bytes): %s", off, len, ENOMEM);
            return 0;
        }
        const int64_t got = read_all(d, buf->data, a1 - a0, a0);
        *reads += 1;
        if (got < 0 || (uint64_t) a0 + (uint64_t) got < off + len) {
            read_failed(d, got, off, len);
            return 0;
        }
        *bytes += (uint64_t) got;
        memcpy(dst, buf->data + (off - a0), len);
    }
    return 1;
}

/* Next request: demand first, then arrival order. Under mu. */
static disk_req * take_next(disk * d) {
    int32_t best = -1;
    for (int32_t i = 0; i < d->n_queue; ++i) {
        const disk_req * q = d->queue[i];
        if (best < 0 || q->copy.priority > d->queue[best]->copy.priority ||
            (q->copy.priority == d->queue[best]->copy.priority && q->seq < d->queue[best]->seq)) {
            best = i;
        }
    }
    if (best < 0) {
        return NULL;
    }
    disk_req * r = d->queue[best];
    d->queue[best] = d->queue[--d->n_queue];
    return r;
}

static void * reader_main(void * arg) {
    disk * d = (disk *) arg;
    reader_buf buf = { NULL, 0 };
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->stop && d->n_queue == 0) {
            pthread_cond_wait(&d->work, &d->mu);
        }
        if (d->stop) {
            break;
        }
        disk_req * r = take_next(d);
        r->state = REQ_RUNNING;
        pthread_mutex_unlock(&d->mu);

        uint64_t bytes = 0, reads = 0;
        const uint64_t t0 = spice_monotonic_ns();
        const int ok = read_copy(d, r, &buf, &bytes, &reads);
        const uint64_t t1 = spice_monotonic_ns();

        pthread_mutex_lock(&d->mu);
        r->read_start_ns = t0;
        r->read_end_ns = t1;
        r->state = ok ? REQ_DONE : REQ_FAILED;
        d->bytes_read += bytes;
        d->reads += reads;
        pthread_cond_broadcast(&d->done);
    }
    pthread_mutex_unlock(&d->mu);
    free(buf.data);
    return NULL;
}

/* Queue r (mu held). */
static void enqueue(disk * d, disk_req * r) {
    r->state = REQ_QUEUED;
    r->seq = d->seq++;
    d->queue[d->n_queue++] = r;
    pthread_cond_signal(&d->work);
}

/* ---- the interface ------------------------------------------------------------- */

static void disk_free(spice_device * dev) {
    disk * d = ctx_of(dev);
    pthread_mutex_lock(&d->mu);
    d->stop = 1;
    pthread_cond_broadcast(&d->work);
    pthread_mutex_unlock(&d->mu);
    for (int32_t i = 0; i < d->n_threads; ++i) {
        pthread_join(d->threads[i], NULL);
    }
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->work);
    pthread_cond_destroy(&d->done);
    if (d->pool != NULL) {
        munmap(d->pool, d->pool_size);
    }
    if (d->fd >= 0) {
        close(d->fd);
    }
    free(d->threads);
    free(d->queue);
    free(d->slots);
    free(d->host);
    free(d);
    free(dev);
}

static const char * disk_slot_data(spice_device * dev, int32_t slot) {
    disk * d = ctx_of(dev);
    return d->slots[slot].state == REQ_DONE ? d->slots[slot].dst : NULL;
}

static int disk_slot_read(spice_device * dev, int32_t slot, size_t offset, void * dst, size_t n) {
    disk * d = ctx_of(dev);
    if (offset + n > d->slot_stride) {
        return SPICE_ERR_INVALID_ARG;
    }
    memcpy(dst, d->pool + (size_t) slot * d->slot_stride + offset, n);
    return SPICE_OK;
}

static int disk_can_start(spice_device * dev, uint64_t now, int32_t n_in_flight) {
    disk * d = ctx_of(dev);
    if (d->clock->manual) {
        return d->bus_free_ns <= now; /* the virtual serial timeline */
    }
    /* keep every reader busy and one read queued behind each: demand copies
     * handed over later still go first inside the device's queue */
    return n_in_flight < 2 * d->n_threads;
}

static int disk_issue(spice_device * dev, int32_t slot, const spice_device_copy * copy, uint64_t not_before,
                      uint64_t * start_ns, uint64_t * end_ns) {
    disk * d = ctx_of(dev);
    disk_req * r = &d->slots[slot];
    const uint64_t now = spice_clock_now(d->clock);
    const uint64_t occupancy = (uint64_t) ((double) copy->bytes / d->bandwidth_gbps);
    const uint64_t from = d->clock->manual ? not_before : now;
    r->start_ns = d->bus_free_ns > from ? d->bus_free_ns : from;
    r->end_ns = r->start_ns + (uint64_t) (d->latency_us * 1e3) + occupancy;
    /* manual: serial, like the emulated bus; real: reads overlap their latency */
    d->bus_free_ns = d->clock->manual ? r->end_ns : r->start_ns + occupancy;
    r->copy = *copy;
    r->dst = d->pool + (size_t) slot * d->slot_stride;
    pthread_mutex_lock(&d->mu);
    enqueue(d, r);
    pthread_mutex_unlock(&d->mu);
    *start_ns = r->start_ns;
    *end_ns = r->end_ns;
    return SPICE_OK;
}

static int disk_poll(spice_device * dev, uint64_t now, const int32_t * slots, int32_t n, uint8_t * landed) {
    disk * d = ctx_of(dev);
    pthread_mutex_lock(&d->mu);
    for (int32_t i = 0; i < n; ++i) {
        const disk_req * r = &d->slots[slots[i]];
        landed[i] = r->state == REQ_DONE && (!d->clock->manual || r->end_ns <= now);
    }
    const int failed = d->failed;
    pthread_mutex_unlock(&d->mu);
    return failed ? SPICE_ERR_INTERNAL : SPICE_OK;
}

/* Block until r is done or failed (mu held). */
static int wait_req(disk * d, disk_req * r) {
    while (r->state == REQ_QUEUED || r->state == REQ_RUNNING) {
        pthread_cond_wait(&d->done, &d->mu);
    }
    return r->state == REQ_DONE;
}

static int disk_wait(spice_device * dev, int32_t slot, uint64_t * stall_ns) {
    disk * d = ctx_of(dev);
    disk_req * r = &d->slots[slot];
    const uint64_t t0 = spice_clock_now(d->clock);
    pthread_mutex_lock(&d->mu);
    const int ok = wait_req(d, r);
    pthread_mutex_unlock(&d->mu);
    if (!ok) {
        *stall_ns = 0;
        return SPICE_ERR_INTERNAL;
    }
    if (d->clock->manual) {
        spice_clock_sleep_until(d->clock, r->end_ns);
    }
    const uint64_t t1 = spice_clock_now(d->clock);
    *stall_ns = t1 > t0 ? t1 - t0 : 0;
    return SPICE_OK;
}

static uint64_t disk_copy_ns(spice_device * dev, int32_t slot) {
    const disk * d = ctx_of(dev);
    const disk_req * r = &d->slots[slot];
    return d->clock->manual ? r->end_ns - r->start_ns : r->read_end_ns - r->read_start_ns;
}

static int disk_host_read(spice_device * dev, const spice_device_copy * copies, char * const * dst, int32_t n,
                          uint64_t * wait_ns) {
    disk * d = ctx_of(dev);
    if (n > d->cap_host) {
        return SPICE_ERR_INVALID_ARG; /* more than one layer's experts */
    }
    const uint64_t t0 = spice_monotonic_ns();
    int ok = 1;
    pthread_mutex_lock(&d->mu);
    for (int32_t i = 0; i < n; ++i) {
        disk_req * r = &d->host[i];
        r->copy = copies[i];
        r->copy.priority = SPICE_PRIORITY_DEMAND + 1; /* ahead of every copy into a slot */
        r->dst = dst[i];
        enqueue(d, r);
    }
    for (int32_t i = 0; i < n; ++i) {
        ok &= wait_req(d, &d->host[i]);
    }
    pthread_mutex_unlock(&d->mu);
    if (wait_ns) {
        *wait_ns = spice_monotonic_ns() - t0;
    }
    return ok ? SPICE_OK : SPICE_ERR_INTERNAL;
}

static void disk_io_totals(spice_device * dev, uint64_t * bytes, uint64_t * reads) {
    disk * d = ctx_of(dev);
    pthread_mutex_lock(&d->mu);
    *bytes = d->bytes_read;
    *reads = d->reads;
    pthread_mutex_unlock(&d->mu);
}

static const char * disk_last_error(spice_device * dev) {
    disk * d = ctx_of(dev);
    pthread_mutex_lock(&d->mu);
    const int failed = d->failed;
    pthread_mutex_unlock(&d->mu);
    return failed ? d->error : NULL; /* written once, before failed is set */
}

static const spice_device_i disk_iface = {
    /* .name           = */ "disk",
    /* .free           = */ disk_free,
    /* .slot_data      = */ disk_slot_data,
    /* .slot_read      = */ disk_slot_read,
    /* .copy_can_start = */ disk_can_start,
    /* .copy_issue     = */ disk_issue,
    /* .copy_poll      = */ disk_poll,
    /* .copy_wait      = */ disk_wait,
    /* .copy_ns        = */ disk_copy_ns,
    /* .exec_begin     = */ NULL,
    /* .exec_end       = */ NULL,
    /* .exec_supports  = */ NULL,
    /* .host_prepare   = */ NULL,
    /* .host_read      = */ disk_host_read,
    /* .io_totals      = */ disk_io_totals,
    /* .last_error     = */ disk_last_error,
};

static void write_err(char * err, size_t err_len, const char * msg, const char * path, int e) {
    if (err && err_len) {
        snprintf(err, err_len, msg, path, strerror(e));
    }
}

static int disk_create(const spice_device_params * p, spice_clock * clock, spice_device ** out, char * err,
                       size_t err_len) {
    *out = NULL;
    if (p->path == NULL || p->path[0] == '\0') {
        if (err && err_len) {
            snprintf(err, err_len, "a disk tier needs the file its experts are read from (path)");
        }
        return SPICE_ERR_INVALID_ARG;
    }
    spice_device * dev = (spice_device *) calloc(1, sizeof(*dev));
    disk * d = (disk *) calloc(1, sizeof(*d));
    if (dev == NULL || d == NULL) {
        free(dev);
        free(d);
        return SPICE_ERR_NO_MEMORY;
    }
    d->fd = -1;
    d->clock = clock;
    d->bandwidth_gbps = p->bandwidth_gbps;
    d->latency_us = p->latency_us;
    d->fault_after = p->io_fault_after;
    atomic_init(&d->n_read_calls, 0);
    snprintf(d->path, sizeof(d->path), "%s", p->path);
    d->n_slots = p->n_slots;
    d->slot_stride = p->slot_stride;
    d->n_threads = p->io_threads > 0 ? p->io_threads : SPICE_DISK_THREADS_DEFAULT;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->work, NULL);
    pthread_cond_init(&d->done, NULL);
    dev->iface = &disk_iface;
    dev->context = d;

    d->fd = open(p->path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    d->direct = d->fd >= 0;
    if (d->fd < 0 && errno == EINVAL) {
        /* the file system has no direct I/O (tmpfs, some overlays): read through the page cache */
        d->fd = open(p->path, O_RDONLY | O_CLOEXEC);
    }
    if (d->fd < 0) {
        write_err(err, err_len, "cannot open %s for reading experts: %s", p->path, errno);
        disk_free(dev);
        return SPICE_ERR_INVALID_ARG;
    }
    /* slot memory: mapped, not touched, so a budget costs RSS only as it fills */
    d->pool_size = (size_t) (d->n_slots > 0 ? d->n_slots : 1) * (d->slot_stride > 0 ? d->slot_stride : 1);
    void * pool = mmap(NULL, d->pool_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    d->cap_host = 1024;
    d->cap_queue = d->n_slots + d->cap_host;
    d->slots = (disk_req *) calloc((size_t) (d->n_slots > 0 ? d->n_slots : 1), sizeof(disk_req));
    d->host = (disk_req *) calloc((size_t) d->cap_host, sizeof(disk_req));
    d->queue = (disk_req **) calloc((size_t) d->cap_queue, sizeof(disk_req *));
    d->threads = (pthread_t *) calloc((size_t) d->n_threads, sizeof(pthread_t));
    d->pool = pool == MAP_FAILED ? NULL : (char *) pool;
    if (d->pool == NULL || d->slots == NULL || d->host == NULL || d->queue == NULL || d->threads == NULL) {
        if (err && err_len) {
            snprintf(err, err_len, "out of memory for a RAM slot pool of %d slots x %zu bytes", d->n_slots,
                     d->slot_stride);
        }
        d->n_threads = 0;
        disk_free(dev);
        return SPICE_ERR_NO_MEMORY;
    }
    const int32_t want = d->n_threads;
    d->n_threads = 0;
    for (int32_t i = 0; i < want; ++i) {
        if (pthread_create(&d->threads[i], NULL, reader_main, d) != 0) {
            break;
        }
        d->n_threads++;
    }
    if (d->n_threads == 0) {
        if (err && err_len) {
            snprintf(err, err_len, "cannot start a reader thread for %s", p->path);
        }
        disk_free(dev);
        return SPICE_ERR_NO_MEMORY;
    }
    *out = dev;
    return SPICE_OK;
}

const spice_device_type spice_device_type_disk = {
    /* .name        = */ "disk",
    /* .slot_layout = */ spice_device_packed_layout,
    /* .uses_pool   = */ NULL,
    /* .create      = */ disk_create,
};
