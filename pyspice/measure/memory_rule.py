"""`bench --memory-limit rule`: the one memory limit every row of a run is judged at.

The limit is a floor plus half the routed-expert bytes. The floor is the cgroup
peak of a row at the smallest RAM budget (RULE_MIN_BUDGET), run first as the
rows run (same sidecar, prompt and threads) under no effective limit. Every
policy among the rows gets a floor row of its own, `exact` always among them,
and the largest peak is the floor: a policy's own memory (SPICE's draft maps,
its planner thread, a lossy level's surrogates) is then inside the limit, and
the limit covers every row it is used for. With `exact`'s floor alone, SPICE
rows at a 50% RAM budget ran 9-11 MiB over the limit on smolmoe-b and paged
their own mapped weights, 100x slower than `lru` (docs/results/edge-mode.md,
"The rule's floor").

A row whose need (its floor's peak plus its RAM budget beyond the floor's) is
over the limit anyway, a budget past half the experts, is named before it
runs: it will page like upstream.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pyspice.measure.isolated_row import UPSTREAM, RowSpec
from pyspice.measure.limited_bench import RowOutcome
from pyspice.units import format_bytes, parse_budget

RULE = "rule"  # --memory-limit rule
RULE_MIN_BUDGET = "1%"  # a policy "at its minimum": the smallest RAM budget a row takes as a share
RULE_BASE_POLICY = "exact"  # always among the floor rows: the rule's original definition
RAM_KEY = "@ram="
RSS_SLACK = 0.05  # peak RSS at most the RAM budget + the floor's overhead, +5%
_MIB = 1 << 20


def physical_memory() -> int:
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def floor_policies(policies: Sequence[str]) -> list[str]:
    """The policies that get a floor row: `exact`, then every other pyspice policy among
    the rows, in their order (upstream is plain llama.cpp: it has no RAM budget)."""
    out = [RULE_BASE_POLICY]
    for policy in policies:
        if policy != UPSTREAM and policy not in out:
            out.append(policy)
    return out


def floor_row_name(policy: str) -> str:
    return f"{policy}{RAM_KEY}{RULE_MIN_BUDGET}"


@dataclass
class RuleLimit:
    """The limit, the floor rows it came from (by policy), and which one set it."""

    limit: int
    floors: dict[str, RowOutcome]
    highest: str  # the policy whose floor row peaked highest
    routed_bytes: int

    @property
    def highest_outcome(self) -> RowOutcome:
        return self.floors[self.highest]

    def need(self, policy: str, ram_budget: str | int | None) -> int | None:
        """What a row of `policy` at `ram_budget` needs by its floor: the floor row's cgroup
        peak plus the budget beyond the floor's own. None for a row without a RAM budget."""
        floor = self.floors.get(policy)
        if floor is None or ram_budget is None or floor.cgroup_peak is None:
            return None
        beyond = budget_bytes(ram_budget, self.routed_bytes) - budget_bytes(
            RULE_MIN_BUDGET, self.routed_bytes
        )
        return floor.cgroup_peak + max(0, beyond)

    def record(self) -> dict[str, object]:
        """The rule's part of the bench JSON document."""
        top = self.highest_outcome
        return {
            "row": floor_row_name(self.highest),
            "cgroup_peak": top.cgroup_peak,
            "vm_hwm": top.vm_hwm,
            "routed_bytes": self.routed_bytes,
            "cached_after_drop": top.cached_before,
            "floors": {
                floor_row_name(p): {"cgroup_peak": o.cgroup_peak, "vm_hwm": o.vm_hwm}
                for p, o in self.floors.items()
            },
        }


def budget_bytes(budget: str | int, whole_tier: int) -> int:
    return parse_budget(str(budget)).resolve(whole_tier) if not isinstance(budget, int) else budget


