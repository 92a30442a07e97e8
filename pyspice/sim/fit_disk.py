"""`pyspice sim fit` on edge mode's disk tier: the disk terms fitted to measured TPOTs.

Edge mode's disk tier has none of the counters pyspice.sim.fit reads to read in the records
it is fitted to, which keep each lossless row's TPOT (a results record
such as docs/results/auto-policy-smolmoe-b.json, or `bench --json` runs of a
RAM budget), and their hit rates. Its three terms -- `disk_read_scale`,
`disk_overlap` and `disk_host_read_us` (pyspice.sim.disk, DiskRules) -- are
fitted by replaying
each run's routing through the rows as `--policy auto` prices them
(pyspice.sim.rank.rank_lossless, on the disk as probed) and searching the
terms for the least root mean square of the rows' relative TPOT errors and of
their hit rates' differences where the record has them (a prefetch that lands
after the call that needs it is a miss, so the hit rate tells overlap lost from
host time lost, which a TPOT alone prices alike):
a grid of the reads' scale and the overlap first, host time per read then
(golden sections), then the three together (Nelder and Mead's simplex,
restarted once). The error is a step function of
the terms (a read lands before the call that needs it or after), with a basin
where a prefetch's reads land in time and one where they do not; the search
can settle in the wrong one, which the fit's own rms error then shows. Where
the records cannot tell a term's values apart it stays at its value without
the term (a tie is broken towards it, and a term whose whole range prices the
records alike is kept so).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pyspice.formats.profile import load_profile as load_cost_profile
from pyspice.formats.routers import RouterReader
from pyspice.formats.sidecar import Sidecar
from pyspice.policy.profile import CostProfile
from pyspice.policy.rows import parse_row
from pyspice.policy.spice.history_lookahead import HistoryLookahead
from pyspice.policy.spice.routing_history import RoutingHistory
from pyspice.sim.costs import Costs
from pyspice.sim.fit import FitTerm, fitted_values
from pyspice.sim.hardware import (
    HardwareProfile,
    budget_bytes,
    disk_costs,
    policy_profile,
    with_probe,
)
from pyspice.sim.rank import AUTO_CANDIDATES, rank_lossless
from pyspice.sim.records import optional_int, read_records, split_record_spec
from pyspice.sim.targets import source_target
from pyspice.sim.workload import ReplayWindow, Workload
from pyspice.units import whole_tier_bytes

# each disk term: its range, and its value where the records cannot tell (the pricing
# without the term: reads at the probe's speed, hidden behind compute, free to the host)
DISK_TERMS: dict[str, tuple[float, float, float]] = {
    "disk_read_scale": (0.25, 6.0, 1.0),
    "disk_overlap": (0.0, 1.0, 1.0),
    "disk_host_read_us": (0.0, 100.0, 0.0),
}
_TIE = 1e-4  # of the objective, per range of a term away from its value without it


@dataclass(frozen=True)
class DiskRun:
    """One edge-mode run: a RAM budget and the TPOT each lossless row measured."""

    source: str  # FILE:N, the N-th run of the file
    budget: str  # as the run gave it ("25%")
    measured_ms: Mapping[str, float]  # lossless candidate -> TPOT (ms per token)
    routing: str | None = None  # the routing sample auto ranked this run on, where recorded
    conditions: str = ""  # the page cache and memory limit, as the record says them
    measured_hit: Mapping[str, float] = field(default_factory=dict)  # decode hit rate, where recorded
    # a run that replayed `routing` (bench --replay-routing): the window of the trace its
    # rows routed
    replayed: ReplayWindow | None = None
    # runs of each row in one process, the first cold and left out of the TPOT
    # (`bench --memory-limit`: a warm median; 1: the TPOT is of the one run)
    passes: int = 1
    history_predictor: str | None = None  # the routing-history predictor SPICE's row read


def _warm_ms(row: Mapping[str, Any]) -> float | None:
    """A row's TPOT: `tpot_ms`, or under a memory limit the median of its warm runs."""
    if row.get("tpot_ms"):
        return float(row["tpot_ms"])
    warm = [float(x) for x in row.get("warm_tpot_ms") or () if x]
    return float(np.median(warm)) if warm else None


