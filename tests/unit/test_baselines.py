"""Baseline policies over hand-made traces (pure Python, fake device tier)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyspice.policy import PolicyContext, make_policy
from pyspice.policy.baselines import AdapMoE, LruCache

from .fake_tier import FakeTier

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


def test_lru_evicts_the_least_recently_used() -> None:
    ctx = context(budget_experts=3, n_layers=1)
    tier, lru = FakeTier(ctx), attached("lru", ctx)
    tier.call(lru, 0, [0, 1])
    tier.call(lru, 0, [2])  # holds 0, 1, 2
    tier.call(lru, 0, [0])  # 0 is fresh again; 1 is now the oldest
    plan = tier.call(lru, 0, [3])
    assert plan.evict == [(0, 1)]
    assert set(np.flatnonzero(tier.residency[0])) == {0, 2, 3}
    assert tier.hits == 1  # the second use of expert 0


def test_lru_never_evicts_what_the_call_needs() -> None:
    ctx = context(budget_experts=2, n_layers=1)
    tier, lru = FakeTier(ctx), attached("lru", ctx)
    tier.call(lru, 0, [0, 1])
    plan = tier.call(lru, 0, [1, 2])
    assert plan.evict == [(0, 0)]


def test_ondemand_keeps_nothing_and_copies_at_least_as_much_as_lru() -> None:
    ctx = context(budget_experts=6)
    trace = [(il, [i % 5, (i * 3) % 7]) for i in range(40) for il in (0, 1)]
    trace = [(il, ids if ids[0] != ids[1] else [ids[0], (ids[0] + 1) % 8]) for il, ids in trace]
    copied = {}
    for name in ("ondemand", "lru"):
        tier, policy = FakeTier(ctx), attached(name, ctx) if name == "lru" else make_policy(name)
        for il, ids in trace:
            tier.call(policy, il, ids)
            if name == "ondemand":
                assert (tier.residency != 0).sum() == len(ids)  # only what this call uses
        copied[name] = tier.copied_bytes
        if name == "ondemand":
            assert tier.hits == 0
    assert copied["ondemand"] >= copied["lru"] > 0


def test_static_loads_whole_layers_once() -> None:
    ctx = context(budget_experts=10, n_layers=3)  # one layer of 8 fits, two do not
    tier, static = FakeTier(ctx), attached("static", ctx)
    for step in range(5):
        before = tier.copied_bytes
        for il in range(3):
            plan = tier.call(static, il, [step % 8, (step + 1) % 8])
            assert (np.asarray(plan.actions) == (0 if il == 0 else 1)).all()  # device for layer 0 only
        if step > 0:
            assert tier.copied_bytes == before  # nothing moves after warm-up
    assert tier.copied_bytes == 8 * 100


def routers_following(rng: np.random.Generator, n_expert: int) -> Any:
    weights = {il: rng.standard_normal((n_expert, N_EMBD)).astype(np.float32) for il in range(3)}
    return lambda il: weights.get(il)


def test_adapmoe_prefetches_the_next_layers_predicted_experts() -> None:
    rng = np.random.default_rng(1)
    routers = routers_following(rng, 8)
    ctx = context(budget_experts=8, n_layers=3, routers=routers)
    tier, policy = FakeTier(ctx), attached("adapmoe", ctx)
    for _ in range(30):
        hidden = rng.standard_normal((1, N_EMBD)).astype(np.float32)
        for il in range(3):
            # the model routes layer il+1 the way its router sees the current hidden state
            # (a perfectly predictable trace), so every prefetch should turn into a hit
            logits = routers(il) @ hidden[0]
            ids = [int(e) for e in np.argsort(-logits)[:2]]
            plan = tier.call(policy, il, ids, hidden)
            if il < 2:
                nxt_logits = routers(il + 1) @ hidden[0]
                predicted = set(int(e) for e in np.argsort(-nxt_logits)[:2])
                assert {e for _, e in plan.prefetch} <= predicted
    assert tier.prefetch_hits > 0


def test_adapmoe_resizes_layers_by_miss_cost() -> None:
    ctx = context(budget_experts=8, n_layers=2)
    tier, policy = FakeTier(ctx), attached("adapmoe", ctx)
    assert isinstance(policy, AdapMoE)
    assert policy.capacity == {0: 4, 1: 4}
    for i in range(policy.resize_every):
        # layer 0 cycles through all 8 experts (misses), layer 1 reuses the same two
        tier.call(policy, 0, [i % 8, (i + 3) % 8])
        tier.call(policy, 1, [0, 1])
    assert policy.capacity[0] > policy.capacity[1]


def test_lru_class_is_the_registered_one() -> None:
    assert isinstance(make_policy("lru"), LruCache)
