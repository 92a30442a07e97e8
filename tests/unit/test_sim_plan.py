"""The engine's plan rules in Python (pyspice.sim.plan): validation rejects what
spice_plan_validate rejects, outcomes are counted as count_actions counts them,
and plans are applied as spice_runtime_apply_store_plan applies them."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import (
    ACTION_DEVICE,
    ACTION_DROP,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_RESIDENT,
    HookCall,
    Plan,
)
from pyspice.sim.costs import Costs
from pyspice.sim.plan import (
    InvalidPlan,
    Outcomes,
    PlanDriver,
    apply_plan,
    count_outcomes,
    instant_tier,
    validate_plan,
)
from pyspice.sim.simulator import Simulator
from pyspice.sim.tier import OK, PRIORITY_DEMAND, PRIORITY_PREFETCH, SimTier
from pyspice.sim.workload import Workload

N_EXPERT = (4, 0, 4)  # layer 1 has no routed experts
IDS = np.array([[0, 1], [2, 1]], np.int32)


def check(plan: Plan, layer: int = 0, surrogates: np.ndarray | None = None) -> np.ndarray | None:
    return validate_plan(plan, layer, IDS, N_EXPERT, surrogates)


# ---- validation --------------------------------------------------------------------


def test_the_default_plan_and_a_full_valid_plan_are_accepted() -> None:
    assert check(Plan()) is None
    plan = Plan(
        actions=[[0, 1], [3, 0]],
        fetch=[3],
        prefetch=[(2, 1), (0, 3)],
        evict=[(2, 0)],
        evict_from=[2, 0],
        resume_layer=2,
    )
    actions = check(plan)
    assert actions is not None and actions.dtype == np.int32 and actions.tolist() == [[0, 1], [3, 0]]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan(actions=[[0, 1, 1], [0, 0, 0]]), "has shape"),
        (Plan(actions=[[0.0, 1.0], [0.0, 0.0]]), "must be integers"),
        (Plan(actions=[[0, 4], [0, 0]]), "plan action 1 (token 0, slot 1) is 4, not a known action"),
        (Plan(actions=[[0, 0], [-1, 0]]), "plan action 2 (token 1, slot 0) is -1"),
        (Plan(fetch=[4]), "plan fetch[0] = 4 is not an expert id (0..3)"),
        (Plan(fetch=[0, 1, 2, 3, 0]), "plan fetch list has 5 entries; at most 4 fit"),
        (Plan(evict_from=[1]), "evict_from[0] names layer 1, which is not an MoE layer"),
        (Plan(evict_from=[0, 2, 0, 2]), "evict_from has 4 entries; at most 3 fit"),
        (Plan(resume_layer=1), "resume_il = 1 is neither -1 nor an MoE layer"),
        (Plan(resume_layer=-2), "resume_il = -2"),
        (Plan(prefetch=[(1, 0)]), "plan prefetch[0] names layer 1, which is not an MoE layer"),
        (Plan(prefetch=[(3, 0)]), "names layer 3"),
        (Plan(evict=[(0, 0), (2, 4)]), "plan evict[1] names expert 4 of layer 2, which has 4 experts"),
        (Plan(prefetch=[(0, 1, 2)]), "an odd count 3"),  # type: ignore[list-item]
        (Plan(prefetch=[(0, 0)] * 13), "plan prefetch has 26 entries; at most 24 fit"),
        (Plan(fetch=[2**31]), "fit in int32"),
        (Plan(fetch=["x"]), "must be integers"),  # type: ignore[list-item]
    ],
)
def test_each_rejection_names_the_problem(plan: Plan, message: str) -> None:
    with pytest.raises(InvalidPlan) as err:
        check(plan)
    assert message in str(err.value)


def test_a_list_as_long_as_its_cap_is_accepted() -> None:
    # n_layers x max_expert pairs of prefetch and evict, max_expert fetches, n_layers evict_from
    every = [(il, e) for il in (0, 2) for e in range(4)] + [(0, 0)] * 4
    assert len(every) == 3 * 4
    assert check(Plan(prefetch=every, evict=every, fetch=[0, 1, 2, 3], evict_from=[0, 2, 2])) is None


def test_a_surrogate_action_needs_that_experts_surrogate() -> None:
    plan = Plan(actions=[[ACTION_SURROGATE, 1], [1, ACTION_SURROGATE]])
    with pytest.raises(InvalidPlan, match="no surrogates are loaded"):
        check(plan)
    table = np.zeros((3, 4), np.bool_)
    with pytest.raises(InvalidPlan, match="no surrogates are loaded"):
        check(plan, surrogates=table)  # a table with none loaded is no table
    table[0, 0] = True  # expert 0 has one, expert 1 (token 1, slot 1) not
    with pytest.raises(
        InvalidPlan, match=r"plan action 3 \(token 1, slot 1\) asks for the surrogate of expert 1"
    ):
        check(plan, surrogates=table)
    table[0, 1] = True
    actions = check(plan, surrogates=table)
    assert actions is not None and actions.tolist() == [[2, 1], [1, 2]]
    table[0, 1] = False
    table[2, 1] = True  # the same expert of another layer does not count
    with pytest.raises(InvalidPlan):
        check(plan, surrogates=table)


def test_the_first_problem_is_the_one_named() -> None:
    # C checks actions first, then fetch, evict_from, resume, prefetch, evict
    plan = Plan(actions=[[0, 9], [0, 0]], fetch=[9], prefetch=[(1, 0)], resume_layer=5)
    with pytest.raises(InvalidPlan, match="not a known action"):
        check(plan)
    with pytest.raises(InvalidPlan, match="fetch"):
        check(Plan(fetch=[9], prefetch=[(1, 0)], resume_layer=5))
    with pytest.raises(InvalidPlan, match="resume_il"):
        check(Plan(prefetch=[(1, 0)], resume_layer=5))


# ---- outcomes ----------------------------------------------------------------------


def test_outcomes_follow_count_actions() -> None:
    actions = np.array(
        [[ACTION_DEVICE, ACTION_DEVICE, ACTION_HOST, ACTION_HOST, ACTION_SURROGATE, ACTION_DROP]]
    )
    hit = np.array([[True, False, True, False, True, True]])
    got = count_outcomes(actions, hit)
    # lossy actions are never hits, resident or not
    assert got == Outcomes(hits=2, fetched=1, host=1, surrogate=1, dropped=1)
    assert got.misses == 4 and got.activations == 6
    assert got + got == Outcomes(4, 2, 2, 2, 2)


# ---- application -------------------------------------------------------------------


def tier(budget_experts: int, n_expert: tuple[int, ...] = (4, 4, 4)) -> SimTier:
    return instant_tier(n_expert, (100,) * len(n_expert), 100 * budget_experts)


def hold(t: SimTier, layer: int, *experts: int) -> None:
    """Make the experts resident: demand copies, landed and seen by a poll."""
    for e in experts:
        t.request(layer, e, PRIORITY_DEMAND)
    t.poll()


def held(t: SimTier) -> set[tuple[int, int]]:
    return {(il, e) for il in range(t.n_layers) for e in range(t.n_expert[il]) if t.holds(il, e)}


def device(ids: list[int]) -> np.ndarray:
    return np.full((1, len(ids)), ACTION_DEVICE, np.int32)


def test_experts_the_call_runs_on_the_device_are_pinned_against_its_own_evictions() -> None:
    t = tier(4)
    hold(t, 0, 0, 1)
    ids = np.array([[0, 2]], np.int32)
    result = apply_plan(t, 0, ids, device([0, 2]), Plan(evict=[(0, 0), (0, 1)]))
    assert held(t) == {(0, 0), (0, 2)}  # 0 pinned stays, 1 goes, 2 fetched on demand
    assert result.waited == (0, 2) and result.actions.tolist() == [[ACTION_DEVICE, ACTION_DEVICE]]
    assert t.evict(0, 0) == OK and t.evict(0, 2) == OK  # unpinned after the call


def test_a_device_expert_without_a_slot_runs_on_the_host() -> None:
    t = tier(2)
    hold(t, 2, 0, 1)
    ids = np.array([[3, 0]], np.int32)
    result = apply_plan(t, 0, ids, device([3, 0]), Plan())
    assert result.actions.tolist() == [[ACTION_HOST, ACTION_HOST]] and result.waited == ()


def test_explicit_fetches_come_before_implied_demand() -> None:
    t = tier(1)
    ids = np.array([[1]], np.int32)
    result = apply_plan(t, 0, ids, device([1]), Plan(fetch=[3]))
    assert held(t) == {(0, 3)}  # the fetch took the only slot
    assert result.actions.tolist() == [[ACTION_HOST]]


def test_without_evict_from_a_refused_prefetch_is_skipped() -> None:
    t = tier(2)
    hold(t, 0, 0)
    ids = np.array([[0]], np.int32)
    apply_plan(t, 0, ids, device([0]), Plan(prefetch=[(2, 0), (2, 1), (2, 2)]))
    assert held(t) == {(0, 0), (2, 0)}
    hold(t, 0, 1)  # no room: refused, not an error
    assert held(t) == {(0, 0), (2, 0)}


def test_evict_from_takes_the_least_recently_selected_expert_of_the_first_listed_layer() -> None:
    t = tier(4)
    hold(t, 0, 0, 1)
    hold(t, 1, 0, 1)
    t.begin_call(0, [[1]])
    t.begin_call(0, [[0]])  # layer 0: 1 is the least recent
    t.begin_call(1, [[0, 1]])
    t.begin_call(2, [[3]])
    ids = np.array([[3]], np.int32)
    apply_plan(t, 2, ids, np.array([[ACTION_HOST]], np.int32), Plan(prefetch=[(2, 0)], evict_from=[0, 1]))
    assert held(t) == {(0, 0), (1, 0), (1, 1), (2, 0)}


def test_evict_from_spares_pinned_experts_and_the_prefetch_list() -> None:
    t = tier(3)
    hold(t, 0, 0, 1, 2)
    ids = np.array([[0]], np.int32)
    # 0 runs on the device (pinned), 1 is named by the prefetch list (kept): 2 goes
    apply_plan(t, 0, ids, device([0]), Plan(prefetch=[(2, 0), (0, 1)], evict_from=[0]))
    assert held(t) == {(0, 0), (0, 1), (2, 0)}


def test_a_prefetch_takes_room_only_from_layers_listed_before_its_own() -> None:
    t = tier(2)
    hold(t, 2, 0, 1)
    ids = np.array([[3]], np.int32)
    host = np.array([[ACTION_HOST]], np.int32)
    # layer 0 comes before layer 2 in evict_from: it may not take layer 2's slots ...
    apply_plan(t, 1, ids, host, Plan(prefetch=[(0, 0)], evict_from=[0, 2]))
    assert held(t) == {(2, 0), (2, 1)}
    # ... while a layer not listed may take room from every listed one
    apply_plan(t, 1, ids, host, Plan(prefetch=[(1, 0)], evict_from=[0, 2]))
    assert len(held(t)) == 2 and (1, 0) in held(t)


def test_a_prefetch_that_finds_no_room_drops_the_ones_after_it() -> None:
    t = instant_tier((4, 4, 4), (100, 300, 100), 600)  # two slots of 300 bytes
    hold(t, 0, 0)
    hold(t, 2, 3)
    ids = np.array([[3]], np.int32)
    host = np.array([[ACTION_HOST]], np.int32)
    # layer 0's prefetch may take room only from layers listed before layer 0 in
    # evict_from (none): it finds no room, and the layer-2 prefetch after it, which
    # could take layer 0's slot, is dropped with it
    apply_plan(t, 1, ids, host, Plan(prefetch=[(0, 1), (2, 0)], evict_from=[0, 2]))
    assert held(t) == {(0, 0), (2, 3)}


def test_victims_come_from_the_listed_layers_in_order_across_prefetches() -> None:
    t = tier(3)
    hold(t, 2, 0, 1)
    hold(t, 0, 0)
    t.begin_call(2, [[0, 1]])
    ids = np.array([[3]], np.int32)
    host = np.array([[ACTION_HOST]], np.int32)
    plan = Plan(prefetch=[(1, 0), (1, 1), (0, 1)], evict_from=[0, 2])
    apply_plan(t, 1, ids, host, plan)
    # (1, 0) takes layer 0's only expert, (1, 1) finds layer 0 empty and takes (2, 0);
    # (0, 1) may only take room from layers before its own (none): dropped
    assert held(t) == {(1, 0), (1, 1), (2, 1)}


def test_waits_are_in_expert_order_and_only_for_pinned_device_experts() -> None:
    t = SimTier((8,), (1000,), 5000, bandwidth_gbps=1.0, latency_us=0.0)
    hold(t, 0, 5)
    t.request(0, 2, PRIORITY_PREFETCH)
    seen: list[tuple[int, int]] = []
    ids = np.array([[6, 2, 5], [1, 7, 3]], np.int32)
    actions = np.array(
        [[ACTION_DEVICE, ACTION_DEVICE, ACTION_HOST], [ACTION_DEVICE, ACTION_HOST, ACTION_DEVICE]]
    )
    result = apply_plan(
        t, 0, ids, actions.astype(np.int32), Plan(), lambda e: seen.append((e, t.ready_at(0, e)))
    )
    assert [e for e, _ in seen] == [1, 2, 3, 6] == list(result.waited)
    assert all(ready > 0 for _, ready in seen)  # none landed yet: the copies are on the bus


def test_the_driver_counts_as_the_engine() -> None:
    class DeviceAll:
        name = "device-all"

        def decide(self, call: HookCall) -> Plan:
            assert call.residency is not None
            return Plan(actions=np.full(call.ids.shape, ACTION_DEVICE, np.int32), prefetch=[(0, 3)])

    drive = PlanDriver(tier(4), DeviceAll())
    drive.call(0, [0, 1])
    drive.call(0, [1, 3])
    assert drive.outcomes == Outcomes(hits=2, fetched=2)
    assert drive.prefetch_used == 1 and drive.copied_bytes == 300
    assert drive.tier.state(0, 3) == RESIDENCY_RESIDENT and drive.tier.state(0, 2) == RESIDENCY_ABSENT


# ---- the simulator on these rules ----------------------------------------------------


def sim_workload() -> Workload:
    ids = np.array([[[0, 1]], [[2, 3]], [[0, 2]]], np.int32)  # 3 tokens, 1 layer, top-2
    return Workload.from_arrays(1, [0], 4, ids)


def sim_costs() -> Costs:
    return Costs(
        expert_bytes=(100,),
        bus_gbps=1.0,
        bus_latency_us=0.0,
        rest_us=((1, 10.0),),
        device_expert_us=((1, 1.0),),
        host_expert_us=((1, 5.0),),
    )


class Lossy:
    name = "lossy"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=np.array([[ACTION_SURROGATE, ACTION_DROP]] * call.n_tokens, np.int32))


def test_the_simulator_rejects_surrogates_the_context_does_not_load() -> None:
    wl = sim_workload()
    none = Simulator(wl, sim_costs(), 400).run("lossy", Lossy(), policy_us=0.0)
    assert none.policy_fallbacks == 3 and none.misses_surrogate == 0  # no surrogates: every plan
    errors = np.array([0.1, np.inf, 0.1, 0.1], np.float32)  # expert 1 has none
    extra = {"surrogate_error": lambda il: errors, "surrogates_loaded": True}
    some = Simulator(wl, sim_costs(), 400, context_extra=extra).run("lossy", Lossy(), policy_us=0.0)
    assert some.policy_fallbacks == 0  # the surrogate slot holds experts 0, 2, 0
    assert (some.misses_surrogate, some.dropped) == (3, 3)
    assert some.misses == some.activations == 6  # dropped activations are misses too
    assert some.fallback_rate == 1.0


def test_the_default_plan_is_never_checked_for_surrogates() -> None:
    result = Simulator(sim_workload(), sim_costs(), 400).run("default", None)
    assert result.policy_fallbacks == 0 and result.misses_host == 6
