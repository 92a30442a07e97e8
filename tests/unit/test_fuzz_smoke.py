"""The fuzz harnesses (fuzz/) for a short while each, as CI runs them: a crash is any
exception but the reader's documented error, a run over 1 s, or RSS over 512 MiB.
Longer runs, outside CI: `python fuzz/fuzz_gguf_header.py DIR fuzz/corpus/gguf_header
-runs=1000000 -timeout=1 -rss_limit_mb=512` (likewise fuzz_sidecar.py, fuzz_trace.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz_launch import through_forking_shell

pytest.importorskip("atheris", reason="atheris (the dev extra) runs the fuzz harnesses")

ROOT = Path(__file__).resolve().parents[2]
# 10 s each, as the issue asks of CI; PYSPICE_FUZZ_SECONDS=0 skips them (a quick local run)
SECONDS = int(os.environ.get("PYSPICE_FUZZ_SECONDS", "10"))
pytestmark = pytest.mark.skipif(SECONDS <= 0, reason="PYSPICE_FUZZ_SECONDS=0")


@pytest.mark.parametrize(
    ("harness", "corpus"),
    [("fuzz_gguf_header", "gguf_header"), ("fuzz_sidecar", "sidecar"), ("fuzz_trace", "trace")],
)
def test_harness_finds_no_crash(tmp_path: Path, harness: str, corpus: str) -> None:
    argv = [
        sys.executable, str(ROOT / "fuzz" / f"{harness}.py"), str(tmp_path),
        str(ROOT / "fuzz" / "corpus" / corpus), f"-max_total_time={SECONDS}", "-timeout=1",
        "-rss_limit_mb=512", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", "-seed=1",
    ]  # fmt: skip
    # the same mutations every run: the smoke proves the harness end to end; the long runs
    # (docs/results/fuzzing.md) hunt
    done = subprocess.run(
        through_forking_shell(argv), cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
