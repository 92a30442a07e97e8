"""Retention on the disk tier (edge mode): where a host action reads its expert
first, SPICE's rule fetches every miss into the RAM pool and keeps it, evicting the
lowest decayed use count (KEEP_DECAYED), and plans asynchronously by default. The
C rule is held to its twin by tests/native/test_rule_twin.py; these pin down the
meaning of each piece."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pyspice.engine.planning import Planning
from pyspice.policy.base import RESIDENCY_RESIDENT
from pyspice.policy.context import PolicyContext
from pyspice.policy.rule import KEEP_ALL, KEEP_DECAYED, KEEP_LRU, MISS_COST, MISS_FETCH, Rule
from pyspice.policy.spice import SpicePolicy
from pyspice.sim import plan as sim_plan
from pyspice.sim.rule import RuleState, rule_plan
from pyspice.sim.tier import SimTier

from .test_spice_policy import N_EMBD, attached, hook_call

EXPERT_BYTES = 1000


def test_a_decayed_rule_needs_a_decay_in_0_to_1() -> None:
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            Rule(miss=MISS_FETCH, keep=KEEP_DECAYED, decay=bad)
    assert Rule(miss=MISS_FETCH, keep=KEEP_DECAYED, decay=1.0).decay == 1.0


def keep_by(keep: int) -> list[tuple[int, int]]:
    """One layer, room for two experts: expert 0 is selected three times, then
    expert 1 once, then expert 2 comes in. Which expert goes?"""
    tier = SimTier((4,), (EXPERT_BYTES,), 2 * EXPERT_BYTES, bandwidth_gbps=1.0, latency_us=0.0)
    state = RuleState(Rule(miss=MISS_FETCH, keep=keep, decay=0.9 if keep == KEEP_DECAYED else 0.0), 1)
    victims: list[tuple[int, int]] = []
    for e in (0, 0, 0, 1, 2):
        ids = np.array([[e]], np.int32)
        tier.now_ns += 10**9  # every copy has landed by the next call
        tier.poll()
        tier.begin_call(0, ids)
        actions, plan = rule_plan(tier, state, 0, ids, np.ones((1, 1), np.float32))
        victims += plan.evict
        sim_plan.apply_plan(tier, 0, ids, actions.copy(), plan)
    return victims


def test_decayed_use_keeps_the_frequent_expert_where_recency_keeps_the_recent_one() -> None:
    assert keep_by(KEEP_LRU) == [(0, 0)]
    assert keep_by(KEEP_DECAYED) == [(0, 1)]


def context(in_memory: bool) -> PolicyContext:
    return PolicyContext(
        n_layers=3,
        n_expert=(8, 8, 8),
        n_expert_used=2,
        expert_bytes=(EXPERT_BYTES,) * 3,
        budget_bytes=6 * EXPERT_BYTES,
        surrogate_error=lambda il: None,
        host_weights_in_memory=in_memory,
    )


def test_spice_retains_misses_only_where_a_host_action_reads() -> None:
    on_disk = attached("spice:exact", context(in_memory=False)).asynchronous_rule()
    assert (on_disk.miss, on_disk.keep, on_disk.decay) == (MISS_FETCH, KEEP_DECAYED, 0.99)
    in_ram = attached("spice:exact", context(in_memory=True)).asynchronous_rule()
    assert (in_ram.miss, in_ram.keep) == (MISS_COST, KEEP_ALL)
    # an ablation that sends every miss to the host keeps its meaning on disk too
    assert attached("abl-b", context(in_memory=False)).asynchronous_rule().keep == KEEP_ALL


def test_a_retaining_policy_prefetches_into_free_room_only() -> None:
    policy = attached("spice:exact", context(in_memory=False))
    assert policy.retains
    assert not attached("spice:exact", context(in_memory=True)).retains
    # the decay is a setting of the variant
    custom = SpicePolicy(replace(policy.config, retention_decay=0.9))
    custom.attach(context(in_memory=False))
    assert custom.asynchronous_rule().decay == 0.9


def test_planning_defaults_to_asynchronous_with_experts_on_disk() -> None:
    assert Planning().chosen(experts_on_disk=True).asynchronous
    assert not Planning(asynchronous=False).chosen(experts_on_disk=True).asynchronous
    assert Planning(asynchronous=True).chosen(experts_on_disk=False).asynchronous


def test_a_retaining_policy_does_not_look_ahead_into_a_full_pool() -> None:
    """Where retention keeps the pool full and a prefetch may take free room only, a
    look-ahead could only be dropped: a planning call with every slot taken returns
    no prefetch and lets the engine answer the rest of the token (resume_layer)."""
    rng = np.random.default_rng(0)
    routers = {il: rng.standard_normal((8, N_EMBD)).astype(np.float32) for il in range(3)}
    policy = attached("spice:exact", replace(context(in_memory=False), router=routers.get))
    assert policy.retains and policy.n_slots == 6
    empty = np.zeros((3, 8), np.int8)
    with_room = policy.decide(hook_call(0, [[0, 1]], [[0.5, 0.5]], empty, 8))
    assert with_room.prefetch  # free room: the look-ahead's experts are prefetched
    full = empty.copy()
    full[2, :6] = RESIDENCY_RESIDENT  # the tier's 6 slots, all held
    plan = policy.decide(hook_call(0, [[0, 1]], [[0.5, 0.5]], full, 8))
    assert not plan.prefetch
    assert plan.resume_layer == policy.token_resume == 0  # the next token's first planning layer
    # where a host action does not read (RAM or a device), the pool is no reason to stop
    in_ram = attached("spice:exact", replace(context(in_memory=True), router=routers.get))
    plan = in_ram.decide(hook_call(0, [[0, 1]], [[0.5, 0.5]], full, 8))
    assert plan.prefetch and plan.evict_from  # room is taken from the layers needed last
