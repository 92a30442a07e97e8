"""Differential test: libspice's per-activation rule (spice_store_rule_plan) against
its twin in the simulator (pyspice.sim.rule), over random tier states, rules and
calls. Both plan the same call from the same state; the plans must be equal, and
so must the tiers after each plan is applied (the store and plan twins are held
equal by test_store_twin.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
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
from pyspice.sim.rule import RuleState, rule_plan

from .test_store_twin import (
    EXPERT_BYTES,
    MOE_LAYERS,
    N_EXPERT,
    apply_both,
    assert_same,
    make_pair,
    op,
    run_op,
)

N_EMBD = 6
next_layers = st.none() | st.sets(st.sampled_from(MOE_LAYERS)).map(tuple)


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
        host_us=draw(st.sampled_from([0.0, 2.0, 3.0, 12.0, 40.0])),
        # host(n) falling with the tokens of a batch; a point past the call's tokens, and
        # one pair whose interpolation rounds, test the ends and the arithmetic
        host_points=draw(st.sampled_from([(), ((1, 12.0),), ((1, 40.0), (3, 7.3)), ((2, 30.0), (9, 2.0))])),
        device_us=draw(st.sampled_from([0.0, 1.0])),
        margin=draw(st.sampled_from([0.0, 0.2])),
        overlap=draw(st.booleans()),
        surrogate_weight=draw(st.sampled_from([0.0, 0.3])) if surrogates is not None else 0.0,
        surrogate_set=surrogates,
        whole_layers=tuple(draw(st.sets(st.sampled_from(MOE_LAYERS), max_size=1))),
        capacity=capacity if keep == KEEP_LAYER_LRU or draw(st.booleans()) else None,
        resize_every=draw(st.sampled_from([0, 2, 3])),
        prefetch_next=prefetch_next,
        routers=routers if prefetch_next else None,
        next_layers=draw(next_layers) if prefetch_next else None,
        next_room=prefetch_next and keep != KEEP_LAYER_LRU and draw(st.booleans()),
        # 0.5 makes ties between counts (the rule's tie-break) as likely as orderings
        decay=draw(st.sampled_from([0.5, 0.9, 0.99, 1.0])) if keep == KEEP_DECAYED else 0.0,
    )


@st.composite
def calls(draw: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    il = draw(st.sampled_from(MOE_LAYERS))
    n_tokens, k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
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
        assert list(c_plan.evict_from) == list(py_plan.evict_from), where
        apply_both(store, tier, il, ids, actions, py_plan)  # the plans are equal (above)
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


def rule_actions(rule: Rule, ids: np.ndarray, setup: tuple[tuple[str, Any], ...] = ()) -> np.ndarray:
    """The actions of one call of layer 0 on an empty tier after `setup` (run_op steps),
    the engine's and the twin's (asserted equal)."""
    store, tier = make_pair(4 * max(EXPERT_BYTES), 3)
    for name, arg in setup:
        run_op(store, tier, name, arg)
    store.set_rule(rule)
    weights = np.full(ids.shape, 0.5, np.float32)
    assert (store.begin_call(0, ids) == tier.begin_call(0, ids)).all()
    c_plan = store.rule_plan(0, ids, weights, None)
    actions, _ = rule_plan(tier, RuleState(rule, len(N_EXPERT)), 0, ids, weights)
    assert (np.asarray(c_plan.actions) == actions).all()
    return actions


@pytest.mark.parametrize(
    ("host_points", "tokens", "expected"),
    [
        ((), 1, ACTION_HOST),  # one token: a 4.6 us copy + 1 on the device loses to 3 on the host
        ((), 2, ACTION_HOST),  # 4.6 + 2 x 1 against 2 x 3
        ((), 4, ACTION_DEVICE),  # 4.6 + 4 x 1 against 4 x 3: one copy serves four tokens
        (((1, 3.0), (4, 2.0)), 4, ACTION_HOST),  # ... not where the host runs four at 2 each
        (((1, 3.0), (4, 2.0)), 8, ACTION_DEVICE),  # 4.6 + 8 x 1 against 8 x 2 (flat past the last point)
    ],
)
def test_a_batch_weighs_one_copy_against_all_its_tokens(
    host_points: tuple[tuple[int, float], ...], tokens: int, expected: int
) -> None:
    """COST weighs a miss for every activation of the call left to it: a copy that loses
    to the host for one token wins for a batch that all picks the expert, by host(n)
    where the rule has its points."""
    rule = Rule(miss=MISS_COST, host_us=3.0, device_us=1.0, host_points=host_points, overlap=True)
    actions = rule_actions(rule, np.array([[1]] * tokens, np.int32))
    assert (actions == expected).all(), actions


@pytest.mark.parametrize(("margin", "overlap", "fetched"), [(0.0, True, 1), (0.2, True, 0), (0.0, False, 0)])
def test_cost_fetches_the_misses_that_shorten_the_layer(margin: float, overlap: bool, fetched: int) -> None:
    """Two misses of one token, 3 us each on the host, a 4.6 us copy: fetching one while
    the host runs the other ends the layer at 5.6 us against 6 all on the host; both
    fetched, at 10.2. So the rule fetches one (the lower id) -- not where that must beat
    all-host by 20%, nor where the device's work is the host's time (!overlap)."""
    rule = Rule(miss=MISS_COST, host_us=3.0, device_us=1.0, margin=margin, overlap=overlap)
    actions = rule_actions(rule, np.array([[1, 2]], np.int32))
    assert actions.tolist() == [[ACTION_DEVICE, ACTION_HOST] if fetched else [ACTION_HOST, ACTION_HOST]]


def test_cost_counts_the_copy_on_the_bus_and_the_device_work_due() -> None:
    """The two misses above again, where fetching one paid. Behind a copy already on the
    bus the fetched one would land 4.6 us later; with 22 us of device work due first
    (resident experts 0, 3 and 4 for 8, 7 and 7 tokens) it would run after that. Both
    times the host is sooner, so both run there."""
    rule = Rule(miss=MISS_COST, host_us=3.0, device_us=1.0, overlap=True)
    on_the_bus = (("prefetch", (2, 0)),)  # started at once on the idle bus
    assert rule_actions(rule, np.array([[1, 2]], np.int32), on_the_bus).tolist() == [[ACTION_HOST] * 2]
    resident = (("demand", (0, 0)), ("demand", (0, 3)), ("demand", (0, 4)), ("advance", 100_000))
    ids = np.array([[0, 1, 2]] + [[0, 3, 4]] * 7, np.int32)
    actions = rule_actions(rule, ids, resident)
    assert actions[0].tolist() == [ACTION_DEVICE, ACTION_HOST, ACTION_HOST]
    assert (actions[1:] == ACTION_DEVICE).all()


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 6, 15, 16, 37, 576, 1100, 2100]),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
    n_tokens=st.integers(1, 3),
    k=st.integers(1, 3),
    scale=st.sampled_from([1e-30, 1.0, 1e4]),
)
def test_the_next_layers_router_picks_the_same_experts_at_any_width(
    width: int, seed: int, ties: bool, n_tokens: int, k: int, scale: float
) -> None:
    """The rule's int16 router and 15-bit input rows give exact integer logits, so C
    (SSE2 in blocks of 16 values) and the twin pick the same top-k, ties to the
    lower id included: `ties` repeats router rows."""
    rng = np.random.default_rng(seed)
    routers = []
    for n in N_EXPERT:
        if not n:
            routers.append(None)
            continue
        r = rng.standard_normal((n, width)).astype(np.float32)
        if ties:
            r[1::2] = r[0::2][: r[1::2].shape[0]]
        routers.append(r)
    rule = Rule(
        resident_action=ACTION_DEVICE,
        miss=MISS_HOST,
        keep=KEEP_ALL,
        prefetch_next=True,
        routers=tuple(routers),
    )
    store, tier = make_pair(10 * sum(N_EXPERT) * max(EXPERT_BYTES), 3)
    store.set_rule(rule)
    state = RuleState(rule, len(N_EXPERT))
    il = MOE_LAYERS[0]
    k = min(k, N_EXPERT[il])
    ids = np.array([rng.permutation(N_EXPERT[il])[:k] for _ in range(n_tokens)], np.int32)
    weights = rng.random(ids.shape).astype(np.float32)
    hidden = (rng.standard_normal((n_tokens, width)) * scale).astype(np.float32)
    assert (store.begin_call(il, ids) == tier.begin_call(il, ids)).all()
    c_plan = store.rule_plan(il, ids, weights, hidden)
    _, py_plan = rule_plan(tier, state, il, ids, weights, hidden)
    assert c_plan.prefetch == py_plan.prefetch
    assert py_plan.prefetch, "the next layer's router named nothing to prefetch"


@settings(max_examples=80, deadline=None)
@given(
    width=st.sampled_from([1, 7, 16, 33, 576, 1040, 2100]),
    n_expert=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    special=st.sampled_from(["none", "zeros", "tiny", "huge", "non-finite", "outlier", "saturated"]),
)
def test_the_rules_router_logits_are_the_twins_bit_for_bit(
    width: int, n_expert: int, seed: int, special: str
) -> None:
    """libspice's integer router logits (SSE2 in blocks of 16: two pmaddwd pair sums
    added in int32, then in int64; C for the rest) equal quantize_rows' in numpy to
    the bit, so the twin and the engine rank experts the same, ties included."""
    from pyspice.runtime import rule_router_logits
    from pyspice.sim.rule import ROUTER_Q_LIMIT, quantize_rows, router_logits

    rng = np.random.default_rng(seed)
    router = rng.standard_normal((n_expert, width)).astype(np.float32)
    hidden = rng.standard_normal((3, width)).astype(np.float32)
    if special == "zeros":
        router[0] = 0
        hidden[0] = 0
    elif special == "tiny":
        hidden *= np.float32(1e-39)  # subnormal rows
    elif special == "huge":
        router *= np.float32(3e37)
        hidden *= np.float32(3e37)
    elif special == "non-finite":
        router.flat[rng.integers(router.size)] = np.inf
        hidden.flat[rng.integers(hidden.size)] = np.nan
    elif special == "saturated":  # every product 32767 x -16383: what the int32 lanes must survive
        router[:] = 1
        hidden[:] = -2
    elif special == "outlier":  # LLMs' massive activations: one dimension dwarfs the rest
        hidden[:, rng.integers(width)] *= np.float32(1e3)
    c = rule_router_logits(router, hidden)
    twin = router_logits(quantize_rows(router, ROUTER_Q_LIMIT), hidden)
    assert c.tobytes() == twin.tobytes(), np.abs(c - twin).max()


def test_the_rules_router_keeps_float_top_k_where_int8_would_not() -> None:
    """Routers' rows hold weights 40-200x their median (smolmoe-b), and hidden rows a
    few outlier dimensions. On rows shaped so, the rule's int16 router picks the
    float64 top-4; int8 rows -- the negative control, tried first -- lose 7% of them
    here and a quarter of some layers' on smolmoe-b (docs/results/cpu-overhead.md)."""
    from pyspice.sim.rule import ROUTER_Q_LIMIT, quantize_rows, router_logits

    rng = np.random.default_rng(7)
    router = rng.standard_normal((32, 576)).astype(np.float32)
    router[rng.random(router.shape) < 0.01] *= 100
    hidden = rng.standard_normal((256, 576)).astype(np.float32)
    hidden[:, rng.integers(576, size=3)] *= 30
    exact = hidden.astype(np.float64) @ router.astype(np.float64).T

    def overlap(logits: np.ndarray) -> float:
        a = np.argsort(-exact, axis=1, kind="stable")[:, :4]
        b = np.argsort(-logits, axis=1, kind="stable")[:, :4]
        return float(np.mean([len(set(x) & set(y)) / 4 for x, y in zip(a, b, strict=True)]))

    assert overlap(router_logits(quantize_rows(router, ROUTER_Q_LIMIT), hidden)) >= 0.995
    assert overlap(router_logits(quantize_rows(router, 127.0), hidden)) < 0.95
