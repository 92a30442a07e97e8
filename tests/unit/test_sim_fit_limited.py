"""`pyspice sim fit` on `bench --memory-limit --json` documents: their rows read per RAM
budget, the routing they replayed priced as bench replayed it (the window of the trace,
as many times over as each row ran in its process), and the wrong mixes refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyspice.cli.main import main
from pyspice.sim.fit_disk import read_disk_runs, select_disk_runs
from pyspice.sim.workload import ReplayWindow, Workload, repeated

from .test_sim_fit_cli import _inputs


def _row(policy: str, tpot: float | None, *, status: str = "ok", ram: str | None = None) -> dict[str, Any]:
    return {
        "policy": policy,
        "ram_budget": ram,
        "status": status,
        "warm_median": {"tpot_ms": tpot} if tpot is not None else {},
    }


def _limited(path: Path, rows: dict[str, Any], **header: Any) -> Path:
    doc = {
        "model": "m.gguf",
        "memory_limit": 7 << 30,
        "prompt_tokens": 6,
        "n_predict": 5,
        "runs": 3,
        "replay_routing": None,
        "history_predictor": None,
        **header,
        "baseline": "upstream",
        "rows": rows,
    }
    path.write_text(json.dumps(doc) + "\n")
    return path


def test_a_limited_document_is_read_as_one_run_per_ram_budget(tmp_path: Path) -> None:
    rows = {
        "upstream": _row("stock", 90.0),  # llama.cpp's own row: no budget, not a candidate
        "exact@ram=25%": _row("exact", 40.0, ram="25%"),
        "lru@ram=25%": _row("lru", 35.0, ram="25%"),
        "spice@ram=25%": _row("spice", 30.0, ram="25%"),
        "auto@ram=25%": _row("auto", 31.0, ram="25%"),  # what auto chose, not a candidate
        "lru@ram=50%": _row("lru", 20.0, ram="50%"),
        "static@ram=50%": _row("static", None, status="oom", ram="50%"),  # killed: no TPOT
        "exact": _row("exact", 25.0, ram="50%"),  # the command's budget, as the row records it
    }
    path = _limited(tmp_path / "limited.json", rows, replay_routing="trace", history_predictor="h.npz")
    runs = read_disk_runs(path)
    assert [(r.budget, dict(r.measured_ms)) for r in runs] == [
        ("25%", {"exact": 40.0, "lru": 35.0, "spice": 30.0}),
        ("50%", {"lru": 20.0, "exact": 25.0}),
    ]
    for run in runs:
        # a record from before bench kept the decode's start leaves it to the rule
        assert run.replayed == ReplayWindow(6, 5, None) and run.passes == 3
        assert run.routing == "trace" and run.history_predictor == "h.npz"
        assert run.measured_hit == {}  # the rows' counters cover the prompt's batch too
        assert "memory limit" in run.conditions


def test_a_limited_document_says_where_its_replayed_decode_started(tmp_path: Path) -> None:
    rows = {"lru@ram=25%": _row("lru", 3.0, ram="25%")}
    path = _limited(tmp_path / "l.json", rows, replay_routing="trace", replay_decode_start=6)
    (run,) = read_disk_runs(path)
    assert run.replayed == ReplayWindow(6, 5, 6)


def test_a_file_of_limited_documents_is_read_a_line_at_a_time(tmp_path: Path) -> None:
    """Runs at several budgets kept in one file, one `bench --memory-limit --json`
    document per line, are named by line."""
    docs = []
    for budget in ("25%", "12.5%"):
        one = _limited(tmp_path / f"{budget}.json", {f"lru@ram={budget}": _row("lru", 3.0, ram=budget)})
        docs.append(one.read_text().strip())
    path = tmp_path / "runs.json"
    path.write_text("\n".join(docs) + "\n")
    runs = read_disk_runs(path)
    assert [(Path(r.source).name, r.budget) for r in runs] == [
        ("runs.json:1", "25%"),
        ("runs.json:2", "12.5%"),
    ]


def test_runs_of_a_record_file_are_chosen_by_number(tmp_path: Path) -> None:
    docs = []
    for budget in ("25%", "12.5%", "50%"):
        one = _limited(tmp_path / f"{budget}.json", {f"lru@ram={budget}": _row("lru", 3.0, ram=budget)})
        docs.append(one.read_text().strip())
    path = tmp_path / "runs.json"
    path.write_text("\n".join(docs) + "\n")
    assert [r.budget for r in select_disk_runs([f"{path}:3,1"])] == ["25%", "50%"]
    assert len(select_disk_runs([str(path)])) == 3
    with pytest.raises(ValueError, match="has no RAM-budget run 4"):
        select_disk_runs([f"{path}:4"])


def test_a_line_of_several_budgets_is_chosen_whole(tmp_path: Path) -> None:
    rows = {f"lru@ram={b}": _row("lru", 3.0, ram=b) for b in ("25%", "50%")}
    two = _limited(tmp_path / "two.json", rows).read_text().strip()
    one = (
        _limited(tmp_path / "one.json", {"lru@ram=12.5%": _row("lru", 3.0, ram="12.5%")}).read_text().strip()
    )
    path = tmp_path / "runs.json"
    path.write_text(f"{one}\n{two}\n")
    chosen = select_disk_runs([f"{path}:2"])
    assert [(Path(r.source).name, r.budget) for r in chosen] == [
        ("runs.json:2.1", "25%"),
        ("runs.json:2.2", "50%"),
    ]


def test_a_limited_run_of_its_own_routing_keeps_no_window(tmp_path: Path) -> None:
    path = _limited(tmp_path / "own.json", {"lru@ram=25%": _row("lru", 3.0, ram="25%")})
    (run,) = read_disk_runs(path)
    assert run.replayed is None and run.routing is None and run.passes == 3


def _steps(n: int) -> Workload:
    ids = np.zeros((n, 1, 2), np.int32)
    ids[:, 0, 1] = 1
    return Workload.from_arrays(1, [0], 4, ids, prompt_tokens=2)


def test_repeated_runs_the_workload_over_with_the_cold_pass_untimed() -> None:
    once = _steps(5)  # a prompt step, then 3 decode steps
    assert once.decoded_tokens == 3
    thrice = repeated(once, 3)
    assert len(thrice.steps) == 3 * len(once.steps)
    assert thrice.decoded_tokens == 2 * once.decoded_tokens
    assert [s.decode for s in thrice.steps[:4]] == [False] * 4  # the cold pass warms only
    assert [s.decode for s in thrice.steps[4:8]] == [s.decode for s in once.steps]
    with pytest.raises(ValueError, match="at least one pass must be timed"):
        repeated(once, 1)


def test_a_replayed_limited_run_is_fitted_on_the_window_bench_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace, probe, _record = _inputs(tmp_path)
    rows = {"exact@ram=25%": _row("exact", 0.6, ram="25%"), "lru@ram=25%": _row("lru", 0.55, ram="25%")}
    limited = _limited(tmp_path / "limited.json", rows, replay_routing=str(trace))
    out = tmp_path / "fitted.json"
    argv = ["sim", "fit", str(limited), "-m", str(model), "--trace", str(trace), "--probe", str(probe)]
    assert main([*argv, "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "fitted the disk terms to 1 run(s)" in said and out.is_file()


def test_two_budgets_are_fitted_together_and_a_third_predicted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace, probe, _record = _inputs(tmp_path)
    rows = {
        f"{name}@ram={budget}": _row(name, ms, ram=budget)
        for budget, scale in (("12.5%", 1.2), ("25%", 1.0), ("50%", 0.8))
        for name, ms in (("exact", 0.6 * scale), ("lru", 0.55 * scale))
    }
    limited = _limited(tmp_path / "limited.json", rows, replay_routing=str(trace))
    argv = ["sim", "fit", str(limited), "-m", str(model), "--trace", str(trace), "--probe", str(probe)]
    assert main([*argv, "--budget", "12.5%,25%", "-o", str(tmp_path / "f.json")]) == 0
    said = capsys.readouterr().out
    assert (
        "fitted the disk terms to 2 run(s)" in said and "(limited.json:1 12.5%, limited.json:2 25%)" in said
    )
    fitted = {line.split()[1] for line in said.splitlines() if line.startswith("*limited.json")}
    predicted = {line.split()[1] for line in said.splitlines() if line.startswith(" limited.json")}
    assert (fitted, predicted) == ({"12.5%", "25%"}, {"50%"})
    with pytest.raises(SystemExit):  # refused as the flag is parsed, before any simulation
        main([*argv, "--budget", "12.5%,", "-o", str(tmp_path / "g.json")])
    assert "a comma-separated list of RAM budgets" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("second", "extra", "message"),
    [
        ({"prompt_tokens": 8}, [], "different windows"),  # another prompt: another window
        ({"runs": 2}, [], "different windows"),  # other repeats: other warm state
        ({}, ["--history-predictor", "nowhere.npz"], "nowhere.npz does not exist"),
        ({"history_predictor": "gone.npz"}, [], "gone.npz, which is not here"),
    ],
)
def test_runs_that_cannot_be_priced_alike_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    second: dict[str, Any],
    extra: list[str],
    message: str,
) -> None:
    model, trace, probe, _record = _inputs(tmp_path)
    rows = {"exact@ram=25%": _row("exact", 0.6, ram="25%"), "lru@ram=25%": _row("lru", 0.55, ram="25%")}
    first = _limited(tmp_path / "a.json", rows, replay_routing=str(trace))
    other = _limited(tmp_path / "b.json", rows, **{"replay_routing": str(trace), **second})
    argv = ["sim", "fit", str(first), str(other), "-m", str(model), "--trace", str(trace)]
    assert main([*argv, "--probe", str(probe), "-o", str(tmp_path / "x.json"), *extra]) != 0
    assert message in capsys.readouterr().err
