#!/usr/bin/env python3
"""Tune one model's lossy SPICE levels' surrogate thresholds on its CALIBRATION text.

`spice:balanced` may cost at most +1% perplexity over exact and `spice:fast` at
most +5% (token by token, as decoding runs), and each should run at least 10%
fewer activations exactly on the host than `spice:exact` in the same run (what
the loss buys). Their two thresholds — the gate weight under which a miss may
be substituted and the surrogate's held-out fit error under which it is
trusted — are chosen here on the calibration split of the model's corpus (the
text the sidecar was fitted on; -m smolmoe-b tunes on smolmoe-b's mix), never
on the text the levels are then judged on (`pyspice eval ppl --token-by-token
--policies spice:exact,spice:balanced,spice:fast -f TEXT-OF-NO-CALIBRATION-SOURCE`).

For every device budget and every (weight, error) pair of the grid this prints
the perplexity change against spice:exact, the share of activations
substituted and the cut in host-executed activations against spice:exact;
then, per level, the pair with the largest host cut (the smallest over the
budgets) whose change stays under `--margin` x the level's bound at every
budget (a margin, because judging text is not calibration text), checked
(`--validate`, the default) on the corpus's held-out split against the full
bound, taking the next pair down where it fails there. With
`--write` the picks go into the model's sidecar (`spice.levels.*`), where
`spice:balanced` and `spice:fast` read them; a level no pair keeps within the
margin is written lossless (it then substitutes nothing and keeps exact slots,
which keeps its bound). Each level's cells run with that level's own slots
(spice:balanced 5-bit, spice:fast 4-bit): the grid is measured once per slot
precision, and a level picks from its own.

    .venv/bin/python tools/tune-quality-levels.py -m smolmoe-b --budgets 25%,50% --chunks 3 \\
        --json grid.json --plot grid.png --write
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from pyspice.policy.spice.config import SlotPrecision

HOST_CUT_TARGET = 0.10  # the levels' contract: each lossy level runs >= 10% fewer host activations than exact


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ranked(
    results: dict[tuple[str, float, float], dict[str, float]],
    budgets: list[str],
    grid: list[tuple[float, float]],
    bound: float,
    margin: float,
) -> list[tuple[float, float, float]]:
    """(weight, error, smallest host cut over the budgets) of every pair whose change stays
    within margin x bound at every budget with a positive such cut, best first: the largest
    cut, then the most substitution. A pair that runs as many activations on the host as
    exact does, or more, does not earn any loss."""
    ok = [
        (
            min(results[(b, w, e)]["host_cut"] for b in budgets),
            min(results[(b, w, e)]["surrogate_rate"] for b in budgets),
            w,
            e,
        )
        for w, e in grid
        if all(results[(b, w, e)]["change"] <= margin * bound for b in budgets)
    ]
    return [(w, e, cut) for cut, _rate, w, e in sorted(ok, reverse=True) if cut > 0.0]


def plot(
    path: Path,
    results: dict[tuple[str, float, float], dict[str, float]],
    budgets: list[str],
    title: str,
    margin: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pyspice.policy.spice import LEVEL_BOUNDS

    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4.2), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        cells = sorted((k, v) for k, v in results.items() if k[0] == budget)
        weights = sorted({w for (_, w, _), _ in cells})
        for w in weights:
            pts = sorted((e, v) for (_, ww, e), v in cells if ww == w)
            xs = [100 * v["host_cut"] for _, v in pts]
            ys = [100 * v["change"] for _, v in pts]
            ax.plot(xs, ys, marker="o", label=f"gate weight < {w:g}")
            for (e, _v), x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"{e:g}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        for level, bound in LEVEL_BOUNDS.items():
            ax.axhline(100 * bound, ls="--", lw=0.8, color="grey")
            ax.axhline(100 * margin * bound, ls=":", lw=0.8, color="grey")
            ax.text(ax.get_xlim()[0], 100 * bound, f" {level} bound", fontsize=7, va="bottom")
            ax.text(ax.get_xlim()[0], 100 * margin * bound, f" {margin:g} x it (picks)", fontsize=6, va="top")
        ax.axvline(100 * HOST_CUT_TARGET, ls="--", lw=0.8, color="red")
        top = ax.get_ylim()[1]
        ax.text(100 * HOST_CUT_TARGET, top, " host cut target", fontsize=7, va="top", color="red")
        ax.set_xlabel("host-executed activations cut vs spice:exact (%)")
        ax.set_ylabel("perplexity change vs spice:exact (%)")
        ax.set_title(f"{budget} device budget (labels: error limit)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _axes(results: dict[tuple[str, float, float], dict[str, float]]) -> tuple[list[float], list[float]]:
    return sorted({w for _, w, _ in results}), sorted({e for _, _, e in results})


def main() -> int:
    from pyspice.cli.common import add_planning_args, planning_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="GGUF or built-in name (default: smolmoe)")
    parser.add_argument("--sidecar", type=Path, default=None, help="default: the one beside the model")
    parser.add_argument("--budgets", default="25%,50%")
    # the MoEfied built-in models' gate weights are all within 0.031-0.033 (near-flat
    # routers over 32 experts): a weight limit of 0.05 passes every miss, and limits
    # inside that range (0.032, 0.0322 on smolmoe-b) pass only the router's weakest
    # picks, which cost less perplexity per substitution
    # (docs/results/quality-levels.md)
    parser.add_argument("--weights", default="0.05", help="gate-weight thresholds to try")
    parser.add_argument("--errors", default="0.5,0.55,0.6,0.65,0.7", help="fit-error thresholds to try")
    parser.add_argument("--chunks", type=int, default=3, help="512-token chunks scored per run")
    parser.add_argument("--margin", type=float, default=0.6, help="use at most this share of each bound")
    parser.add_argument("-t", "--threads", type=int, default=2)
    # auto: as a shipped lossy level plans at these threads (on 2 cores, -t 1: one layer
    # late on the planner thread; -t 2: synchronously)
    add_planning_args(parser)
    parser.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check each level's pick on the corpus's HELD-OUT split (not the judging text) "
        "against the level's full bound, and fall back to the next pair down where it fails",
    )
    parser.add_argument("--validate-chunks", type=int, default=6, help="512-token chunks of it scored")
    parser.add_argument("--json", type=Path, default=None, help="write every grid cell here")
    parser.add_argument("--plot", type=Path, default=None, help="plot change vs host cut over the grid")
    parser.add_argument("--write", action="store_true", help="write the picks into the sidecar")
    parser.add_argument("--replot", type=Path, default=None, help="only plot an earlier --json to --plot")
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="an earlier run's --json (same model and budgets): its cells join this grid; a pair "
        "measured on more chunks wins (each cell is relative to its own run's spice:exact)",
    )
    args = parser.parse_args()
    if args.replot is not None:
        doc = json.loads(args.replot.read_text(encoding="utf-8"))
        kinds = sorted({c.get("slots", "exact") for c in doc["grid"]})
        for slots in kinds:
            cells = {
                (c["budget"], float(c["weight"]), float(c["error"])): c
                for c in doc["grid"]
                if c.get("slots", "exact") == slots
            }
            title = f"{doc['model']}, {slots} slots: calibration text, token by token"
            path = args.plot if len(kinds) == 1 else args.plot.with_stem(f"{args.plot.stem}-{slots}")
            plot(path, cells, list(doc["exact"]), title, args.margin)
        return 0
    if args.merge and args.write:
        # merged cells were measured with the slots of their own run; picks would mix them
        parser.error("--merge with --write: write the picks of a run that measured every cell itself")

    if args.plan_lag and args.planning != "async":
        parser.error("--plan-lag is for --planning async")

    from pyspice.api import Llama
    from pyspice.engine import RunConfig
    from pyspice.formats.sidecar import default_sidecar_path, with_levels
    from pyspice.measure.perplexity import perplexity
    from pyspice.models.builtin import builtin_of
    from pyspice.models.default import default_model
    from pyspice.models.smolmoe_build import MODEL_NAMES
    from pyspice.models.smolmoe_recipe import RECIPE_NAME, corpus_part
    from pyspice.policy.spice import LEVEL_BOUNDS, SpiceConfig, SpicePolicy, SurrogateThresholds, spice_config

    def say(message: str) -> None:
        print(f"pyspice: {message}", file=sys.stderr)

    # a built-in model by name (smolmoe, smolmoe-b) is tuned on ITS calibration split; a
    # GGUF path on that of the built-in model it is a build of, else smolmoe's
    if args.model is None or args.model in MODEL_NAMES:
        model = default_model(args.model or RECIPE_NAME, note=say)
    else:
        model = Path(args.model)
    sidecar = args.sidecar or default_sidecar_path(model)
    corpus = builtin_of(model) or RECIPE_NAME
    say(f"tuning on the calibration split of {corpus}'s corpus")
    text = corpus_part("calibration", corpus).text
    # an empty grid (--weights '' or --errors '') measures nothing: the --merge runs' cells only
    grid = list(itertools.product(floats(args.weights), floats(args.errors)))
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    # the slot precisions the levels run with (each level's cells are measured with its own)
    level_slots = {level: spice_config(level).slot_precision for level in LEVEL_BOUNDS}
    precisions = sorted(set(level_slots.values()))
    # (slots, budget, weight, error) -> change vs exact, surrogate and host rates, host cut
    measured: dict[tuple[str, str, float, float], dict[str, float]] = {}
    exact: dict[str, dict[str, float]] = {}
    started = datetime.datetime.now()

    # every cell plans the same way, told by name in the record ("det1": one layer late)
    planning = planning_of(args)  # --planning and --plan-lag read as the CLI reads them
    if args.planning == "auto":
        planning = planning.chosen(decode_threads=args.threads, lossy=True)
    planned = planning.label
    say(f"every cell plans {planned}")

    def open_llm(budget: str) -> Any:
        config = RunConfig(
            model=model,
            policy="exact",
            device_budget=budget,
            sidecar=sidecar,
            threads=args.threads,
            n_gpu_layers=0,
            n_ctx=512,
            n_batch=1,
            n_ubatch=1,
            planning=planning,
        )
        return Llama.from_config(config, logits_all=True, note=say)

    def score(llm: Any, text: str, chunks: int) -> dict[str, float]:
        llm.spice_reset_stats()
        ppl = perplexity(llm, text, 512, max_chunks=chunks).ppl
        stats = llm.spice_stats()
        n = max(1, int(stats["activations"]))
        return {
            "ppl": ppl,
            "surrogate_rate": stats["misses"]["surrogate"] / n,
            "host_rate": stats["misses"]["host"] / n,
            "hit_rate": float(stats["hit_rate"]),
        }

    def level_config(weight: float, error: float, slots: str) -> SpiceConfig:
        return dataclasses.replace(
            spice_config("spice:fast"),
            name=f"tune@{weight},{error},{slots}",
            surrogate_max_weight=weight,
            surrogate_max_error=error,
            slot_precision=cast("SlotPrecision", slots),
        )

    for budget in budgets if grid else []:
        llm = open_llm(budget)
        try:
            llm.set_policy("spice:exact")
            base = exact[budget] = score(llm, text, args.chunks)
            print(
                f"{budget}: spice:exact ppl {base['ppl']:.4f}, host rate {base['host_rate']:.4f}",
                file=sys.stderr,
                flush=True,
            )
            for slots, (weight, error) in itertools.product(precisions, grid):
                llm.set_policy(SpicePolicy(level_config(weight, error, slots)))
                cell = score(llm, text, args.chunks)
                cell["change"] = cell["ppl"] / base["ppl"] - 1.0
                cell["host_cut"] = 1.0 - cell["host_rate"] / base["host_rate"] if base["host_rate"] else 0.0
                cell["surrogates_loaded"] = llm.spice_surrogates().count
                cell["chunks"] = args.chunks
                measured[(slots, budget, weight, error)] = cell
                print(
                    f"{budget}, {slots} slots: weight < {weight:g}, error <= {error:g}: "
                    f"ppl {cell['ppl']:.4f} ({cell['change']:+.2%}), surrogate rate "
                    f"{cell['surrogate_rate']:.4f}, host rate {cell['host_rate']:.4f} "
                    f"(cut {cell['host_cut']:+.1%} vs exact), "
                    f"{cell['surrogates_loaded']} surrogates loaded",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            llm.close()
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    for earlier in args.merge:
        before = json.loads(earlier.read_text(encoding="utf-8"))
        if before["model"] != model.name or any(b not in before["exact"] for b in budgets):
            raise SystemExit(f"--merge {earlier}: not a run of {model.name} at {','.join(budgets)}")
        for c in before["grid"]:
            # grids from before slots had a precision (9fb888d) ran every cell on exact ones
            key = (c.get("slots", "exact"), c["budget"], float(c["weight"]), float(c["error"]))
            cell = {k: v for k, v in c.items() if k not in ("slots", "budget", "weight", "error")}
            cell.setdefault("chunks", before.get("chunks", 0))
            if c["budget"] in budgets and cell["chunks"] > measured.get(key, {}).get("chunks", -1):
                measured[key] = cell
        for b in budgets:
            exact.setdefault(b, before["exact"][b])
        minutes += float(before.get("minutes", 0.0))
    # the held-out split's spice:exact runs per budget and the cells checked there
    heldout_exact: dict[str, dict[str, float]] = {}
    heldout_cells: dict[str, dict[str, float]] = {}

    @functools.cache
    def heldout_text() -> str:
        return corpus_part("heldout", corpus).text

    def heldout_change(budget: str, weight: float, error: float, slots: str) -> float:
        """The pair's perplexity change over spice:exact on the held-out split (cached).
        Each opens its own instance: only the budgets' few candidates are checked, and two
        budgets' instances of a large model at once would not fit where one does."""
        key = f"{slots} {budget} {weight:g} {error:g}"
        if key not in heldout_cells:
            llm = open_llm(budget)
            try:
                if budget not in heldout_exact:
                    llm.set_policy("spice:exact")
                    heldout_exact[budget] = score(llm, heldout_text(), args.validate_chunks)
                llm.set_policy(SpicePolicy(level_config(weight, error, slots)))
                cell = score(llm, heldout_text(), args.validate_chunks)
            finally:
                llm.close()
            cell["change"] = cell["ppl"] / heldout_exact[budget]["ppl"] - 1.0
            heldout_cells[key] = cell
        return heldout_cells[key]["change"]

    def first_that_holds(
        level: str, slots: str, bound: float, candidates: list[tuple[float, float, float]]
    ) -> tuple[float, float, float] | None:
        """The first candidate whose change on the held-out split stays within the level's
        full bound at every budget: the calibration grid's 3-chunk noise can rank a pair
        first that does not (balanced's 0.55, +1.29% there at 50%)."""
        for w, e, cut in candidates:
            changes = [heldout_change(b, w, e, slots) for b in budgets]
            shown = " / ".join(f"{c:+.2%}" for c in changes)
            if all(c <= bound for c in changes):
                print(f"{level}: ({w:g}, {e:g}) on the held-out split: {shown}, within {bound:.0%}")
                return w, e, cut
            print(f"{level}: ({w:g}, {e:g}) on the held-out split: {shown}, past {bound:.0%}: next pair")
        return None

    picks: dict[str, SurrogateThresholds] = {}
    by_slots: dict[str, dict[tuple[str, float, float], dict[str, float]]] = {}
    for slots in sorted({k[0] for k in measured}):
        results = by_slots[slots] = {(b, w, e): v for (p, b, w, e), v in measured.items() if p == slots}
        grid = [
            p for p in sorted({(w, e) for (_, w, e) in results}) if all((b, *p) in results for b in budgets)
        ]
        chunks = sorted({int(c["chunks"]) for c in results.values()})
        print(
            f"{model.name}, {slots} slots: calibration text, token by token, {'/'.join(map(str, chunks))} "
            f"chunks of 512, {len(grid)} pairs x {len(budgets)} budgets; change vs spice:exact / "
            "surrogate rate / host cut vs spice:exact"
        )
        print(f"{'weight':>7} {'error':>6} {'chunks':>6} " + " ".join(f"{b:>28}" for b in budgets))
        for weight, error in grid:
            row_cells = []
            for b in budgets:
                cell = results[(b, weight, error)]
                row_cells.append(
                    f"{cell['change']:+7.2%} / {cell['surrogate_rate']:.4f} / {cell['host_cut']:+6.1%}"
                )
            n = int(results[(budgets[0], weight, error)]["chunks"])
            print(f"{weight:>7g} {error:>6g} {n:>6} " + " ".join(f"{c:>28}" for c in row_cells))
        for level, bound in LEVEL_BOUNDS.items():
            if level_slots[level] != slots:
                continue
            candidates = ranked(results, budgets, grid, bound, args.margin)
            chosen = candidates[0] if candidates else None
            if args.validate:
                chosen = first_that_holds(level, slots, bound, candidates)
            if chosen is None:
                print(
                    f"{level} ({slots} slots): no pair of the grid stays under {args.margin:g} x {bound:.0%} "
                    "at every budget with fewer host activations than spice:exact (and, validating, within "
                    "the bound on the held-out split): lossless (substitutes nothing, exact slots)"
                )
                picks[level] = SurrogateThresholds(0.0, 0.0)
                continue
            w, e, cut = chosen
            picks[level] = SurrogateThresholds(w, e)
            verdict = "meets" if cut >= HOST_CUT_TARGET else "misses"
            print(
                f"{level} ({slots} slots): surrogate_max_weight={w:g}, surrogate_max_error={e:g} "
                f"(host cut at least {cut:+.1%}: {verdict} the {HOST_CUT_TARGET:.0%} target on "
                "calibration text)"
            )
    print(f"{minutes:.1f} min measuring (1 exact run per budget and run besides)")
    missing = [level for level in LEVEL_BOUNDS if level not in picks]
    if missing and args.write:
        raise SystemExit(f"no cells measured with the slots of {', '.join(missing)}: nothing written")
    all_cells = {k[1:]: v for k, v in measured.items()}
    chunks = sorted({int(c["chunks"]) for c in measured.values()})
    grid = sorted({(w, e) for (_, _, w, e) in measured})
    tuned_on = (
        f"{corpus} calibration split, {'/'.join(map(str, chunks))} chunks of 512 token by token, budgets "
        f"{','.join(budgets)}, margin {args.margin:g}, {len(grid)} (weight, error) pairs "
        f"(weights {','.join(f'{w:g}' for w in _axes(all_cells)[0])}; errors "
        f"{','.join(f'{e:g}' for e in _axes(all_cells)[1])}), each level with its slots "
        f"({', '.join(f'{level} {p}' for level, p in level_slots.items())}), "
        f"planning {planned}, "
        f"{'checked on the held-out split, ' if args.validate else ''}"
        f"{started.date().isoformat()} (tools/tune-quality-levels.py)"
    )
    if args.json is not None:
        doc = {
            "model": model.name,
            "tuned_on": tuned_on,
            "minutes": minutes,
            "chunks": args.chunks,
            "planning": planned,
            "exact": exact,
            "grid": [
                {"slots": p, "budget": b, "weight": w, "error": e, **v}
                for (p, b, w, e), v in measured.items()
            ],
            "picks": {k: dataclasses.asdict(v) for k, v in picks.items()},
            "heldout": {"exact": heldout_exact, "cells": heldout_cells},
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        for slots, results in by_slots.items():
            path = args.plot if len(by_slots) == 1 else args.plot.with_stem(f"{args.plot.stem}-{slots}")
            plot(
                path,
                results,
                budgets,
                f"{model.name}, {slots} slots: calibration text, token by token",
                args.margin,
            )
    if args.write:
        with_levels(sidecar, picks, tuned_on)
        say(f"thresholds written to {sidecar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
