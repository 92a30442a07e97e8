"""`bench --memory-limit` without a model: where row cgroups go (a fake cgroup root in
tmp_path), their files, the page-cache drop, the argument errors, and the table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pyspice.cli import bench_limited
from pyspice.cli.common import run_config as command_config
from pyspice.cli.main import build_parser
from pyspice.cli.numbers import byte_size
from pyspice.engine.config import RunConfig
from pyspice.measure import memory_rule, pagecache
from pyspice.measure.isolated_row import RowSpec, config_fields, run_config
from pyspice.measure.limited_bench import RowOutcome
from pyspice.measure.limited_report import format_limited_table, limited_document
from pyspice.measure.memlimit import CgroupError, CgroupLayout, MemoryCgroup, find_layout
from pyspice.measure.upstream_rows import UPSTREAM_ROWS
from pyspice.policy.rows import PolicyRow, parse_rows

V1_SELF = "4:memory:/jobs/me\n1:cpu:/\n0::/\n"


def _v1_mounts(root: Path) -> str:
    return (
        f"cgroup {root / 'cpu'} cgroup rw,relatime,cpu 0 0\n"
        f"cgroup {root / 'memory'} cgroup rw,relatime,memory 0 0\n"
        f"cgroup2 {root / 'unified'} cgroup2 rw,relatime 0 0\n"
    )


def _v2_root(root: Path, controllers: str = "cpu memory io") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    return root


def test_v1_rows_go_under_this_process_memory_cgroup(tmp_path: Path) -> None:
    own = tmp_path / "memory" / "jobs" / "me"
    own.mkdir(parents=True)
    _v2_root(tmp_path / "unified", "hugetlb")  # a hybrid machine: v2 mounted without memory
    layout = find_layout(_v1_mounts(tmp_path), V1_SELF)
    assert layout == CgroupLayout(1, own)


def test_v1_without_this_process_cgroup_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    with pytest.raises(CgroupError, match=r"does not exist.*run as root.*leave --memory-limit out"):
        find_layout(_v1_mounts(tmp_path), V1_SELF)


def test_v2_own_cgroup_when_memory_is_delegated_there_else_the_root(tmp_path: Path) -> None:
    root = _v2_root(tmp_path / "cg2")
    own = root / "user" / "me"
    own.mkdir(parents=True)
    mounts = f"cgroup2 {root} cgroup2 rw 0 0\n"
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    assert find_layout(mounts, "0::/user/me\n") == CgroupLayout(2, root)
    (own / "cgroup.subtree_control").write_text("memory\n")
    assert find_layout(mounts, "0::/user/me\n") == CgroupLayout(2, own)


def test_v2_without_memory_delegated_names_the_fix(tmp_path: Path) -> None:
    root = _v2_root(tmp_path / "cg2")
    (root / "cgroup.subtree_control").write_text("cpu\n")
    with pytest.raises(CgroupError, match=r"'memory' is not in cgroup.subtree_control.*run as root"):
        find_layout(f"cgroup2 {root} cgroup2 rw 0 0\n", "0::/\n")


def test_no_memory_controller_at_all(tmp_path: Path) -> None:
    _v2_root(tmp_path / "cg2", "cpu io")
    with pytest.raises(CgroupError, match=r"no memory controller.*leave --memory-limit out"):
        find_layout(f"cgroup2 {tmp_path / 'cg2'} cgroup2 rw 0 0\n", "0::/\n")
    with pytest.raises(CgroupError, match=r"no cgroup memory controller is mounted \(/proc/mounts\)"):
        find_layout("proc /proc proc rw 0 0\n", "0::/\n")


def test_not_writable_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memory" / "jobs" / "me").mkdir(parents=True)
    monkeypatch.setattr("pyspice.measure.memlimit.os.access", lambda path, mode: False)
    with pytest.raises(CgroupError, match=r"is not writable.*run as root"):
        find_layout(_v1_mounts(tmp_path), V1_SELF)


def test_v1_cgroup_files(tmp_path: Path) -> None:
    cg = MemoryCgroup(CgroupLayout(1, tmp_path), "row-0", 150 * 2**20, limit_swap=False)
    assert cg.path == tmp_path / "row-0" and cg.path.is_dir()
    assert (cg.path / "memory.limit_in_bytes").read_text() == f"{150 * 2**20}\n"
    assert cg.limit == 150 * 2**20 and cg.procs_file == cg.path / "cgroup.procs"
    assert cg.peak() is None and cg.oom_kills() == 0 and cg.limit_hits() == 0  # files absent: none yet
    (cg.path / "memory.max_usage_in_bytes").write_text("123456\n")
    (cg.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (cg.path / "memory.failcnt").write_text("17\n")
    assert (cg.peak(), cg.oom_kills(), cg.limit_hits()) == (123456, 2, 17)
    (cg.path / "memory.memsw.failcnt").write_text("3\n")
    assert cg.limit_hits() == 20


def test_v2_cgroup_files_and_a_leftover_cgroup(tmp_path: Path) -> None:
    (tmp_path / "row-1").mkdir()
    (tmp_path / "row-1" / "memory.swap.max").write_text("max\n")
    with pytest.raises(OSError):  # left by a killed run and not empty: rmdir says so
        MemoryCgroup(CgroupLayout(2, tmp_path), "row-1", 4096)
    (tmp_path / "row-1" / "memory.swap.max").unlink()
    cg = MemoryCgroup(CgroupLayout(2, tmp_path), "row-1", 4096, limit_swap=True)
    assert (cg.path / "memory.max").read_text() == "4096\n"
    (cg.path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    (cg.path / "memory.peak").write_text("8192\n")
    assert (cg.peak(), cg.oom_kills(), cg.limit_hits()) == (8192, 1, 5)
    for f in cg.path.iterdir():
        f.unlink()
    cg.remove()
    assert not cg.path.exists()


def test_page_cache_drop(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * (4 * 2**20))
    path.read_bytes()
    if pagecache.resident_bytes(path) == 0:
        pytest.skip("this file system keeps no page cache for tmp_path")
    pagecache.drop(path)
    left = pagecache.resident_bytes(path)
    if left == path.stat().st_size:
        pytest.skip("tmp_path is on tmpfs: its pages are the file, DONTNEED cannot drop them")
    assert left == 0


def test_memory_limit_takes_sizes_not_shares() -> None:
    parse = byte_size()
    assert parse("2GiB") == 2 * 2**30 and parse("512MiB") == 512 * 2**20 and parse("1000") == 1000
    for bad in ("50%", "lots", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--memory-limit", "50%"])


def test_memory_limit_rule_is_the_highest_floor_plus_half_the_routed_experts() -> None:
    assert build_parser().parse_args(["bench", "--memory-limit", "rule"]).memory_limit == memory_rule.RULE
    assert bench_limited.parse_memory_limit(" Rule ") == memory_rule.RULE
    # exact always has a floor row; every other pyspice policy among the rows one of its own
    assert memory_rule.floor_policies(["upstream", "lru", "spice:exact", "lru"]) == [
        "exact",
        "lru",
        "spice:exact",
    ]
    assert memory_rule.floor_policies(["upstream"]) == ["exact"]
    mib = 2**20
    peaks = {"exact": 200 * mib + 5, "spice:exact": 209 * mib}
    specs = [RowSpec(memory_rule.floor_row_name(p), p, {}, [1, 2], 2, 2) for p in peaks]
    seen: list[tuple[str, int]] = []

    def measure(row: RowSpec, limit: int) -> RowOutcome:
        seen.append((row.row, limit))
        return RowOutcome(row, cgroup_peak=peaks[row.policy], vm_hwm=peaks[row.policy] + 20 * mib)

    rule = memory_rule.rule_limit(specs, 54 * mib, measure)
    # the higher floor (SPICE's, with its draft maps) + 27 MiB, up to the next MiB
    assert rule.limit == 236 * mib and rule.highest == "spice:exact"
    assert seen == [(s.row, memory_rule.physical_memory()) for s in specs]
    record = rule.record()
    assert record["row"] == "spice:exact@ram=1%" and record["cgroup_peak"] == 209 * mib
    assert set(record["floors"]) == {"exact@ram=1%", "spice:exact@ram=1%"}  # type: ignore[arg-type]
    # a row's need: its own floor's peak + its budget beyond the floor's 1%
    assert rule.need("spice:exact", "50%") == 209 * mib + int(54 * mib * 0.5) - int(54 * mib * 0.01)
    assert rule.need("spice:exact", None) is None and rule.need("upstream", "50%") is None
    assert memory_rule.over_limit_rows(rule, [("spice:exact", "spice:exact", "50%")]) == []
    (over,) = memory_rule.over_limit_rows(rule, [("spice:exact@ram=80%", "spice:exact", "80%")])
    assert "row spice:exact@ram=80% needs about" in over and "over the limit 236.00 MiB" in over

    def oom(row: RowSpec, limit: int) -> RowOutcome:
        return RowOutcome(row, status="oom-killed", message="the kernel killed it")

    with pytest.raises(RuntimeError, match=r"exact@ram=1% row that sets the limit ended oom-killed"):
        memory_rule.rule_limit(specs, 54 * mib, oom)
    # model pages another process kept cached were never charged to the floor row
    assert memory_rule.rule_warning(rule.highest_outcome) is None
    held = RowOutcome(specs[0], cgroup_peak=113 * mib, cached_before=126 * mib)
    assert "126.00 MiB of the model stayed in the page cache" in (memory_rule.rule_warning(held) or "")


def test_rss_bound_is_the_budget_plus_its_policys_floor_overhead_plus_five_percent() -> None:
    mib = 2**20
    whole = 100 * mib  # the floor's 1% budget is 1 MiB of it
    floors = {
        "exact": RowOutcome(RowSpec("exact@ram=1%", "exact", {}, [1], 2, 2), cgroup_peak=1, vm_hwm=201 * mib),
        "spice:exact": RowOutcome(
            RowSpec("spice:exact@ram=1%", "spice:exact", {}, [1], 2, 2), cgroup_peak=1, vm_hwm=206 * mib
        ),
    }
    rule = memory_rule.RuleLimit(300 * mib, floors, "spice:exact", whole)
    rows = [
        ("upstream", "upstream", None),
        ("exact@ram=50%", "exact", "50%"),
        ("spice:exact", "spice:exact", "25%"),
    ]
    outcomes = [
        RowOutcome(RowSpec(name, policy, {}, [1], 2, 2), vm_hwm=hwm * mib)
        for (name, policy, _), hwm in zip(rows, (300, 262, 242), strict=True)
    ]
    bounds = memory_rule.rss_bounds(rows, outcomes, rule)
    assert "upstream" not in bounds  # no RAM budget, no bound
    assert bounds["exact@ram=50%"] == {"vm_hwm": 262 * mib, "bound": int(250 * mib * 1.05), "met": True}
    # SPICE's own floor, with its draft maps, sets its overhead
    assert bounds["spice:exact"]["bound"] == int(230 * mib * 1.05)
    assert bounds["spice:exact"]["met"] is False
    text = memory_rule.format_rss_bounds(bounds)
    assert "exact@ram=50%: 262.00 MiB against 262.50 MiB: met" in text
    assert "spice:exact: 242.00 MiB against 241.50 MiB: over by 512.00 KiB" in text


def _rows(text: str) -> list[PolicyRow]:
    args = build_parser().parse_args(["bench", "-m", "x.gguf", "--memory-limit", "1GiB", "--policies", text])
    bench_limited.check_rows(args.policies)
    rows: list[PolicyRow] = args.policies
    return rows


def test_rows() -> None:
    rows = _rows("upstream, stock,exact,spice:exact@plan=async,ram=2GiB")
    assert [(r.label, r.name, r.ram_text) for r in rows] == [
        ("upstream", "upstream", ""),
        ("stock", "stock", ""),
        ("exact", "exact", ""),
        ("spice:exact@async,ram=2GiB", "spice:exact", "2GiB"),
    ]
    for bad in ("upstream@ram=50%", "upstream@async"):
        with pytest.raises(ValueError, match=r"upstream is plain llama\.cpp"):
            _rows(bad)


def test_a_row_ram_budget_reaches_the_row_config_and_upstream_gets_none(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    args = build_parser().parse_args(
        ["bench", "-m", str(model), "--memory-limit", "1GiB", "--ram-budget", "25%"]
    )
    row, plain, up, planned = parse_rows("exact@ram=50%,lru,upstream,spice:exact@det2", UPSTREAM_ROWS)
    assert bench_limited.row_config(args, row, 2).ram_budget == "50%"
    assert bench_limited.row_config(args, plain, 2).ram_budget == "25%"  # the global flag
    assert bench_limited.row_config(args, up, 2).ram_budget is None
    config = bench_limited.row_config(args, planned, 2)
    assert (config.planning.asynchronous, config.planning.deterministic_lag) == (True, 2)
    assert bench_limited.row_config(args, plain, 2).planning == command_config(args, "lru").planning


def test_replayed_routing_reaches_the_pyspice_rows_not_upstream(tmp_path: Path) -> None:
    """Under a memory limit the pyspice rows replay a trace (their hook swaps the ids);
    plain llama.cpp has no hook, so its row keeps the model's own routing."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    args = build_parser().parse_args(
        ["bench", "-m", str(model), "--memory-limit", "1GiB", "--replay-routing", str(tmp_path / "t")]
    )
    row, up = parse_rows("lru@ram=25%,upstream", UPSTREAM_ROWS)
    assert bench_limited.row_config(args, row, 2).replay_routing == tmp_path / "t"
    assert bench_limited.row_config(args, up, 2).replay_routing is None


