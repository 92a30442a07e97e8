"""`pyspice sim --predict RECORD`: each recorded bench row's TPOT beside the
simulator's prediction of it, on a profile (a shipped one, or one `sim fit`
fitted to other runs).

A run is replayed as its hook saw it: the decode steps (and the prompt's
batches where the record says they went through the hook) of the routing it
ran on -- the trace it replayed, laid onto the model as bench's replay lays
it (pyspice.engine.replay), or a trace of the model's own routing given with
`--trace` -- on a device tier of the row's recorded slot bytes. Predictions
are compared as TPOT over the run's `stock` row, each side's own: the ratio a
user reads off a bench table, free of how fast the machine was that day.

llama.cpp's own rows (`upstream*`: no hook) are priced from the placement
the record keeps for them (pyspice.sim.upstream) and scored apart: they are
not our policies, and the summary's figure for the lossless rows leaves them
out. Rows the simulator cannot replay say why: policies that read what the
routing lacks (hidden rows for a draft predictor or a gate, a sidecar).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pyspice.policy.context import RouterLoader
from pyspice.policy.rows import PolicyRow
from pyspice.sim.costs import Costs
from pyspice.sim.hardware import HardwareProfile, policy_profile, target_costs
from pyspice.sim.records import UPSTREAM_PREFIX, RecordedRow, RecordedRun, recorded_row
from pyspice.sim.report import simulate_row
from pyspice.sim.simulator import Simulator
from pyspice.sim.targets import TargetModel
from pyspice.sim.upstream import price_row, split_free_costs
from pyspice.sim.workload import Workload, from_trace

TOLERANCE = 0.10  # |predicted - measured| of TPOT over stock's, as a share of measured


@dataclass(frozen=True)
class Prediction:
    run: str
    row: str
    budget: str  # the tier's share of the whole tier ("" without one)
    measured_ms: float
    predicted_ms: float | None
    measured_ratio: float | None  # over the run's stock
    predicted_ratio: float | None
    measured_hit: float | None
    predicted_hit: float | None
    lossless: bool
    routing: str = ""  # the trace the prediction replayed
    note: str = ""

    @property
    def llama_cpp(self) -> bool:
        """llama.cpp's own row, not one of our policies."""
        return self.row.startswith(UPSTREAM_PREFIX)

    @property
    def error(self) -> float | None:
        if self.measured_ratio is None or self.predicted_ratio is None or self.measured_ratio <= 0:
            return None
        return (self.predicted_ratio - self.measured_ratio) / self.measured_ratio

    def record(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "row": self.row,
            "budget": self.budget,
            "measured_ms": self.measured_ms,
            "predicted_ms": self.predicted_ms,
            "measured_over_stock": self.measured_ratio,
            "predicted_over_stock": self.predicted_ratio,
            "error": self.error,
            "measured_hit": self.measured_hit,
            "predicted_hit": self.predicted_hit,
            "lossless": self.lossless,
            "llama_cpp_row": self.llama_cpp,
            "routing": self.routing,
            "note": self.note,
        }


def _hooked_steps(wl: Workload, prompt_hooked: bool, decode_steps: int) -> Workload:
    """The steps a bench repeat's hook sees: the prompt's only where it was hooked, then
    `decode_steps` decode steps."""
    prompt = [s for s in wl.steps if not s.decode] if prompt_hooked else []
    decode = [s for s in wl.steps if s.decode][:decode_steps]
    return replace(wl, steps=[*prompt, *decode])


def own_workload(trace: Path, run: RecordedRun, target: TargetModel, prompt_hooked: bool) -> Workload:
    """A trace of the model's own routing (its geometry must be the target's)."""
    wl = from_trace(trace)
    if wl.moe_layers != tuple(target.moe_layers) or max(wl.n_expert) != target.n_expert:
        raise ValueError(
            f"{trace} routes {len(wl.moe_layers)} MoE layers of {max(wl.n_expert)} experts; the run's model "
            f"({target.name}) has {len(target.moe_layers)} of {target.n_expert}: give a trace of that model"
        )
    return _hooked_steps(wl, prompt_hooked, max(0, run.n_predict - 1))


def _stock_costs(costs: Costs) -> Costs:
    """stock: every expert on the host through llama.cpp's own path -- no policy, no
    copies, its per-layer cost where the hook's would be."""
    return replace(costs, hook_us=costs.stock_layer_us, copy_issue_us=0.0, python_call_us=0.0)


def _share(row: RecordedRow, target: TargetModel, placement: Any = None) -> str:
    """The tier's share of the whole tier; for llama.cpp's --n-cpu-moe row the budget of
    the pyspice rows its GPU experts were sized to (matched_bytes)."""
    nbytes = row.slots_bytes
    if nbytes is None and isinstance(placement, dict) and placement.get("matched_bytes"):
        nbytes = int(placement["matched_bytes"])
    if nbytes is None:
        return ""
    return f"{100 * nbytes / target.routed_bytes:.3g}%"


def _why_not(name: str, row: PolicyRow | None, wl: Workload, has_router: bool) -> str:
    """Why the simulator cannot replay a recorded row as it ran ("" when it can); `row`:
    its name parsed (None: one the grammar refuses)."""
    if row is None:
        try:
            row = recorded_row(name)
        except ValueError as err:
            return str(err)
    assert row.spec is not None  # parsed with no other rows: every row names a policy
    if row.ram is not None:
        return "edge mode (a RAM budget of the row's own): not modelled here"
    if "hidden" in row.spec.inputs:
        # a policy run without its gate or draft is another policy than the one measured
        if not any(c.hidden is not None and c.hidden.size for s in wl.steps for c in s.calls):
            return f"{row.name} reads hidden rows, which this routing lacks"
        if not has_router:
            return f"{row.name} reads the model's routers: give -m MODEL"
    return ""