def rule_limit(
    specs: Sequence[RowSpec], whole_tier: int, measure: Callable[[RowSpec, int], RowOutcome]
) -> RuleLimit:
    """The limit by the rule from the floor rows `specs` (one per policy, each at
    RULE_MIN_BUDGET) run by `measure` under the machine's whole memory: the highest cgroup
    peak + half of `whole_tier`, rounded up to a MiB. A floor row that does not end well
    cannot set a limit: an error saying so."""
    floors: dict[str, RowOutcome] = {}
    for spec in specs:
        outcome = measure(spec, physical_memory())
        if outcome.status != "ok" or not outcome.cgroup_peak:
            raise RuntimeError(
                f"--memory-limit {RULE}: the {spec.row} row that sets the limit ended {outcome.status}"
                + (f" ({outcome.message})" if outcome.message else "")
                + "; give the limit in bytes instead"
            )
        floors[spec.policy] = outcome
    highest = max(floors, key=lambda p: floors[p].cgroup_peak or 0)
    peak = floors[highest].cgroup_peak or 0
    limit = -(-(peak + whole_tier // 2) // _MIB) * _MIB
    return RuleLimit(limit, floors, highest, whole_tier)


def rule_warning(outcome: RowOutcome) -> str | None:
    """Why a floor row's peak may be low: model pages the drop could not evict (another
    process has them mapped) were never charged to its cgroup."""
    if outcome.cached_before <= 0:
        return None
    return (
        f"warning: {format_bytes(outcome.cached_before)} of the model stayed in the page cache after "
        "the drop (another process has it mapped), so the floor row was not charged for them and "
        "this limit is low: take the rule on an otherwise idle machine"
    )


def over_limit_rows(rule: RuleLimit, rows: Sequence[tuple[str, str, str | int | None]]) -> list[str]:
    """One line for each (row, policy, RAM budget) whose need by its floor is over the
    limit: such a row pages its mapped weights like upstream, and the reader is told so."""
    lines = []
    for name, policy, budget in rows:
        need = rule.need(policy, budget)
        if need is not None and need > rule.limit:
            lines.append(
                f"warning: row {name} needs about {format_bytes(need)} ({floor_row_name(policy)}'s peak "
                f"+ its RAM budget {budget} beyond the floor's), over the limit {format_bytes(rule.limit)}: "
                "it will page its mapped weights like upstream; give it a smaller RAM budget"
            )
    return lines


def rss_bounds(
    rows: Sequence[tuple[str, str, str | int | None]],
    outcomes: Sequence[RowOutcome],
    rule: RuleLimit,
) -> dict[str, dict[str, int | bool]]:
    """Each pyspice row's peak RSS against the bound the rule implies: its RAM budget
    plus the overhead of its own policy's floor row (that row's peak RSS less its budget),
    +5%. Rows without a RAM budget (upstream, a device tier) have no such bound."""
    floor_budget = budget_bytes(RULE_MIN_BUDGET, rule.routed_bytes)
    bounds: dict[str, dict[str, int | bool]] = {}
    for (name, policy, budget), outcome in zip(rows, outcomes, strict=True):
        floor = rule.floors.get(policy)
        if budget is None or floor is None or not outcome.vm_hwm:
            continue
        overhead = floor.vm_hwm - floor_budget
        bound = int((budget_bytes(budget, rule.routed_bytes) + overhead) * (1 + RSS_SLACK))
        bounds[name] = {"vm_hwm": outcome.vm_hwm, "bound": bound, "met": outcome.vm_hwm <= bound}
    return bounds


def format_rss_bounds(bounds: dict[str, dict[str, int | bool]]) -> str:
    lines = [
        "peak RSS against RAM budget + the overhead of its policy's floor row (that row's peak RSS "
        f"less its budget), +{RSS_SLACK:.0%}:"
    ]
    for row, b in bounds.items():
        verdict = "met" if b["met"] else f"over by {format_bytes(int(b['vm_hwm']) - int(b['bound']))}"
        lines.append(
            f"  {row}: {format_bytes(int(b['vm_hwm']))} against {format_bytes(int(b['bound']))}: {verdict}"
        )
    return "\n".join(lines)
