"""`pyspice sim fit`: a hardware profile's costs read off recorded bench runs.

A bench record holds, per row and per MoE layer, what the hook's thread spent
on each part of a decode call (pyspice.stats._per_call_record): running host
experts (`exec_us` of a call with no device launch), launching and collecting
device work, the store's bookkeeping and the copies it issued, waiting for
copies (`stall_ms_per_token`), and the time between calls (`gap_us`: the
layer's attention and shared work on the device). Each cost term of the
simulator's model (pyspice.sim.simulator, module docstring) is the mean of the
calls that show it alone:

- `device_layer_us`: the gap between hook calls, less reading the layer's
  weights at the device's bandwidth (the sim adds that back);
- host experts: `exec_us` of calls with no device work and no copies, over
  their host activations (`host_call_us` + n x per activation; a least-squares
  line where the calls' counts differ, else the base profile's `host_call_us`
  and the slope through the mean); stored as `host_mem_gbps`, the target's
  mean expert bytes over that time, so another model's experts scale by bytes;
- the device executor: `launch_us + exec_us` of calls with no host work, as a
  floor per call (`device_call_us`) plus a slope per activation
  (`device_act_overhead_us` beyond reading its bytes) where counts differ,
  else the slope of reading the bytes alone;
- `copy_issue_us`: the store's time per copy beyond a call without copies;
- `bus_gbps`: demand fetches' bytes over the time waited for them, in rows
  that prefetch nothing (every byte waited for);
- `hook_us`: what a call's time holds beyond those parts (reading the call,
  checking ids, the store's own bookkeeping);
- `step_us`: a token's time outside the layers (embedding, output head,
  sampling), from rows without copies;
- `stock_layer_us`: what llama.cpp's own path costs per MoE layer beyond our
  host executor's work on the same experts, from the `stock` row;
- `async_layer_us`: what a planner thread at work costs the decode per MoE
  layer, from rows that planned asynchronously: their longer gaps between
  hook calls and slower device launches (on the H200 the planner's Python
  and the decode's graph work contend: docs/results/gpu.md);
- `deciding_us`: each row's measured deciding time per decode call, which a
  prediction charges where the simulator cannot time the policy itself (rules
  run natively).

`bus_host_slowdown` needs host experts running while the bus copies; where
no row of the records shows that, the base profile's value is kept and the
note says so.

Edge mode's disk tier (`fit_disk`) has no such counters to read in the records
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

import argparse
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
from pyspice.sim.hardware import (
    HardwareProfile,
    budget_bytes,
    disk_costs,
    load_profile,
    policy_profile,
    with_probe,
)
from pyspice.sim.rank import AUTO_CANDIDATES, rank_lossless
from pyspice.sim.records import LayerCounters, RecordedRow, RecordedRun, read_records
from pyspice.sim.simulator import Costs
from pyspice.sim.targets import TargetModel, source_target
from pyspice.sim.workload import Workload, from_trace
from pyspice.units import whole_tier_bytes


@dataclass(frozen=True)
class FitTerm:
    key: str
    value: float
    note: str
    fitted: bool = True  # False: kept from the base profile


def _line(points: Sequence[tuple[float, float]], intercept: float | None) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x over the points: least squares where x varies,
    else through their mean with intercept `intercept` (or 0)."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if len(points) >= 2 and float(xs.max() - xs.min()) >= 1.0:
        b, a = np.polyfit(xs, ys, 1)
        return float(a), float(b)
    a = intercept or 0.0
    return a, float((ys.mean() - a) / max(xs.mean(), 1e-9))


def _hooked(runs: Sequence[RecordedRun]) -> list[tuple[RecordedRun, RecordedRow]]:
    return [(run, row) for run in runs for row in run.rows.values() if row.hooked]


def _gaps(row: RecordedRow) -> list[float]:
    """The row's gaps between hook calls, per layer: every MoE layer's but the first's
    (nothing hooked runs before it in the graph, so its gap is 0)."""
    first = min((x.layer for x in row.layers), default=-1)
    return [x.per_call["gap_us"] for x in row.layers if x.layer != first and x.per_call["gap_us"] > 0]


def _stall_per_call(row: RecordedRow) -> float:
    return row.stall_ms_per_token * 1e3 / max(1, len(row.layers))


def _calls(runs: Sequence[RecordedRun]) -> list[tuple[RecordedRow, LayerCounters]]:
    return [(row, layer) for _, row in _hooked(runs) for layer in row.layers]


def fit_terms(runs: Sequence[RecordedRun], target: TargetModel, base: HardwareProfile) -> list[FitTerm]:
    """Every cost term the records show (module docstring), the base's where they do not."""
    if not _hooked(runs):
        raise ValueError("the records hold no row that went through the hook: nothing to fit")
    dev_bw = base["device_mem_gbps"] * 1e3  # bytes per microsecond
    moe_bytes = [target.expert_bytes[il] for il in target.moe_layers]
    mean_expert = sum(moe_bytes) / len(moe_bytes)
    mean_layer = sum(target.layer_bytes) / target.n_layers
    read_us = mean_expert / dev_bw  # one expert's bytes at the device's bandwidth
    k = target.n_expert_used
    calls = _calls(runs)
    where = ", ".join(dict.fromkeys(run.source.rsplit("/", 1)[-1] for run in runs))
    terms: list[FitTerm] = []

    # a planner thread lengthens the gaps (async_layer_us below): the layer's own time is the others'
    gaps = [g for _, row in _hooked(runs) if not row.asynchronous for g in _gaps(row)]
    if not gaps:
        raise ValueError(
            "the records' rows have no gap between hook calls (gap_us): no per-layer time to fit"
        )
    rest = float(np.mean(gaps))
    terms.append(
        FitTerm(
            "device_layer_us",
            rest - mean_layer / dev_bw,
            f"mean gap between hook calls {rest:.1f} us ({len(gaps)} layer rows of {where}), less "
            f"{mean_layer / dev_bw:.1f} us reading a layer's weights",
        )
    )

    no_copy = [(r, x) for r, x in calls if r.copies_per_call == 0 and x.per_call.get("copies", 0) == 0]
    host_pts = [
        (x.host_per_call, x.per_call["exec_us"])
        for _, x in no_copy
        if x.per_call.get("launches", 0) == 0 and x.host_per_call > 0
    ]
    if not host_pts:
        raise ValueError(
            "no layer of the records ran host experts alone (exact or a stock-like row): no host time"
        )
    call_us, per_act = _line(host_pts, base["host_call_us"])
    how = "least squares" if call_us != base["host_call_us"] else f"the base's {call_us:g} us per call kept"
    terms.append(FitTerm("host_call_us", call_us, f"host executor per call with host work ({how})", True))
    terms.append(
        FitTerm(
            "host_mem_gbps",
            mean_expert / per_act / 1e3,
            f"{per_act:.1f} us per host activation ({len(host_pts)} layer rows without device work or "
            f"copies) for the target's mean expert of {mean_expert / 1e6:.2f} MB",
        )
    )

    dev_pts = [
        (k - x.host_per_call, x.per_call.get("launch_us", 0.0) + x.per_call["exec_us"])
        for _, x in calls
        if x.host_per_call == 0 and x.per_call.get("launches", 0) >= 1
    ]
    if dev_pts:
        xs = [p[0] for p in dev_pts]
        if max(xs) - min(xs) >= 1.0:
            floor, slope = _line(dev_pts, None)
        else:
            slope = read_us
            floor = float(np.mean([y for _, y in dev_pts])) - slope * float(np.mean(xs))
        terms.append(
            FitTerm(
                "device_call_us",
                floor,
                f"device executor per call with device work: launch + collect of {len(dev_pts)} layer rows "
                "without host work, less its activations",
            )
        )
        terms.append(
            FitTerm(
                "device_act_overhead_us",
                max(0.0, slope - read_us),
                f"per device activation beyond reading its bytes ({slope:.2f} us in all)",
            )
        )

    base_store = [r.per_call.get("store_us", 0.0) for _, r in _hooked(runs) if r.copies_per_call == 0]
    store0 = float(np.mean(base_store)) if base_store else 0.0
    copying = [r for _, r in _hooked(runs) if r.copies_per_call > 0]
    if copying:
        issued = sum(r.copies_per_call for r in copying)
        extra = sum(r.per_call.get("store_us", 0.0) - store0 for r in copying)
        terms.append(
            FitTerm(
                "copy_issue_us",
                max(0.0, extra / issued),
                f"the store's time per copy beyond a call without copies ({store0:.1f} us), "
                f"{len(copying)} rows",
            )
        )
    demand = [
        r for r in copying if r.prefetch_issued == 0 and r.stall_ms_per_token > 0 and r.bytes_per_token > 0
    ]
    if demand:
        gbps = sum(r.bytes_per_token for r in demand) / sum(r.stall_ms_per_token * 1e6 for r in demand)
        terms.append(
            FitTerm("bus_gbps", gbps, f"demand fetches' bytes over the time waited ({len(demand)} rows)")
        )
        terms.append(FitTerm("bus_latency_us", 0.0, "folded into bus_gbps by the fit"))

    rests = [
        r.per_call["hook_us"]
        - r.per_call.get("launch_us", 0.0)
        - r.per_call["exec_us"]
        - _stall_per_call(r)
        - r.policy_us
        - (r.per_call.get("store_us", 0.0) - store0)
        for _, r in _hooked(runs)
    ]
    terms.append(
        FitTerm(
            "hook_us",
            max(0.0, float(np.median(rests))),
            "a hook call's time beyond executors, stalls, deciding and copies (median of rows)",
        )
    )

    steps = [
        row.tpot_ms * 1e3 - sum(x.per_call["hook_us"] for x in row.layers) - target.n_layers * rest
        for _, row in _hooked(runs)
        if row.copies_per_call == 0 and row.layers
    ]
    step = float(np.mean(steps)) if steps else 0.0
    if steps:
        terms.append(FitTerm("step_us", step, "a token's time outside the layers (rows without copies)"))

    stocks = [run.stock for run in runs if run.stock is not None and run.stock.tpot_ms > 0]
    if stocks:
        n_moe = len(target.moe_layers)
        own = [
            (s.tpot_ms * 1e3 - step - target.n_layers * rest) / n_moe - (call_us + k * per_act)
            for s in stocks
        ]
        terms.append(
            FitTerm(
                "stock_layer_us",
                float(np.mean(own)),
                f"llama.cpp's own path per MoE layer beyond our host executor's work "
                f"({len(stocks)} stock rows)",
            )
        )

    native_launch = [
        r.per_call["launch_us"] / r.per_call["launches"]
        for _, r in _hooked(runs)
        if not r.asynchronous and r.per_call.get("launches", 0) > 0
    ]
    planned = [r for _, r in _hooked(runs) if r.asynchronous]
    if planned and native_launch:
        launch0 = float(np.mean(native_launch))
        extras = []
        for r in planned:
            row_gaps = _gaps(r)
            gap = float(np.mean(row_gaps)) if row_gaps else rest
            extras.append(
                gap - rest + r.per_call.get("launch_us", 0.0) - launch0 * r.per_call.get("launches", 0.0)
            )
        terms.append(
            FitTerm(
                "async_layer_us",
                max(0.0, float(np.mean(extras))),
                f"per MoE layer while a planner thread plans: longer gaps and launches ({len(planned)} rows)",
            )
        )

    slow = [
        (x.per_call["exec_us"] - call_us) / (x.host_per_call * per_act) - 1.0
        for r, x in calls
        if r.copies_per_call > 0 and x.host_per_call > 0 and x.per_call.get("launches", 0) == 0
    ]
    if slow:
        terms.append(
            FitTerm(
                "bus_host_slowdown",
                max(0.0, float(np.mean(slow))),
                f"host experts' time while the row copies, over that without ({len(slow)} layer rows; "
                "as if the bus were busy throughout)",
            )
        )
    else:
        kept = base.optional("bus_host_slowdown")
        terms.append(
            FitTerm(
                "bus_host_slowdown",
                kept,
                f"kept from {base.name}: no row of the records runs host experts while copying",
                fitted=False,
            )
        )
    return terms


