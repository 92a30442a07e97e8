"""The simulator's model of asynchronous planning (sim/planner.py): plans applied
exactly K calls late in deterministic mode, dropped when too late free-running,
and lossless policies' outcomes unchanged in kind (the rule runs every call)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from pyspice.policy import HookCall, Plan
from pyspice.policy.base import RESIDENCY_ABSENT
from pyspice.policy.rule import DEFAULT_RULE, MISS_FETCH, Rule
from pyspice.sim.costs import Costs
from pyspice.sim.planner import AsyncModel
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import Workload

N_LAYERS, N_EXPERT, K = 4, 8, 2


def workload(tokens: int = 10, prompt: int = 4) -> Workload:
    rng = np.random.default_rng(3)
    ids = np.stack(
        [[rng.choice(N_EXPERT, K, replace=False) for _ in range(N_LAYERS)] for _ in range(tokens)]
    ).astype(np.int32)
    return Workload.from_arrays(N_LAYERS, list(range(N_LAYERS)), N_EXPERT, ids, prompt_tokens=prompt)


def costs() -> Costs:
    return Costs(
        expert_bytes=(10_000,) * N_LAYERS,
        bus_gbps=10.0,
        bus_latency_us=1.0,
        rest_us=((1, 100.0), (4, 100.0)),
        device_expert_us=((1, 1.0),),
        host_expert_us=((1, 20.0),),
    )


class Targets:
    """One new prefetch per call for its first calls; keeps every snapshot's residency."""

    name = "targets"

    def __init__(self, n_targets: int, sleep_s: float = 0.0) -> None:
        self.n_targets, self.sleep_s = n_targets, sleep_s
        self.seen: list[np.ndarray] = []
        self.targets: list[tuple[int, int]] = []
        self.free: list[tuple[int, int]] = []

    def asynchronous_rule(self) -> Rule:
        return DEFAULT_RULE

    def decide(self, call: HookCall) -> Plan:
        residency = call.residency
        assert residency is not None
        if not self.free:
            layers, experts = np.nonzero(residency == RESIDENCY_ABSENT)
            self.free = [(int(il), int(e)) for il, e in zip(layers, experts, strict=True)][::-1]
        self.seen.append(residency.copy())
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if len(self.targets) < self.n_targets:
            self.targets.append(self.free.pop())
            return Plan(prefetch=[self.targets[-1]])
        return Plan()


def first_seen(policy: Targets) -> list[int]:
    """Per target, the first snapshot (call index) in which it is no longer absent."""
    return [
        next(i for i, seen in enumerate(policy.seen) if seen[il, e] != RESIDENCY_ABSENT)
        for il, e in policy.targets
    ]


def test_deterministic_mode_applies_each_plan_exactly_k_calls_later() -> None:
    for lag in (1, 3):
        policy = Targets(n_targets=6)
        sim = Simulator(workload(), costs(), budget_bytes=10**9)
        result = sim.run("t", policy, asynchronous=AsyncModel(deterministic_lag=lag))
        # planned at call c, applied at call c + lag, whose snapshot is posted after that
        assert first_seen(policy) == [c + lag for c in range(6)]
        assert result.plan_lag_layers == lag and result.plans_stale == 0


def test_free_running_drops_plans_older_than_the_bound() -> None:
    # 2 ms a plan (more on a loaded machine) against 1 ms layers: plans land several calls
    # late, well inside the run's ~120 simulated ms
    policy = Targets(n_targets=4, sleep_s=0.002)
    slow = replace(costs(), rest_us=((1, 1000.0), (4, 1000.0)))
    sim = Simulator(workload(tokens=30), slow, budget_bytes=10**9)
    result = sim.run("t", policy, asynchronous=AsyncModel(max_lag=1))
    assert result.plans_stale > 0
    assert result.plans_skipped > 0
    # a replaced snapshot is planned from its newer post: a few of those land in time
    assert result.plans_applied < result.plans_stale


def test_a_synchronous_run_is_unchanged_by_the_model() -> None:
    policy = Targets(n_targets=6)
    sim = Simulator(workload(), costs(), budget_bytes=10**9)
    result = sim.run("t", policy)
    assert first_seen(policy) == [c + 1 for c in range(6)]  # applied at its own call
    assert result.plans_applied == 0


class FetchRule:
    """A plan that installs a fetch-every-miss rule (Plan.rule), deciding each decode
    step at layer 0 only."""

    name = "fetch-rule"

    def __init__(self, install: bool) -> None:
        self.rule = Rule(miss=MISS_FETCH) if install else None

    def asynchronous_rule(self) -> Rule:
        return DEFAULT_RULE

    def decide(self, call: HookCall) -> Plan:
        return Plan(rule=self.rule, resume_layer=0 if call.n_tokens == 1 else -1)


def test_a_plan_installs_a_rule_synchronously_and_asynchronously() -> None:
    for asynchronous in (None, AsyncModel(deterministic_lag=1)):
        fetched = {}
        for install in (False, True):
            sim = Simulator(workload(), costs(), budget_bytes=10**9)
            result = sim.run("r", FetchRule(install), asynchronous=asynchronous)
            fetched[install] = result.misses_fetched
        assert fetched[False] == 0 and fetched[True] > 0, asynchronous


def test_the_shipped_planners_run_asynchronously_in_the_simulator() -> None:
    """spice:* and abl-* as `sim` rows NAME@async / NAME@detK: their rule runs every call,
    their plans arrive later, nothing falls back."""
    from pyspice.policy import make_policy
    from pyspice.policy.rows import parse_row

    rng = np.random.default_rng(2)
    n_tok = 10
    ids = np.stack(
        [[rng.choice(N_EXPERT, K, replace=False) for _ in range(N_LAYERS)] for _ in range(n_tok)]
    ).astype(np.int32)
    hidden = rng.standard_normal((n_tok, N_LAYERS, 16)).astype(np.float32)
    wl = Workload.from_arrays(N_LAYERS, list(range(N_LAYERS)), N_EXPERT, ids, hidden=hidden, prompt_tokens=4)
    routers = {il: rng.standard_normal((N_EXPERT, 16)).astype(np.float32) for il in range(N_LAYERS)}
    # layers of 5 ms: the planner (the policy's decide as timed here) keeps up with them
    slow = replace(costs(), rest_us=((1, 5000.0), (4, 5000.0)))
    sim = Simulator(wl, slow, budget_bytes=N_LAYERS * N_EXPERT * 10_000 // 2, router=routers.get)
    for text in ("spice:exact@async", "abl-b@det2", "abl-d@async"):
        row = parse_row(text)
        assert row.planning == "async"
        model = AsyncModel(max_lag=0, deterministic_lag=row.plan_lag)
        result = sim.run(row.label, make_policy(row.name), asynchronous=model)
        assert result.policy_fallbacks == 0, text
        assert result.plans_applied > 0, text
        assert result.activations == wl.decoded_tokens * N_LAYERS * K
        if row.plan_lag:
            assert result.plan_lag_layers == row.plan_lag
    assert (parse_row("lru").planning, parse_row("lru").plan_lag) == (None, 0)
