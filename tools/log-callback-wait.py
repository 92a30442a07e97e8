#!/usr/bin/env python3
"""How long a thread that logs through llama.cpp waits for Python, with and without
another Python thread busy: the mechanism behind the asynchronous rows' slow CUDA
graph launches (native/src/spice-log-filter.h).

ggml-cuda logs a debug line at every CUDA graph it replays. llama-cpp-python's log
callback is a Python function, so the launching thread takes the GIL for each line;
a planner thread running a policy in Python holds it. This script logs such a line
from a Python thread through `ggml_log_internal` (the GIL released for the call, as
for llama_decode) and times, per line, the call's start to the callback's first
statement: the time the launching thread would wait. Idle: nothing else runs. Busy:
another thread runs pure Python, as a planner does.

    tools/log-callback-wait.py --lines 400

libspice's filter (installed while a runtime's hook is enabled) drops debug lines in
C, so they never reach the callback: no wait at all. This script cannot time the
filter itself without a native thread; tests/native/test_log_filter.py checks that
debug lines stop before Python and the other levels still arrive.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from pathlib import Path

GGML_LOG_LEVEL_DEBUG = 1


def ggml_base() -> ctypes.CDLL:
    """libggml-base as llama-cpp-python loaded it (the one whose log callback it set)."""
    import llama_cpp  # importing it installs llama-cpp-python's log callback

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-base.so*"))
    if not found:
        raise SystemExit(f"no libggml-base.so under {lib_dir}: run `make build` first")
    return ctypes.CDLL(str(found[0]))


def waits_us(lines: int, busy: bool) -> list[float]:
    import llama_cpp

    lib = ggml_base()
    log = lib.ggml_log_internal
    log.restype = None
    entered: list[int] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        entered.append(time.perf_counter_ns())

    previous = llama_cpp.llama_log_callback()
    previous_data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    stop = threading.Event()

    def planner() -> None:  # pure Python, as a policy's planning
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    other = threading.Thread(target=planner, daemon=True)
    if busy:
        other.start()
    out: list[float] = []
    try:
        for _ in range(lines):
            t0 = time.perf_counter_ns()
            log(GGML_LOG_LEVEL_DEBUG, b"CUDA Graph id 7 reused\n")
            out.append((entered[-1] - t0) / 1e3)
            time.sleep(0.0005)  # a launch every half millisecond
    finally:
        stop.set()
        if busy:
            other.join()
        llama_cpp.llama_log_set(previous, previous_data)
    return out


def percentile(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=400, help="debug lines logged per case")
    args = ap.parse_args()
    print(f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms; {args.lines} lines per case")
    print(f"{'case':6s} {'p50 us':>9s} {'p90 us':>9s} {'max us':>9s} {'mean us':>9s}")
    for busy in (False, True):
        w = sorted(waits_us(args.lines, busy))
        name = "busy" if busy else "idle"
        p50, p90 = percentile(w, 0.5), percentile(w, 0.9)
        print(f"{name:6s} {p50:9.1f} {p90:9.1f} {w[-1]:9.1f} {statistics.fmean(w):9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
