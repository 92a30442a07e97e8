"""Differential tests: libspice's store, plan rules and outcome counting against
their twins in the simulator (pyspice.sim.tier, pyspice.sim.plan).

The simulator drives the same policy objects as the engine; what it measures
is what ships only if its model of the mechanism is the mechanism. Hypothesis
drives the C store (through pyspice.runtime on a manual clock) and SimTier
with the same operation sequences and plans and asserts, after every step,
the same statuses, residency tables, ready times, clocks, budgets and
counters; and the same accept/reject decision for random plans, and the same
outcome counts for random actions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspice.policy import ACTION_DEVICE, ACTION_DROP, ACTION_HOST, ACTION_SURROGATE, Plan
from pyspice.runtime import Store, StoreParams, add_outcomes, plan_check
from pyspice.sim import plan as sim_plan
from pyspice.sim.tier import PRIORITY_DEMAND, PRIORITY_PREFETCH, REFUSED_STATE, SimTier

N_EXPERT = (5, 0, 4, 5)  # layer 1 is dense
EXPERT_BYTES = (4096, 0, 8192, 6144)  # quant types differ: each takes a slot of the largest
MOE_LAYERS = [il for il, n in enumerate(N_EXPERT) if n]
BANDWIDTH_GBPS = 1.0  # 1 byte per ns
LATENCY_US = 0.5
COUNTERS = (
    "bytes_h2d",
    "copy_ns",
    "stall_ns",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_cancelled",
    "store_polls",
    "device_copies",
    "device_waits",
)


def make_pair(budget: int, queue: int) -> tuple[Store, SimTier]:
    store = Store(
        StoreParams(budget, BANDWIDTH_GBPS, LATENCY_US, prefetch_queue_max=queue, manual_clock=True),
        list(N_EXPERT),
        list(EXPERT_BYTES),
    )
    tier = SimTier(N_EXPERT, EXPERT_BYTES, budget, BANDWIDTH_GBPS, LATENCY_US, prefetch_queue_max=queue)
    assert store.n_slots == tier.n_slots
    return store, tier


def assert_same(store: Store, tier: SimTier, where: str) -> None:
    assert (store.states() == tier.states()).all(), f"{where}: residency\n{store.states()}\n{tier.states()}"
    assert store.now() == tier.now_ns, where
    assert store.used_bytes == tier.used_bytes, where
    for il in range(len(N_EXPERT)):
        c, k = store.counters(il), tier.counters[il]
        for name in COUNTERS:
            assert getattr(c, name) == getattr(k, name), f"{where}: layer {il} {name}"
    for il in MOE_LAYERS:
        for e in range(N_EXPERT[il]):
            assert store.ready_at(il, e) == tier.ready_at(il, e), f"{where}: ready_at({il}, {e})"


# ---- operations ------------------------------------------------------------------

expert = st.sampled_from([(il, e) for il in MOE_LAYERS for e in range(N_EXPERT[il])])


@st.composite
def plans(draw: Any) -> tuple[int, np.ndarray, np.ndarray, Plan]:
    """A plan that passes validation (the store applies validated plans only)."""
    il = draw(st.sampled_from(MOE_LAYERS))
    n_tokens, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ids = np.array(
        [
            draw(st.lists(st.integers(0, N_EXPERT[il] - 1), min_size=k, max_size=k, unique=True))
            for _ in range(n_tokens)
        ],
        dtype=np.int32,
    )
    actions = np.array(
        draw(
            st.lists(
                st.sampled_from([ACTION_DEVICE, ACTION_HOST, ACTION_DROP]),
                min_size=ids.size,
                max_size=ids.size,
            )
        ),
        dtype=np.int32,
    ).reshape(ids.shape)
    plan = Plan(
        actions=actions,
        fetch=draw(st.lists(st.integers(0, N_EXPERT[il] - 1), max_size=3)),
        prefetch=draw(st.lists(expert, max_size=6)),
        evict=draw(st.lists(expert, max_size=3)),
        evict_from=draw(st.lists(st.sampled_from(MOE_LAYERS), max_size=4)),
    )
    return il, ids, actions, plan


op = st.one_of(
    st.tuples(st.just("demand"), expert),
    st.tuples(st.just("prefetch"), expert),
    st.tuples(st.just("evict"), expert),
    st.tuples(st.just("pin"), expert),
    st.tuples(st.just("unpin"), expert),
    st.tuples(st.just("wait"), expert),
    st.tuples(st.just("advance"), st.integers(0, 30_000)),
    st.tuples(st.just("poll"), st.none()),
    st.tuples(st.just("call"), plans()),
)


def apply_both(
    store: Store, tier: SimTier, il: int, ids: np.ndarray, actions: np.ndarray, plan: Plan
) -> None:
    """One plan applied by libspice's store and by its twin: the actions carried out agree."""
    done = store.apply_plan(
        il,
        ids,
        actions,
        fetch=plan.fetch,
        prefetch=plan.prefetch,
        evict=plan.evict,
        evict_from=plan.evict_from,
    )
    twin = sim_plan.apply_plan(tier, il, ids, np.array(actions), plan)
    assert (done == twin.actions).all(), f"actions after the plan: {done} vs {twin.actions}"


