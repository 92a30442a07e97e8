"""Ctrl-C stops generation promptly under every policy and bus speed (issue 22, rows
31, 80-82): a bus so slow that finishing would take many minutes, SIGINT once, and
the process must be gone within 30 s with exit 130 ("pyspice: interrupted")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

EXIT_WITHIN_S = 30.0  # the margin the issue asks for; a stop takes well under 1 s when it works
# 1 KB/s: one expert copy of the tiny model takes longer than the whole test may
SLOW_BUS_GBPS = "1e-6"

NEEDS_LEAD = (
    "needs changes in files this issue may not touch: Runtime.enable_policy's ffi.callback "
    "onerror= (a SIGINT landing on _on_call's first bytecode is 'Exception ignored from cffi "
    "callback') and an abortable wait in the emulated bus (native/), so a copy in flight "
    "cannot hold Ctrl-C for minutes"
)


@pytest.mark.parametrize(
    "policy",
    [
        # run=False: each failing case costs CI 40 s; `pytest --runxfail` runs them (both fail
        # today: still running 30 s after the SIGINT, 2026-12-01)
        pytest.param("lru", marks=pytest.mark.xfail(reason=NEEDS_LEAD, run=False)),
        pytest.param("exact", marks=pytest.mark.xfail(reason=NEEDS_LEAD, run=False)),
    ],
)
def test_one_sigint_stops_generation_on_a_very_slow_bus(synth_model: Any, policy: str) -> None:
    model: Path = synth_model("qwen2moe", "tiny", "Q8_0")
    argv = [
        sys.executable, "-m", "pyspice", "generate", "-m", str(model), "-p", "Once upon a time",
        "-n", "3000", "--temp", "0", "-t", "1", "-c", "4096", "--policy", policy,
        "--device-budget", "25%", "--emulate-bandwidth", SLOW_BUS_GBPS,
    ]  # fmt: skip
    # a child of a non-interactive shell may start with SIGINT ignored: restore the default
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        time.sleep(8.0)  # loaded and decoding (the model loads in about a second)
        assert proc.poll() is None, "finished before the SIGINT: the bus is not slow enough"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_WITHIN_S:g} s after one SIGINT")
        took = time.monotonic() - sent
        err = proc.stderr.read() if proc.stderr else ""
        assert proc.returncode == 130, err[-2000:]
        assert "pyspice: interrupted" in err and "Exception ignored" not in err
        print(f"stopped {took:.2f} s after SIGINT")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