def _bench_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "-m", "x.gguf", "--memory-limit", "1GiB", *extra])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--repeat", "1"], "--repeat of at least 2"),
        (["-n", "1"], "-n of at least 2"),
        (["--trace", "t"], "leave it out with --memory-limit"),
        (["--policies", "stock,exact", "--baseline", "lru"], "baseline 'lru' is not among"),
    ],
)
def test_argument_errors_come_before_any_work(extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench_limited.run(_bench_args(*extra))


def test_row_spec_round_trips_a_run_config(tmp_path: Path) -> None:
    cfg = RunConfig(model=tmp_path / "m.gguf", policy="exact", threads=2, sidecar=tmp_path / "s.gguf")
    spec = RowSpec("exact", "exact", config_fields(cfg), [1, 2, 3], 4, 2)
    back = RowSpec.from_json(spec.to_json())
    assert back == spec and run_config(back) == cfg


def _outcome(row: str, status: str, tpot: float | None, tokens: list[int]) -> RowOutcome:
    spec = RowSpec(row, row, {}, [1], 4, 2)
    runs = []
    if tpot is not None:
        run = {"tpot_ms": tpot, "prefill_tps": 100.0, "read_bytes_per_token": 2**20, "rchar_per_token": 0}
        runs = [dict(run, tokens=tokens), dict(run, tokens=tokens, tpot_ms=tpot / 2)]
    return RowOutcome(spec, status=status, runs=runs, cgroup_peak=3 * 2**20, vm_hwm=2 * 2**20)


def test_table_reports_an_oom_killed_row_as_such() -> None:
    rows = [
        _outcome("upstream", "ok", 10.0, [5, 6, 7, 8]),
        _outcome("exact", "ok", 4.0, [5, 6, 7, 8]),
        _outcome("lru", "ok", 4.0, [5, 6, 7, 9]),
        _outcome("stock", "oom-killed", None, []),
    ]
    rows[3].oom_kills, rows[3].message = 1, "killed by the OOM killer under the 4096-byte limit"
    table = format_limited_table(rows, "upstream", 150 * 2**20, 1).splitlines()
    exact = next(line for line in table if line.startswith("exact "))
    assert " 0.40 " in exact and exact.rstrip().endswith("yes")  # warm TPOT 2.0 / 5.0
    assert next(line for line in table if line.startswith("lru ")).rstrip().endswith("NO")
    stock = next(line for line in table if line.startswith("stock "))
    assert "oom-killed" in stock and stock.split()[-3:] == ["1", "0", "-"]
    assert "stock: oom-killed: killed by the OOM killer" in table[-1]
    doc = limited_document(rows, "upstream", {"memory_limit": 1})
    assert doc["rows"]["stock"]["status"] == "oom-killed" and doc["rows"]["exact"]["same_tokens"] == "yes"
    assert doc["rows"]["exact"]["warm_median"]["tpot_ms"] == 2.0


def test_replayed_rows_are_timing_only_and_an_auto_row_keeps_its_choice() -> None:
    """Rows that replay recorded routing have no model output to compare with upstream's;
    they are checked for the same tokens in every repeat (each replays from the trace's
    start), and an `auto` row's record says what it chose."""
    base = _outcome("upstream", "ok", 10.0, [5, 6, 7, 8])
    replayed = _outcome("lru", "ok", 4.0, [1, 2, 3, 4])
    replayed.spec.config["replay_routing"] = "trace-dir"
    drifting = _outcome("exact", "ok", 4.0, [1, 2, 3, 4])
    drifting.spec.config["replay_routing"] = "trace-dir"
    drifting.runs[1]["tokens"] = [1, 2, 3, 9]
    auto = _outcome("auto", "ok", 4.0, [1, 2, 3, 4])
    auto.spec.config["replay_routing"] = "trace-dir"
    auto.load = {"seconds": 1.0, "auto": {"chose": "lru", "simulated_tpot_ms": {"lru": 3.0}}}
    doc = limited_document([base, replayed, drifting, auto], "upstream", {"memory_limit": 1})
    assert doc["rows"]["lru"]["same_tokens"] == "timing only"
    assert doc["rows"]["exact"]["same_tokens"] == "NO (runs differ)"
    assert doc["rows"]["auto"]["auto"]["chose"] == "lru" and "auto" not in doc["rows"]["lru"]
    assert doc["rows"]["upstream"]["same_tokens"] == "yes"


def test_disk_probe_times_reads_of_the_file(tmp_path: Path) -> None:
    from pyspice.engine.disk_probe import measure_disk

    path = tmp_path / "model.bin"
    path.write_bytes(bytes(1 << 20))
    figures = measure_disk(path, 64 * 1024, latency_reads=8, seconds=0.05)
    assert figures.gbps > 0 and figures.latency_us > 0
