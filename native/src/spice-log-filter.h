/* llama.cpp's log without its debug lines, from a runtime's first enable or
 * disable of its hook until the runtime is freed.
 *
 * ggml-cuda logs a debug line at every launch of a CUDA graph it replays
 * ("CUDA Graph id N reused"): each of the slot pool's launches and each of
 * the decode graph's CUDA splits, every token. llama-cpp-python installs a
 * Python function as llama.cpp's log callback, so each of those lines takes
 * the GIL on the launching thread -- and while an asynchronous policy plans
 * in Python on the planner thread, the launch waits for it. On an H200 the
 * asynchronous rows' pool launches took 39-83 us in
 * ggml_backend_graph_compute_async against 5-10 for every other row
 * (docs/results/gpu.md, section 6b). llama-cpp-python
 * prints no debug line unless verbose, and pyspice never asks for that.
 *
 * The filter wraps the callback installed then: a debug line (and the pieces
 * that continue it) is dropped in C, every other line goes on to the wrapped
 * callback. Debug lines are kept where they were asked for:
 * SPICE_LLAMA_DEBUG_LOG=1, GGML_SCHED_DEBUG (its split dumps are debug lines),
 * a verbose model (spice_runtime_keep_debug_log). llama.cpp has one log
 * callback per process: a filter goes in only where no filter is the installed
 * callback, and comes out on release only while it is still the one installed.
 * One that whoever installed a callback over it took out again (pyspice's log
 * taps around model loads put back what they found) is never reinstalled: the
 * next enable or disable wraps the callback then installed with a new filter,
 * so lines cannot go round in a loop, and the old one stays allocated (a
 * callback may still hand lines to it). A filter that stays allocated that
 * way, or that could not come out on release because a callback is installed
 * over it (a verbose model's keep, or the runtime freed), stops dropping: it
 * hands every line on, so debug lines are kept where asked for, and none is
 * lost to a filter whose runtime is gone. */
#ifndef SPICE_LOG_FILTER_H
#define SPICE_LOG_FILTER_H

#include "ggml.h"

#include <stdatomic.h>

typedef struct spice_log_filter {
    ggml_log_callback next; /* the wrapped callback; NULL: llama.cpp's default */
    void * next_data;
    atomic_int dropping; /* the last piece was a dropped debug line: its continuations go too */
    atomic_int passing;  /* released or buried under another callback: every line goes on */
    int installed;
} spice_log_filter;

/* A filter over llama.cpp's current log callback, unless a filter that drops
 * debug lines is the installed callback already (f itself drops them again if
 * it had stopped) or debug lines were asked for through the environment.
 * Returns the filter the caller keeps: f (NULL: none yet), or a new one where
 * f went in once and is no longer the callback (put back under it by whoever
 * installed one over it, or still beneath one that may hand it lines: f is
 * then left allocated, handing every line on, and reinstalling it could make
 * a loop). */
spice_log_filter * spice_log_filter_ensure(spice_log_filter * f);

/* Put back the callback f wraps if f is the one installed. Returns 1 when f
 * may be freed (never installed, or taken out), 0 when it went in and another
 * callback is installed now (it may still hand lines to f, which from now on
 * hands every one of them on). */
int spice_log_filter_release(spice_log_filter * f);

#endif /* SPICE_LOG_FILTER_H */
