"""llama.cpp's log, tapped for a block: its reasons for refusing a model reach the user.

llama.cpp says why it refuses a file only in its log ("tensor 'x' has offset
N, expected M", "wrong number of tensors"), and llama-cpp-python, with
verbose=False, sends that log to /dev/null and raises a bare "Failed to load
model from file". `llama_log_tap` sees every log line while a block runs
and passes it on to whatever callback was installed before (llama-cpp-python's,
or an outer tap), which it puts back on leaving. `llama_load_reasons` wraps a
model load with one and, when llama-cpp-python raises its load or context
error, raises ModelLoadError with llama.cpp's error lines instead.

llama.cpp has one log callback per process (llama_log_set, which sets ggml's
too): two threads loading models at once would each tap the other's lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# ggml_log_level (ggml.h)
LOG_ERROR = 4
LOG_CONT = 5
# llama-cpp-python's messages for a refused model and context (llama_cpp/_internals.py)
_LOAD_FAILURES = ("Failed to load model from file", "Failed to create llama_context")
# lines that only say that something failed, not why
_GENERIC = re.compile(r"^(failed to (load model|read\b)|error loading model)", re.I)
# what prefixes a reason: the logging function's name, llama.cpp's "error loading model: "
_PREFIX = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_:]*|error loading model): ")
MAX_REASON_CHARS = 400


class ModelLoadError(ValueError):
    """llama.cpp refused a model file or could not make its context; the message
    carries llama.cpp's reason (a ValueError, as llama-cpp-python's own error)."""


@contextmanager
def llama_log_tap(
    on_line: Callable[[int, str], None], *, forward: bool = True, drop: re.Pattern[str] | None = None
) -> Iterator[None]:
    """Call on_line(level, text) for each piece of llama.cpp's log written in the block
    (CONT pieces carry the level of the piece they continue), then hand the piece to the
    callback installed before (forward=False keeps every piece from it, `drop` the pieces
    it matches), restored on leaving."""
    import llama_cpp  # lazy: importing llama_cpp loads libllama

    previous = llama_cpp.llama_log_callback()
    previous_data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    last_level = [LOG_ERROR]

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def tap(level: int, text: bytes, user_data: Any) -> None:
        if level != LOG_CONT:
            last_level[0] = level
        with contextlib.suppress(Exception):  # a log line must never raise into llama.cpp
            on_line(last_level[0], text.decode("utf-8", errors="replace"))
        if not forward or (drop is not None and drop.search(text.decode("utf-8", errors="replace"))):
            return
        # nor may the callback before (llama-cpp-python's decodes strictly: a fuzzed tensor
        # name that is not UTF-8 would raise there)
        with contextlib.suppress(Exception):
            if previous:
                previous(level, text, previous_data)
            else:  # llama.cpp's default: everything to stderr
                sys.stderr.write(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(tap, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(previous, previous_data)


def error_reason(pieces: list[str]) -> str:
    """llama.cpp's error lines as one line: each said once, the prefixes before the
    reason dropped, lines that only say 'failed' left out when others say why."""
    lines: list[str] = []
    for line in "".join(pieces).splitlines():
        text = line.strip()
        while _PREFIX.match(text):
            text = _PREFIX.sub("", text, count=1)
        if text and text not in lines:
            lines.append(text)
    specific = [t for t in lines if not _GENERIC.search(t)] or lines
    reason = "; ".join(specific)
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


@contextmanager
def llama_log_dropping(pattern: re.Pattern[str]) -> Iterator[None]:
    """The block's llama.cpp log as usual, less the pieces `pattern` matches."""
    with llama_log_tap(lambda level, text: None, drop=pattern):
        yield


@contextmanager
def llama_load_reasons(model_path: str | Path) -> Iterator[None]:
    """Around llama_cpp.Llama(...): its "Failed to load model" or "Failed to create
    llama_context" becomes a ModelLoadError naming the file and llama.cpp's reason."""
    errors: list[str] = []

    def keep_errors(level: int, text: str) -> None:
        if level == LOG_ERROR:
            errors.append(text)

    with llama_log_tap(keep_errors):
        try:
            yield
        except ValueError as exc:
            message = str(exc)
            if isinstance(exc, ModelLoadError) or not message.startswith(_LOAD_FAILURES):
                raise
            what = "load" if message.startswith(_LOAD_FAILURES[0]) else "make a context for"
            reason = error_reason(errors) or "it logged no reason"
            raise ModelLoadError(
                f"llama.cpp could not {what} {model_path}: {reason} (a corrupt or incomplete file, or an "
                "architecture or quant type this llama.cpp does not support; `pyspice inspect -m MODEL` "
                "shows what the file holds)"
            ) from exc
