"""Lossless policies ranked by simulated TPOT on one tier: the choice `--policy auto`
makes (pyspice.engine.auto_policy), from this machine's probe and a routing sample.

Every row is simulated where the engine would run it: the budget's bytes as the
tier holds them, the policy's default planning (simulate_row), its deciding time
timed here (a Python policy's decide() runs on this machine, which is the one the
run uses). A candidate that cannot run on what the run has (SPICE without a
predictor, adapmoe without hidden rows) is left out with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspice.policy import policy_spec
from pyspice.policy.profile import CostProfile
from pyspice.policy.registry import inputs_verdict
from pyspice.policy.rows import parse_row
from pyspice.sim.costs import Costs
from pyspice.sim.report import simulate_row, tier_context
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import Workload

# what `--policy auto` ranks; lossless only: a lossy level is asked for by name
AUTO_CANDIDATES = ("exact", "static", "lru", "adapmoe", "spice")


@dataclass(frozen=True)
class RankedRow:
    row: str
    tpot_ms: float  # simulated
    hit_rate: float


@dataclass(frozen=True)
class Ranking:
    rows: tuple[RankedRow, ...]  # fastest first
    left_out: tuple[tuple[str, str], ...]  # (row, why it could not be ranked)

    @property
    def best(self) -> RankedRow:
        return self.rows[0]

    @property
    def runner_up(self) -> RankedRow | None:
        return self.rows[1] if len(self.rows) > 1 else None


def rank_lossless(
    workload: Workload,
    costs: Costs,
    budget_bytes: int,
    candidates: Sequence[str],
    *,
    router: Any = None,
    profile: CostProfile | None = None,
    context_extra: dict[str, Any] | None = None,
) -> Ranking:
    """Each lossless candidate through one simulator of the tier; `context_extra`: the
    policies' further inputs (a predictor). A lossy name is refused: auto never picks one."""
    lossy = [name for name in candidates if not policy_spec(name).lossless]
    if lossy:
        raise ValueError(f"ranking is for lossless policies only; {', '.join(lossy)} are lossy")
    has_predictor = bool(context_extra and context_extra.get("predictor") is not None)
    hidden = workload.n_embd > 0  # a trace with hidden rows (an imported one has none)
    left_out: list[tuple[str, str]] = []
    runnable: list[str] = []
    for name in candidates:
        # only what would run as itself: a fallback would rank another policy under its name
        verdict = inputs_verdict(
            policy_spec(name), hidden_rows=hidden, routers=router is not None, predictor=has_predictor
        )
        if verdict.runs_as_itself:
            runnable.append(name)
        else:
            left_out.append((name, verdict.missing or f"without hidden rows it {verdict.fallback}"))
    sim = Simulator(
        workload,
        costs,
        budget_bytes,
        router=router,
        profile=profile,
        context_extra={**tier_context(costs), **(context_extra or {})},
    )
    ranked: list[RankedRow] = []
    for name in runnable:
        _, result = simulate_row({True: sim}, parse_row(name), None)
        ranked.append(RankedRow(name, result.tpot_ms, result.hit_rate))
    if not ranked:
        raise ValueError("no lossless policy could be ranked on this tier")
    ranked.sort(key=lambda r: r.tpot_ms)
    return Ranking(tuple(ranked), tuple(left_out))


def _candidate(row: str) -> bool:
    """A recorded row auto would have run: a candidate by name, at its default planning."""
    return row in AUTO_CANDIDATES or row == "spice:exact"  # `spice` is spice:exact


def picks_on_records(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What auto's rule picks on recorded runs, and how that pick measured: `rows` are
    `sim --predict` records (run, row, budget, measured_ms, predicted_ms, lossless). Per
    run and budget with two candidates or more predicted, the pick is the candidate of
    least predicted TPOT; `over_best` is its measured TPOT over the best measured
    lossless row of that run and budget (any row the hook ran, planned any way), and
    `over_ncmoe` over llama.cpp's `--n-cpu-moe` row of the run, where recorded."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ncmoe: dict[str, float] = {}
    for r in rows:
        if r["row"] == "upstream-ncmoe" and r.get("measured_ms"):
            ncmoe[r["run"]] = float(r["measured_ms"])
        elif r["budget"] and r.get("measured_ms"):
            groups.setdefault((r["run"], r["budget"]), []).append(r)
    picks = []
    for (run, budget), group in groups.items():
        pool = [r for r in group if _candidate(r["row"]) and r.get("predicted_ms") is not None]
        if len(pool) < 2:
            continue  # nothing to choose between
        pick = min(pool, key=lambda r: float(r["predicted_ms"]))
        best = min((r for r in group if r["lossless"]), key=lambda r: float(r["measured_ms"]))
        measured = float(pick["measured_ms"])
        picks.append(
            {
                "run": run,
                "budget": budget,
                "pick": pick["row"],
                "candidates": sorted(r["row"] for r in pool),
                "pick_measured_ms": measured,
                "best": best["row"],
                "best_measured_ms": float(best["measured_ms"]),
                "over_best": measured / float(best["measured_ms"]),
                "over_ncmoe": measured / ncmoe[run] if run in ncmoe else None,
            }
        )
    return picks