def deciding_us(runs: Sequence[RecordedRun]) -> dict[str, float]:
    """Each hooked row's deciding time per decode call, averaged over the runs that have it."""
    seen: dict[str, list[float]] = {}
    for _, row in _hooked(runs):
        seen.setdefault(row.name, []).append(row.policy_us)
    return {name: float(np.mean(v)) for name, v in seen.items()}


def fitted_profile(
    runs: Sequence[RecordedRun],
    target: TargetModel,
    base: HardwareProfile,
    name: str,
    terms: Sequence[FitTerm] | None = None,
) -> dict[str, Any]:
    """The base profile with every term the records show replaced by its fit, as a
    profile JSON document (pyspice/sim/profiles format). `terms`: fit_terms of the
    same arguments, where the caller has them already."""
    values = _fitted_values(base, terms if terms is not None else fit_terms(runs, target, base))
    sources = [run.source for run in runs]
    return {
        "name": name,
        "description": f"{base.name} with costs fitted by `pyspice sim fit` to {len(sources)} bench run(s) "
        f"of {target.name}",
        "fitted_from": sources,
        "target": target.name,
        "values": values,
        "deciding_us": {k: round(v, 3) for k, v in deciding_us(runs).items()},
    }


def _fitted_values(base: HardwareProfile, terms: Sequence[FitTerm]) -> dict[str, Any]:
    """The base profile's values as profile JSON, each fitted term in its place."""
    values: dict[str, Any] = {}
    for key, v in base.values.items():
        doc: dict[str, Any] = {"source": v.source, "note": v.note}
        if v.source == "derived":
            doc.update(peak=v.peak, efficiency=v.efficiency)
        else:
            doc["value"] = v.value
        values[key] = doc
    for term in terms:
        if term.fitted:
            values[term.key] = {
                "value": round(term.value, 4),
                "source": "measured",
                "note": f"sim fit: {term.note}",
            }
    return values


