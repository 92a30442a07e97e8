"""Differential test: libspice's per-activation rule (spice_store_rule_plan) against
its twin in the simulator (pyspice.sim.rule), over random tier states, rules and
calls. Both plan the same call from the same state; the plans must be equal, and
so must the tiers after each plan is applied (the store and plan twins are held
equal by test_store_twin.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspice.policy import ACTION_DEVICE, ACTION_HOST
from pyspice.policy.rule import (
    KEEP_ALL,
    KEEP_DECAYED,
    KEEP_LAYER_LRU,
    KEEP_LRU,
    KEEP_NONE,
    MISS_COST,
    MISS_FETCH,
    MISS_HOST,
    Rule,
)
from pyspice.sim import plan as sim_plan
from pyspice.sim.rule import RuleState, rule_plan

from .test_store_twin import EXPERT_BYTES, MOE_LAYERS, N_EXPERT, assert_same, make_pair, op, run_op

N_EMBD = 6


@st.composite
def rules(draw: Any) -> Rule:
    keep = draw(st.sampled_from([KEEP_ALL, KEEP_LRU, KEEP_LAYER_LRU, KEEP_NONE, KEEP_DECAYED]))
    capacity = tuple(draw(st.integers(1, n)) if n else 0 for n in N_EXPERT)
    prefetch_next = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    routers = tuple(rng.standard_normal((n, N_EMBD)).astype(np.float32) if n else None for n in N_EXPERT)
    surrogates = None
    if draw(st.booleans()):
        surrogates = rng.random((len(N_EXPERT), max(N_EXPERT))) < 0.5
    return Rule(
        resident_action=draw(st.sampled_from([ACTION_DEVICE, ACTION_DEVICE, ACTION_HOST])),
        miss=draw(st.sampled_from([MISS_HOST, MISS_FETCH, MISS_COST])),
        keep=keep,
        host_us=draw(st.sampled_from([0.0, 3.0, 12.0, 40.0])),
        device_us=draw(st.sampled_from([0.0, 1.0])),
        margin=draw(st.sampled_from([0.0, 0.2])),
        surrogate_weight=draw(st.sampled_from([0.0, 0.3])) if surrogates is not None else 0.0,
        surrogate_set=surrogates,
        whole_layers=tuple(draw(st.sets(st.sampled_from(MOE_LAYERS), max_size=1))),
        capacity=capacity if keep == KEEP_LAYER_LRU or draw(st.booleans()) else None,
        resize_every=draw(st.sampled_from([0, 2, 3])),
        prefetch_next=prefetch_next,
        routers=routers if prefetch_next else None,
        # 0.5 makes ties between counts (the rule's tie-break) as likely as orderings
        decay=draw(st.sampled_from([0.5, 0.9, 0.99, 1.0])) if keep == KEEP_DECAYED else 0.0,
    )


@st.composite
def calls(draw: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    il = draw(st.sampled_from(MOE_LAYERS))
    n_tokens, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ids = np.array(
        [
            draw(st.lists(st.integers(0, N_EXPERT[il] - 1), min_size=k, max_size=k, unique=True))
            for _ in range(n_tokens)
        ],
        np.int32,
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    weights = rng.random(ids.shape).astype(np.float32)
    hidden = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    return il, ids, weights, hidden


@settings(max_examples=300, deadline=None)
@given(
    budget_experts=st.integers(1, 6),
    setup=st.lists(op, max_size=15),
    rule=rules(),
    sequence=st.lists(st.tuples(calls(), st.integers(0, 20_000)), min_size=1, max_size=6),
    switch=st.none() | st.tuples(st.integers(1, 5), rules()),
)
def test_rule_and_sim_rule_agree(
    budget_experts: int,
    setup: list[Any],
    rule: Rule,
    sequence: list[Any],
    switch: tuple[int, Rule] | None,
) -> None:
    """`switch`: (call, rule) installs another rule before that call, as a plan's
    rule or a policy change does mid-run."""
    store, tier = make_pair(budget_experts * max(EXPERT_BYTES), 3)
    for name, arg in setup:
        run_op(store, tier, name, arg)
    if rule.keep == KEEP_LAYER_LRU and rule.capacity is None:
        return
    store.set_rule(rule)
    state = RuleState(rule, len(N_EXPERT))
    for step, ((il, ids, weights, hidden), gap) in enumerate(sequence):
        if switch is not None and step == switch[0]:
            if switch[1].keep == KEEP_LAYER_LRU and switch[1].capacity is None:
                return
            store.set_rule(switch[1])
            state = RuleState(switch[1], len(N_EXPERT))
        store.advance(gap)
        tier.now_ns += gap
        tier.poll()
        assert (store.begin_call(il, ids) == tier.begin_call(il, ids)).all()
        c_plan = store.rule_plan(il, ids, weights, hidden)
        actions, py_plan = rule_plan(tier, state, il, ids, weights, hidden)
        where = f"call {step} (layer {il}, ids {ids.tolist()})"
        assert (np.asarray(c_plan.actions) == actions).all(), (
            f"{where}: actions {c_plan.actions} vs {actions}"
        )
        assert c_plan.fetch == py_plan.fetch, where
        assert c_plan.prefetch == py_plan.prefetch, where
        assert c_plan.evict == py_plan.evict, where
        done = store.apply_plan(
            il, ids, actions, fetch=c_plan.fetch, prefetch=c_plan.prefetch, evict=c_plan.evict
        )
        twin = sim_plan.apply_plan(tier, il, ids, actions.copy(), py_plan)
        assert (done == twin.actions).all(), where
        assert_same(store, tier, where)


def test_a_refused_wait_moves_no_queue() -> None:
    """Found by hypothesis (2026-12-01): a wait on an absent expert, refused, used to
    start the queued copies in libspice (start_copies ran before the check) and not
    in SimTier, so a prefetch queued behind a demand copy was in flight in one and
    still cancellable in the other; a later layer-LRU eviction then made 2 copies
    against 1."""
    from pyspice.policy import Plan

    one = np.array([[0]], np.int32)
    setup = [
        ("call", (0, np.array([[1]], np.int32), one, Plan(actions=one, prefetch=[(0, 2)]))),
        ("wait", (0, 0)),
        ("call", (2, one.copy(), one, Plan(actions=one.copy()))),
    ]
    rule = Rule(resident_action=1, miss=2, keep=2, host_us=12.0, margin=0.2, capacity=(1, 0, 3, 3))
    hidden = np.zeros((1, N_EMBD), np.float32)
    sequence = [((0, one.copy(), np.array([[0.64]], np.float32), hidden), 0)]
    test_rule_and_sim_rule_agree.hypothesis.inner_test(  # type: ignore[attr-defined]
        budget_experts=1, setup=setup, rule=rule, sequence=sequence, switch=None
    )
