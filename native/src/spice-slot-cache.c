/* The low-precision slot copies kept on disk between runs (spice-slot-cache.h). */
#define _GNU_SOURCE /* pread, pwrite */
#include "spice-slot-cache.h"

#include "spice.h"

#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KEY_PRECISION "spice.slot_copies.precision"
#define KEY_MODEL     "spice.slot_copies.model"
#define KEY_QUANTIZER "spice.slot_copies.quantizer"

/* Which quantizer made the copies: the same build reads back what it wrote;
 * another (a new llama.cpp pin) makes its own. */
static void quantizer_id(char * out, size_t len) {
    snprintf(out, len, "ggml %s %s", ggml_version(), ggml_commit());
}

static const char * str_key(const struct gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, id) : NULL;
}

/* Whether g's keys and tensors are the copies asked for; err names the first difference. */
static int matches(const struct gguf_context * g, const char * path, const char * model_key, int32_t precision,
                   struct ggml_tensor * const * tensors, int32_t n, char * err, size_t err_len) {
    const int64_t pid = gguf_find_key(g, KEY_PRECISION);
    if (pid < 0 || gguf_get_kv_type(g, pid) != GGUF_TYPE_INT32) {
        snprintf(err, err_len, "%s is not a file of slot copies (no %s)", path, KEY_PRECISION);
        return 0;
    }
    if (gguf_get_val_i32(g, pid) != precision) {
        snprintf(err, err_len, "%s holds copies for slot precision %d, not %d", path, gguf_get_val_i32(g, pid),
                 precision);
        return 0;
    }
    const char * model = str_key(g, KEY_MODEL);
    if (model == NULL || strcmp(model, model_key) != 0) {
        snprintf(err, err_len, "%s was made from another model (%s, this one is %s)", path,
                 model != NULL ? model : "none named", model_key);
        return 0;
    }
    char ours[256];
    quantizer_id(ours, sizeof(ours));
    const char * theirs = str_key(g, KEY_QUANTIZER);
    if (theirs == NULL || strcmp(theirs, ours) != 0) {
        snprintf(err, err_len, "%s was quantized by another build (%s, this one is %s)", path,
                 theirs != NULL ? theirs : "none named", ours);
        return 0;
    }
    if (gguf_get_n_tensors(g) != n) {
        snprintf(err, err_len, "%s holds %lld copied matrices where this model's take %d", path,
                 (long long) gguf_get_n_tensors(g), n);
        return 0;
    }
    for (int32_t i = 0; i < n; ++i) {
        const int64_t id = gguf_find_tensor(g, tensors[i]->name);
        if (id < 0 || gguf_get_tensor_type(g, id) != tensors[i]->type ||
            gguf_get_tensor_size(g, id) != ggml_nbytes(tensors[i])) {
            snprintf(err, err_len, "%s has no %s of type %s and %zu bytes", path, tensors[i]->name,
                     ggml_type_name(tensors[i]->type), ggml_nbytes(tensors[i]));
            return 0;
        }
    }
    return 1;
}

/* All `len` bytes at `offset`, through short reads; 0 on an error or end of file. */
static int read_fully(int fd, void * dst, size_t len, uint64_t offset) {
    char * p = (char *) dst;
    while (len > 0) {
        const ssize_t got = pread(fd, p, len, (off_t) offset);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            return 0;
        }
        p += got;
        len -= (size_t) got;
        offset += (uint64_t) got;
    }
    return 1;
}

static int write_fully(int fd, const void * src, size_t len, uint64_t offset) {
    const char * p = (const char *) src;
    while (len > 0) {
        const ssize_t put = pwrite(fd, p, len, (off_t) offset);
        if (put < 0 && errno == EINTR) {
            continue;
        }
        if (put <= 0) {
            return 0;
        }
        p += put;
        len -= (size_t) put;
        offset += (uint64_t) put;
    }
    return 1;
}

