"""The C fuzz harness for spice_plan_check (fuzz/fuzz_plan_check.c), as the build made it:
a libFuzzer target where clang has -fsanitize=fuzzer, else a driver replaying the seed
corpus with byte-flip mutations (under ASan and UBSan where the compiler links them).
The contract: only SPICE_OK or SPICE_ERR_INVALID_PLAN, a NUL-terminated message, no
read out of bounds, and every accepted plan in range. A second each; longer runs outside
CI: `build/cmake/bin/spice-fuzz-plan-check fuzz/corpus/plan_check -runs=1000000`, or the
libFuzzer build of docs/guide.md's "Fuzzing" (clang, build/fuzz-clang)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from pyspice.build_info import load_build_info

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fuzz" / "corpus" / "plan_check"


def test_the_plan_check_harness_finds_no_failure(tmp_path: Path) -> None:
    harness = load_build_info().tool("spice-fuzz-plan-check")
    assert harness.is_file(), f"{harness} is missing: `make build` builds it"
    done = subprocess.run(
        [str(harness), str(tmp_path), str(CORPUS), "-runs=20000", "-max_total_time=10", "-timeout=1",
         "-rss_limit_mb=512", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "ASAN_OPTIONS": "abort_on_error=0:detect_leaks=1"},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    standalone = re.search(r"(\d+) executions \((\d+) plans accepted\), no failure", out)
    if standalone:  # the replay driver: it got far enough to accept plans, not only reject them
        assert int(standalone.group(1)) >= 20000 * len(list(CORPUS.iterdir()))
        assert int(standalone.group(2)) > 0
    else:  # libFuzzer: its own summary
        assert "Done" in out, out[-3000:]
    assert not list(tmp_path.glob("crash-*"))
