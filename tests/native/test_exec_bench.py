"""spice-exec-bench (native/bench/spice-exec-bench.c) on a CPU build: the slot-pool
graph on ggml's CPU backend against the host executor, on DeepSeek-V2-Lite-shaped
experts whose down matrices are Q5_0 on one layer and Q8_0 on the other (two graph
classes, strides that must be multiples of 22-, 34- and 144-byte blocks). Every row
of the pool must equal the host executor's bit for bit; the timings are not judged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pyspice.build_info import load_build_info
from pyspice.runtime import device_count


@pytest.mark.skipif(device_count() > 0, reason="on a GPU it compares pool and legacy CUDA rows (gpu-check)")
def test_pool_rows_equal_the_host_executor_rows(tmp_path: Path) -> None:
    tool = load_build_info().tool("spice-exec-bench")
    out = tmp_path / "exec.json"
    done = subprocess.run(
        [str(tool), "--iters", "3", "--experts", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {r["executor"] for r in results} == {"pool-cpu", "host"}
    compared = [r for r in results if r["identical"] is not None]
    assert len(compared) == 9  # 1, 2, 4, 6 device experts at 1 and 8 tokens; 2 at 32 tokens
    assert all(r["identical"] for r in compared), compared
