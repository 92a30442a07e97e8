"""The SPICE policy over hand-made and random calls (pure Python, no model).

Properties (hypothesis): every selected expert gets exactly one valid action;
the engine accepts every plan and, applying it by its own rules
(pyspice.sim.plan), stays within the budget; the exact quality level never
substitutes. Behaviour: a confident prediction is
prefetched and turns into hits, stale prefetches are cancelled, victims are
the experts needed last, misses go to the host when fetching cannot win and
are fetched when the cost model says so, lossy levels substitute only
low-weight misses with good surrogates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyspice.policy import (
    ACTION_DEVICE,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
    HookCall,
    Plan,
    PolicyContext,
    make_policy,
)
from pyspice.policy.profile import PROFILE_VERSION, BatchCost, CostProfile
from pyspice.policy.spice import SpicePolicy, spice_config
from pyspice.policy.spice.cost import CostModel
from pyspice.policy.spice.lookahead import look_ahead
from pyspice.sim.plan import PlanDriver, apply_plan, default_actions, instant_tier, validate_plan
from pyspice.sim.tier import PRIORITY_DEMAND, PRIORITY_PREFETCH, SimTier

N_EMBD = 16
EXPERT_BYTES = 1000


class ScriptedPredictor:
    """Predicts what the test says the next layers will pick (a perfect predictor)."""

    def __init__(self, n_expert: int) -> None:
        self.n_expert = n_expert
        self.future: dict[int, list[int]] = {}

    def rollout_logits(self, layer: int, hidden: Any, depth: int) -> list[tuple[int, Any]]:
        out = []
        for il in range(layer + 1, layer + 1 + depth):
            if il not in self.future:
                break
            logits = np.full(self.n_expert, -10.0, np.float32)
            logits[self.future[il]] = 10.0
            out.append((il, logits))
        return out


def profile(bus_gbps: float, host_us: float, device_us: float, emulated: bool) -> CostProfile:
    return CostProfile(
        version=PROFILE_VERSION,
        model="test",
        model_sha="",
        threads=1,
        n_layers=0,
        n_moe_layers=0,
        expert_bytes={},
        bus_gbps=bus_gbps,
        bus_latency_us=1.0,
        bus_source="measured",
        device_expert_us=device_us,
        device_source="emulated: the host's own time" if emulated else "measured",
        batches=[BatchCost(tokens=1, expert_us=host_us, rest_us_per_layer=50.0)],
    )


def context(
    budget_experts: int,
    n_layers: int = 4,
    n_expert: int = 8,
    k: int = 2,
    prof: Any = None,
    predictor: Any = None,
    errors: Any = None,
) -> PolicyContext:
    return PolicyContext(
        n_layers=n_layers,
        n_expert=(n_expert,) * n_layers,
        n_expert_used=k,
        expert_bytes=(EXPERT_BYTES,) * n_layers,
        budget_bytes=EXPERT_BYTES * budget_experts,
        profile=prof,
        predictor=predictor,
        surrogate_error=errors or (lambda il: None),
        surrogates_loaded=errors is not None,
    )


def hook_call(
    layer: int, ids: list[list[int]], weights: Any, residency: np.ndarray, n_expert: int
) -> HookCall:
    ids_arr = np.asarray(ids, dtype=np.int32)
    n = ids_arr.shape[0]
    return HookCall(
        layer,
        np.ones((n, N_EMBD), np.float32),
        np.full((n, n_expert), 1.0 / n_expert, np.float32),
        ids_arr,
        np.asarray(weights, dtype=np.float32).reshape(ids_arr.shape),
        None,
        residency,
    )


def plan_actions(plan: Plan, call: HookCall) -> np.ndarray:
    """The plan's actions, the default plan's (resident -> device, else host) when it has none."""
    if plan.actions is not None:
        return np.asarray(plan.actions)
    assert call.residency is not None
    resident = call.residency[call.layer][call.ids] == RESIDENCY_RESIDENT
    return np.where(resident, ACTION_DEVICE, ACTION_HOST).astype(np.int32)


def attached(name: str, ctx: PolicyContext) -> SpicePolicy:
    policy = make_policy(name)
    assert isinstance(policy, SpicePolicy)
    policy.attach(ctx)
    return policy


def driver(policy: Any, ctx: PolicyContext) -> PlanDriver:
    """The policy under the engine's plan rules, on a tier whose copies land at once."""
    return PlanDriver(instant_tier(ctx.n_expert, ctx.expert_bytes, ctx.budget_bytes or 0), policy)


