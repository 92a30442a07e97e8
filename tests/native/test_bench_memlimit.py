"""`bench --memory-limit` for real: rows of smolmoe in memory cgroups of this machine
(root and cgroup v1 or v2 needed; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pyspice.measure.memlimit import CgroupError, system_layout

from .conftest import ModelFactory

BENCH = [sys.executable, "-m", "pyspice", "bench", "--no-sidecar", "-n", "4", "--repeat", "2"]
BENCH += ["--prompt-tokens", "16", "-t", "2", "--json"]


@pytest.fixture(scope="module")
def smolmoe(builtin_model: ModelFactory) -> Path:
    try:
        system_layout()
    except CgroupError as exc:
        pytest.skip(str(exc))
    return builtin_model("smolmoe")


def _bench(model: Path, rows: str, limit: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    out = subprocess.run(
        [*BENCH, "-m", str(model), "--policies", rows, "--memory-limit", limit, *extra],
        capture_output=True,
        text=True,
    )
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}, out.stderr


def test_rows_run_cold_then_warm_in_their_own_cgroup(smolmoe: Path, tmp_path: Path) -> None:
    rc, doc, err = _bench(smolmoe, "upstream,exact", "1GiB", "--plot", str(tmp_path / "b.png"))
    assert rc == 0, err[-2000:]
    assert (tmp_path / "b.png").stat().st_size > 0
    assert doc["memory_limit"] == 2**30 and doc["cgroup_version"] in (1, 2) and doc["threads"] == 2
    size = smolmoe.stat().st_size
    for name, row in doc["rows"].items():
        assert row["status"] == "ok" and row["oom_kills"] == 0, (name, row["message"])
        assert row["cold"]["cold"] and len(row["warm"]) == 1 and not row["warm"][0]["cold"]
        assert len(row["tokens"]) == 4 and row["same_tokens"] == "yes"
        # the peak is this row's own: its process and its page cache, under the limit
        assert 0 < row["cgroup_peak"] <= 2**30 and row["vm_hwm"] > 0
        assert row["cached_after_drop"] < size // 4, "the page-cache drop did not work"
    # dropped from the page cache first, each row had to read the model from disk
    # (pyspice's loader at load, upstream's mmap by its faults, at load or in the cold run)
    exact, upstream = doc["rows"]["exact"], doc["rows"]["upstream"]
    assert exact["load"]["io"]["read_bytes"] > size // 4
    cold = upstream["cold"]
    upstream_read = sum(
        io["read_bytes"] for io in (upstream["load"]["io"], cold["prefill_io"], cold["decode_io"])
    )
    assert upstream_read > size // 4


def test_a_row_over_the_limit_is_reported_oom_killed_not_a_bench_crash(smolmoe: Path) -> None:
    rc, doc, err = _bench(smolmoe, "exact", "80MiB")
    assert rc == 0, err[-2000:]
    row = doc["rows"]["exact"]
    assert row["status"] == "oom-killed" and row["oom_kills"] >= 1 and row["cold"] is None
    assert "killed by the OOM killer" in row["message"]


def test_a_row_that_fails_fails_the_bench_with_its_reason(smolmoe: Path) -> None:
    rc, doc, err = _bench(smolmoe, "stock,lru", "1GiB")  # lru needs a device tier
    assert rc == 1
    assert doc["rows"]["stock"]["status"] == "ok"
    row = doc["rows"]["lru"]
    assert row["status"] == "error" and "--device-budget" in row["message"]
    assert "bench: row lru failed" in err


def test_the_rule_limit_is_measured_first_and_printed(smolmoe: Path) -> None:
    rc, doc, err = _bench(smolmoe, "exact@ram=50%", "rule")
    assert rc == 0, err[-2000:]
    rule = doc["memory_limit_rule"]
    assert rule["row"] == "exact@ram=1%" and rule["cgroup_peak"] > 0 and rule["routed_bytes"] > 0
    mib = 2**20
    assert doc["memory_limit"] == -(-(rule["cgroup_peak"] + rule["routed_bytes"] // 2) // mib) * mib
    assert doc["rows"]["exact@ram=50%"]["cgroup_limit"] == doc["memory_limit"]
    assert "memory limit" in err and "half of" in err
    # the row's peak RSS is judged against its budget + the floor row's overhead, +5%
    bound = rule["rss_bounds"]["exact@ram=50%"]
    assert bound["vm_hwm"] == doc["rows"]["exact@ram=50%"]["vm_hwm"] and rule["vm_hwm"] > 0
    assert bound["bound"] > rule["vm_hwm"] and "peak RSS against RAM budget" in err


# A SPICE row under the rule's limit takes at most this many times lru's limit hits per
# decoded token, plus an allowance per token for the few a row that fits still takes. With
# the limit set by exact's floor alone, SPICE's draft maps put it 9-11 MiB over the limit
# on smolmoe-b at a 50% RAM budget and it took ~16,000 hits per token to lru's 0
# (docs/results/edge-mode.md, "The rule's floor").
LIMIT_HITS_FACTOR = 4
LIMIT_HITS_ALLOWANCE = 64


def test_spice_under_the_rule_limit_pages_no_more_than_lru(builtin_model: ModelFactory) -> None:
    try:
        system_layout()
    except CgroupError as exc:
        pytest.skip(str(exc))
    model = builtin_model("smolmoe-b")  # with its sidecar (made on first use): SPICE's draft maps
    n, runs = 8, 2
    cmd = [sys.executable, "-m", "pyspice", "bench", "-m", "smolmoe-b", "-n", str(n), "--repeat", str(runs)]
    cmd += ["--prompt-tokens", "32", "-t", "2", "--json", "--policies", "lru,spice:exact"]
    cmd += ["--ram-budget", "50%", "--memory-limit", "rule"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["model"] == str(model)
    hits = {name: row["limit_hits"] / (n * runs) for name, row in doc["rows"].items()}
    assert all(row["status"] == "ok" for row in doc["rows"].values()), doc["rows"]
    assert hits["spice:exact"] <= LIMIT_HITS_FACTOR * hits["lru"] + LIMIT_HITS_ALLOWANCE, hits
    # the limit came from every row's policy at its minimum
    floors = doc["memory_limit_rule"]["floors"]
    assert set(floors) == {"exact@ram=1%", "lru@ram=1%", "spice:exact@ram=1%"}
    assert doc["rows"]["spice:exact"]["tokens"] == doc["rows"]["lru"]["tokens"]  # both lossless
