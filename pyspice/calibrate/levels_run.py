"""Measuring the lossy levels' threshold grid on a model and writing the picks into its sidecar.

`pyspice calibrate --levels` runs this on a model whose sidecar is already
calibrated (pyspice.calibrate.levels explains what is chosen and how). One
instance of the model per device budget scores `spice:exact` and then every
(slot precision, weight, error) cell of the grid on the calibration split of
the model's corpus, 512-token chunks token by token, every cell planning the
way the lossy levels plan at these threads; the picks are then checked on the
held-out split, each held-out run in an instance of its own (only the few
candidates are checked, and two instances of a large model at once would not
fit where one does). This module runs the model, so it sits beside
pyspice.measure in the layering.

    pyspice calibrate -m smolmoe-b --levels --budgets 25%,50% --chunks 3 \\
        --json --plot grid.png > grid.json
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from tqdm import tqdm

from pyspice.calibrate.levels import (
    Cell,
    Cells,
    Measured,
    grid_table,
    merge_record,
    pick_levels,
    plot,
    plot_path,
    record,
    split_by_slots,
    tuned_on,
)
from pyspice.engine import RunConfig
from pyspice.engine.planning import Planning
from pyspice.formats.sidecar import with_levels
from pyspice.models.builtin import builtin_of
from pyspice.models.smolmoe_recipe import RECIPE_NAME, corpus_part
from pyspice.policy.spice import LEVEL_BOUNDS, SpiceConfig, SpicePolicy, SurrogateThresholds, spice_config

if TYPE_CHECKING:
    from pyspice.api import Llama
    from pyspice.policy.spice.config import SlotPrecision

CHUNK = 512  # tokens per scored chunk


@dataclass(frozen=True)
class LevelsOptions:
    """What `pyspice calibrate --levels` measures and how it picks (its options' defaults)."""

    budgets: tuple[str, ...] = ("25%", "50%")
    # the MoEfied built-in models' gate weights all lie within 0.031-0.033 (near-flat
    # routers over 32 experts): a weight limit of 0.05 passes every miss, and limits
    # inside that range pass only the router's weakest picks (docs/results/quality-levels.md)
    weights: tuple[float, ...] = (0.05,)
    errors: tuple[float, ...] = (0.5, 0.55, 0.6, 0.65, 0.7)
    chunks: int = 3  # calibration chunks scored per cell
    margin: float = 0.6  # share of each level's bound a pick may use on calibration text
    threads: int = 2
    planning: Planning = field(default_factory=Planning)
    validate: bool = True  # check the picks on the held-out split against the full bound
    validate_chunks: int = 6
    merge: tuple[Path, ...] = ()  # earlier runs' records whose cells join this grid
    write: bool = True  # write the picks into the sidecar

    def __post_init__(self) -> None:
        if not self.budgets:
            raise ValueError("--budgets: at least one device budget is needed")
        if self.chunks < 1 or self.validate_chunks < 1:
            raise ValueError("--chunks and --validate-chunks must be at least 1")
        if not 0.0 < self.margin <= 1.0:
            raise ValueError(f"--margin is a share of each level's bound, in (0, 1]; got {self.margin:g}")
        if self.merge and self.write:
            # merged cells were measured with the slots and planning of their own run
            raise ValueError("--merge: picks from joined runs are only printed; add --dry-run")


@dataclass
class LevelsResult:
    model: str
    budgets: tuple[str, ...]
    picks: dict[str, SurrogateThresholds]
    by_slots: dict[str, Cells]
    doc: dict[str, Any]  # the run's record (--json)
    written: Path | None  # the sidecar the picks went into


def _score(llm: Llama, text: str, chunks: int) -> Cell:
    from pyspice.measure.perplexity import perplexity

    llm.spice_reset_stats()
    ppl = perplexity(llm, text, CHUNK, max_chunks=chunks).ppl
    stats = llm.spice_stats()
    n = max(1, int(stats["activations"]))
    return {
        "ppl": ppl,
        "surrogate_rate": stats["misses"]["surrogate"] / n,
        "host_rate": stats["misses"]["host"] / n,
        "hit_rate": float(stats["hit_rate"]),
    }


def _level_config(weight: float, error: float, slots: str) -> SpiceConfig:
    """spice:fast's rule with this pair's thresholds and these slots."""
    return dataclasses.replace(
        spice_config("spice:fast"),
        name=f"tune@{weight},{error},{slots}",
        surrogate_max_weight=weight,
        surrogate_max_error=error,
        slot_precision=cast("SlotPrecision", slots),
    )


def tune_levels(
    model: Path,
    sidecar: Path,
    options: LevelsOptions,
    *,
    say: Callable[[str], None],
    out: TextIO = sys.stdout,
    progress: bool = True,
) -> LevelsResult:
    """Measure the grid, pick each level's pair and, with options.write, write the picks
    into `sidecar`. Tables and picks go to `out`; notes and each cell to `say`."""
    from pyspice.api import Llama  # lazy: native code loads here

    corpus = builtin_of(model) or RECIPE_NAME
    say(f"tuning on the calibration split of {corpus}'s corpus")
    text = corpus_part("calibration", corpus).text
    budgets = list(options.budgets)
    # an empty grid (--weights '' or --errors '') measures nothing: the merged runs' cells only
    grid = list(itertools.product(options.weights, options.errors))
    level_slots = {level: str(spice_config(level).slot_precision) for level in LEVEL_BOUNDS}
    precisions = sorted(set(level_slots.values()))
    measured: Measured = {}
    exact: dict[str, Cell] = {}
    started = datetime.datetime.now()
    # every cell plans as a shipped lossy level plans at these threads (on 2 cores, -t 1:
    # one layer late on the planner thread; -t 2: synchronously), told by name in the record
    planning = options.planning.chosen(decode_threads=options.threads, lossy=True)
    say(f"every cell plans {planning.label}")

    def open_llm(budget: str) -> Llama:
        config = RunConfig(
            model=model,
            policy="exact",
            device_budget=budget,
            sidecar=sidecar,
            threads=options.threads,
            n_gpu_layers=0,
            n_ctx=CHUNK,
            n_batch=1,
            n_ubatch=1,
            planning=planning,
        )
        return Llama.from_config(config, logits_all=True, note=say)

    runs = len(budgets) * (1 + len(precisions) * len(grid)) if grid else 0
    bar = tqdm(total=runs, desc="levels: grid", unit="run", disable=not progress or not runs, file=sys.stderr)

    def tell(line: str) -> None:  # above the bar, on standard error
        tqdm.write(line, file=sys.stderr)

    for budget in budgets if grid else []:
        llm = open_llm(budget)
        try:
            llm.set_policy("spice:exact")
            base = exact[budget] = _score(llm, text, options.chunks)
            bar.update()
            tell(f"{budget}: spice:exact ppl {base['ppl']:.4f}, host rate {base['host_rate']:.4f}")
            for slots, (weight, error) in itertools.product(precisions, grid):
                llm.set_policy(SpicePolicy(_level_config(weight, error, slots)))
                cell = _score(llm, text, options.chunks)
                cell["change"] = cell["ppl"] / base["ppl"] - 1.0
                cell["host_cut"] = 1.0 - cell["host_rate"] / base["host_rate"] if base["host_rate"] else 0.0
                cell["surrogates_loaded"] = llm.spice_surrogates().count
                cell["chunks"] = options.chunks
                measured[(slots, budget, weight, error)] = cell
                bar.update()
                tell(
                    f"{budget}, {slots} slots: weight < {weight:g}, error <= {error:g}: "
                    f"ppl {cell['ppl']:.4f} ({cell['change']:+.2%}), surrogate rate "
                    f"{cell['surrogate_rate']:.4f}, host rate {cell['host_rate']:.4f} "
                    f"(cut {cell['host_cut']:+.1%} vs exact), {cell['surrogates_loaded']:g} surrogates loaded"
                )
        finally:
            llm.close()
    bar.close()
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    for earlier in options.merge:
        doc = json.loads(earlier.read_text(encoding="utf-8"))
        minutes += merge_record(measured, exact, doc, model.name, budgets, f"--merge {earlier}")

    heldout_exact: dict[str, Cell] = {}
    heldout_cells: dict[str, Cell] = {}

    @functools.cache
    def heldout_text() -> str:
        return str(corpus_part("heldout", corpus).text)

    def heldout_change(budget: str, weight: float, error: float, slots: str) -> float:
        key = f"{slots} {budget} {weight:g} {error:g}"
        if key not in heldout_cells:
            llm = open_llm(budget)
            try:
                if budget not in heldout_exact:
                    llm.set_policy("spice:exact")
                    heldout_exact[budget] = _score(llm, heldout_text(), options.validate_chunks)
                llm.set_policy(SpicePolicy(_level_config(weight, error, slots)))
                cell = _score(llm, heldout_text(), options.validate_chunks)
            finally:
                llm.close()
            cell["change"] = cell["ppl"] / heldout_exact[budget]["ppl"] - 1.0
            heldout_cells[key] = cell
        return heldout_cells[key]["change"]

    def holds(level: str, slots: str, bound: float, w: float, e: float) -> bool:
        """Within the level's full bound on the held-out split at every budget: the
        calibration grid's few chunks can rank first a pair that is not."""
        changes = [heldout_change(b, w, e, slots) for b in budgets]
        shown = " / ".join(f"{c:+.2%}" for c in changes)
        ok = all(c <= bound for c in changes)
        past = "within" if ok else "past"
        print(
            f"{level}: ({w:g}, {e:g}) on the held-out split: {shown}, {past} {bound:.0%}"
            f"{'' if ok else ': next pair'}",
            file=out,
        )
        return ok

    by_slots = split_by_slots(measured)
    picks: dict[str, SurrogateThresholds] = {}
    for slots, results in by_slots.items():  # each precision's table, then the levels that run with it
        print(grid_table(model.name, slots, results, budgets), file=out)
        own = {k: v for k, v in measured.items() if k[0] == slots}
        picks |= pick_levels(
            own,
            budgets,
            options.margin,
            level_slots,
            holds=holds if options.validate else None,
            say=lambda line: print(line, file=out),
        )
    print(f"{minutes:.1f} min measuring (1 exact run per budget and run besides)", file=out)
    tuned = tuned_on(
        corpus,
        measured,
        budgets,
        options.margin,
        level_slots,
        planning.label,
        options.validate,
        started.date().isoformat(),
    )
    doc = record(
        model.name,
        tuned,
        minutes,
        options.chunks,
        planning.label,
        exact,
        measured,
        picks,
        {"exact": heldout_exact, "cells": heldout_cells},
    )
    written = None
    if options.write:
        missing = [level for level in LEVEL_BOUNDS if level not in picks]
        if missing:
            raise ValueError(f"no cells measured with the slots of {', '.join(missing)}: nothing written")
        written = with_levels(sidecar, picks, tuned)
        say(f"thresholds written to {sidecar}")
    return LevelsResult(model.name, tuple(budgets), picks, by_slots, doc, written)


def plot_result(result: LevelsResult, path: Path, margin: float) -> list[Path]:
    """One PNG per slot precision of the run (`--plot`)."""
    written = []
    for slots, results in result.by_slots.items():
        png = plot_path(path, slots, len(result.by_slots))
        title = f"{result.model}, {slots} slots: calibration text, token by token"
        plot(png, results, result.budgets, title, margin)
        written.append(png)
    return written
