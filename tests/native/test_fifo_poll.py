"""spice-fifo-poll-check (native/tools/spice-fifo-poll-check.c): the CUDA tier's poll of
copies in flight, against a simulated in-order stream. Copies on one stream finish in
issue order, so a poll asks about the oldest unfinished copy and no later one; it must
still report exactly the copies landed. A CPU build has no CUDA stream, so the logic is
checked here on its own."""

from __future__ import annotations

import subprocess

from pyspice.build_info import load_build_info


def test_a_poll_reports_exactly_the_landed_copies_asking_about_few() -> None:
    tool = load_build_info().tool("spice-fifo-poll-check")
    for seed in ("1", "2", "3"):
        done = subprocess.run([str(tool), "20000", seed], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "all checks passed" in done.stdout
