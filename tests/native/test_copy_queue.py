"""spice-copy-queue-check (native/tools/spice-copy-queue-check.c): the CUDA tier's
copier thread and its queue (SPICE_CUDA_COPY_THREAD=1), with a stand-in for the CUDA
calls, since a CPU build has none. Copies are issued once each, in queue order, by the
copier or by a wait that finds them still queued; a wait returns only once its copy is
issued; a failed issue is reported."""

from __future__ import annotations

import subprocess

from pyspice.build_info import load_build_info


def test_copies_are_issued_once_in_order_and_waits_see_theirs_issued() -> None:
    tool = load_build_info().tool("spice-copy-queue-check")
    for seed in ("1", "2", "3"):
        done = subprocess.run([str(tool), "20000", seed], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "all checks passed" in done.stdout
