"""spice-rule-bench (native/bench/spice-rule-bench.c): the shipped rules alone through
libspice's public API. The timings are not judged (they belong in a benchmark); what
each rule keeps is: ondemand keeps nothing between calls (no hits), lru and adapmoe
keep half the experts under skewed routing (most selections hit), adapmoe as well when
the next layer's logits come with the call as the graph hands them over (adapmoe-g), and
spice:exact's asynchronous rule on a GPU (cost: misses weighed, nothing evicted);
--only runs one rule; --cold-mib sets how much the calls' caches are emptied by."""

from __future__ import annotations

import subprocess

from pyspice.build_info import load_build_info


def test_rule_bench_runs_every_rule_and_each_keeps_what_it_should() -> None:
    tool = load_build_info().tool("spice-rule-bench")
    done = subprocess.run([str(tool), "--calls", "600"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"ondemand", "lru", "adapmoe", "adapmoe-g", "cost"}, done.stdout
    hit = {name: float(cols[-1]) for name, cols in rows.items()}
    assert hit["ondemand"] == 0.0
    assert hit["lru"] > 0.3 and hit["adapmoe"] > 0.3 and hit["adapmoe-g"] > 0.3, hit
    assert hit["cost"] > 0.3, hit  # keeps what it fetched (nothing evicts), so the skew hits


def test_rule_bench_runs_only_the_rule_asked_for() -> None:
    tool = load_build_info().tool("spice-rule-bench")
    command = [str(tool), "--calls", "200", "--only", "adapmoe-g"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[0] for line in done.stdout.splitlines()[2:]] == ["adapmoe-g"], done.stdout


def test_rule_bench_empties_caches_by_the_amount_asked_for() -> None:
    tool = load_build_info().tool("spice-rule-bench")
    command = [str(tool), "--calls", "50", "--only", "lru", "--cold-mib", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cold caches (2 MiB touched between calls)" in done.stdout.splitlines()[0], done.stdout
    assert [line.split()[0] for line in done.stdout.splitlines()[2:]] == ["lru"], done.stdout


def test_rule_bench_refuses_a_bad_flag() -> None:
    tool = load_build_info().tool("spice-rule-bench")
    done = subprocess.run([str(tool), "--used", "0"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--used" in done.stderr
    done = subprocess.run([str(tool), "--cold-mib", "0"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--cold-mib" in done.stderr