def place(drive: PlanDriver, layer: int, experts: list[int]) -> None:
    """Experts on the device before the calls (demand copies, landed at once)."""
    for e in experts:
        drive.tier.request(layer, e, PRIORITY_DEMAND)


def tier_holding(ctx: PolicyContext, residency: np.ndarray) -> SimTier:
    """A tier on a slow bus holding what `residency` shows: its resident experts
    landed, the others on their way (the first on the bus, the rest queued)."""
    tier = SimTier(ctx.n_expert, ctx.expert_bytes, ctx.budget_bytes or 0, bandwidth_gbps=1e-3, latency_us=1.0)
    for il, e in zip(*np.nonzero(residency == RESIDENCY_RESIDENT), strict=True):
        tier.request(int(il), int(e), PRIORITY_DEMAND)
    tier.now_ns = 10**15  # long after: every copy so far has landed
    tier.states()
    for il, e in zip(
        *np.nonzero((residency == RESIDENCY_QUEUED) | (residency == RESIDENCY_COPYING)), strict=True
    ):
        tier.request(int(il), int(e), PRIORITY_PREFETCH)
    return tier


# ---- properties --------------------------------------------------------------------------


@st.composite
def situations(draw: Any) -> tuple[str, PolicyContext, HookCall]:
    n_layers = draw(st.integers(2, 5))
    n_expert = draw(st.integers(2, 10))
    k = draw(st.integers(1, n_expert))
    budget = draw(st.integers(1, n_layers * n_expert))
    n_tokens = draw(st.sampled_from([1, 1, 1, 3]))
    layer = draw(st.integers(0, n_layers - 1))
    name = draw(
        st.sampled_from(["spice:exact", "spice:balanced", "spice:fast", "abl-a", "abl-b", "abl-c", "abl-d"])
    )
    emulated = draw(st.booleans())
    prof = profile(draw(st.sampled_from([1.0, 12.0, 64.0])), 5.0, 0.5 if not emulated else 5.0, emulated)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    predictor = ScriptedPredictor(n_expert)
    predictor.future = {il: rng.choice(n_expert, k, replace=False).tolist() for il in range(n_layers)}
    errors = rng.uniform(0, 1, size=(n_layers, n_expert)).astype(np.float32)
    ctx = context(budget, n_layers, n_expert, k, prof, predictor, lambda il: errors[il])
    # a residency table the budget can hold
    residency = np.zeros((n_layers, n_expert), np.int8)
    cells = rng.permutation(n_layers * n_expert)[: draw(st.integers(0, budget))]
    states = rng.choice(
        [RESIDENCY_RESIDENT, RESIDENCY_QUEUED, RESIDENCY_COPYING], size=cells.size, p=[0.7, 0.2, 0.1]
    )
    residency.flat[cells] = states
    ids = [rng.choice(n_expert, k, replace=False).tolist() for _ in range(n_tokens)]
    weights = rng.uniform(0, 0.2, size=(n_tokens, k))
    return name, ctx, hook_call(layer, ids, weights, residency, n_expert)


