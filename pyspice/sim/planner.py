"""The planner thread of asynchronous planning, modelled (libspice's
spice-runtime-async.c and spice-planner.c; spice_runtime_enable_async).

The simulator's twin of the mechanism: each call the policy would be asked
posts its snapshot once the call's plan is applied; the planner decides snapshots one at a time, oldest first,
on its own timeline (a decision takes what the policy's decide took here);
a finished plan is applied at a later call by the hook: in deterministic mode
the plan of call c exactly at call c + lag (the hook waits for it), otherwise
at the first call after it is done, dropped when older than max_lag calls.
Its prefetch, evict and evict_from join that call's rule plan; resume_layer
holds while its layer is still ahead. When every entry of the ring is busy,
the newest snapshot not started yet is replaced (free-running only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyspice.policy.base import HookCall, Plan
from pyspice.policy.rule import Rule

RING = 4  # free-running entries (spice-planner.c)


@dataclass(frozen=True)
class AsyncModel:
    """deterministic_lag > 0: deterministic mode; else free-running with max_lag
    (0: the policy's horizon, plan_horizon(), as the engine sets it)."""

    max_lag: int = 4
    deterministic_lag: int = 0

    def __post_init__(self) -> None:
        if self.max_lag < 0 or not 0 <= self.deterministic_lag <= 64:
            raise ValueError("max_lag must be >= 0 and deterministic_lag in 0..64")

    def expected_lag(self) -> int:
        """Layers from a call to its plan's use (engine/planning.py's, measured 1.0-1.1)."""
        return self.deterministic_lag if self.deterministic_lag > 0 else 1


@dataclass
class _Entry:
    seq: int
    posted_ns: int
    call: HookCall
    plan: Plan | None = None  # None: not decided yet, or the policy failed (failed = True)
    failed: bool = False
    done_ns: int | None = None  # None: not started


@dataclass
class Collected:
    """What the plans applied at one call add to its rule plan."""

    prefetch: list[tuple[int, int]] = field(default_factory=list)
    evict: list[tuple[int, int]] = field(default_factory=list)
    evict_from: list[int] = field(default_factory=list)
    wait_ns: int = 0
    rule: Rule | None = None  # a plan's new rule (Plan.rule), for this call on
    quiet: bool = False  # the policy decided this call in advance: not posted


# decide(call) -> (plan or None when it raised or was invalid, microseconds it took)
Decide = Callable[[HookCall], tuple[Plan | None, float]]


@dataclass
class PlannerModel:
    model: AsyncModel
    decide: Decide
    seq: int = 0
    resume_layer: int = -1
    layer_seq: dict[int, int] = field(default_factory=dict)
    queue: list[_Entry] = field(default_factory=list)  # posted, in order
    free_ns: int = 0  # when the planner finishes what it started
    # counters (spice_counters async_*)
    posted: int = 0
    skipped: int = 0
    applied: int = 0
    stale: int = 0
    lag_calls: int = 0
    fallbacks: int = 0
    planner_us: float = 0.0
    posting: bool = False  # the call collected for last posts its snapshot (post)

    def _run_until(self, now_ns: int, until: _Entry | None = None) -> None:
        """Start (decide) queued entries whose turn comes by now_ns; with `until`,
        every entry up to that one whatever the time (the hook waits for it)."""
        for e in self.queue:
            if e.done_ns is not None:
                continue
            start = max(e.posted_ns, self.free_ns)
            if start > now_ns and until is None:
                break
            plan, us = self.decide(e.call)
            e.plan, e.failed = plan, plan is None
            e.done_ns = start + round(us * 1e3)
            self.free_ns = e.done_ns
            self.planner_us += us
            if e is until:
                break

    def _take(self, e: _Entry, seq: int, got: Collected) -> None:
        self.queue.remove(e)
        age = seq - e.seq
        if e.failed or e.plan is None:
            self.fallbacks += 1
            return
        if not self.model.deterministic_lag and age > self.model.max_lag:
            self.stale += 1
            return
        plan = e.plan
        got.prefetch.extend((int(a), int(b)) for a, b in plan.prefetch)
        got.evict.extend((int(a), int(b)) for a, b in plan.evict)
        if plan.evict_from:
            got.evict_from = [int(x) for x in plan.evict_from]
        if isinstance(plan.rule, Rule):  # validate_plan refused any other value
            got.rule = plan.rule
        r = plan.resume_layer
        if r >= 0 and self.layer_seq.get(r, 0) <= e.seq:
            self.resume_layer = r
        self.applied += 1
        self.lag_calls += age

    def mean_lag(self) -> float:
        return self.lag_calls / self.applied if self.applied else 0.0

    def call(self, layer: int, n_tokens: int, now_ns: int) -> Collected:
        """A hook call of `layer` begins at now_ns: collect the plans due. Returns what
        they add to its plan, and whether the call is quiet; a call that is not posts
        its snapshot once its plan is applied (post)."""
        self.seq += 1
        seq = self.seq
        self.layer_seq[layer] = seq
        got = Collected()
        lag = self.model.deterministic_lag
        if lag:
            due = next((e for e in self.queue if e.seq == seq - lag), None)
            if due is not None:
                self._run_until(now_ns, until=due)
                assert due.done_ns is not None
                got.wait_ns = max(0, due.done_ns - now_ns)
                self._take(due, seq, got)
        else:
            self._run_until(now_ns)
            for e in [e for e in self.queue if e.done_ns is not None and e.done_ns <= now_ns]:
                self._take(e, seq, got)
        got.quiet = self.resume_layer >= 0 and n_tokens == 1 and layer != self.resume_layer
        if not got.quiet:
            self.resume_layer = -1
            if not lag and len(self.queue) >= RING:
                waiting = [e for e in self.queue if e.done_ns is None]
                if waiting:
                    self.queue.remove(waiting[-1])  # the newest not started: replaced
                self.skipped += 1
            self.posting = lag > 0 or len(self.queue) < RING
        return got

    def post(self, call: HookCall, now_ns: int) -> None:
        """The snapshot of the call `call` just collected for, once the store has applied
        its plan (its residency as that plan left it: spice_async_post)."""
        if self.posting:
            self.posting = False
            self.queue.append(_Entry(self.seq, now_ns, call))
            self.posted += 1
