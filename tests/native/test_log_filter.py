"""llama.cpp's debug lines stop in C while a runtime's hook is enabled
(native/src/spice-log-filter.h): ggml-cuda logs one at every CUDA graph it replays,
and a Python log callback made each of those launches take the GIL, waiting for a
planner thread's policy. Every other level still reaches the callback installed
before, and freeing the runtime puts that callback back."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from .golden import greedy_run, load

DEBUG, INFO, ERROR, CONT = 1, 2, 4, 5  # ggml_log_level


def ggml_log() -> ctypes._CFuncPtr:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(sorted(lib_dir.glob("libggml-base.so*"))[0]))
    fn = lib.ggml_log_internal
    fn.restype = None
    return fn


def current_callback() -> int:
    cb = llama_cpp.llama_log_callback()
    data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
    return ctypes.cast(cb, ctypes.c_void_p).value or 0


@pytest.fixture
def recorded() -> Iterator[tuple[list[tuple[int, str]], int]]:
    """A recording Python callback installed as llama.cpp's, the one before put back after."""
    lines: list[tuple[int, str]] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append((level, text.decode()))

    previous = llama_cpp.llama_log_callback()
    previous_data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    llama_cpp.llama_log_set(record, ctypes.c_void_p(0))
    try:
        yield lines, current_callback()
    finally:
        llama_cpp.llama_log_set(previous, previous_data)


def test_debug_lines_stop_in_c_while_a_hook_is_enabled(synth_model, recorded) -> None:  # type: ignore[no-untyped-def]
    lines, python_cb = recorded
    log = ggml_log()
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        greedy_run(llm, "exact", n_decode=2)  # enables the hook: the filter goes over `record`
        assert current_callback() != python_cb
        lines.clear()
        log(DEBUG, b"CUDA Graph id 7 reused\n")
        log(CONT, b"... its continuation\n")
        log(ERROR, b"an error\n")
        log(CONT, b"... and its continuation\n")
        log(INFO, b"some info\n")
        assert lines == [(ERROR, "an error\n"), (CONT, "... and its continuation\n"), (INFO, "some info\n")]
    finally:
        llm.close()
    # the runtime is gone: the callback it wrapped is llama.cpp's again, debug lines and all
    assert current_callback() == python_cb
    lines.clear()
    log(DEBUG, b"after\n")
    assert lines == [(DEBUG, "after\n")]


def test_spice_llama_debug_log_keeps_them(synth_model, recorded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPICE_LLAMA_DEBUG_LOG", "1")
    lines, python_cb = recorded
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        greedy_run(llm, "exact", n_decode=2)
        assert current_callback() == python_cb
        lines.clear()
        ggml_log()(DEBUG, b"kept\n")
        assert lines == [(DEBUG, "kept\n")]
    finally:
        llm.close()


def test_stock_rows_get_it_too_and_a_callback_put_back_under_it_is_wrapped_again(  # type: ignore[no-untyped-def]
    synth_model, recorded
) -> None:
    """`stock` disables the hook (a bench's stock row decodes through CUDA graphs too);
    a log tap that, on leaving, puts back the callback it found (pyspice's around model
    loads) takes the filter out: the next enable or disable wraps again, and a callback
    installed over a filter never makes lines go round in a loop."""
    lines, python_cb = recorded
    log = ggml_log()
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        greedy_run(llm, "stock", n_decode=2)  # the runtime's first call: a disable
        assert current_callback() != python_cb
        # a tap that took the filter out when it left
        cb, data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
        seen: list[str] = []

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def over(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            seen.append(text.decode())
            cb(level, text, data)  # hands every line on to the filter beneath

        llama_cpp.llama_log_set(over, ctypes.c_void_p(0))
        greedy_run(llm, "exact", n_decode=2)  # wraps `over`, which hands on to the old filter
        lines.clear()
        seen.clear()
        log(DEBUG, b"dropped\n")
        log(ERROR, b"once\n")
        assert seen == ["once\n"] and lines == [(ERROR, "once\n")]
    finally:
        llm.close()
        llama_cpp.llama_log_set(cb, data)  # as the tap would on leaving
    # the first filter stays allocated (`over` may still call it) and, its runtime gone,
    # hands every line on: nothing is lost, debug lines included
    lines.clear()
    log(ERROR, b"after\n")
    log(DEBUG, b"debug after\n")
    assert lines == [(ERROR, "after\n"), (DEBUG, "debug after\n")]


def test_a_verbose_model_keeps_them(synth_model, recorded) -> None:  # type: ignore[no-untyped-def]
    lines, python_cb = recorded
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        greedy_run(llm, "exact", n_decode=2)
        assert current_callback() != python_cb
        llm.spice_engine.runtime.keep_debug_log()  # what Llama(verbose=True) asks for: the filter goes
        assert current_callback() == python_cb
        greedy_run(llm, "exact", n_decode=2)
        lines.clear()
        ggml_log()(DEBUG, b"kept\n")
        assert lines == [(DEBUG, "kept\n")]
    finally:
        llm.close()


def test_a_verbose_model_keeps_them_under_a_callback_installed_over_the_filter(  # type: ignore[no-untyped-def]
    synth_model, recorded
) -> None:
    """The filter cannot come out while a callback installed over it may still hand it
    lines; keep then makes it hand every line on, debug lines included."""
    lines, _ = recorded
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    cb, data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    try:
        greedy_run(llm, "exact", n_decode=2)  # the filter goes over `record`
        llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(data))

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def over(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            cb(level, text, data)  # hands every line on to the filter beneath

        llama_cpp.llama_log_set(over, ctypes.c_void_p(0))
        llm.spice_engine.runtime.keep_debug_log()
        lines.clear()
        ggml_log()(DEBUG, b"kept\n")
        assert lines == [(DEBUG, "kept\n")]
    finally:
        llm.close()
        llama_cpp.llama_log_set(cb, data)