@settings(max_examples=300, deadline=None)
@given(situations())
def test_every_activation_gets_one_action_and_the_budget_holds(
    case: tuple[str, PolicyContext, HookCall],
) -> None:
    name, ctx, call = case
    assert call.residency is not None
    residency = call.residency.copy()
    plan = attached(name, ctx).decide(call)
    actions = plan_actions(plan, call)
    assert actions.shape == call.ids.shape  # one action per (token, selected expert)
    assert set(np.unique(actions).tolist()) <= {ACTION_DEVICE, ACTION_HOST, ACTION_SURROGATE}
    if spice_config(name).lossless:
        assert not (actions == ACTION_SURROGATE).any()
    for il, e in plan.evict:
        assert residency[il, e] != RESIDENCY_COPYING, "a copy on the bus cannot be taken back"
    for il, e in plan.prefetch:
        assert residency[il, e] != RESIDENCY_QUEUED, "queued something already on its way"
        assert residency[il, e] != RESIDENCY_COPYING, "queued something already on its way"
    # room is taken from the layers needed last first
    n = ctx.n_layers
    distance = [(il - call.layer) % n or n for il in range(n)]
    assert [distance[il] for il in plan.evict_from] == sorted(
        (distance[il] for il in plan.evict_from), reverse=True
    )
    # the engine accepts the plan and applies it within the budget; every device action
    # left runs on an expert the tier holds
    tier = tier_holding(ctx, residency)
    tier.begin_call(call.layer, call.ids)
    hit = residency[call.layer][call.ids] == RESIDENCY_RESIDENT
    surrogates = np.ones((ctx.n_layers, ctx.max_expert), np.bool_)  # every error is finite
    checked = validate_plan(plan, call.layer, call.ids, ctx.n_expert, surrogates)
    applied = apply_plan(
        tier, call.layer, call.ids, default_actions(hit) if checked is None else checked, plan
    )
    held = [(il, e) for il in range(n) for e in range(ctx.n_expert[il]) if tier.holds(il, e)]
    assert len(held) * EXPERT_BYTES <= (ctx.budget_bytes or 0)
    for e in call.ids[applied.actions == ACTION_DEVICE].tolist():
        assert tier.holds(call.layer, e)


@settings(max_examples=100, deadline=None)
@given(situations())
def test_exact_level_never_substitutes_even_with_surrogates_loaded(
    case: tuple[str, PolicyContext, HookCall],
) -> None:
    _, ctx, call = case
    plan = attached("spice:exact", ctx).decide(call)
    assert not (plan_actions(plan, call) == ACTION_SURROGATE).any()


# ---- behaviour ---------------------------------------------------------------------------


@pytest.mark.parametrize(("plan_every", "budget"), [(1, 6), (2, 12)])
def test_a_perfect_prediction_turns_into_hits(plan_every: int, budget: int) -> None:
    # planning every 2nd layer holds two layers' predictions at once: it needs the room
    n_layers, n_expert, k = 4, 8, 2
    predictor = ScriptedPredictor(n_expert)
    rng = np.random.default_rng(1)
    picks = [[rng.choice(n_expert, k, replace=False).tolist() for _ in range(n_layers)] for _ in range(20)]
    ctx = context(budget_experts=budget, n_layers=n_layers, n_expert=n_expert, k=k, predictor=predictor)
    policy = SpicePolicy(replace(spice_config("spice:exact"), plan_every=plan_every))
    policy.attach(ctx)
    drive = driver(policy, ctx)
    assert policy.plan_every == plan_every
    for token in picks:
        for il, ids in enumerate(token):
            predictor.future = {j: token[j] for j in range(n_layers)}
            drive.call(il, ids, np.ones((1, N_EMBD), np.float32))
    # every layer but each token's first is predicted from the one before and lands in time
    assert drive.outcomes.hits >= (len(picks) - 1) * (n_layers - 1) * k
    assert drive.prefetch_used > 0


