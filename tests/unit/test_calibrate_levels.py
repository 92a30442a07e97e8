"""`pyspice calibrate --levels`: the pick from a measured grid, the options it parses, and the
tuner's run over a stand-in model (no model runs here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pyspice.calibrate import levels_run
from pyspice.calibrate.levels import (
    LOSSLESS,
    Cells,
    Measured,
    complete_pairs,
    merge_record,
    pick_levels,
    ranked,
)
from pyspice.calibrate.levels_run import LevelsOptions, tune_levels
from pyspice.cli.calibrate_cmd import levels_options, run_calibrate
from pyspice.cli.main import build_parser
from pyspice.policy.spice import SurrogateThresholds

BUDGETS = ["25%", "50%"]
SLOTS = {"spice:balanced": "5bit", "spice:fast": "4bit"}


def cell(change: float, host_cut: float, surrogate_rate: float = 0.01, chunks: int = 3) -> dict[str, float]:
    return {"change": change, "host_cut": host_cut, "surrogate_rate": surrogate_rate, "chunks": chunks}


def grid(rows: dict[tuple[float, float], tuple[dict[str, float], dict[str, float]]]) -> Cells:
    """(weight, error) -> (25% cell, 50% cell)."""
    return {(b, w, e): pair[i] for (w, e), pair in rows.items() for i, b in enumerate(BUDGETS)}


def test_ranked_keeps_pairs_within_the_margin_at_every_budget_largest_smallest_cut_first() -> None:
    results = grid(
        {
            # within 0.6 x 1% at both budgets; smallest cut 0.20
            (0.05, 0.5): (cell(0.004, 0.20), cell(0.002, 0.50)),
            # larger cuts, but past the margin at 50% (+0.7% > 0.6%)
            (0.05, 0.6): (cell(0.005, 0.30), cell(0.007, 0.60)),
            # within, smallest cut 0.25: the best
            (0.05, 0.55): (cell(0.006, 0.25), cell(-0.01, 0.55)),
            # within but cuts nothing at 25%: earns no loss
            (0.05, 0.45): (cell(-0.02, 0.0), cell(-0.01, 0.40)),
        }
    )
    pairs = complete_pairs(results, BUDGETS)
    assert ranked(results, BUDGETS, pairs, 0.01, 0.6) == [(0.05, 0.55, 0.25), (0.05, 0.5, 0.20)]
    # the full bound (margin 1) lets 0.6 in, and it cuts the most
    assert ranked(results, BUDGETS, pairs, 0.01, 1.0)[0] == (0.05, 0.6, 0.30)


def test_ranked_breaks_a_tie_in_cut_by_the_larger_substitution() -> None:
    results = grid(
        {
            (0.05, 0.5): (cell(0.0, 0.2, 0.001), cell(0.0, 0.3, 0.001)),
            (0.04, 0.5): (cell(0.0, 0.2, 0.003), cell(0.0, 0.3, 0.002)),
        }
    )
    assert [p[:2] for p in ranked(results, BUDGETS, complete_pairs(results, BUDGETS), 0.01, 0.6)] == [
        (0.04, 0.5),
        (0.05, 0.5),
    ]


def test_complete_pairs_leaves_out_a_pair_missing_a_budget() -> None:
    results = grid({(0.05, 0.5): (cell(0.0, 0.1), cell(0.0, 0.1))})
    results[("25%", 0.05, 0.7)] = cell(0.0, 0.9)
    assert complete_pairs(results, BUDGETS) == [(0.05, 0.5)]


def measured_grid() -> Measured:
    """5-bit cells where balanced keeps (0.05, 0.5) over (0.05, 0.45); 4-bit cells that all
    pass fast's margin (3%), so fast keeps none of them only when every one cuts nothing."""
    out: Measured = {}
    five = {
        (0.05, 0.45): (cell(0.001, 0.15), cell(0.0, 0.4)),
        (0.05, 0.5): (cell(0.003, 0.22), cell(0.002, 0.5)),
        (0.05, 0.6): (cell(0.02, 0.30), cell(0.01, 0.6)),  # past 0.6%
    }
    four = {(0.05, 0.5): (cell(0.01, -0.05), cell(0.01, 0.2)), (0.05, 0.6): (cell(0.04, 0.3), cell(0.0, 0.3))}
    for slots, rows in (("5bit", five), ("4bit", four)):
        for (b, w, e), c in grid(rows).items():
            out[(slots, b, w, e)] = c
    return out


