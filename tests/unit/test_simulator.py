"""The discrete-event model: perfect prediction with room hides every copy; policies
run unchanged; the plan is applied as the engine applies it."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import (
    ACTION_DEVICE,
    RESIDENCY_RESIDENT,
    HookCall,
    Plan,
    PolicyContext,
    make_policy,
    policy_names,
    policy_spec,
)
from pyspice.sim.costs import Costs, interpolate
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import Workload

N_LAYERS, N_EXPERT, K = 4, 8, 2


def workload(tokens: int = 24, prompt: int = 4, seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    ids = np.stack(
        [[rng.choice(N_EXPERT, K, replace=False) for _ in range(N_LAYERS)] for _ in range(tokens)]
    ).astype(np.int32)
    return Workload.from_arrays(N_LAYERS, list(range(N_LAYERS)), N_EXPERT, ids, prompt_tokens=prompt)


def costs(**kw: object) -> Costs:
    base: dict[str, object] = dict(
        expert_bytes=(10_000,) * N_LAYERS,
        bus_gbps=10.0,  # 1 us + 1 us latency per copy
        bus_latency_us=1.0,
        rest_us=((1, 100.0), (4, 100.0)),
        device_expert_us=((1, 1.0),),
        host_expert_us=((1, 20.0),),
    )
    base.update(kw)
    return Costs(**base)  # type: ignore[arg-type]


class Oracle:
    """Prefetches exactly the experts the next call will use (perfect prediction)."""

    name = "oracle"

    def __init__(self, wl: Workload) -> None:
        self.sequence = [
            (c.layer, sorted({int(e) for e in c.ids.ravel()})) for s in wl.steps for c in s.calls
        ]
        self.i = 0

    def decide(self, call: HookCall) -> Plan:
        assert call.residency is not None
        nxt = self.sequence[self.i + 1] if self.i + 1 < len(self.sequence) else None
        self.i += 1
        prefetch = [(nxt[0], e) for e in nxt[1]] if nxt else []
        return Plan(actions=np.full(call.ids.shape, ACTION_DEVICE, np.int32), prefetch=prefetch)


def test_perfect_prediction_with_enough_budget_never_stalls() -> None:
    wl = workload()
    sim = Simulator(wl, costs(), budget_bytes=N_LAYERS * N_EXPERT * 10_000)
    result = sim.run("oracle", Oracle(wl), policy_us=5.0)
    assert result.stall_ms_per_token == 0.0
    assert result.misses == 0 and result.hit_rate == 1.0
    assert result.prefetch_used > 0
    # the same trace fetched on demand waits for every copy
    ondemand = sim.run("ondemand", make_policy("ondemand"), policy_us=5.0)
    assert ondemand.stall_ms_per_token > 0.0
    assert ondemand.tpot_ms > result.tpot_ms


def test_a_slow_bus_shows_as_stall_even_with_perfect_prediction() -> None:
    wl = workload()
    slow = costs(bus_gbps=0.01)  # 1 ms per copy, layers take 0.1 ms
    result = Simulator(wl, slow, budget_bytes=N_LAYERS * N_EXPERT * 10_000).run(
        "oracle", Oracle(wl), policy_us=5.0
    )
    assert result.stall_ms_per_token > 0.0


def test_host_policy_time_is_rest_plus_host_experts_plus_policy() -> None:
    wl = workload(prompt=0, tokens=3)
    result = Simulator(wl, costs(), budget_bytes=80_000).run("host", make_policy("host"), policy_us=7.0)
    per_layer_us = 100.0 + K * 20.0 + 7.0
    assert result.tpot_ms == pytest.approx(N_LAYERS * per_layer_us / 1e3)
    assert result.bytes_per_token == 0 and result.misses_host == 3 * N_LAYERS * K


def test_emulated_device_is_serial_and_real_device_overlaps() -> None:
    wl = workload(prompt=0, tokens=2)
    budget = N_LAYERS * N_EXPERT * 10_000

    class Half:
        name = "half"

        def decide(self, call: HookCall) -> Plan:
            actions = np.full(call.ids.shape, 1, np.int32)
            actions[:, 0] = ACTION_DEVICE
            return Plan(actions=actions)

    par = Simulator(wl, costs(), budget).run("half", Half(), policy_us=0.0)
    ser = Simulator(wl, costs(device_shares_host=True), budget).run("half", Half(), policy_us=0.0)
    assert ser.tpot_ms > par.tpot_ms


def test_a_failing_policy_falls_back_to_the_default_plan() -> None:
    class Broken:
        name = "broken"

        def decide(self, call: HookCall) -> Plan:
            raise ZeroDivisionError

    wl = workload(prompt=0, tokens=2)
    result = Simulator(wl, costs(), 80_000).run("broken", Broken(), policy_us=1.0)
    assert result.policy_fallbacks == 2 * N_LAYERS
    assert result.misses_host == result.activations


def test_policies_get_the_engine_context() -> None:
    seen: list[PolicyContext] = []

    class Spy:
        name = "spy"

        def attach(self, ctx: PolicyContext) -> None:
            seen.append(ctx)

        def decide(self, call: HookCall) -> Plan:
            return Plan()

    wl = workload(prompt=0, tokens=1)
    Simulator(wl, costs(), 123_456).run("spy", Spy(), policy_us=0.0)
    assert seen[0].budget_bytes == 123_456
    assert seen[0].expert_bytes == (10_000,) * N_LAYERS
    assert seen[0].n_expert_used == K


def test_every_python_and_rule_policy_of_the_registry_runs_in_the_simulator() -> None:
    rng = np.random.default_rng(2)
    base = workload()
    n_tok = sum(s.n_tokens for s in base.steps)
    ids = np.concatenate([np.stack([c.ids for c in s.calls], axis=1) for s in base.steps])
    hidden = rng.standard_normal((n_tok, N_LAYERS, 16)).astype(np.float32)
    probs = rng.random((n_tok, N_LAYERS, N_EXPERT)).astype(np.float32)
    wl = Workload.from_arrays(
        N_LAYERS, list(range(N_LAYERS)), N_EXPERT, ids, probs=probs, hidden=hidden, prompt_tokens=4
    )
    routers = {il: rng.standard_normal((N_EXPERT, 16)).astype(np.float32) for il in range(N_LAYERS)}
    sim = Simulator(wl, costs(), budget_bytes=N_LAYERS * N_EXPERT * 10_000 // 4, router=routers.get)
    names = [n for n in policy_names() if policy_spec(n).kind in ("python", "rule")]
    assert {"host", "static", "ondemand", "lru", "adapmoe"} <= {
        n for n in names if policy_spec(n).kind == "rule"
    }
    for name in names:
        result = sim.run(name, make_policy(name))
        assert result.policy_fallbacks == 0, name
        assert result.activations == wl.decoded_tokens * N_LAYERS * K


def test_interpolation_is_log_linear_and_flat_outside() -> None:
    table = ((1, 10.0), (4, 4.0))
    assert interpolate(table, 1) == 10.0
    assert interpolate(table, 2) == pytest.approx(7.0)
    assert interpolate(table, 64) == 4.0


class FirstLayerOnly:
    """Asks to be called again only at layer 0: the other decode calls are decided in advance."""

    name = "first-layer-only"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def decide(self, call: HookCall) -> Plan:
        self.calls.append((call.layer, call.n_tokens))
        return Plan(resume_layer=0)


def test_decode_calls_decided_in_advance_are_not_made() -> None:
    wl = workload(tokens=10, prompt=4)
    policy = FirstLayerOnly()
    result = Simulator(wl, costs(), budget_bytes=None).run("first", policy)
    decode = [c for c in policy.calls if c[1] == 1]
    prompt = [c for c in policy.calls if c[1] > 1]
    assert prompt == [(il, 4) for il in range(N_LAYERS)]  # a batch always asks
    assert decode == [(0, 1)] * (10 - 4)  # one call per decoded token, at layer 0
    assert result.policy_fallbacks == 0


def test_a_resume_layer_that_is_no_moe_layer_falls_back() -> None:
    class Bad:
        name = "bad"

        def decide(self, call: HookCall) -> Plan:
            return Plan(resume_layer=N_LAYERS + 3)

    result = Simulator(workload(), costs(), budget_bytes=None).run("bad", Bad())
    assert result.policy_fallbacks > 0


class FirstCallResidency:
    """Records the residency table its first call sees, and decides nothing."""

    name = "first-call-residency"

    def __init__(self, preloads: bool) -> None:
        self.preloads_tier = preloads
        self.seen: np.ndarray | None = None

    def decide(self, call: HookCall) -> Plan:
        if self.seen is None and call.residency is not None:
            self.seen = call.residency.copy()
        return Plan()


def test_a_policy_that_preloads_starts_with_the_tier_filled_in_layer_order() -> None:
    """As the engine starts it (policy.base.preloads_tier, spice_runtime_preload): the
    first layers full, as far as the budget goes; a policy that does not say starts empty."""
    budget = 10 * 10_000  # 10 experts: layer 0's 8 and 2 of layer 1's
    warm, cold = FirstCallResidency(True), FirstCallResidency(False)
    for policy in (warm, cold):
        Simulator(workload(), costs(), budget).run(policy.name, policy, policy_us=0.0)
    assert warm.seen is not None and cold.seen is not None
    assert (warm.seen[0] == RESIDENCY_RESIDENT).all()
    assert [e for e in range(N_EXPERT) if warm.seen[1, e] == RESIDENCY_RESIDENT] == [0, 1]
    assert not (warm.seen[2:] == RESIDENCY_RESIDENT).any()
    assert not (cold.seen == RESIDENCY_RESIDENT).any()
    assert not make_policy("spice:exact").preloads_tier  # type: ignore[union-attr]  # off by default
    assert not getattr(make_policy("lru"), "preloads_tier", False)


def test_measured_copy_costs_charge_what_a_real_gpu_showed() -> None:
    """What the lent H200 measured (Costs.copy_issue_us, device_act_overhead_us,
    bus_host_slowdown; docs/results/gpu.md): the hook's thread pays for
    each copy it starts, a device activation costs more than its bytes, and host work
    slows while the bus copies. A policy that copies nothing pays none of the copy terms."""
    wl = workload(prompt=0, tokens=6)
    budget = N_LAYERS * N_EXPERT * 10_000

    def tpot(policy: str, **kw: object) -> float:
        return Simulator(wl, costs(**kw), budget).run(policy, make_policy(policy), policy_us=0.0).tpot_ms

    # ondemand copies every selection: 6 tokens x 4 layers x 2 experts, 10 us each
    issued = tpot("ondemand", copy_issue_us=10.0) - tpot("ondemand")
    assert issued == pytest.approx(N_LAYERS * K * 10.0 / 1e3)
    assert tpot("host", copy_issue_us=10.0) == tpot("host")  # no copies, no charge
    # every ondemand activation runs on the device: 50 us more each
    assert tpot("ondemand", device_act_overhead_us=50.0) - tpot("ondemand") == pytest.approx(
        N_LAYERS * K * 50.0 / 1e3
    )

    class HostWhileCopying:
        """Runs every miss on the host while prefetching the next layer's experts, so
        the bus is busy during host work."""

        name = "host-while-copying"

        def decide(self, call: HookCall) -> Plan:
            nxt = (call.layer + 1) % N_LAYERS
            return Plan(
                actions=np.full(call.ids.shape, 1, np.int32),
                prefetch=[(nxt, e) for e in range(N_EXPERT)],
                evict=[(call.layer, e) for e in range(N_EXPERT)],
            )

    slow_bus = costs(bus_gbps=0.1)  # 100 us a copy: the bus stays busy
    base = Simulator(wl, slow_bus, budget).run("p", HostWhileCopying(), policy_us=0.0).tpot_ms
    slowed = costs(bus_gbps=0.1, bus_host_slowdown=0.5)
    contended = Simulator(wl, slowed, budget).run("p", HostWhileCopying(), policy_us=0.0).tpot_ms
    assert contended > base
    assert tpot("host", bus_host_slowdown=0.5) == tpot("host")  # no copies, no contention


def test_a_repeated_run_counts_only_its_timed_decode_steps() -> None:
    """A bench row's runs in one process (workload.repeated): the later runs' prompts and
    the cold run's decode warm the tier but are no part of the decode's hits or bytes."""
    from pyspice.sim.workload import repeated

    once = workload(tokens=24, prompt=8)
    budget = N_LAYERS * 3 * 10_000  # 3 slots a layer: the prompt's batch evicts the decode's experts
    single = Simulator(once, costs(), budget_bytes=budget).run("lru", make_policy("lru"))
    thrice = Simulator(repeated(once, 3), costs(), budget_bytes=budget).run("lru", make_policy("lru"))
    decode_activations = once.decoded_tokens * N_LAYERS * K
    assert single.activations == decode_activations
    assert thrice.activations == 2 * decode_activations  # the two warm runs' decode steps only
    assert thrice.decoded_tokens == 2 * once.decoded_tokens
    # bytes per decoded token: the later prompts' copies are not charged to the decode
    per_miss = 10_000 * (thrice.misses_fetched / thrice.decoded_tokens)
    assert thrice.bytes_per_token == pytest.approx(per_miss, rel=0.01)
