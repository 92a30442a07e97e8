"""Choosing the lossy levels' surrogate thresholds from a measured grid (`pyspice calibrate --levels`).

What is chosen. `spice:balanced` and `spice:fast` substitute a missed expert by
its LoRE surrogate when two thresholds let it: the miss's gate weight is below
`max_weight`, and the surrogate's held-out fit error is at most `max_error`.
Each level promises a perplexity bound over `spice:exact` (LEVEL_BOUNDS:
+1% and +5%, token by token as decoding runs), and its loss has to buy
something: at least HOST_CUT_TARGET fewer activations run exactly on the host
than `spice:exact` runs in the same run.

How. The tuner (pyspice.calibrate.levels_run) measures every (weight, error)
pair of a grid at every device budget on the calibration split of the model's
corpus, the text its sidecar was fitted on, and never on the text the levels
are later judged on (`pyspice eval ppl --token-by-token` on a text of no
calibration source). A cell records the pair's perplexity change against that
budget's `spice:exact` run, the share of activations substituted, and the cut
in host-executed activations. Each level runs with its own slot precision
(balanced 5-bit, fast 4-bit), so the grid is measured once per precision and a
level picks only among the cells of its own.

Per level the pick (`ranked`, `pick_levels`) is the pair with the largest host
cut, taken as the smallest over the budgets, among the pairs whose change stays
within `margin` x the level's bound at every budget: a margin, because the
judging text is not the calibration text. A pair that cuts nothing earns no
loss. Validation, when asked, checks the ranked pairs in order on the corpus's
held-out split against the full bound and keeps the first that holds. A level
that no pair keeps is written lossless (thresholds 0, 0): it then substitutes
nothing and keeps exact slots, which trivially keeps its bound.

This module is pure (no model runs): the selection, the printed table, the
JSON record and its plot. Cells are keyed (budget, weight, error); the measured
grid of a whole run adds the slot precision in front.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pyspice.policy.spice import LEVEL_BOUNDS, SurrogateThresholds

# the levels' contract: each lossy level runs >= 10% fewer host activations than exact
HOST_CUT_TARGET = 0.10
# what a level no pair keeps is written with: substitutes nothing
LOSSLESS = SurrogateThresholds(0.0, 0.0)

Cell = dict[str, float]  # ppl, surrogate_rate, host_rate, hit_rate, change, host_cut, chunks, ...
Cells = dict[tuple[str, float, float], Cell]  # (budget, weight, error) -> cell
Measured = dict[tuple[str, str, float, float], Cell]  # (slots, budget, weight, error) -> cell
# (level, slots, bound, weight, error) -> whether the pair holds on the held-out split
Holds = Callable[[str, str, float, float, float], bool]


def complete_pairs(results: Cells, budgets: Sequence[str]) -> list[tuple[float, float]]:
    """The (weight, error) pairs measured at every budget, in order."""
    pairs = sorted({(w, e) for (_, w, e) in results})
    return [p for p in pairs if all((b, *p) in results for b in budgets)]


def ranked(
    results: Cells,
    budgets: Sequence[str],
    grid: Iterable[tuple[float, float]],
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


def split_by_slots(measured: Measured) -> dict[str, Cells]:
    """The measured grid per slot precision."""
    out: dict[str, Cells] = {}
    for (slots, b, w, e), cell in measured.items():
        out.setdefault(slots, {})[(b, w, e)] = cell
    return dict(sorted(out.items()))


def pick_levels(
    measured: Measured,
    budgets: Sequence[str],
    margin: float,
    level_slots: Mapping[str, str],
    *,
    holds: Holds | None = None,
    say: Callable[[str], None] = lambda _line: None,
    bounds: Mapping[str, float] = LEVEL_BOUNDS,
) -> dict[str, SurrogateThresholds]:
    """Each level's thresholds, picked among the cells of its own slot precision
    (`level_slots`): the first ranked pair (that `holds`, when given), else LOSSLESS.
    A level whose precision has no measured cell is left out."""
    by_slots = split_by_slots(measured)
    picks: dict[str, SurrogateThresholds] = {}
    for level, bound in bounds.items():
        slots = level_slots[level]
        results = by_slots.get(slots)
        if results is None:
            continue
        candidates = ranked(results, budgets, complete_pairs(results, budgets), bound, margin)
        if holds is not None:  # lazily: each check runs the model
            first = next((c for c in candidates if holds(level, slots, bound, c[0], c[1])), None)
            candidates = [first] if first is not None else []
        if not candidates:
            say(
                f"{level} ({slots} slots): no pair of the grid stays under {margin:g} x {bound:.0%} "
                "at every budget with fewer host activations than spice:exact"
                f"{' (and within the bound on the held-out split)' if holds is not None else ''}: "
                "lossless (substitutes nothing, exact slots)"
            )
            picks[level] = LOSSLESS
            continue
        w, e, cut = candidates[0]
        picks[level] = SurrogateThresholds(w, e)
        verdict = "meets" if cut >= HOST_CUT_TARGET else "misses"
        say(
            f"{level} ({slots} slots): surrogate_max_weight={w:g}, surrogate_max_error={e:g} "
            f"(host cut at least {cut:+.1%}: {verdict} the {HOST_CUT_TARGET:.0%} target on "
            "calibration text)"
        )
    return picks


def grid_table(model: str, slots: str, results: Cells, budgets: Sequence[str]) -> str:
    """The table of one slot precision's cells: change / surrogate rate / host cut per budget."""
    grid = complete_pairs(results, budgets)
    chunks = sorted({int(c["chunks"]) for c in results.values()})
    lines = [
        f"{model}, {slots} slots: calibration text, token by token, {'/'.join(map(str, chunks))} "
        f"chunks of 512, {len(grid)} pairs x {len(budgets)} budgets; change vs spice:exact / "
        "surrogate rate / host cut vs spice:exact",
        f"{'weight':>7} {'error':>6} {'chunks':>6} " + " ".join(f"{b:>28}" for b in budgets),
    ]
    for weight, error in grid:
        row = []
        for b in budgets:
            c = results[(b, weight, error)]
            row.append(f"{c['change']:+7.2%} / {c['surrogate_rate']:.4f} / {c['host_cut']:+6.1%}")
        n = int(results[(budgets[0], weight, error)]["chunks"])
        lines.append(f"{weight:>7g} {error:>6g} {n:>6} " + " ".join(f"{c:>28}" for c in row))
    return "\n".join(lines)


