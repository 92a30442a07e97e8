"""Baseline policies over hand-made traces (pure Python), applied to a simulated
device tier whose copies land at once, by the engine's own plan rules."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyspice.policy import PolicyContext, make_policy
from pyspice.policy.baselines import AdapMoE, LruCache
from pyspice.sim.plan import PlanDriver, instant_tier

N_EMBD = 8


def context(budget_experts: int, n_layers: int = 2, n_expert: int = 8, routers: Any = None) -> PolicyContext:
    return PolicyContext(
        n_layers=n_layers,
        n_expert=(n_expert,) * n_layers,
        n_expert_used=2,
        expert_bytes=(100,) * n_layers,
        budget_bytes=100 * budget_experts,
        router=routers or (lambda il: None),
    )


def attached(name: str, ctx: PolicyContext) -> Any:
    policy = make_policy(name)
    policy.attach(ctx)  # type: ignore[union-attr]
    return policy


def driver(policy: Any, ctx: PolicyContext) -> PlanDriver:
    return PlanDriver(instant_tier(ctx.n_expert, ctx.expert_bytes, ctx.budget_bytes or 0), policy)


def held(drive: PlanDriver) -> int:
    """Experts the tier holds, over all layers."""
    return sum(len(drive.resident(il)) for il in range(drive.tier.n_layers))


def test_lru_evicts_the_least_recently_used() -> None:
    ctx = context(budget_experts=3, n_layers=1)
    drive = driver(attached("lru", ctx), ctx)
    drive.call(0, [0, 1])
    drive.call(0, [2])  # holds 0, 1, 2
    drive.call(0, [0])  # 0 is fresh again; 1 is now the oldest
    plan = drive.call(0, [3])
    assert plan.evict == [(0, 1)]
    assert drive.resident(0) == {0, 2, 3}
    assert drive.outcomes.hits == 1  # the second use of expert 0


def test_lru_never_evicts_what_the_call_needs() -> None:
    ctx = context(budget_experts=2, n_layers=1)
    drive = driver(attached("lru", ctx), ctx)
    drive.call(0, [0, 1])
    plan = drive.call(0, [1, 2])
    assert plan.evict == [(0, 0)]
    assert drive.resident(0) == {1, 2}


def test_ondemand_keeps_nothing_and_copies_at_least_as_much_as_lru() -> None:
    ctx = context(budget_experts=6)
    trace = [(il, [i % 5, (i * 3) % 7]) for i in range(40) for il in (0, 1)]
    trace = [(il, ids if ids[0] != ids[1] else [ids[0], (ids[0] + 1) % 8]) for il, ids in trace]
    copied = {}
    for name in ("ondemand", "lru"):
        drive = driver(attached(name, ctx) if name == "lru" else make_policy(name), ctx)
        for il, ids in trace:
            drive.call(il, ids)
            if name == "ondemand":
                assert held(drive) == len(ids)  # only what this call uses
        copied[name] = drive.copied_bytes
        if name == "ondemand":
            assert drive.outcomes.hits == 0
    assert copied["ondemand"] >= copied["lru"] > 0


def test_static_loads_whole_layers_once() -> None:
    ctx = context(budget_experts=10, n_layers=3)  # one layer of 8 fits, two do not
    drive = driver(attached("static", ctx), ctx)
    for step in range(5):
        before = drive.copied_bytes
        for il in range(3):
            plan = drive.call(il, [step % 8, (step + 1) % 8])
            assert (np.asarray(plan.actions) == (0 if il == 0 else 1)).all()  # device for layer 0 only
        if step > 0:
            assert drive.copied_bytes == before  # nothing moves after warm-up
    assert drive.copied_bytes == 8 * 100
    assert drive.resident(0) == set(range(8))


def routers_following(rng: np.random.Generator, n_expert: int) -> Any:
    weights = {il: rng.standard_normal((n_expert, N_EMBD)).astype(np.float32) for il in range(3)}
    return lambda il: weights.get(il)


def test_adapmoe_prefetches_the_next_layers_predicted_experts() -> None:
    rng = np.random.default_rng(1)
    routers = routers_following(rng, 8)
    ctx = context(budget_experts=8, n_layers=3, routers=routers)
    drive = driver(attached("adapmoe", ctx), ctx)
    for _ in range(30):
        hidden = rng.standard_normal((1, N_EMBD)).astype(np.float32)
        for il in range(3):
            # the model routes layer il+1 the way its router sees the current hidden state
            # (a perfectly predictable trace), so every prefetch should turn into a hit
            logits = routers(il) @ hidden[0]
            ids = [int(e) for e in np.argsort(-logits)[:2]]
            plan = drive.call(il, ids, hidden)
            if il < 2:
                nxt_logits = routers(il + 1) @ hidden[0]
                predicted = set(int(e) for e in np.argsort(-nxt_logits)[:2])
                assert {e for _, e in plan.prefetch} <= predicted
    assert drive.prefetch_used > 0


def test_adapmoe_resizes_layers_by_miss_cost() -> None:
    ctx = context(budget_experts=8, n_layers=2)
    policy = attached("adapmoe", ctx)
    drive = driver(policy, ctx)
    assert isinstance(policy, AdapMoE)
    assert policy.rule().capacity == (4, 4)  # capacities start equal
    for i in range(policy.resize_every):
        # layer 0 cycles through all 8 experts (misses), layer 1 reuses the same two
        drive.call(0, [i % 8, (i + 3) % 8])
        drive.call(1, [0, 1])
    assert drive.rule_state is not None  # the rule's state, as libspice keeps it
    assert drive.rule_state.capacity[0] > drive.rule_state.capacity[1]


def test_lru_class_is_the_registered_one() -> None:
    assert isinstance(make_policy("lru"), LruCache)