def test_the_cross_layer_baseline_is_used_without_a_sidecar() -> None:
    routers = {il: np.eye(8, N_EMBD, dtype=np.float32) for il in range(4)}
    ctx = replace(context(budget_experts=8), router=lambda il: routers[il])
    policy = attached("spice:exact", ctx)
    residency = np.zeros((4, 8), np.int8)
    hidden = np.zeros((1, N_EMBD), np.float32)
    hidden[0, [3, 5]] = 5.0  # the next layers' routers all pick experts 3 and 5
    call = HookCall(
        0,
        hidden,
        np.full((1, 8), 0.125, np.float32),
        np.array([[0, 1]], np.int32),
        np.full((1, 2), 0.5, np.float32),
        None,
        residency,
    )
    plan = policy.decide(call)
    assert (1, 3) in plan.prefetch and (1, 5) in plan.prefetch


def test_stale_prefetches_are_cancelled() -> None:
    predictor = ScriptedPredictor(8)
    ctx = context(budget_experts=8, predictor=predictor)
    policy = attached("abl-c", ctx)  # next layer only: predictions for layer 1 made at layer 0
    residency = np.zeros((4, 8), np.int8)
    predictor.future = {1: [2, 3]}
    plan = policy.decide(hook_call(0, [[0, 1]], [0.5, 0.5], residency, 8))
    assert sorted(plan.prefetch) == [(1, 2), (1, 3)]
    residency[1, [2, 3]] = RESIDENCY_QUEUED  # still waiting for the bus
    predictor.future = {2: [4, 5]}
    # layer 1 runs them on the host rather than wait (emulated device): the copies are stale
    call = hook_call(1, [[2, 3]], [0.5, 0.5], residency, 8)
    plan = policy.decide(call)
    assert (plan_actions(plan, call) == ACTION_HOST).all()
    assert {(1, 2), (1, 3)} <= set(plan.evict)


def test_victims_are_the_experts_needed_last() -> None:
    predictor = ScriptedPredictor(8)
    ctx = context(budget_experts=4, predictor=predictor)
    policy = attached("abl-c", ctx)
    residency = np.zeros((4, 8), np.int8)
    residency[0, [6, 7]] = RESIDENCY_RESIDENT  # layer 0: just run, needed again last
    residency[3, [6, 7]] = RESIDENCY_RESIDENT  # layer 3: needed before layer 0 comes back
    predictor.future = {2: [0, 1]}
    plan = policy.decide(hook_call(1, [[4, 5]], [0.5, 0.5], residency, 8))
    assert sorted(plan.prefetch) == [(2, 0), (2, 1)]
    # room comes from the layers needed last first: 1 (just run), then 0, then 3; not 2,
    # the horizon itself
    assert tuple(plan.evict_from) == (1, 0, 3)
    drive = driver(policy, ctx)
    place(drive, 0, [6, 7])
    place(drive, 3, [6, 7])
    drive.call(1, [4, 5])
    drive.tier.poll()  # the prefetches have landed by the next call
    states = drive.tier.states()
    assert states[2, [0, 1]].tolist() == [RESIDENCY_RESIDENT] * 2
    assert states[0, [6, 7]].tolist() == [RESIDENCY_ABSENT] * 2  # layer 1 held nothing
    assert states[3, [6, 7]].tolist() == [RESIDENCY_RESIDENT] * 2


def test_among_equals_the_least_recently_selected_expert_goes_first() -> None:
    predictor = ScriptedPredictor(8)
    ctx = context(budget_experts=4, predictor=predictor)
    policy = attached("abl-c", ctx)
    drive = driver(policy, ctx)
    place(drive, 0, [2, 3, 4])  # and one slot free
    predictor.future = {}
    drive.call(0, [3, 4])
    drive.call(0, [4, 2])  # now 3 is the least recently selected
    predictor.future = {2: [0, 1]}
    drive.call(1, [5, 6])  # two prefetches: the free slot, then 3's
    drive.tier.poll()  # the prefetches have landed by the next call
    states = drive.tier.states()
    assert states[0].tolist()[2:5] == [RESIDENCY_RESIDENT, RESIDENCY_ABSENT, RESIDENCY_RESIDENT]
    assert states[2, [0, 1]].tolist() == [RESIDENCY_RESIDENT] * 2