def test_each_level_picks_from_its_own_slots_and_one_no_pair_keeps_is_lossless() -> None:
    lines: list[str] = []
    picks = pick_levels(measured_grid(), BUDGETS, 0.6, SLOTS, say=lines.append)
    assert picks["spice:balanced"] == SurrogateThresholds(0.05, 0.5)
    # fast's 4-bit pairs: (0.05, 0.5) cuts nothing at 25%, (0.05, 0.6) is past 0.6 x 5% there
    assert picks["spice:fast"] == LOSSLESS and SurrogateThresholds(0.0, 0.0) == LOSSLESS
    assert any("spice:fast" in line and "lossless" in line for line in lines)
    assert any("surrogate_max_error=0.5" in line and "meets" in line for line in lines)


def test_validation_takes_the_next_pair_down_and_checks_no_more_than_it_needs() -> None:
    asked: list[tuple[str, float]] = []

    def holds(level: str, slots: str, bound: float, w: float, e: float) -> bool:
        asked.append((level, e))
        return e != 0.5  # the calibration grid's first pick fails on the held-out split

    picks = pick_levels(measured_grid(), BUDGETS, 0.6, SLOTS, holds=holds)
    assert picks["spice:balanced"] == SurrogateThresholds(0.05, 0.45)
    assert asked == [("spice:balanced", 0.5), ("spice:balanced", 0.45)]
    # every candidate failing: lossless
    picks = pick_levels(measured_grid(), BUDGETS, 0.6, SLOTS, holds=lambda *_: False)
    assert picks["spice:balanced"] == LOSSLESS


def test_a_level_whose_slots_were_not_measured_is_left_out() -> None:
    only_five = {k: v for k, v in measured_grid().items() if k[0] == "5bit"}
    assert set(pick_levels(only_five, BUDGETS, 0.6, SLOTS)) == {"spice:balanced"}


def test_merge_keeps_the_cell_measured_on_more_chunks() -> None:
    measured: Measured = {("5bit", "25%", 0.05, 0.5): cell(0.01, 0.1, chunks=3)}
    exact: dict[str, dict[str, float]] = {}
    doc = {
        "model": "m.gguf",
        "minutes": 2.5,
        "exact": {b: {"ppl": 20.0} for b in BUDGETS},
        "grid": [
            {"slots": "5bit", "budget": "25%", "weight": 0.05, "error": 0.5, **cell(0.02, 0.2, chunks=6)},
            {"slots": "5bit", "budget": "50%", "weight": 0.05, "error": 0.5, **cell(0.03, 0.3, chunks=2)},
            {"budget": "25%", "weight": 0.05, "error": 0.7, **cell(0.0, 0.0)},  # before slot precisions
        ],
    }
    assert merge_record(measured, exact, doc, "m.gguf", BUDGETS) == 2.5
    assert measured[("5bit", "25%", 0.05, 0.5)]["chunks"] == 6
    assert measured[("5bit", "50%", 0.05, 0.5)]["change"] == 0.03
    assert ("exact", "25%", 0.05, 0.7) in measured and exact["50%"] == {"ppl": 20.0}
    with pytest.raises(ValueError, match="not a run of"):
        merge_record(measured, exact, doc, "other.gguf", BUDGETS)


def parse(*words: str) -> Any:
    return build_parser().parse_args(["calibrate", *words])


def test_cli_levels_options_parse_into_levels_options() -> None:
    args = parse(
        "-m", "x.gguf", "--levels", "--budgets", "25%,50%", "--errors", "0.45,0.5,0.55", "--chunks", "6",
        "-t", "1", "--json", "--plot", "g.png", "--dry-run", "--no-validate", "--margin", "0.5",
    )  # fmt: skip
    assert args.levels and args.json and args.plot == Path("g.png")
    options = levels_options(args)
    assert options.budgets == ("25%", "50%") and options.errors == (0.45, 0.5, 0.55)
    assert (options.chunks, options.threads, options.margin, options.validate) == (6, 1, 0.5, False)
    assert not options.write and options.weights == (0.05,)


