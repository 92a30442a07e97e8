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

Edge mode's disk tier has terms of its own, fitted to TPOTs and hit rates:
pyspice.sim.fit_disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyspice.sim.hardware import (
    HardwareProfile,
)
from pyspice.sim.records import LayerCounters, RecordedRow, RecordedRun
from pyspice.sim.targets import TargetModel


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
    values = fitted_values(base, terms if terms is not None else fit_terms(runs, target, base))
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


def fitted_values(base: HardwareProfile, terms: Sequence[FitTerm]) -> dict[str, Any]:
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