def _candidates(rows: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Each lossless candidate's TPOT, and its decode hit rate where the row has one."""
    ms: dict[str, float] = {}
    hit: dict[str, float] = {}
    for name in AUTO_CANDIDATES:
        row = rows.get(name)
        got = _warm_ms(row) if isinstance(row, Mapping) else None
        if row is None or not got:
            continue
        ms[name] = got
        if row.get("decode_hit_rate") is not None:
            hit[name] = float(row["decode_hit_rate"])
    return ms, hit


def _limited_runs(path: Path, doc: Mapping[str, Any], line: int | None = None) -> list[DiskRun]:
    """The runs of `bench --memory-limit --json`: one document, its rows named
    NAME@ram=BUDGET (one process each), a run per budget, named FILE:N (FILE:LINE, or
    FILE:LINE.N, for the document on a line of a file of several). Its rows' hit rates
    are left out: their counters cover the prompt's batch with the decode."""
    by_budget: dict[str, dict[str, float]] = {}
    for label, row in (doc.get("rows") or {}).items():
        try:
            parsed = parse_row(label)
        except ValueError:
            continue
        if not isinstance(row, Mapping):
            continue
        got = (row.get("warm_median") or {}).get("tpot_ms")
        # the row's budget: its own (NAME@ram=B), else the command's as the row records it
        budget = parsed.ram_text or row.get("ram_budget")
        if not budget or parsed.name not in AUTO_CANDIDATES or row.get("status") != "ok" or not got:
            continue
        by_budget.setdefault(str(budget), {})[parsed.name] = float(got)
    replay = doc.get("replay_routing")
    window = (
        ReplayWindow(
            int(doc.get("prompt_tokens") or 0),
            int(doc.get("n_predict") or 0),
            optional_int(doc.get("replay_decode_start")),
        )
        if replay
        else None
    )
    limit = doc.get("memory_limit")
    conditions = (
        f"memory limit {int(limit)} bytes, the model's pages dropped from the page cache before each row"
        if limit
        else ""
    )

    def name(i: int) -> str:
        if line is None:
            return f"{path}:{i}"
        return f"{path}:{line}" if len(by_budget) == 1 else f"{path}:{line}.{i}"

    return [
        DiskRun(
            name(i),
            budget,
            measured,
            str(replay) if replay else None,
            conditions,
            replayed=window,
            history_predictor=doc.get("history_predictor"),
            passes=max(1, int(doc.get("runs") or 1)),
        )
        for i, (budget, measured) in enumerate(by_budget.items(), 1)
    ]


def _is_limited(doc: Any) -> bool:
    return isinstance(doc, dict) and "memory_limit" in doc and isinstance(doc.get("rows"), dict)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def select_disk_runs(specs: Sequence[str]) -> list[DiskRun]:
    """`FILE` (every RAM-budget run in it) or `FILE:N[,N...]` (its runs named so: every
    run of line N of a file of documents, or the N-th run of one document) -> the runs."""
    out: list[DiskRun] = []
    for spec in specs:
        path, wanted = split_record_spec(spec)
        runs = read_disk_runs(path)
        if wanted is not None:
            # FILE:LINE.I, a line's I-th budget, belongs to line LINE
            number = {id(run): int(run.source.rpartition(":")[2].partition(".")[0]) for run in runs}
            missing = sorted(wanted - set(number.values()))
            if missing:
                raise ValueError(f"{path} has no RAM-budget run {', '.join(map(str, missing))}")
            runs = sorted((run for run in runs if number[id(run)] in wanted), key=lambda run: number[id(run)])
        out.extend(runs)
    return out


def read_disk_runs(path: Path) -> list[DiskRun]:
    """The RAM-budget runs of a record file: a results record (`{"runs": [...]}`, each
    with `tier` "ram-budget", its `budget` and `rows`, as docs/results/auto-policy-*.json
    keep them), a `bench --memory-limit --json` document (`{"memory_limit": ...,
    "rows": {"NAME@ram=BUDGET": ...}}`) or a file of such documents one per line, or
    `pyspice bench --json` runs whose tier is the disk."""
    text = path.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if _is_limited(doc):
        return _limited_runs(path, doc)
    if doc is None:
        lines = [(n, _json_or_none(t)) for n, t in enumerate(text.splitlines(), 1) if t.strip()]
        if lines and all(_is_limited(d) for _, d in lines):
            return [run for n, d in lines for run in _limited_runs(path, d, n)]
    if isinstance(doc, dict) and isinstance(doc.get("runs"), list):
        out = []
        for i, run in enumerate(doc["runs"], 1):
            if not isinstance(run, dict) or run.get("tier") != "ram-budget":
                continue
            measured, hits = _candidates(run.get("rows") or {})
            if measured:
                auto = run.get("auto") or {}
                out.append(
                    DiskRun(
                        f"{path}:{i}",
                        str(run["budget"]),
                        measured,
                        auto.get("routing"),
                        str(run.get("page_cache") or ""),
                        hits,
                    )
                )
        return out
    out = []
    for run in read_records(path):
        tier = run.tier or {}
        if not tier.get("disk"):
            continue
        rows = {name: row for name, row in run.rows.items() if name in AUTO_CANDIDATES and row.tpot_ms}
        if rows:
            out.append(
                DiskRun(
                    run.source,
                    str(tier.get("budget", "")),
                    {name: row.tpot_ms for name, row in rows.items()},
                    run.replay_routing,
                    measured_hit={name: row.hit_rate for name, row in rows.items()},
                )
            )
    return out


class Pricing(Protocol):
    """What the fit asks of a pricing: each of a run's rows' simulated (TPOT in ms, decode
    hit rate) with terms."""

    def predict(self, run: DiskRun, terms: Mapping[str, float]) -> Mapping[str, tuple[float, float]]: ...


@dataclass(frozen=True)
class DiskPricing:
    """What prices a disk-tier run as `--policy auto` prices it: the tier's costs (the
    probe's compute and disk, pyspice.sim.hardware.disk_costs), the routing replayed, and
    what the policies read (the probe as the engine hands it to them, the routers, a
    predictor)."""

    costs: Costs
    workload: Workload
    policy_profile: CostProfile | None = None
    router: Any = None
    context_extra: Mapping[str, Any] = field(default_factory=dict)

    def with_terms(self, terms: Mapping[str, float]) -> Costs:
        assert self.costs.disk is not None, "a disk tier's costs (Costs.disk)"
        disk = replace(
            self.costs.disk,
            read_scale=terms.get("disk_read_scale", DISK_TERMS["disk_read_scale"][2]),
            overlap=terms.get("disk_overlap", DISK_TERMS["disk_overlap"][2]),
            host_read_us=terms.get("disk_host_read_us", DISK_TERMS["disk_host_read_us"][2]),
        )
        return replace(self.costs, disk=disk)

    def predict(self, run: DiskRun, terms: Mapping[str, float]) -> dict[str, tuple[float, float]]:
        """Simulated (TPOT, hit rate) of each of the run's rows with `terms`."""
        costs = self.with_terms(terms)
        routed = whole_tier_bytes(costs.expert_bytes, self.workload.n_expert)
        # a policy's attach notes (static's resident layers) are about the replay, not news
        with contextlib.redirect_stderr(io.StringIO()):
            ranking = rank_lossless(
                self.workload,
                costs,
                budget_bytes(run.budget, routed),
                list(run.measured_ms),
                router=self.router,
                profile=self.policy_profile,
                context_extra=dict(self.context_extra),
            )
        return {r.row: (r.tpot_ms, r.hit_rate) for r in ranking.rows}


@dataclass(frozen=True)
class DiskPrediction:
    run: str
    budget: str
    row: str
    measured_ms: float
    predicted_ms: float
    measured_hit: float | None = None
    predicted_hit: float | None = None

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1.0


def predict_disk(
    pricing: Pricing, runs: Sequence[DiskRun], terms: Mapping[str, float]
) -> list[DiskPrediction]:
    """Every lossless row of `runs`, predicted with `terms`, beside its measured TPOT."""
    out: list[DiskPrediction] = []
    priced: dict[tuple[str, tuple[str, ...]], Mapping[str, tuple[float, float]]] = {}
    for run in runs:
        # runs of one budget and rows price alike (one routing replayed for all)
        key = (run.budget, tuple(run.measured_ms))
        if key not in priced:
            priced[key] = pricing.predict(run, terms)
        got = priced[key]
        out.extend(
            DiskPrediction(
                run.source, run.budget, row, ms, got[row][0], run.measured_hit.get(row), got[row][1]
            )
            for row, ms in run.measured_ms.items()
            if row in got
        )
    return out


def rms_error(preds: Sequence[DiskPrediction]) -> float:
    """Root-mean-square relative error of predicted TPOTs."""
    return math.sqrt(sum(p.error**2 for p in preds) / len(preds)) if preds else 0.0


def fit_error(preds: Sequence[DiskPrediction]) -> float:
    """What the fit minimises: the root mean square of every row's relative TPOT error and
    of every recorded hit rate's difference (module docstring)."""
    residuals = [p.error for p in preds] + [
        p.predicted_hit - p.measured_hit
        for p in preds
        if p.measured_hit is not None and p.predicted_hit is not None
    ]
    return math.sqrt(sum(r * r for r in residuals) / len(residuals)) if residuals else 0.0


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """The least of f over [lo, hi] by golden sections, the ends included."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return min((f(lo), lo), (fc, c), (fd, d), (f(hi), hi))[1]


def _simplex(
    f: Callable[[Sequence[float]], float], start: Sequence[float], step: float, evals: int
) -> list[float]:
    """The least of f over the unit cube near `start`, by Nelder and Mead's simplex (each
    trial point clipped into the cube), within about `evals` evaluations."""

    def clip(x: Sequence[float]) -> list[float]:
        return [min(1.0, max(0.0, v)) for v in x]

    n = len(start)
    pts = [clip(start)] + [
        clip([v + (step if i == k else 0.0) for i, v in enumerate(start)]) for k in range(n)
    ]
    for k in range(1, n + 1):  # a vertex the cube's wall flattened steps the other way
        if pts[k] == pts[0]:
            pts[k] = clip([v - (step if i == k - 1 else 0.0) for i, v in enumerate(start)])
    vals = [f(x) for x in pts]
    spent = n + 1
    while spent < evals:
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if max(abs(a - b) for x in pts[1:] for a, b in zip(x, pts[0], strict=True)) < 1e-3:
            break
        centre = [sum(x[i] for x in pts[:-1]) / n for i in range(n)]
        worst = pts[-1]

        def toward(t: float, centre: list[float] = centre, worst: list[float] = worst) -> list[float]:
            return clip([c + t * (w - c) for c, w in zip(centre, worst, strict=True)])

        reflected = toward(-1.0)
        fr = f(reflected)
        spent += 1
        if fr < vals[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            spent += 1
            pts[-1], vals[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            spent += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = contracted, fc
            else:  # shrink towards the best
                pts = [pts[0]] + [
                    clip([(a + b) / 2 for a, b in zip(x, pts[0], strict=True)]) for x in pts[1:]
                ]
                vals = [vals[0]] + [f(x) for x in pts[1:]]
                spent += n
    return pts[min(range(n + 1), key=vals.__getitem__)]


@dataclass(frozen=True)
class DiskFit:
    terms: dict[str, float]
    error: float  # fit_error over the runs fitted
    tpot_error: float  # rms_error of their TPOTs alone
    evaluations: int
    told: dict[str, bool]  # whether the records tell the term's values apart (else: its default)


def fit_disk(pricing: Pricing, runs: Sequence[DiskRun], *, steps: int = 8, evals: int = 60) -> DiskFit:
    """The disk terms that price `runs` best (module docstring)."""
    if not runs:
        raise ValueError("no RAM-budget run with a lossless row's TPOT in the records: nothing to fit")
    keys = list(DISK_TERMS)
    terms = {key: default for key, (_, _, default) in DISK_TERMS.items()}
    seen: dict[tuple[float, ...], float] = {}

    def error(trial: Mapping[str, float]) -> float:
        key = tuple(round(trial[k], 6) for k in keys)
        if key not in seen:
            seen[key] = fit_error(predict_disk(pricing, runs, trial))
        return seen[key]

    def objective(trial: Mapping[str, float]) -> float:
        # ties go to the pricing without the term: what the records cannot show stays so
        tie = sum(abs(trial[k] - d) / (hi - lo) for k, (lo, hi, d) in DISK_TERMS.items())
        return error(trial) + _TIE * tie

    def along(key: str) -> Callable[[float], float]:
        return lambda v: objective({**terms, key: v})

    # first a coarse look at the reads' scale and the overlap together, without host time
    # per read (a read's scale and its overlap both move every prefetch's landing, so one
    # alone from the pricing without the other lands in the wrong basin); then host time
    # per read from there; then all three together
    grid = [
        {**terms, "disk_read_scale": scale, "disk_overlap": overlap}
        for scale in np.geomspace(0.5, 4.0, 6)
        for overlap in np.linspace(0.0, 1.0, 5)
    ]
    terms = {k: float(v) for k, v in min(grid, key=objective).items()}
    lo, hi, _ = DISK_TERMS["disk_host_read_us"]
    terms["disk_host_read_us"] = _golden(along("disk_host_read_us"), lo, hi, steps)

    def scaled(x: Sequence[float]) -> dict[str, float]:
        return {k: lo + v * (hi - lo) for k, v, (lo, hi, _) in zip(keys, x, DISK_TERMS.values(), strict=True)}

    # the simplex stalls on a ridge (lost overlap and host time per read price a prefetch
    # alike where its reads land in time): once more from where it stopped, a smaller one
    x = [(terms[k] - lo) / (hi - lo) for k, (lo, hi, _) in DISK_TERMS.items()]
    for step, budget in ((0.1, evals), (0.03, evals // 2)):
        x = _simplex(lambda y: objective(scaled(y)), x, step, budget)
    terms = scaled(x)
    told = {}
    for key, (lo, hi, default) in DISK_TERMS.items():
        # a term whose whole range prices the records alike (within a thousandth): untold
        # (its ends alone can price them alike by chance, on either side of a basin)
        spread = [error({**terms, key: float(v)}) for v in np.linspace(lo, hi, 5)]
        told[key] = max(spread) - min(spread) > 1e-3
        if not told[key]:
            terms[key] = default
    return DiskFit(terms, error(terms), rms_error(predict_disk(pricing, runs, terms)), len(seen), told)


def disk_fit_terms(fit: DiskFit, runs: Sequence[DiskRun], probe_note: str) -> list[FitTerm]:
    """The fitted terms as FitTerms for a profile, each noting the records and the error."""
    where = ", ".join(f"{Path(r.source).name} {r.budget}" for r in runs)
    common = (
        f"fitted to {len(runs)} RAM-budget run(s) ({where}) on {probe_note}; rms error of TPOT "
        f"{fit.tpot_error:.3f}, with the hit rates {fit.error:.3f}"
    )
    what = {
        "disk_read_scale": "a read's time while a decode runs, over the probe's",
        "disk_overlap": "share of a read's progress that goes on while the host computes",
        "disk_host_read_us": "host compute lost per pread done while the host computes, us",
    }
    untold = "the records price its whole range alike: kept at its value without the term"
    return [
        FitTerm(
            key,
            fit.terms[key],
            f"{what[key]}: {common}" if fit.told[key] else f"{what[key]}: {untold}",
            fit.told[key],
        )
        for key in DISK_TERMS
    ]


def fitted_disk_profile(
    base: HardwareProfile, terms: Sequence[FitTerm], runs: Sequence[DiskRun], name: str
) -> dict[str, Any]:
    """The base disk profile (its JSON's values, not a probe's) with the fitted disk
    terms, as a profile JSON document: a probe given with it replaces its disk's
    bandwidth and latency as it does the shipped profile's (hardware.with_probe). A term
    the records could not tell is left out, so it prices as the fit priced it: at its
    value without the term (not the base profile's, which the fit did not use)."""
    values = fitted_values(base, terms)
    for term in terms:
        if not term.fitted:
            values.pop(term.key, None)
    return {
        "name": name,
        "kind": "disk",
        "description": f"{base.description}; disk terms fitted by `pyspice sim fit` to "
        f"{len(runs)} RAM-budget run(s)",
        "fitted_from": [run.source for run in runs],
        "values": values,
    }


def disk_pricing(
    model: Path,
    workload: Workload,
    probe: Path | None,
    base: HardwareProfile,
    *,
    sidecar: Path | None = None,
    history: Path | None = None,
) -> tuple[DiskPricing, HardwareProfile]:
    """The disk tier of `model` priced as `--policy auto` prices it (engine.auto_policy.
    tier_pricing): `base` with the probe's compute and disk, the routing `workload`
    replays, the model's routers, and SPICE's predictor where one is given: the
    sidecar's draft predictor, or a routing-history predictor (`pyspice trace fit`)."""
    if sidecar is not None and history is not None:
        raise ValueError("give SPICE one predictor: --sidecar or --history-predictor, not both")
    prof = with_probe(base, load_cost_profile(probe)) if probe is not None else base
    router = RouterReader(model) if workload.n_embd > 0 else None
    extra: dict[str, Any] = {}
    if sidecar is not None:
        extra["predictor"] = Sidecar.load(sidecar, model).predictor(router)
    if history is not None:
        extra["predictor"] = HistoryLookahead(RoutingHistory.load(history), workload.moe_layers)
    costs = disk_costs(prof, workload, model, tuple(source_target(model).expert_bytes))
    return DiskPricing(costs, workload, policy_profile(prof, costs), router, extra), prof


def format_disk_predictions(preds: Sequence[DiskPrediction], fitted: set[str]) -> str:
    """Predicted beside measured TPOT per row, the runs fitted marked, and each group's
    rms error and the row each run's ranking would pick."""
    lines = [
        "simulated TPOT beside measured (ms per token); * = a run the terms were fitted to",
        f"{'run':<34} {'budget':>6} {'row':<8} {'measured':>9} {'predicted':>9} {'error':>7} {'hit m/p':>11}",
    ]
    for p in preds:
        mark = "*" if p.run in fitted else " "
        hit = (
            f"{p.measured_hit:.3f}/{p.predicted_hit:.3f}"
            if p.measured_hit is not None
            else f"-/{p.predicted_hit:.3f}"
        )
        lines.append(
            f"{mark}{Path(p.run).name:<33} {p.budget:>6} {p.row:<8} {p.measured_ms:9.2f} "
            f"{p.predicted_ms:9.2f} {100 * p.error:+6.1f}% {hit:>11}"
        )
    for name, group in (
        ("fitted", [p for p in preds if p.run in fitted]),
        ("not fitted", [p for p in preds if p.run not in fitted]),
    ):
        if group:
            lines.append(
                f"{name}: rms error of TPOT {rms_error(group):.3f} over {len(group)} rows, "
                f"with the hit rates {fit_error(group):.3f}"
            )
    for run in dict.fromkeys(p.run for p in preds):
        rows = [p for p in preds if p.run == run]
        pick = min(rows, key=lambda p: p.predicted_ms)
        best = min(rows, key=lambda p: p.measured_ms)
        lines.append(
            f"{Path(run).name} {rows[0].budget}: simulated pick {pick.row} (measured {pick.measured_ms:.2f}, "
            f"{pick.measured_ms / best.measured_ms:.3f}x the best, {best.row} {best.measured_ms:.2f})"
        )
    return "\n".join(lines)