def test_emulated_device_runs_misses_on_the_host() -> None:
    ctx = context(budget_experts=8, prof=profile(12.0, 5.0, 5.0, emulated=True))
    policy = attached("spice:exact", ctx)
    call = hook_call(0, [[0, 1]], [0.5, 0.5], np.zeros((4, 8), np.int8), 8)
    plan = policy.decide(call)
    assert plan.fetch == [] and (plan_actions(plan, call) == ACTION_HOST).all()


def test_cheap_copies_are_fetched_on_a_real_device() -> None:
    # 1000-byte experts over a fast bus cost ~1 us to copy; the host needs 50 us, the device 1
    ctx = context(budget_experts=8, prof=profile(64.0, 50.0, 1.0, emulated=False))
    policy = attached("spice:exact", ctx)
    plan = policy.decide(hook_call(0, [[0, 1]], [0.5, 0.5], np.zeros((4, 8), np.int8), 8))
    assert sorted(plan.fetch) == [0, 1] and (np.asarray(plan.actions) == ACTION_DEVICE).all()


def test_ablation_a_fetches_every_miss_and_b_none() -> None:
    ctx = context(budget_experts=8, prof=profile(12.0, 5.0, 5.0, emulated=True))
    call = hook_call(0, [[0, 1]], [0.5, 0.5], np.zeros((4, 8), np.int8), 8)
    assert sorted(attached("abl-a", ctx).decide(call).fetch) == [0, 1]
    assert attached("abl-b", ctx).decide(call).fetch == []


def test_lossy_levels_substitute_only_low_weight_misses_with_good_surrogates() -> None:
    errors = np.array([0.1, 0.1, 0.95, 0.1, 0.1, 0.1, 0.1, 0.1], np.float32)
    ctx = context(budget_experts=8, errors=lambda il: errors)
    residency = np.zeros((4, 8), np.int8)
    residency[0, 3] = RESIDENCY_RESIDENT
    # expert 0: low weight, good surrogate -> substituted; 1: high weight; 2: bad surrogate;
    # 3: resident, never substituted
    call = hook_call(0, [[0, 1, 2, 3]], [0.01, 0.9, 0.01, 0.01], residency, 8)
    actions = np.asarray(attached("spice:fast", ctx).decide(call).actions)[0]
    assert actions.tolist() == [ACTION_SURROGATE, ACTION_HOST, ACTION_HOST, ACTION_DEVICE]
    assert not (np.asarray(attached("spice:exact", ctx).decide(call).actions) == ACTION_SURROGATE).any()


def test_a_lossy_level_without_surrogates_says_so_and_stays_exact(capsys: pytest.CaptureFixture[str]) -> None:
    policy = attached("spice:balanced", context(budget_experts=8))
    assert "no surrogates loaded" in capsys.readouterr().err
    plan = policy.decide(hook_call(0, [[0, 1]], [0.01, 0.01], np.zeros((4, 8), np.int8), 8))
    assert not (np.asarray(plan.actions) == ACTION_SURROGATE).any()


def test_h_min_follows_the_transfer_cost() -> None:
    slow_bus = CostModel.from_context(context(8, prof=profile(0.001, 5.0, 5.0, emulated=False)))
    fast_bus = CostModel.from_context(context(8, prof=profile(1000.0, 5.0, 5.0, emulated=False)))
    # eq. 4: P * M_e / (B * T_comp): a 1 MB/s bus needs many layers of warning, a fast one one
    assert slow_bus.h_min(0, 2, 2) > 1 and fast_bus.h_min(0, 2, 2) == 1


