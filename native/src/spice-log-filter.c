/* llama.cpp's log without its debug lines (spice-log-filter.h). */
#include "spice-log-filter.h"

#include "ggml.h"
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void drop_debug(enum ggml_log_level level, const char * text, void * user_data) {
    spice_log_filter * f = (spice_log_filter *) user_data;
    /* a passing filter (released, or buried under a callback) only hands lines on */
    if (!atomic_load(&f->passing) &&
        (level == GGML_LOG_LEVEL_DEBUG || (level == GGML_LOG_LEVEL_CONT && atomic_load(&f->dropping)))) {
        atomic_store(&f->dropping, 1);
        return;
    }
    if (level != GGML_LOG_LEVEL_CONT) {
        atomic_store(&f->dropping, 0);
    }
    if (f->next != NULL) {
        f->next(level, text, f->next_data);
    } else { /* llama.cpp's default */
        fputs(text, stderr);
        fflush(stderr);
    }
}

/* Whether debug lines were asked for through the environment. */
static int debug_wanted(void) {
    const char * keep = getenv("SPICE_LLAMA_DEBUG_LOG");
    const char * sched = getenv("GGML_SCHED_DEBUG");
    return (keep != NULL && keep[0] == '1') || (sched != NULL && sched[0] != '\0' && strcmp(sched, "0") != 0);
}

spice_log_filter * spice_log_filter_ensure(spice_log_filter * f) {
    if (debug_wanted()) {
        return f;
    }
    ggml_log_callback current = NULL;
    void * current_data = NULL;
    llama_log_get(&current, &current_data);
    if (current == drop_debug) {
        spice_log_filter * top = (spice_log_filter *) current_data;
        if (top == f) { /* this one: filtering again if it had stopped */
            atomic_store(&f->passing, 0);
            return f;
        }
        if (!atomic_load(&top->passing)) { /* another runtime's, filtering */
            return f;
        }
        /* another runtime's that only hands lines on: wrapped like any callback */
    }
    if (f != NULL && f->installed) {
        atomic_store(&f->passing, 1); /* buried under another callback: it only hands lines on now */
    }
    spice_log_filter * use = f != NULL && !f->installed ? f : (spice_log_filter *) calloc(1, sizeof(*use));
    if (use == NULL) {
        return f; /* no memory: the log stays as it is */
    }
    use->next = current;
    use->next_data = current_data;
    atomic_init(&use->dropping, 0);
    atomic_init(&use->passing, 0);
    use->installed = 1;
    llama_log_set(drop_debug, use);
    return use;
}

int spice_log_filter_release(spice_log_filter * f) {
    if (f == NULL || !f->installed) {
        return 1;
    }
    ggml_log_callback current = NULL;
    void * current_data = NULL;
    llama_log_get(&current, &current_data);
    if (current != drop_debug || current_data != f) {
        atomic_store(&f->passing, 1); /* a callback over it may still hand it lines: they go on whole */
        return 0;
    }
    llama_log_set(f->next, f->next_data);
    f->installed = 0;
    return 1;
}
