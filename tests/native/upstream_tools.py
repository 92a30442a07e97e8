"""Running upstream's command-line tools from tests."""

from __future__ import annotations

import re
import subprocess

from pyspice.build_info import load_build_info

FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llama_perplexity(*args: str) -> float:
    """llama-perplexity's final estimate for these arguments.

    Upstream's logger writes from a worker thread and, rarely, the process exits
    before it has written its last lines (seen once in CI: output cut after "ETA",
    exit status 0). A missing line is retried; a wrong number never is."""
    tool = load_build_info().tool("llama-perplexity")
    output = ""
    for _ in range(3):
        result = subprocess.run([str(tool), *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        output = result.stdout + result.stderr
        match = FINAL_PPL.search(output)
        if match:
            return float(match.group(1))
    raise AssertionError(f"llama-perplexity printed no final estimate:\n{output[-2000:]}")
