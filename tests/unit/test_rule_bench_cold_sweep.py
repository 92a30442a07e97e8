"""tools/rule-bench-cold-sweep.py: spice-rule-bench's table read back per rule, the
sweep's markdown (a row per amount touched), and bad input refused with what to do."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.script_module import load_script as load_script_file

BENCH_OUTPUT = """3 layers x 64 experts, top-6, n_embd 2048, budget 25%, 50 calls, cold caches (2 MiB ...)
rule        rule p50  rule mean    store p50   store mean       hit
ondemand         219        250         1200         1300     0.000
lru              611        640         1240         1401     0.332
"""


def load_script() -> ModuleType:
    return load_script_file("rule-bench-cold-sweep.py")


def test_rows_are_read_per_rule() -> None:
    rows = load_script().parse_rows(BENCH_OUTPUT)
    assert list(rows) == ["ondemand", "lru"]
    assert rows["lru"] == {
        "rule_p50_ns": 611.0,
        "rule_mean_ns": 640.0,
        "store_p50_ns": 1240.0,
        "store_mean_ns": 1401.0,
        "hit": 0.332,
    }


def test_a_row_it_cannot_read_is_named() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_script().parse_rows(BENCH_OUTPUT + "lru 1 2\n")
    with pytest.raises(ValueError, match="no rows"):
        load_script().parse_rows(BENCH_OUTPUT.splitlines()[0] + "\nheader\n")


def test_markdown_has_a_row_per_amount_and_a_column_per_rule() -> None:
    script = load_script()
    rows = script.parse_rows(BENCH_OUTPUT)
    colder = {name: dict(row, rule_p50_ns=row["rule_p50_ns"] * 2) for name, row in rows.items()}
    table = script.markdown([{"mib": 2, "rules": rows}, {"mib": 96, "rules": colder}]).splitlines()
    assert table[0] == "| MiB touched | ondemand | lru |"
    assert table[2] == "| 2 | 219 | 611 |"
    assert table[3] == "| 96 | 438 | 1222 |"


@pytest.mark.parametrize("text", ["0", "8,x", "", "5000"])
def test_bad_amounts_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--mib"):
        load_script().parse_mib(text)


def test_a_saved_sweep_is_drawn_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script()
    rows = script.parse_rows(BENCH_OUTPUT)
    saved = tmp_path / "sweep.json"
    saved.write_text(
        '{"bench": "3 layers x 64 experts, cold caches (8 MiB)", "sweep": '
        + json.dumps([{"mib": 8, "rules": rows}, {"mib": 96, "rules": rows}])
        + "}"
    )
    out = tmp_path / "sweep.png"
    monkeypatch.setattr("sys.argv", ["rule-bench-cold-sweep.py", "--replot", str(saved), "--plot", str(out)])
    assert script.main() == 0
    assert out.stat().st_size > 0