# -- edge mode's disk tier (module docstring: fit_disk) ---------------------------------

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


def read_disk_runs(path: Path) -> list[DiskRun]:
    """The RAM-budget runs of a record file: a results record (`{"runs": [...]}`, each
    with `tier` "ram-budget", its `budget` and `rows`, as docs/results/auto-policy-*.json
    keep them), or `pyspice bench --json` runs whose tier is the disk."""
    text = path.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
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
    bandwidth and latency as it does the shipped profile's (hardware.with_probe)."""
    return {
        "name": name,
        "kind": "disk",
        "description": f"{base.description}; disk terms fitted by `pyspice sim fit` to "
        f"{len(runs)} RAM-budget run(s)",
        "fitted_from": [run.source for run in runs],
        "values": _fitted_values(base, terms),
    }


def disk_pricing(
    model: Path,
    trace: Path,
    probe: Path | None,
    sidecar: Path | None,
    base: HardwareProfile,
) -> tuple[DiskPricing, HardwareProfile]:
    """The disk tier of `model` priced as `--policy auto` prices it (engine.auto_policy.
    tier_pricing): `base` with the probe's compute and disk, the routing of `trace`, the
    model's routers, and the sidecar's draft predictor where one is given."""
    prof = with_probe(base, load_cost_profile(probe)) if probe is not None else base
    workload = from_trace(trace)
    router = RouterReader(model) if workload.n_embd > 0 else None
    extra: dict[str, Any] = {}
    if sidecar is not None:
        extra["predictor"] = Sidecar.load(sidecar, model).predictor(router)
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


