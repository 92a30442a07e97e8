"""spice-planner-bench (native/bench/spice-planner-bench.c): the hook's side of
asynchronous planning alone, no model. The timings are not judged (they belong in a
benchmark); that it runs the shape asked for, prints its three rows, and refuses what
it cannot run, is."""

from __future__ import annotations

import subprocess

from pyspice.build_info import load_build_info


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    tool = load_build_info().tool("spice-planner-bench")
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=120)


def test_planner_bench_prints_take_post_and_both_for_the_shape_asked_for() -> None:
    done = run_bench("--calls", "200", "--layers", "2", "--embd", "256", "--cold-mib", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "2 layers x 64 experts" in lines[0] and "200 calls, 1 MiB" in lines[0], lines[0]
    rows = {line.rsplit(maxsplit=2)[0]: line.split()[-2:] for line in lines[2:]}
    assert set(rows) == {"take", "post+settle", "both"}, done.stdout
    p50 = {name: int(cols[0]) for name, cols in rows.items()}
    assert p50["post+settle"] > 0 and p50["both"] >= p50["post+settle"], p50


def test_planner_bench_refuses_a_shape_it_cannot_run() -> None:
    for args in (["--used", "65"], ["--cold-mib", "5000"], ["--calls", "0"]):
        done = run_bench(*args)
        assert done.returncode == 2, args
        assert "spice-planner-bench: want" in done.stderr, done.stderr
    done = run_bench("--colder", "1")
    assert done.returncode == 2 and "usage:" in done.stderr