def predict_run(
    run: RecordedRun,
    workload: Workload,
    profile: HardwareProfile,
    target: TargetModel,
    router: RouterLoader | None = None,
) -> list[Prediction]:
    """Every row of `run`, predicted on `profile` where the simulator can replay it."""
    costs = target_costs(profile, target, workload)
    free = split_free_costs(profile, target, workload)
    stock_rec = run.stock
    stock_ms = None
    if stock_rec is not None:
        stock_ms = Simulator(workload, _stock_costs(costs), 0).run("stock", None, policy_us=0.0).tpot_ms
    out: list[Prediction] = []
    for name, row in run.rows.items():
        meas_ratio = row.tpot_ms / stock_rec.tpot_ms if stock_rec is not None and stock_rec.tpot_ms else None
        policy_row = row.policy_row
        lossless = name.startswith(UPSTREAM_PREFIX) or name == "stock"
        if not lossless:
            lossless = policy_row is not None and policy_row.spec is not None and policy_row.spec.lossless
        placement = run.llama_cpp.get(name)
        common: dict[str, Any] = dict(
            run=run.source, row=name, budget=_share(row, target, placement), measured_ms=row.tpot_ms,
            measured_ratio=meas_ratio, lossless=lossless, routing=workload.source,
            measured_hit=row.hit_rate if row.hooked else None,
        )  # fmt: skip
        if name == "stock":
            out.append(
                Prediction(
                    **common,
                    predicted_ms=stock_ms,
                    predicted_ratio=1.0 if stock_ms else None,
                    predicted_hit=None,
                )
            )
            continue
        if name.startswith(UPSTREAM_PREFIX):
            priced = price_row(name, placement, costs, free, workload)
            ratio = priced.tpot_ms / stock_ms if priced.tpot_ms is not None and stock_ms else None
            out.append(
                Prediction(
                    **common,
                    predicted_ms=priced.tpot_ms,
                    predicted_ratio=ratio,
                    predicted_hit=None,
                    note=priced.note,
                )
            )
            continue
        why = _why_not(name, policy_row, workload, router is not None) or (
            "" if row.slots_bytes is not None else "no device tier recorded"
        )
        if why:
            out.append(
                Prediction(**common, predicted_ms=None, predicted_ratio=None, predicted_hit=None, note=why)
            )
            continue
        sims = {
            lossless_kind: Simulator(
                workload, costs, row.slots_bytes, router=router, profile=policy_profile(profile, costs)
            )
            for lossless_kind in (True, False)
        }
        assert policy_row is not None  # _why_not names every row that did not parse
        us = profile.deciding_us.get(name)
        # a row that did not say planned where the engine chose; the record says which
        if policy_row.planning is None and row.asynchronous:
            policy_row = replace(policy_row, planning="async")
        _, result = simulate_row(sims, policy_row, us, native_us=us or 0.0)
        out.append(
            Prediction(
                **common,
                predicted_ms=result.tpot_ms,
                predicted_ratio=result.tpot_ms / stock_ms if stock_ms else None,
                predicted_hit=result.hit_rate,
            )
        )
    return out


def format_predictions(preds: Sequence[Prediction]) -> str:
    head = (
        f"{'run':<28} {'row':<20} {'budget':>6} {'measured':>9} {'predicted':>9} "
        f"{'meas/stock':>10} {'pred/stock':>10} {'error':>7} {'hit m/p':>11}  note"
    )
    lines = ["simulated predictions beside measured bench rows (TPOT ms per token)", head, "-" * len(head)]
    for p in preds:
        err = f"{100 * p.error:+.1f}%" if p.error is not None else ""
        hit = (
            f"{p.measured_hit:.3f}/{p.predicted_hit:.3f}"
            if p.measured_hit is not None and p.predicted_hit is not None
            else ""
        )
        lines.append(
            f"{Path(p.run).name:<28} {p.row:<20} {p.budget:>6} {p.measured_ms:9.3f} "
            f"{(f'{p.predicted_ms:.3f}' if p.predicted_ms is not None else '-'):>9} "
            f"{(f'{p.measured_ratio:.3f}' if p.measured_ratio is not None else '-'):>10} "
            f"{(f'{p.predicted_ratio:.3f}' if p.predicted_ratio is not None else '-'):>10} "
            f"{err:>7} {hit:>11}  {p.note}"
        )
    ours = [p for p in preds if p.lossless and not p.llama_cpp and p.row != "stock"]
    theirs = [p for p in preds if p.llama_cpp]
    for what, group in (("lossless rows predicted", ours), ("llama.cpp's own rows predicted", theirs)):
        line = _score_line(what, group)
        if line:
            lines.append(line)
    if theirs:
        lines.append("(llama.cpp's own rows are not our policies: the lossless rows' figure leaves them out)")
    return "\n".join(lines)


def _score_line(what: str, preds: Sequence[Prediction]) -> str:
    errors = [abs(p.error) for p in preds if p.error is not None]
    if not errors:
        return ""
    within = sum(e <= TOLERANCE for e in errors)
    return (
        f"{what}: {len(errors)}; within {100 * TOLERANCE:.0f}% of measured (over stock): {within}; "
        f"worst {100 * max(errors):.1f}%"
    )