def test_cli_levels_defaults_are_the_tuners() -> None:
    options = levels_options(parse("--levels"))
    assert options == LevelsOptions()  # 25%,50%; weight 0.05; errors 0.5-0.7; 3 chunks; margin 0.6; -t 2
    assert options.threads == 2 and options.write and options.validate


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--levels", "--rank", "4"], "--rank: --levels tunes"),
        (["--levels", "-f", "t.txt"], "-f: --levels tunes"),
        (["--budgets", "25%"], "--budgets: only with --levels"),
        (["--dry-run"], "--dry-run: only with --levels"),
        (["--levels", "--merge", "g.json"], "add --dry-run"),
        (["--levels", "--plan-lag", "1"], "--planning async"),
        (["--levels", "--replot", "g.json"], "--plot"),
    ],
)
def test_cli_refuses_options_of_the_other_mode_before_any_model_loads(words: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_calibrate(parse("-m", "missing.gguf", *words))


def test_cli_bad_budget_or_threshold_is_a_parse_error() -> None:
    for words in (["--budgets", "25%,lots"], ["--errors", "0.5,-1"]):
        with pytest.raises(SystemExit):
            parse("--levels", *words)


class FakeLlama:
    """Stands in for pyspice.api.Llama: a policy's perplexity and host misses by its thresholds."""

    def __init__(self, budget: str) -> None:
        self.budget, self.policy = budget, "spice:exact"

    def set_policy(self, policy: Any) -> None:
        self.policy = policy if isinstance(policy, str) else policy.config

    def spice_reset_stats(self) -> None:
        pass

    def spice_stats(self) -> dict[str, Any]:
        if isinstance(self.policy, str):
            return {"activations": 1000, "misses": {"surrogate": 0, "host": 200}, "hit_rate": 0.8}
        e = self.policy.surrogate_max_error
        return {
            "activations": 1000,
            "misses": {"surrogate": int(e * 100), "host": 200 - int(e * 200)},
            "hit_rate": 0.8,
        }

    def ppl(self) -> float:
        if isinstance(self.policy, str):
            return 20.0
        bits = 0.5 if self.policy.slot_precision == "5bit" else 0.9
        return 20.0 * (1.0 + bits * (self.policy.surrogate_max_error - 0.5) / 10)

    def spice_surrogates(self) -> Any:
        return type("S", (), {"count": 7})()

    def close(self) -> None:
        pass


def test_tune_levels_runs_the_grid_validates_and_writes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import pyspice.api
    import pyspice.measure.perplexity

    opened: list[str] = []

    def from_config(config: Any, **_: Any) -> FakeLlama:
        opened.append(config.device_budget)
        return FakeLlama(config.device_budget)

    written: dict[str, Any] = {}
    monkeypatch.setattr(pyspice.api.Llama, "from_config", staticmethod(from_config))
    monkeypatch.setattr(
        pyspice.measure.perplexity, "perplexity", lambda llm, *a, **k: type("R", (), {"ppl": llm.ppl()})()
    )
    monkeypatch.setattr(levels_run, "corpus_part", lambda part, name: type("T", (), {"text": part})())
    monkeypatch.setattr(
        levels_run, "with_levels", lambda path, picks, tuned: written.update(picks=picks, tuned=tuned) or path
    )
    out = tmp_path / "tables.txt"
    options = LevelsOptions(errors=(0.5, 0.52, 0.6, 0.8), threads=1)
    with out.open("w") as fh:
        result = tune_levels(
            tmp_path / "m.gguf",
            tmp_path / "m.spice.gguf",
            options,
            say=lambda _m: None,
            out=fh,
            progress=False,
        )
    # 5-bit: +0.5% per 0.1 of error, so 0.6 (+0.5%) is the largest within 0.6 x 1%;
    # 4-bit: +0.9% per 0.1, so 0.8 (+2.7%) is within 0.6 x 5%
    assert result.picks == {
        "spice:balanced": SurrogateThresholds(0.05, 0.6),
        "spice:fast": SurrogateThresholds(0.05, 0.8),
    }
    assert written["picks"] == result.picks and "pyspice calibrate --levels" in written["tuned"]
    # one instance per budget for the grid, one per checked (budget, pick) on the held-out split
    assert opened == ["25%", "50%"] + ["25%", "50%"] * 2
    doc = json.loads(json.dumps(result.doc))
    assert len(doc["grid"]) == 2 * 2 * 4 and doc["picks"]["spice:fast"] == {
        "max_weight": 0.05,
        "max_error": 0.8,
    }
    assert "held-out split" in out.read_text() and "4bit slots" in out.read_text()