int spice_slot_cache_read(const char * path, const char * model_key, int32_t precision,
                          struct ggml_tensor * const * tensors, int32_t n, _Atomic uint64_t * progress, char * err,
                          size_t err_len) {
    if (path == NULL || model_key == NULL || (n > 0 && tensors == NULL)) {
        snprintf(err, err_len, "reading slot copies needs a path and a model key");
        return SPICE_ERR_INVALID_ARG;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, err_len, "cannot read slot copies from %s: %s", path, strerror(errno));
        return SPICE_ERR_INVALID_ARG;
    }
    struct gguf_init_params gp = { /* .no_alloc = */ true, /* .ctx = */ NULL };
    struct gguf_context * g = gguf_init_from_file(path, gp);
    if (g == NULL) {
        snprintf(err, err_len, "%s is not a readable GGUF of slot copies (truncated or damaged?)", path);
        return SPICE_ERR_INVALID_ARG;
    }
    int status = matches(g, path, model_key, precision, tensors, n, err, err_len) ? SPICE_OK : SPICE_ERR_INVALID_ARG;
    const int fd = status == SPICE_OK ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (status == SPICE_OK && fd < 0) {
        snprintf(err, err_len, "cannot open %s: %s", path, strerror(errno));
        status = SPICE_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < n && status == SPICE_OK; ++i) {
        const int64_t id = gguf_find_tensor(g, tensors[i]->name);
        const uint64_t at = (uint64_t) gguf_get_data_offset(g) + (uint64_t) gguf_get_tensor_offset(g, id);
        const size_t len = ggml_nbytes(tensors[i]);
        if (at + len > (uint64_t) st.st_size || !read_fully(fd, tensors[i]->data, len, at)) {
            snprintf(err, err_len, "%s ends before %s's bytes (truncated?)", path, tensors[i]->name);
            status = SPICE_ERR_INVALID_ARG;
        } else if (progress != NULL) {
            atomic_fetch_add_explicit(progress, (uint64_t) len, memory_order_relaxed);
        }
    }
    if (fd >= 0) {
        close(fd);
    }
    gguf_free(g);
    return status;
}

int spice_slot_cache_write(const char * path, const char * model_key, int32_t precision,
                           struct ggml_context * ctx, char * err, size_t err_len) {
    if (path == NULL || model_key == NULL || ctx == NULL) {
        snprintf(err, err_len, "saving slot copies needs a path, a model key and the copies");
        return SPICE_ERR_INVALID_ARG;
    }
    struct gguf_context * g = gguf_init_empty();
    char tmp[4096];
    if (g == NULL || snprintf(tmp, sizeof(tmp), "%s.tmp-%ld", path, (long) getpid()) >= (int) sizeof(tmp)) {
        snprintf(err, err_len, "cannot save slot copies to %s (out of memory or path too long)", path);
        gguf_free(g);
        return SPICE_ERR_INVALID_ARG;
    }
    char quantizer[256];
    quantizer_id(quantizer, sizeof(quantizer));
    gguf_set_val_i32(g, KEY_PRECISION, precision);
    gguf_set_val_str(g, KEY_MODEL, model_key);
    gguf_set_val_str(g, KEY_QUANTIZER, quantizer);
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        gguf_add_tensor(g, t);
    }
    const size_t meta_size = gguf_get_meta_size(g);
    void * meta = malloc(meta_size);
    int fd = -1, failed = meta == NULL ? ENOMEM : 0; /* the errno of the first step that failed */
    if (!failed && (fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        failed = errno;
    }
    if (!failed) {
        gguf_get_meta_data(g, meta);
        failed = write_fully(fd, meta, meta_size, 0) ? 0 : errno;
    }
    /* each tensor at its offset in the data section; the alignment padding between is a hole, read as zeros */
    uint64_t end = meta_size;
    for (int64_t i = 0; !failed && i < gguf_get_n_tensors(g); ++i) {
        const struct ggml_tensor * t = ggml_get_tensor(ctx, gguf_get_tensor_name(g, i));
        const uint64_t at = (uint64_t) meta_size + (uint64_t) gguf_get_tensor_offset(g, i);
        failed = t != NULL && write_fully(fd, t->data, ggml_nbytes(t), at) ? 0 : (errno != 0 ? errno : EIO);
        end = at + (t != NULL ? ggml_nbytes(t) : 0);
    }
    if (!failed && (ftruncate(fd, (off_t) end) != 0 || fsync(fd) != 0)) {
        failed = errno;
    }
    if (fd >= 0 && close(fd) != 0 && !failed) {
        failed = errno;
    }
    if (!failed && rename(tmp, path) != 0) {
        failed = errno;
    }
    if (failed) {
        snprintf(err, err_len, "cannot save slot copies to %s: %s", path, strerror(failed));
        if (fd >= 0) {
            unlink(tmp);
        }
    }
    free(meta);
    gguf_free(g);
    return failed ? SPICE_ERR_INVALID_ARG : SPICE_OK;
}
