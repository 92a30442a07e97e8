"""The differential fuzz harness (fuzz/fuzz_gguf_differential.py) for a short while, as CI
runs it: mutated GGUFs from the seed corpus go through read_header, and every one it
accepts is loaded by pyspice.Llama (llama.cpp) and decoded in a forked child, which must
not die by a signal, hang past 5 s or pass 512 MiB. It needs the native build, so it lives
here rather than beside the reader-only harnesses' smoke (tests/unit/test_fuzz_smoke.py).
PYSPICE_FUZZ_SECONDS sets its length (default 12; 0 skips it). Longer runs, outside CI:
`python fuzz/fuzz_gguf_differential.py DIR fuzz/corpus/gguf_differential -runs=1000000`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz_launch import through_forking_shell

pytest.importorskip("atheris", reason="atheris (the dev extra) runs the fuzz harnesses")

ROOT = Path(__file__).resolve().parents[2]
SECONDS = int(os.environ.get("PYSPICE_FUZZ_SECONDS", "12"))
STATS = re.compile(r"differential: (\d+) inputs .*?, (\d+) accepted by the reader, (\d+) loaded and decoded")


@pytest.mark.skipif(SECONDS <= 0, reason="PYSPICE_FUZZ_SECONDS=0")
def test_the_differential_harness_finds_no_crash(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(ROOT / "fuzz" / "fuzz_gguf_differential.py"), str(tmp_path),
        str(ROOT / "fuzz" / "corpus" / "gguf_differential"), f"-max_total_time={SECONDS}",
        "-rss_limit_mb=1024", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", "-seed=1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYSPICE_FUZZ_KEEP_GOING"}
    # The same mutations every run, and a hang limit for a loaded CI machine (a child loads
    # and decodes a model): the smoke proves the path end to end; the 5 s hang limit is the
    # long runs' (fuzz/fuzz_gguf_differential.py), which hunt for hangs.
    env["PYSPICE_FUZZ_CHILD_TIMEOUT"] = env.get("PYSPICE_FUZZ_CHILD_TIMEOUT", "30")
    done = subprocess.run(
        through_forking_shell(argv), cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 120, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
    # the last count line, printed at exit: the run really reached llama.cpp
    counts = STATS.findall(done.stderr)
    assert counts, done.stderr[-3000:]
    inputs, accepted, loaded = map(int, counts[-1])
    assert inputs > 0 and accepted > 0 and loaded > 0, counts[-1]