def run_op(store: Store, tier: SimTier, name: str, arg: Any) -> None:
    if name == "advance":
        store.advance(arg)
        tier.now_ns += arg
        tier.poll()
    elif name == "poll":
        assert store.poll() == 0
        tier.poll()
    elif name == "call":
        il, ids, actions, plan = arg
        hit = store.begin_call(il, ids)
        assert (hit == tier.begin_call(il, ids)).all()
        apply_both(store, tier, il, ids, actions, plan)
    else:
        il, e = arg
        if name in ("demand", "prefetch"):
            prio = PRIORITY_DEMAND if name == "demand" else PRIORITY_PREFETCH
            assert store.request(il, e, name == "demand") == tier.request(il, e, prio)
        elif name == "evict":
            assert store.evict(il, e) == tier.evict(il, e)
        elif name == "pin":
            assert store.pin(il, e) == tier.pin(il, e)
        elif name == "unpin":
            assert store.unpin(il, e) == tier.unpin(il, e)
        elif name == "wait":
            status, stall = store.wait(il, e)
            if not tier.holds(il, e):
                assert status == REFUSED_STATE
            else:
                assert status == 0
                assert stall == tier.wait(il, e)


@settings(max_examples=300, deadline=None)
@given(budget_experts=st.integers(1, 8), queue=st.integers(1, 4), ops=st.lists(op, max_size=40))
def test_store_and_sim_tier_agree(budget_experts: int, queue: int, ops: list[tuple[str, Any]]) -> None:
    store, tier = make_pair(budget_experts * max(EXPERT_BYTES), queue)
    for step, (name, arg) in enumerate(ops):
        run_op(store, tier, name, arg)
        assert_same(store, tier, f"step {step} ({name})")


def test_a_copy_in_flight_reads_copying_until_a_poll_sees_it_land() -> None:
    """The rule the twins share, spelled out: lookups ask the device nothing."""
    store, tier = make_pair(4 * max(EXPERT_BYTES), 4)
    store.request(0, 0, True)
    tier.request(0, 0, PRIORITY_DEMAND)
    end = int(LATENCY_US * 1e3 + EXPERT_BYTES[0] / BANDWIDTH_GBPS)
    assert store.state(0, 0) == tier.state(0, 0) == 2  # COPYING: started at once on an idle bus
    store.advance(end - 1)
    tier.now_ns += end - 1
    tier.poll()
    assert store.state(0, 0) == tier.state(0, 0) == 2
    store.advance(1)  # advance polls
    tier.now_ns += 1
    tier.poll()
    assert store.state(0, 0) == tier.state(0, 0) == 3


# ---- plan validation -------------------------------------------------------------

SURROGATES = np.zeros((len(N_EXPERT), max(N_EXPERT)), dtype=np.bool_)
SURROGATES[0, [1, 3]] = True
SURROGATES[3, 0] = True

any_layer = st.integers(-1, len(N_EXPERT))
any_expert = st.integers(-1, max(N_EXPERT))


@st.composite
def any_plans(draw: Any) -> tuple[int, np.ndarray, Plan]:
    il = draw(st.sampled_from(MOE_LAYERS))
    n_tokens, k = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    ids = np.array(
        draw(st.lists(st.integers(0, N_EXPERT[il] - 1), min_size=n_tokens * k, max_size=n_tokens * k)),
        np.int32,
    ).reshape(n_tokens, k)
    actions = np.array(
        draw(st.lists(st.integers(-1, 4), min_size=ids.size, max_size=ids.size)), np.int32
    ).reshape(ids.shape)
    pair = st.tuples(any_layer, any_expert)
    plan = Plan(
        actions=actions,
        fetch=draw(st.lists(any_expert, max_size=6)),
        prefetch=draw(st.lists(pair, max_size=3)),
        evict=draw(st.lists(pair, max_size=3)),
        evict_from=draw(st.lists(any_layer, max_size=3)),
        resume_layer=draw(st.sampled_from([-1, -2, *range(len(N_EXPERT) + 1)])),
    )
    return il, ids, plan


@settings(max_examples=400, deadline=None)
@given(case=any_plans(), loaded=st.booleans())
def test_plan_validation_agrees(case: tuple[int, np.ndarray, Plan], loaded: bool) -> None:
    il, ids, plan = case
    table = SURROGATES if loaded else None
    c_error = plan_check(
        N_EXPERT,
        table,
        il,
        ids,
        np.asarray(plan.actions),
        fetch=plan.fetch,
        prefetch=plan.prefetch,
        evict=plan.evict,
        evict_from=plan.evict_from,
        resume_layer=plan.resume_layer,
    )
    try:
        sim_plan.validate_plan(plan, il, ids, N_EXPERT, table)
        sim_error = None
    except sim_plan.InvalidPlan as exc:
        sim_error = str(exc)
    assert (c_error is None) == (sim_error is None), f"C: {c_error!r}; simulator: {sim_error!r}"


def test_plan_validation_names_a_surrogate_the_sidecar_lacks() -> None:
    ids = np.array([[2]], np.int32)
    actions = np.array([[ACTION_SURROGATE]], np.int32)
    assert plan_check(N_EXPERT, SURROGATES, 0, ids, actions) is not None
    assert plan_check(N_EXPERT, SURROGATES, 0, np.array([[3]], np.int32), actions) is None


# ---- outcomes --------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(
            st.sampled_from([ACTION_DEVICE, ACTION_HOST, ACTION_SURROGATE, ACTION_DROP]), st.booleans()
        ),
        max_size=40,
    )
)
def test_outcome_counting_agrees(pairs: list[tuple[int, bool]]) -> None:
    actions = np.array([a for a, _ in pairs], np.int32)
    hit = np.array([h for _, h in pairs], np.bool_)
    c = add_outcomes(actions, hit)
    o = sim_plan.count_outcomes(actions, hit)
    assert (c.activations, c.hits, c.misses_fetched, c.misses_host, c.misses_surrogate, c.dropped) == (
        o.activations,
        o.hits,
        o.fetched,
        o.host,
        o.surrogate,
        o.dropped,
    )
    assert c.misses == o.misses
