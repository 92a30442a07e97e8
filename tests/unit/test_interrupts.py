"""SigintGuard (pyspice.interrupts): within the block a SIGINT calls `abort` from the
watcher thread while the main thread is blocked, and is recorded instead of raised;
after the block everything is as before."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from pyspice.interrupts import SigintGuard

pytestmark = pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="needs Python's default SIGINT handler",
)


def test_a_sigint_calls_abort_from_the_watcher_and_is_recorded_not_raised() -> None:
    callers: list[str] = []
    by_watcher = threading.Event()

    def abort() -> None:
        callers.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            by_watcher.set()

    with SigintGuard(abort) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        # the watcher's call is the one that reaches native code no Python runs in
        assert by_watcher.wait(10.0), f"abort called only by {callers}"
    assert guard.interrupted  # and no KeyboardInterrupt
    assert "pyspice-sigint" in callers
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.set_wakeup_fd(-1) == -1  # nothing left installed


def test_no_interrupt_no_abort_and_a_stale_signal_does_not_reach_the_next_block() -> None:
    calls: list[int] = []
    with SigintGuard(lambda: calls.append(1)) as first:
        pass
    assert not first.interrupted and not calls
    with SigintGuard(lambda: calls.append(2)) as second:
        os.kill(os.getpid(), signal.SIGINT)
    # the signal is drained with its own block: whatever it did, it did there
    with SigintGuard(lambda: calls.append(3)) as third:
        pass
    assert second.interrupted and not third.interrupted
    assert 3 not in calls


def test_a_wakeup_fd_installed_before_gets_the_bytes_and_is_put_back() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    old = signal.set_wakeup_fd(a.fileno(), warn_on_full_buffer=False)
    try:
        done = threading.Event()
        with SigintGuard(done.set):
            os.kill(os.getpid(), signal.SIGINT)
            assert done.wait(10.0)
        assert signal.set_wakeup_fd(a.fileno(), warn_on_full_buffer=False) == a.fileno()
        assert signal.SIGINT in b.recv(64)
    finally:
        signal.set_wakeup_fd(old)
        a.close()
        b.close()


def test_off_the_main_thread_or_without_abort_it_does_nothing() -> None:
    seen: list[bool] = []

    def worker() -> None:
        with SigintGuard(lambda: None) as guard:
            seen.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        seen.append(guard.interrupted)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [True, False]
    with SigintGuard(None):
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
