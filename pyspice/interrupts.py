"""Ctrl-C that reaches native code which runs no Python.

Python runs a SIGINT handler only on the main thread, between bytecodes: while
that thread sits in `llama_decode` under a rule policy (no Python callback) or in
a copy wait on a slow bus, KeyboardInterrupt waits for the decode to finish,
which may take minutes; and when it does run, it runs inside whatever Python
callback the decode makes next (llama-cpp-python's log callback, a policy's),
where ctypes and cffi swallow the exception ("Exception ignored ...").

`SigintGuard(abort)` closes both gaps for a block of code:
- Python's C-level handler writes the signal's number to a wakeup fd
  (`signal.set_wakeup_fd`) as soon as the signal lands, and one watcher thread
  reading it calls `abort` (thread-safe: `spice_runtime_request_abort`), which
  makes the decode return at once;
- for the block, SIGINT's Python handler records the signal instead of raising,
  so no callback sees a KeyboardInterrupt; the caller raises it once the native
  call is back (`interrupted`).

Only on the main thread (the only one Python delivers signals to), and only
while SIGINT has Python's default handler (a program with its own handler, or
SIGINT ignored, decides for itself). A wakeup fd installed before (asyncio's)
gets every byte forwarded and is put back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable
from types import FrameType

Abort = Callable[[], None]


class _Watcher:
    """One per process: the pipe Python's handler writes to, and the thread reading it."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)  # drained without blocking when a block ends
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd's requirement
        self._lock = threading.Lock()
        self._abort: Abort | None = None
        self._forward_fd = -1
        threading.Thread(target=self._run, name="pyspice-sigint", daemon=True).start()

    def _run(self) -> None:
        while True:
            select.select([self._read_fd], [], [])
            with self._lock:
                self._handle(self._read(), self._abort)

    def _read(self) -> bytes:
        try:
            return os.read(self._read_fd, 512)
        except BlockingIOError:
            return b""  # a block's end drained it first

    def _handle(self, data: bytes, abort: Abort | None) -> None:
        if data and abort is not None and signal.SIGINT in data:
            abort()
        if data and self._forward_fd >= 0:
            with contextlib.suppress(OSError):  # the owner's fd is full or gone: its own problem
                os.write(self._forward_fd, data)

    def arm(self, abort: Abort) -> int:
        """Take the wakeup fd; returns the one installed before."""
        previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        with self._lock:
            self._abort, self._forward_fd = abort, previous
        return previous

    def disarm(self, previous: int) -> None:
        # asyncio, the usual owner of a wakeup fd, sets it without warnings too
        signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
        with self._lock:
            # a signal that landed before this point belongs to this block: forwarded,
            # never left in the pipe to abort the next one
            while data := self._read():
                self._handle(data, None)
            self._abort, self._forward_fd = None, -1


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _forget_watcher() -> None:
    global _watcher, _watcher_lock
    # a forked child has the pipe but not the thread (nor a lock's owner): it makes its own
    _watcher, _watcher_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_watcher)


def _get_watcher() -> _Watcher:
    global _watcher
    if _watcher is None:
        with _watcher_lock:
            if _watcher is None:
                _watcher = _Watcher()
    return _watcher


class SigintGuard:
    """A block during which SIGINT calls `abort` at once and is recorded, not raised:
    `interrupted` says whether one came. A no-op for None, off the main thread, or when
    SIGINT's handler is not Python's default. About 20 us per block (mostly two sigactions)."""

    def __init__(self, abort: Abort | None) -> None:
        self._abort = abort
        self.interrupted = False
        self._watcher: _Watcher | None = None
        self._previous_fd = -1

    def _on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        self.interrupted = True
        if self._abort is not None:
            self._abort()  # the watcher does too; this one covers a full or failed pipe

    def __enter__(self) -> SigintGuard:
        if (
            self._abort is None
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            return self
        self._watcher = _get_watcher()
        self._previous_fd = self._watcher.arm(self._abort)
        signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._watcher.disarm(self._previous_fd)
            self._watcher = None