def disk_fit_command(
    records: Sequence[Path],
    output: Path,
    *,
    model: Path,
    trace: Path,
    probe: Path | None,
    sidecar: Path | None,
    budget: str | None,
    base: str = "disk",
    name: str | None = None,
) -> int:
    """Fit the disk terms to the RAM-budget runs of `records` (those of `budget` only, where
    given; the others are predicted beside them) and write the base profile with them."""
    runs = [run for path in records for run in read_disk_runs(path)]
    fit_runs = [run for run in runs if budget is None or run.budget == budget]
    if not fit_runs:
        have = ", ".join(sorted({run.budget for run in runs})) or "none"
        raise ValueError(f"no RAM-budget run of {budget} in the records (budgets there: {have})")
    profile = load_profile(base)
    if not profile.disk:
        raise ValueError(f"profile {profile.name!r} is not a disk profile: the disk terms are edge mode's")
    pricing, priced = disk_pricing(model, trace, probe, sidecar, profile)
    fit = fit_disk(pricing, fit_runs)
    disk = f"{priced['bus_gbps']:.3g} GB/s and {priced['bus_latency_us']:.3g} us per 64 KiB read"
    terms = disk_fit_terms(fit, fit_runs, f"the disk as probed ({disk}), routing {trace.name}")
    doc = fitted_disk_profile(profile, terms, fit_runs, name or output.stem)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"fitted the disk terms to {len(fit_runs)} run(s) ({fit.evaluations} simulations), on {profile.name}:"
    )
    for term in terms:
        print(f"  {term.key:<20} {term.value:8.3f}{'' if term.fitted else '  (kept)'}  {term.note}")
    print(format_disk_predictions(predict_disk(pricing, runs, fit.terms), {r.source for r in fit_runs}))
    print(f"profile written to {output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pyspice.sim.fit RECORD... -o PROFILE -m MODEL --trace SAMPLE`: the disk
    terms fitted to edge-mode records (disk_fit_command)."""
    p = argparse.ArgumentParser(prog="python -m pyspice.sim.fit", description=disk_fit_command.__doc__)
    p.add_argument("records", nargs="+", type=Path, help="results records or bench --json files")
    p.add_argument("-o", "--output", type=Path, required=True, help="the profile JSON to write")
    p.add_argument("-m", "--model", type=Path, required=True, help="the runs' GGUF model file")
    p.add_argument("--trace", type=Path, required=True, help="the routing to replay (auto's sample)")
    p.add_argument("--probe", type=Path, help="`pyspice probe`'s cost profile of the model")
    p.add_argument("--sidecar", type=Path, help="the model's sidecar, for SPICE's draft predictor")
    p.add_argument("--budget", help="fit to the runs of this RAM budget only (e.g. 25%%)")
    p.add_argument("--base", default="disk", help="the disk profile the terms join (default disk)")
    p.add_argument("--name", help="the new profile's name (default: the output file's stem)")
    return disk_fit_command(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
