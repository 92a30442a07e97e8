"""Planning asynchronously, SPICE's plans land a call or more late, too late for the
next layer; at each planning layer the engine's rule prefetches that layer's experts
itself, by the next router on the call's input, taking room from the layers that run
again last (SpiceConfig.rule_next). The C rule is held to its twin, used here, by
tests/native/test_rule_twin.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pyspice.policy.base import RESIDENCY_ABSENT, RESIDENCY_RESIDENT
from pyspice.policy.context import PolicyContext
from pyspice.policy.rule import KEEP_LAYER_LRU, Rule
from pyspice.policy.spice import SpicePolicy
from pyspice.sim import plan as sim_plan
from pyspice.sim.rule import RuleState, rule_plan
from pyspice.sim.tier import SimTier

from .test_spice_policy import attached

EXPERT_BYTES = 1000
N_LAYERS, N_EXPERT, N_EMBD = 8, 8, 4


def router(il: int) -> np.ndarray:
    """Layer il's router picks experts il and il + 1 for the input e_0."""
    w = np.zeros((N_EXPERT, N_EMBD), np.float32)
    w[il % N_EXPERT, 0] = 2.0
    w[(il + 1) % N_EXPERT, 0] = 1.0
    return w


def context(in_memory: bool = True, budget_experts: int = 24) -> PolicyContext:
    return PolicyContext(
        n_layers=N_LAYERS,
        n_expert=(N_EXPERT,) * N_LAYERS,
        n_expert_used=2,
        expert_bytes=(EXPERT_BYTES,) * N_LAYERS,
        budget_bytes=budget_experts * EXPERT_BYTES,
        surrogate_error=lambda il: None,
        host_weights_in_memory=in_memory,
        router=router,
    )


def with_lag(name: str, lag: int, ctx: PolicyContext, **config: object) -> SpicePolicy:
    policy = attached(name, ctx)
    policy = SpicePolicy(replace(policy.config, **config))  # type: ignore[arg-type]
    policy.plan_lag = lag  # as the engine sets it before attach
    policy.attach(ctx)
    return policy


def test_a_lagged_plan_leaves_the_next_layer_to_the_rule_at_planning_layers_only() -> None:
    policy = with_lag("spice:exact", 1, context(), plan_every_async=4)
    rule = policy.asynchronous_rule()
    planning = tuple(il for il in range(N_LAYERS) if policy.plans[il])
    assert rule.prefetch_next and rule.next_room
    assert rule.next_layers == planning
    assert 0 < len(planning) < N_LAYERS  # every 4th: the layers in between are the plan's
    assert rule.routers is not None and (rule.routers[3] == router(3)).all()


def test_planning_off_the_hook_thread_plans_every_layer_of_a_device_tier() -> None:
    """plan_every_async (default 1) where plans land late; plan_every (4) inline, and on
    edge mode's disk tier, whose cadence was not measured against it."""
    assert with_lag("spice:exact", 1, context()).plan_every == 1
    assert all(with_lag("spice:exact", 1, context()).plans)
    assert with_lag("spice:exact", 0, context()).plan_every == 4
    assert with_lag("spice:exact", 1, context(False)).plan_every == 4
    assert with_lag("spice:exact", 1, context(), plan_every_async=2).plan_every == 2


@pytest.mark.parametrize(
    "why, lag, ctx, config",
    [
        ("synchronous: the plan itself reaches the next layer", 0, context(), {}),
        ("switched off", 1, context(), {"rule_next": False}),
        ("no speculative copies at all", 1, context(), {"prefetch": False}),
        ("the disk tier's rule retains by use and prefetches into free room only", 1, context(False), {}),
        # 2 experts of 1000 bytes at 1 MB/s: 2 ms of bus against a nominal layer's compute
        (
            "a guess one layer ahead would land after the layer",
            1,
            replace(context(), tier_bus=(0.001, 0.0)),
            {},
        ),
    ],
)
def test_the_rule_leaves_prefetching_to_the_plans(
    why: str, lag: int, ctx: PolicyContext, config: dict
) -> None:
    rule = with_lag("spice:exact", lag, ctx, **config).asynchronous_rule()
    assert not rule.prefetch_next and rule.next_layers is None and not rule.next_room, why


def test_next_room_needs_prefetch_next_and_no_capacities() -> None:
    with pytest.raises(ValueError, match="next_room"):
        Rule(next_room=True)
    with pytest.raises(ValueError, match="next_room"):
        Rule(keep=KEEP_LAYER_LRU, capacity=(1,), prefetch_next=True, routers=(router(0),), next_room=True)


