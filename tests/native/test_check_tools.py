"""libspice's logic that only a GPU exercises, checked on every build by small C tools
(native/tests/spice-*-check.c) over random inputs. Each prints "all checks passed" or
names the first failing input (replayable with its seed) and exits 1.

- spice-pool-ids-check: the slot-pool graph's expert ids. MUL_MAT_ID wants a token's
  ids distinct; ggml-cuda's batched kernel broke on a token whose off-device pairs all
  pointed at the zero slot (an H200, 2026-12-04: device rows 0.6-3.2 of the host's
  largest value off in 9-32-token calls). Device pairs keep their slots, no token of a
  several-token launch repeats an id, a one-token launch reads no real slot for a pair
  off the device.
- spice-fifo-poll-check: the CUDA tier's poll of copies in flight against a simulated
  in-order stream: exactly the landed copies reported, asking about the oldest
  unfinished one and no later one.
- spice-copy-queue-check: the copier thread (the CUDA tier's default;
  SPICE_CUDA_COPY_THREAD=0: inline) with a stand-in for the CUDA calls: copies
  issued once each in queue order, by the copier or by a wait that finds them
  queued; a wait returns once its copy is issued; a failed issue is reported.
- spice-row-snapshot-check: the residency table an asynchronous snapshot carries, taken
  again only where a row's version changed since the ring entry last held it: every
  take equals the table, copies exactly the changed rows, and a new store, shape or a
  take without versions copies it whole.
- spice-planner-check: asynchronous planning's planner thread and ring, with a policy
  in C and the idle budget shrunk so that the planner parks thousands of times: every
  plan is its own call's (its ids, its lent hidden row, never one overwritten after
  settle), plans come back in posting order, deterministic mode hands back exactly
  call c - lag, every post is planned, and no wake-up is lost (a watchdog names a
  hang). Free-running and deterministic, polling (the post does not fence; the planner
  fences every thread with membarrier before it parks) and parking at once.
"""

from __future__ import annotations

import subprocess

import pytest

from pyspice.build_info import load_build_info

TOOLS = [
    "spice-pool-ids-check",
    "spice-fifo-poll-check",
    "spice-copy-queue-check",
    "spice-row-snapshot-check",
    "spice-planner-check",
]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("seed", ["1", "2", "3"])
def test_check_tool_passes(tool: str, seed: str) -> None:
    path = load_build_info().tool(tool)
    done = subprocess.run([str(path), "20000", seed], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all checks passed" in done.stdout