def test_the_cost_model_keys_the_hosts_batch_costs_by_one_experts_tokens() -> None:
    """`pyspice probe` measures a batch of n tokens: a layer's expert time over its
    activations, where each expert runs about n x k / E of them. A decision weighs one
    expert's tokens, so the table is re-keyed: with k = 2 of E = 8, the 32-token batch's
    cost per activation is that of an expert running 8 tokens; an 8-token batch (2 per
    expert) adds a point, a 2-token one (under 1 each) none."""
    from pyspice.policy.spice.cost import per_expert_points

    batches = [(1, 10.0), (2, 9.5), (8, 6.0), (32, 2.0)]
    assert per_expert_points(batches, 2 / 8) == ((1, 10.0), (2, 6.0), (8, 2.0))
    prof = replace(
        profile(12.0, 10.0, 1.0, emulated=False),
        batches=[BatchCost(tokens=n, expert_us=us, rest_us_per_layer=50.0) for n, us in batches],
    )
    cost = CostModel.from_context(context(8, prof=prof))
    assert cost.host_us(1) == 10.0  # a decode step's expert, as measured at batch 1
    assert cost.host_us(8) == 8 * 2.0  # 8 tokens of one expert: the 32-token batch's rate
    assert cost.host_us(5) == pytest.approx(5 * (6.0 + (2.0 - 6.0) * 3 / 6))


def test_decode_steps_plan_at_every_other_layer_and_run_the_default_plan_between() -> None:
    predictor = ScriptedPredictor(8)
    predictor.future = {il: [il, il + 1] for il in range(4)}
    ctx = context(budget_experts=16, predictor=predictor, prof=profile(12.0, 5.0, 5.0, emulated=True))
    policy = SpicePolicy(replace(spice_config("spice:exact"), plan_every=2))
    policy.attach(ctx)
    assert policy.plan_every == 2
    residency = np.zeros((4, 8), np.int8)
    residency[1, 5] = RESIDENCY_RESIDENT
    first = policy.decide(hook_call(0, [[0, 1]], [0.5, 0.5], residency, 8))
    # layer 0 plans for at least layers 1 and 2 (the next plan is at layer 2)
    assert {(1, 1), (1, 2), (2, 2), (2, 3)} <= set(first.prefetch)
    # ... and lets the engine skip the call in between (its answer is the default plan)
    assert first.resume_layer == 2
    between = policy.decide(hook_call(1, [[5, 6]], [0.5, 0.5], residency, 8))
    assert between.actions is None and not between.prefetch and not between.evict and not between.fetch
    last = policy.decide(hook_call(2, [[0, 1]], [0.5, 0.5], residency, 8))
    assert last.prefetch and last.resume_layer == 0  # the next token's first layer plans