@pytest.mark.parametrize(
    "points",
    [
        ((0, 1.0),),
        ((2, 1.0), (2, 0.5)),
        ((1, 1.0), (4, 0.0)),
        ((1, float("nan")),),
        tuple((n, 1.0) for n in range(1, 18)),
    ],
)
def test_host_points_libspice_would_refuse_are_refused_here(points: tuple[tuple[int, float], ...]) -> None:
    """spice_store_set_rule refuses these (tokens not positive and ascending, a time not
    finite and positive, more than SPICE_RULE_MAX_HOST_POINTS): the Rule says why first."""
    with pytest.raises(ValueError, match="host_points"):
        Rule(host_points=points)


def full_tier_for_layer_2s_next_room(holders: tuple[int, ...]) -> tuple[SimTier, RuleState]:
    """A tier with one slot per layer in `holders`, each holding that layer's expert 5
    (landed), and the state of a rule whose layer-2 calls prefetch layer 3 with next_room."""
    rule = Rule(
        prefetch_next=True,
        routers=tuple(router(il) for il in range(N_LAYERS)),
        next_layers=(2,),
        next_room=True,
    )
    tier = SimTier((N_EXPERT,) * N_LAYERS, (EXPERT_BYTES,) * N_LAYERS, len(holders) * EXPERT_BYTES, 1.0, 0.0)
    for il in holders:
        tier.request(il, 5, 1)
    tier.now_ns += 10**9
    tier.poll()
    return tier, RuleState(rule, N_LAYERS)


def test_the_rules_prefetch_takes_room_from_the_layers_just_run_first() -> None:
    """A full tier of 4 slots: layers 1, 2 (just run) and 6, 7 (coming) hold one
    expert each. The rule at layer 2 prefetches layer 3's top-2 (3 and 4), taking
    room from layer 2, then layer 1; the layers to come, listed after them, keep theirs."""
    tier, state = full_tier_for_layer_2s_next_room(holders=(7, 6, 1, 2))
    hidden = np.eye(1, N_EMBD, dtype=np.float32)
    for il, expect_prefetch in ((1, []), (2, [(3, 3), (3, 4)])):
        ids = np.array([[0, 1]], np.int32)
        tier.begin_call(il, ids)
        actions, plan = rule_plan(tier, state, il, ids, np.ones((1, 2), np.float32), hidden)
        assert plan.prefetch == expect_prefetch, f"layer {il}: {plan.prefetch}"
        sim_plan.apply_plan(tier, il, ids, actions.copy(), plan)
    assert plan.evict_from == [2, 1, 0, 7, 6, 5, 4, 3]  # the one just run first, the next one last
    assert tier.state(3, 3) != RESIDENCY_ABSENT and tier.state(3, 4) != RESIDENCY_ABSENT  # on their way
    assert tier.state(2, 5) == RESIDENCY_ABSENT and tier.state(1, 5) == RESIDENCY_ABSENT
    assert tier.state(6, 5) == RESIDENCY_RESIDENT and tier.state(7, 5) == RESIDENCY_RESIDENT


def test_the_rules_prefetch_takes_room_from_the_farthest_layer_to_come_when_those_just_run_are_empty() -> (
    None
):
    """A full tier of 2 slots held by layers 6 and 7 (coming). The rule at layer 2
    prefetches layer 3's top-2, taking room from layer 7 (which runs after 6) first,
    then from 6: with half the layers listed (2, 1, 0, 7) layer 6 kept its expert
    and the second prefetch was dropped."""
    tier, state = full_tier_for_layer_2s_next_room(holders=(6, 7))
    ids = np.array([[0, 1]], np.int32)
    tier.begin_call(2, ids)
    actions, plan = rule_plan(
        tier, state, 2, ids, np.ones((1, 2), np.float32), np.eye(1, N_EMBD, dtype=np.float32)
    )
    assert plan.prefetch == [(3, 3), (3, 4)]
    sim_plan.apply_plan(tier, 2, ids, actions.copy(), plan)
    assert tier.state(3, 3) != RESIDENCY_ABSENT and tier.state(3, 4) != RESIDENCY_ABSENT
    assert tier.state(7, 5) == RESIDENCY_ABSENT and tier.state(6, 5) == RESIDENCY_ABSENT
