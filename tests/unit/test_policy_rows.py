"""The row grammar of bench and sim, `NAME[@key=value,...]`, parsed once into a typed row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyspice.cli.main import build_parser, main
from pyspice.measure.bench import check_in_process_rows, row_planning
from pyspice.measure.upstream_rows import UPSTREAM_ROWS
from pyspice.policy.registry import policy_names, policy_spec
from pyspice.policy.rows import PolicyRow, parse_row, parse_rows, split_rows
from pyspice.sim.records import read_records
from pyspice.units import Budget


def test_a_plain_name_is_the_policy_as_it_is() -> None:
    row = parse_row("lru")
    assert row.spec is policy_spec("lru") and row.planning is None and row.ram is None
    assert row.label == "lru"


def test_keys_and_their_shorthands() -> None:
    row = parse_row("spice:exact@plan=det2,ram=2GiB")
    assert (row.planning, row.plan_lag, row.ram) == ("async", 2, Budget(bytes=2 << 30))
    assert row.label == "spice:exact@det2,ram=2GiB"  # the plan short and first
    assert parse_row(row.label) == row
    assert parse_row("spice@async") == parse_row("spice@plan=async")
    assert parse_row("exact@sync").planning == "sync"
    assert parse_row("lru@device=25%").device == Budget(share=0.25)


def test_a_list_keeps_each_rows_keys_with_it() -> None:
    assert split_rows("spice@plan=async,ram=2GiB,lru, exact@ram=50%") == [
        "spice@plan=async,ram=2GiB",
        "lru",
        "exact@ram=50%",
    ]
    rows = parse_rows("upstream,exact@ram=50%", others=("upstream",))
    assert rows[0].spec is None and rows[1].ram == Budget(share=0.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nosuch", "unknown policy 'nosuch'"),
        ("lru@speed=9", "not a key=value"),
        ("spice@plan=det99", "detK"),
        ("exact@ram=2GX", "ram: bad budget '2GX'"),
        ("lru@plan=async", "plans in the hook's call only"),
        ("exact@ram=1GiB,ram=2GiB", "ram is given twice"),
    ],
)
def test_bad_rows_name_the_row_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_row(text)


def test_a_list_has_rows_and_none_twice() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        parse_rows(" , ")
    with pytest.raises(ValueError, match="names row 'spice@async' twice"):
        parse_rows("spice@async,lru,spice@plan=async")


@pytest.mark.parametrize(
    "label",
    ["lru", "spice:exact@async", "spice:fast@det1", "spice:exact@sync", "exact@ram=50%", "lru@ram=25%"],
)
def test_recorded_labels_are_their_rows_labels(label: str) -> None:
    """docs/results and the tests name rows so; a row written any way labels itself so."""
    assert parse_row(label).label == label


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2  # argparse's usage error: nothing ran
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("lru@speed=9", "'speed=9' is not a key=value of the row grammar"),
        ("spice@plan=det99", "plan is sync, async or detK"),
        ("lru@async", "lru plans in the hook's call only"),
        ("nosuch", "unknown policy 'nosuch'"),
    ],
)
def test_a_bad_row_fails_while_the_arguments_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: str, message: str
) -> None:
    missing = str(tmp_path / "missing.gguf")  # never opened: the row fails first
    for argv in (
        ["bench", "-m", missing, "--policies", f"exact,{row}"],
        ["bench", "-m", missing, "--memory-limit", "1GiB", "--policies", f"exact,{row}"],
        ["sim", "-m", missing, "--trace", str(tmp_path / "no-trace"), "--policies", f"exact,{row}"],
    ):
        err = _usage_error(capsys, argv)
        assert f"argument --policies: row {row!r}" in err and message in err, argv
        assert "missing.gguf" not in err


def test_each_command_takes_its_own_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.gguf")
    # llama.cpp's rows are bench's, and the simulator's budgets are its own options
    err = _usage_error(capsys, ["sim", "-m", missing, "--policies", "upstream"])
    assert "row 'upstream': unknown policy" in err
    err = _usage_error(capsys, ["sim", "-m", missing, "--policies", "lru@ram=25%"])
    assert "row 'lru@ram=25%': this command's rows take no ram=" in err
    args = build_parser().parse_args(["bench", "-m", missing, "--policies", "upstream,exact@ram=50%"])
    assert [r.label for r in args.policies] == ["upstream", "exact@ram=50%"]
    # in one process a row's own budget has nowhere to go: said before the model is looked for
    with pytest.raises(ValueError, match="needs --memory-limit"):
        args.func(args)
    with pytest.raises(ValueError, match="no hook to plan in"):
        check_in_process_rows(parse_rows("upstream@async", UPSTREAM_ROWS))


def test_bench_and_sim_get_the_same_row_for_the_same_text(tmp_path: Path) -> None:
    text = "spice:exact@plan=det2,lru,exact@sync"
    parser = build_parser()
    bench = parser.parse_args(["bench", "-m", "m.gguf", "--policies", text]).policies
    sim = parser.parse_args(["sim", "--trace", "t", "--policies", text]).policies
    assert bench == sim == parse_rows(text)
    assert all(isinstance(r, PolicyRow) for r in bench)
    assert [r.label for r in sim] == ["spice:exact@det2", "lru", "exact@sync"]
    planning = row_planning(bench[0])
    assert planning is not None and (planning.asynchronous, planning.deterministic_lag) == (True, 2)
    assert row_planning(bench[1]) is None
    # a bench record read back names each row as it ran
    record = tmp_path / "bench.json"
    record.write_text(json.dumps({"policies": {r.label: {"tpot_ms": 1.0} for r in bench}}))
    (run,) = read_records(record)
    assert [row.policy_row for row in run.rows.values()] == bench


def test_every_spec_says_what_it_reads() -> None:
    for name in policy_names():
        spec = policy_spec(name)
        assert "ids" in spec.inputs
        assert (spec.make() is None) == (spec.kind in ("stock", "native", "auto")), name
        assert spec.reads_sidecar == ("hidden" in spec.inputs and spec.kind == "python"), name