def test_next_layer_ablations_and_lossy_levels_decide_every_step() -> None:
    predictor = ScriptedPredictor(8)
    predictor.future = {il: [il, il + 1] for il in range(4)}
    errors = np.full(8, 0.1, np.float32)
    ctx = context(budget_experts=16, predictor=predictor, errors=lambda il: errors)
    residency = np.zeros((4, 8), np.int8)
    # abl-c predicts the next layer only: it plans at every layer
    nxt = attached("abl-c", ctx).decide(hook_call(1, [[5, 6]], [0.5, 0.5], residency, 8))
    assert nxt.prefetch and nxt.resume_layer == -1
    # a lossy level still substitutes on a layer that does not plan, so no call is skipped
    fast = attached("spice:fast", ctx)
    assert fast.decide(hook_call(0, [[0, 1]], [0.5, 0.5], residency, 8)).resume_layer == -1
    plan = fast.decide(hook_call(1, [[5, 6]], [0.01, 0.5], residency, 8))
    assert plan.actions is not None and not plan.prefetch
    assert np.asarray(plan.actions).tolist() == [[ACTION_SURROGATE, ACTION_HOST]]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 12),
    st.integers(1, 3),
    st.integers(0, 3),
    st.sampled_from([0.05, 0.3, 0.6, 0.9]),
    st.integers(0, 2**31),
)
def test_look_ahead_is_algorithm_1(n_expert: int, h_min: int, extra: int, tau: float, seed: int) -> None:
    """The decode look-ahead equals a direct reading of Algorithm 1: softmax of each
    predicted layer, top-k by probability, H_min layers, then deeper while the top-k
    mass stays >= tau, at most H_max."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, n_expert + 1))
    h_max = h_min + extra
    scale = rng.uniform(0.1, 4)
    logits = {il: (rng.standard_normal(n_expert) * scale).astype(np.float32) for il in range(1, 9)}

    class Fixed:
        def rollout_logits(self, layer: int, hidden: Any, depth: int) -> list[tuple[int, Any]]:
            return [(il, logits[il]) for il in range(layer + 1, min(9, layer + 1 + depth))]

    probs = {il: np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum() for il, lg in logits.items()}
    mass = {il: float(np.sort(p)[::-1][:k].sum()) for il, p in probs.items()}
    assume(all(abs(m - tau) > 1e-5 for m in mass.values()))  # no ties with tau up to rounding
    got = look_ahead(Fixed(), 0, np.zeros(N_EMBD, np.float32), k, h_min, h_max, tau)
    depth = h_min
    if h_max > h_min and mass[h_min] >= tau:
        while depth < h_max and mass[depth + 1] >= tau:
            depth += 1
    assert got.layers == list(range(1, depth + 1))
    for il, experts in zip(got.layers, got.experts, strict=True):
        assert len(experts) == k and len(set(experts)) == k
        ranked = probs[il][experts]
        assert (np.diff(ranked) <= 1e-7).all()  # most probable first
        assert ranked.min() >= np.sort(probs[il])[::-1][k - 1] - 1e-7  # the top k


def test_a_tight_budget_plans_at_every_layer() -> None:
    # 2 experts chosen per layer: planning every e-th layer keeps e + 1 layers' worth on the
    # device at once, which the budget must hold twice over: 4 * 2 * (e + 1) <= budget
    assert attached("spice:exact", context(budget_experts=11)).plan_every == 1
    assert attached("spice:exact", context(budget_experts=12)).plan_every == 2
    assert attached("spice:exact", context(budget_experts=19)).plan_every == 3
    assert attached("spice:exact", context(budget_experts=20)).plan_every == 4  # the default
    assert attached("abl-c", context(budget_experts=64)).plan_every == 1  # next layer only
    # surrogates' reserved bytes are not slots: 20 experts' budget less 1 reserved holds 19
    reserved = replace(context(budget_experts=20), reserved_bytes=EXPERT_BYTES)
    assert attached("spice:exact", reserved).plan_every == 3


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_late_plan_queues_the_layers_it_still_reaches_first(lag: int) -> None:
    """A plan applied `lag` MoE layers after its call reaches the layers within that
    distance only after they ran: their prefetches (for the next token) queue last, so
    a full queue holds the layers ahead instead (a prompt batch predicts nearly every
    expert of every layer: at lag 3 it once filled the queue with passed layers, and
    its hit rate fell from 0.82 to 0.07 on smolmoe-b at 50%)."""
    from pyspice.policy.spice.lookahead import NO_CONFIDENCE, Predictions
    from pyspice.policy.spice.planner import PrefetchPlanner

    ctx = context(budget_experts=32)
    planner = PrefetchPlanner(ctx, queue_max=4, lag=lag)
    pred = Predictions(layers=[1, 2, 3], experts=[[0, 1], [2, 3], [4, 5]], confidence=NO_CONFIDENCE)
    plan = planner.plan(0, pred, np.zeros((4, 8), np.int8), busy=[])
    order = {0: [1, 2, 3], 1: [2, 3, 1], 2: [3, 1, 2]}[lag]  # nearest first, the passed ones last
    assert [il for il, _ in plan.prefetch] == [il for il in order for _ in range(2)][:4]


@pytest.mark.parametrize(("lag", "room"), [(0, [0, 3, 2, 1]), (1, [1, 0, 3, 2]), (2, [2, 1, 0, 3])])
def test_a_late_plan_takes_room_from_the_layers_needed_last_where_it_lands(lag: int, room: list[int]) -> None:
    """evict_from lists the layers farthest first counted from the layer where the plan
    lands: `lag` layers on, the layer that landed it has run and is needed again last.
    Counted from the planning layer, the landing layer was listed last and never gave
    room (1-4% more TPOT in the simulator on the targets' sizes)."""
    from pyspice.policy.spice.lookahead import NO_CONFIDENCE, Predictions
    from pyspice.policy.spice.planner import PrefetchPlanner

    planner = PrefetchPlanner(context(budget_experts=32), queue_max=8, lag=lag)
    pred = Predictions(layers=[1, 2, 3], experts=[[0, 1], [2, 3], [4, 5]], confidence=NO_CONFIDENCE)
    plan = planner.plan(0, pred, np.zeros((4, 8), np.int8), busy=[])
    assert list(plan.evict_from) == room


def test_a_token_s_last_plan_prefetches_the_first_layer_s_most_picked_experts() -> None:
    """No look-ahead reaches the next token's first MoE layer: the token's last planning
    layer prefetches the experts that layer picked most lately (FirstLayerPrior), after
    what the look-ahead predicts; with first_layer_share 0 it does not."""
    predictor = ScriptedPredictor(8)
    predictor.future = {il: [il, il + 1] for il in range(4)}
    ctx = context(budget_experts=24, predictor=predictor, prof=profile(12.0, 5.0, 5.0, emulated=True))
    for share, expected in ((1.0, [(0, 6), (0, 3)]), (0.0, [])):
        policy = SpicePolicy(replace(spice_config("spice:exact"), plan_every=2, first_layer_share=share))
        policy.attach(ctx)
        residency = np.zeros((4, 8), np.int8)
        for ids in ([[3, 6]], [[6, 1]], [[6, 3]]):  # 6 three times, 3 twice, 1 once
            policy.decide(hook_call(0, ids, [0.5, 0.5], residency, 8))
        last = policy.decide(hook_call(2, [[0, 1]], [0.5, 0.5], residency, 8))
        assert set(last.prefetch[: len(last.prefetch) - len(expected)]) == {
            (3, 3),
            (3, 4),
        }  # look-ahead first
        assert [p for p in last.prefetch if p[0] == 0] == expected, share
        # the other planning layer is mid-token: the look-ahead alone
        mid = policy.decide(hook_call(0, [[6, 3]], [0.5, 0.5], residency, 8))
        assert all(p[0] != 0 for p in mid.prefetch)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_late_plan_prefetches_the_first_layer_from_a_layer_it_still_lands_within_the_token(
    lag: int,
) -> None:
    """A plan applied `lag` MoE layers late lands at the next token's first layer if it was
    made at the token's last one: the prior's prefetch then comes too late for that layer,
    which (the 4-layer DeepSeek-V2-Lite at 25%) then held nothing at all. The
    prior goes with the last planning layer whose plan lands within the token."""
    predictor = ScriptedPredictor(8)
    predictor.future = {il: [il, il + 1] for il in range(4)}
    ctx = context(budget_experts=24, predictor=predictor, prof=profile(12.0, 5.0, 5.0, emulated=True))
    policy = SpicePolicy(replace(spice_config("spice:exact"), plan_every=1, plan_every_async=1))
    policy.plan_lag = lag
    policy.attach(ctx)
    residency = np.zeros((4, 8), np.int8)
    for ids in ([[3, 6]], [[6, 1]], [[6, 3]]):  # the prior: 6, then 3
        policy.decide(hook_call(0, ids, [0.5, 0.5], residency, 8))
    with_prior = {
        il
        for il in (1, 2, 3)
        if (0, 6) in policy.decide(hook_call(il, [[0, 1]], [0.5, 0.5], residency, 8)).prefetch
    }
    assert with_prior == {3 - lag}