def merge_record(
    measured: Measured,
    exact: dict[str, Cell],
    doc: Mapping[str, Any],
    model: str,
    budgets: Sequence[str],
    source: str = "--merge",
) -> float:
    """Join an earlier run's record (same model and budgets) into `measured` and `exact`:
    of two measurements of one cell the one on more chunks wins. The minutes it took."""
    if doc.get("model") != model or any(b not in doc.get("exact", {}) for b in budgets):
        raise ValueError(f"{source}: not a run of {model} at {','.join(budgets)}")
    for c in doc["grid"]:
        # records from before the levels had slot precisions ran every cell on exact slots
        key = (str(c.get("slots", "exact")), str(c["budget"]), float(c["weight"]), float(c["error"]))
        cell: Cell = {k: v for k, v in c.items() if k not in ("slots", "budget", "weight", "error")}
        cell.setdefault("chunks", doc.get("chunks", 0))
        if key[1] in budgets and cell["chunks"] > measured.get(key, {}).get("chunks", -1):
            measured[key] = cell
    for b in budgets:
        exact.setdefault(b, dict(doc["exact"][b]))
    return float(doc.get("minutes", 0.0))


def tuned_on(
    corpus: str,
    measured: Measured,
    budgets: Sequence[str],
    margin: float,
    level_slots: Mapping[str, str],
    planning: str,
    validated: bool,
    date: str,
) -> str:
    """How the levels were tuned, as the sidecar records it (spice.levels.tuned_on)."""
    chunks = sorted({int(c["chunks"]) for c in measured.values()})
    weights = sorted({w for (_, _, w, _) in measured})
    errors = sorted({e for (_, _, _, e) in measured})
    pairs = {(w, e) for (_, _, w, e) in measured}
    return (
        f"{corpus} calibration split, {'/'.join(map(str, chunks))} chunks of 512 token by token, budgets "
        f"{','.join(budgets)}, margin {margin:g}, {len(pairs)} (weight, error) pairs "
        f"(weights {','.join(f'{w:g}' for w in weights)}; errors {','.join(f'{e:g}' for e in errors)}), "
        f"each level with its slots ({', '.join(f'{lv} {p}' for lv, p in level_slots.items())}), "
        f"planning {planning}, {'checked on the held-out split, ' if validated else ''}"
        f"{date} (pyspice calibrate --levels)"
    )


def record(
    model: str,
    tuned: str,
    minutes: float,
    chunks: int,
    planning: str,
    exact: Mapping[str, Cell],
    measured: Measured,
    picks: Mapping[str, SurrogateThresholds],
    heldout: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON record of a run (`--json`): every cell, the picks, the held-out checks;
    what `--merge` and `--replot` read back."""
    return {
        "model": model,
        "tuned_on": tuned,
        "minutes": minutes,
        "chunks": chunks,
        "planning": planning,
        "exact": dict(exact),
        "grid": [
            {"slots": p, "budget": b, "weight": w, "error": e, **v} for (p, b, w, e), v in measured.items()
        ],
        "picks": {k: dataclasses.asdict(v) for k, v in picks.items()},
        "heldout": dict(heldout),
    }


def plot_path(path: Path, slots: str, kinds: int) -> Path:
    """One PNG per slot precision when there are several: name-4bit.png, name-5bit.png."""
    return path if kinds == 1 else path.with_stem(f"{path.stem}-{slots}")


def plot(path: Path, results: Cells, budgets: Sequence[str], title: str, margin: float) -> None:
    """Perplexity change against host cut over the grid, one panel per budget, with each
    level's bound and the margin the picks keep."""
    # lazy: matplotlib is optional, for --plot only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4.2), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        cells = sorted((k, v) for k, v in results.items() if k[0] == budget)
        for w in sorted({w for (_, w, _), _ in cells}):
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
        ax.text(
            100 * HOST_CUT_TARGET, ax.get_ylim()[1], " host cut target", fontsize=7, va="top", color="red"
        )
        ax.set_xlabel("host-executed activations cut vs spice:exact (%)")
        ax.set_ylabel("perplexity change vs spice:exact (%)")
        ax.set_title(f"{budget} device budget (labels: error limit)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_record(doc: Mapping[str, Any], path: Path, margin: float) -> list[Path]:
    """Plot an earlier run's record (`--replot`); the PNGs written."""
    kinds = sorted({str(c.get("slots", "exact")) for c in doc["grid"]})
    written = []
    for slots in kinds:
        cells: Cells = {
            (str(c["budget"]), float(c["weight"]), float(c["error"])): {
                k: v for k, v in c.items() if k not in ("slots", "budget", "weight", "error")
            }
            for c in doc["grid"]
            if c.get("slots", "exact") == slots
        }
        out = plot_path(path, slots, len(kinds))
        title = f"{doc['model']}, {slots} slots: calibration text, token by token"
        plot(out, cells, list(doc["exact"]), title, margin)
        written.append(out)
    return written
