"""Asynchronous planning (spice_runtime_enable_async): the policy on libspice's
planner thread, its plans applied at later hook calls by the hook's thread.

Deterministic mode applies the plan of call c exactly at call c + K and repeats
run to run; free-running mode drops plans older than the bound and counts them;
a policy raising on the planner thread leaves the calls to the rule, warned once;
disabling or closing joins the thread whatever it is doing."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pyspice.engine.planning import Planning
from pyspice.policy import HookCall, Plan
from pyspice.policy.base import RESIDENCY_ABSENT
from pyspice.policy.rule import DEFAULT_RULE, MISS_FETCH, Rule
from pyspice.policy.spice import SpicePolicy, spice_config
from pyspice.runtime import AsyncParams
from pyspice.sim.costs import Costs
from pyspice.sim.planner import AsyncModel
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import SimCall, SimStep, Workload

from .golden import PROMPT, greedy_run, load, prompt_length

N_DECODE = 8


@pytest.fixture(scope="module")
def model(synth_model: Any) -> Any:
    return synth_model("qwen2moe", "tiny", "Q8_0")


@pytest.fixture(scope="module")
def reference(model: Any) -> Any:
    llm = load(model)
    try:
        return greedy_run(llm, "stock", n_decode=N_DECODE)
    finally:
        llm.close()


class Targets:
    """Prefetches one new (layer, expert) per call for its first calls, and keeps the
    residency every snapshot showed: when a target stops being absent says at which
    call its plan was applied."""

    name = "targets"

    def __init__(self, n_targets: int, sleep_s: float = 0.0) -> None:
        self.n_targets = n_targets
        self.sleep_s = sleep_s
        self.seen: list[np.ndarray] = []
        self.finished = 0  # decide calls that came back from their sleep
        self.targets: list[tuple[int, int]] = []
        self.free: list[tuple[int, int]] = []
        self.calls: list[SimCall] = []  # what it was asked, for the simulator to replay

    def asynchronous_rule(self) -> Rule:
        return DEFAULT_RULE

    def decide(self, call: HookCall) -> Plan:
        residency = call.residency
        assert residency is not None
        self.calls.append(
            SimCall(call.layer, call.ids.copy(), call.weights.copy(), hidden=call.hidden.copy())
        )
        if not self.free:  # candidates: absent everywhere at the first call
            layers, experts = np.nonzero(residency == RESIDENCY_ABSENT)
            self.free = [(int(il), int(e)) for il, e in zip(layers, experts, strict=True)]
            self.free.reverse()
        self.seen.append(residency.copy())
        if self.sleep_s:
            time.sleep(self.sleep_s)
            self.finished += 1
        if len(self.targets) < self.n_targets:
            self.targets.append(self.free.pop())
            return Plan(prefetch=[self.targets[-1]])
        return Plan()


class Raises:
    name = "raises"

    def decide(self, call: HookCall) -> Plan:
        raise ValueError("planner bug")


def _fresh_tier(llm: Any, budget: str = "100%") -> Any:
    """An empty tier with a manual clock (copies land only when waited for) and the
    default rule; the engine's exact policy registered, to be replaced."""
    llm.set_device(budget, 8.0, 5.0, manual_clock=True)
    runtime = llm.spice_engine.runtime
    runtime.set_device(llm.spice_engine.device_params)  # empty: `exact` preloaded it
    runtime.set_rule(None)
    return runtime


def _decode(
    llm: Any, n: int, pause_s: float = 0.0, after_token: Callable[[int], None] | None = None
) -> list[int]:
    """The prompt, then n greedy tokens; after_token(i) runs once token i is decoded."""
    llm.reset()
    llm.spice_reset_stats()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    tokens = []
    for i in range(n):
        time.sleep(pause_s)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
        if after_token is not None:
            after_token(i)
    return tokens


@pytest.mark.parametrize("lag", [1, 3])
def test_deterministic_mode_applies_the_plan_of_call_c_at_call_c_plus_k(model: Any, lag: int) -> None:
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        policy = Targets(n_targets=6)
        runtime.enable_policy(policy, asynchronous=AsyncParams(deterministic_lag=lag))  # type: ignore[arg-type]
        assert runtime.is_async()
        _decode(llm, 3)
        runtime.disable()
        assert not runtime.is_async()
        for c, (il, e) in enumerate(policy.targets):
            # the snapshot of call c+K is posted once that call's plan, call c's, is applied
            states = [int(seen[il, e]) for seen in policy.seen]
            assert all(s == RESIDENCY_ABSENT for s in states[: c + lag]), (c, states)
            assert states[c + lag] != RESIDENCY_ABSENT, (c, states)
        stats = llm.spice_stats()["planning"]
        assert stats["applied"] > 0 and stats["stale"] == 0 and stats["skipped"] == 0
        assert stats["lag_layers"] == lag
    finally:
        llm.close()


def test_an_idle_planner_parks_at_once_unless_it_may_poll(model: Any, reference: Any) -> None:
    """AsyncParams.idle_poll: a planner without a core of its own parks as soon as it has
    nothing to do, so a post after an idle spell wakes it (counted); one allowed to poll
    sees posts that come within its polling time (5 ms) without being woken."""
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        for idle_poll in (False, True):
            runtime.enable_policy(Targets(n_targets=0), asynchronous=AsyncParams(idle_poll=idle_poll))  # type: ignore[arg-type]
            # 2 ms between tokens: far longer than a plan, well within the polling time
            tokens = _decode(llm, N_DECODE, pause_s=0.002)
            planning = llm.spice_stats()["planning"]
            assert tokens == reference.tokens[:N_DECODE]
            assert planning["posted"] > N_DECODE, planning
            if idle_poll:  # at most the first post (after the prompt's load) wakes it
                assert planning["wakes"] <= max(2, planning["posted"] // 4), planning
            else:  # each token's first post found it parked
                assert N_DECODE <= planning["wakes"] <= planning["posted"], planning
        runtime.disable()
    finally:
        llm.close()


def test_a_polling_planner_learns_the_gap_at_each_token_end(model: Any, reference: Any) -> None:
    """A polling planner polls for twice the longest recent gap between snapshots, not a
    fixed 5 ms: where a token's end (here a 12 ms pause) takes longer than that, only the
    first such gap parks it, and later tokens' first posts find it polling. With a fixed
    5 ms every token's first post woke it."""
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        runtime.enable_policy(Targets(n_targets=0), asynchronous=AsyncParams(idle_poll=True))  # type: ignore[arg-type]
        tokens = _decode(llm, N_DECODE, pause_s=0.012)
        planning = llm.spice_stats()["planning"]
        runtime.disable()
        assert tokens == reference.tokens[:N_DECODE]
        assert planning["posted"] > N_DECODE, planning
        # the prompt's load and the first 12 ms gap may each find it parked
        assert planning["wakes"] <= 3, planning
    finally:
        llm.close()


def test_deterministic_spice_is_lossless_and_repeats_run_to_run(model: Any, reference: Any) -> None:
    llm = load(model)
    try:
        llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        llm.spice_engine.set_planning(Planning(deterministic_lag=2))
        runs = [greedy_run(llm, name, n_decode=N_DECODE) for name in ("spice:exact", "abl-b", "spice:exact")]
        for got in runs:
            assert got.tokens == reference.tokens
            assert np.array_equal(got.logits, reference.logits)
            assert got.stats["policy_fallbacks"] == 0
        first, again = runs[0].stats, runs[2].stats
        assert first["planning"]["applied"] > 0 and first["planning"]["lag_layers"] == 2
        assert first["prefetch_issued"] > 0
        for key in ("hit_rate", "prefetch_issued", "prefetch_used", "bytes_per_token", "misses"):
            assert first[key] == again[key], key
        assert first["planning"]["applied"] == again["planning"]["applied"]
    finally:
        llm.close()


def test_deterministic_planning_runs_an_emulated_tier_on_a_virtual_clock(model: Any, reference: Any) -> None:
    """On the wall clock which copies have landed when a call comes -- and so, with lossy
    slots, the output -- varied between runs of the same deterministic command. With a
    deterministic lag the engine puts an emulated tier on a virtual clock that moves one
    modelled layer per hook call: the clock reads exactly calls x step after a run, and
    two runs agree in every residency-driven count. Free-running planning keeps real time."""
    from pyspice.engine.planning import virtual_layer_ns

    llm = load(model)
    try:
        llm.set_device("25%", 8.0, 5.0)  # real time, as a user's emulated tier
        engine = llm.spice_engine
        engine.set_planning(Planning(deterministic_lag=1))
        step = virtual_layer_ns(engine.policy_context())
        runtime = engine.require_runtime()
        lib = runtime._n.lib  # the tier's clock, read where the engine reads it

        def clock() -> int:
            return int(lib.spice_store_now(lib.spice_runtime_get_store(runtime._rt)))

        runs = []
        for _ in range(2):
            got = greedy_run(llm, "spice:exact", n_decode=N_DECODE)  # a new tier each run
            assert got.tokens == reference.tokens
            after = clock()
            time.sleep(0.01)
            assert clock() == after  # only the calls move it
            # a step per token of each call: the prompt's batch a step per prompt token
            n_moe = got.stats["hook_calls"] // (1 + N_DECODE)
            assert after >= n_moe * (prompt_length(llm) + N_DECODE) * step
            runs.append(got.stats)
        for key in ("hit_rate", "prefetch_issued", "prefetch_used", "misses", "bytes_per_token"):
            assert runs[0][key] == runs[1][key], key
        engine.set_planning(Planning(asynchronous=True))  # free-running: the wall clock again
        greedy_run(llm, "spice:exact", n_decode=1)
        before = clock()
        time.sleep(0.01)
        assert clock() - before >= 10_000_000
    finally:
        llm.close()


def test_free_running_spice_is_lossless(model: Any, reference: Any) -> None:
    llm = load(model)
    try:
        llm.set_device("50%", 8.0, 5.0)
        llm.spice_engine.set_planning(Planning(asynchronous=True))
        got = greedy_run(llm, "spice:exact", n_decode=N_DECODE)
        assert got.tokens == reference.tokens
        assert np.array_equal(got.logits, reference.logits)
        planning = got.stats["planning"]
        assert planning["asynchronous"] and planning["posted"] > 0
        assert planning["applied"] + planning["stale"] > 0
        assert llm.spice_engine.require_runtime().is_async()
        # a user's policy object plans inline unless it declares the rule the calls run by
        # while it plans (Targets, a SpicePolicy of the user's own thresholds) and the user
        # asked for asynchronous planning; by default it plans inline
        llm.set_policy(OutOfRange())  # type: ignore[arg-type]
        assert not llm.spice_engine.require_runtime().is_async()
        llm.set_policy(SpicePolicy(spice_config("spice:exact")))
        assert llm.spice_engine.require_runtime().is_async()
        llm.spice_engine.set_planning(Planning())
        llm.set_policy(SpicePolicy(spice_config("spice:exact")))
        assert not llm.spice_engine.require_runtime().is_async()
    finally:
        llm.close()


class Gated(Targets):
    """Holds its first plan until the test opens `gate`: the hook calls meanwhile find
    the planner busy, and that plan, once done, is older than any lag."""

    def __init__(self) -> None:
        super().__init__(n_targets=4)
        self.gate = threading.Event()
        self.first_done = threading.Event()

    def decide(self, call: HookCall) -> Plan:
        if not self.first_done.is_set():
            self.gate.wait(timeout=60.0)  # bounded: a broken test fails, it never hangs
        plan = super().decide(call)
        self.first_done.set()
        return plan


def test_stale_plans_are_dropped_and_counted(model: Any, reference: Any) -> None:
    """Free-running, a plan older than max_lag when it could be applied is dropped and
    counted, and a snapshot the planner has not started is replaced by a newer one.
    The first plan is held back by the test, not by a sleep, so neither depends on how
    fast this machine decodes."""
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        policy = Gated()
        runtime.enable_policy(policy, asynchronous=AsyncParams(max_lag=1))  # type: ignore[arg-type]

        def release_after_first_token(i: int) -> None:
            # the prompt's and the first token's calls were all posted while the planner was
            # held; the next token's calls find the first plan done, and many calls old
            if i == 0:
                policy.gate.set()
                assert policy.first_done.wait(timeout=60.0), "the planner never finished its first plan"

        tokens = _decode(llm, 3, after_token=release_after_first_token)
        runtime.disable()
        assert tokens == reference.tokens[:3]
        planning = llm.spice_stats()["planning"]
        assert planning["stale"] > 0
        assert planning["skipped"] > 0  # the planner was held: newer snapshots replaced queued ones
        assert planning["posted"] >= planning["applied"] + planning["stale"]
    finally:
        llm.close()


class Recorder(Targets):
    """Records each call's hidden and shared-expert rows; sleeps on odd calls when
    asked, so that the next snapshot comes while the planner is busy."""

    reads_shared = True

    def __init__(self, sleep_odd_s: float = 0.0) -> None:
        super().__init__(n_targets=0)
        self.sleep_odd_s = sleep_odd_s
        self.shared: list[np.ndarray] = []

    def decide(self, call: HookCall) -> Plan:
        plan = super().decide(call)
        assert call.shared is not None
        self.shared.append(call.shared.copy())
        if self.sleep_odd_s and len(self.calls) % 2:
            time.sleep(self.sleep_odd_s)
        return plan


@pytest.mark.parametrize("copier", ["planner", "hook"])
def test_the_planner_sees_each_calls_own_rows_whichever_thread_copies_them(model: Any, copier: str) -> None:
    """A post lends the call's hidden and shared-expert rows: the planner copies them
    while the call's experts run, or, when it is busy with an older snapshot, the
    hook's thread copies them before the call returns (counted). Either way the policy
    sees exactly what a synchronous policy sees at the same call."""
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        inline = Recorder()
        runtime.enable_policy(inline)  # type: ignore[arg-type]
        _decode(llm, 3)
        if copier == "planner":  # polls, and is idle whenever a call posts
            policy, params = Recorder(), AsyncParams(deterministic_lag=1, idle_poll=True)
        else:  # still planning call c - 1 when call c returns
            policy, params = Recorder(sleep_odd_s=0.002), AsyncParams(deterministic_lag=2)
        runtime.enable_policy(policy, asynchronous=params)  # type: ignore[arg-type]
        _decode(llm, 3)
        runtime.disable()
        planning = llm.spice_stats()["planning"]
        # the snapshots the planner had not taken when the hook waited for the last plan
        assert len(inline.calls) - 2 <= len(policy.calls) <= len(inline.calls)
        for c, got in enumerate(policy.calls):
            want = inline.calls[c]
            assert got.layer == want.layer, c
            assert np.array_equal(got.hidden, want.hidden), c
            assert np.array_equal(policy.shared[c], inline.shared[c]), c
        by_hook = planning["rows_by_hook"]
        if copier == "planner":
            assert by_hook < planning["posted"], planning
        else:
            assert by_hook >= planning["posted"] // 4, planning
    finally:
        llm.close()


def _decode_planning_badly(model: Any, reference: Any, capfd: Any, policy: Any) -> tuple[dict[str, Any], str]:
    """Decode with `policy` planning on the planner thread, none of whose plans is used:
    the tokens stay the reference's and every call falls back to the rule. Returns the
    stats and what was printed."""
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        runtime.enable_policy(policy, asynchronous=AsyncParams(deterministic_lag=1))
        tokens = _decode(llm, N_DECODE)
        runtime.report_rejections()
        assert tokens == reference.tokens
        stats = llm.spice_stats()
        assert stats["policy_fallbacks"] > 1 and stats["planning"]["applied"] == 0
        return stats, capfd.readouterr().err
    finally:
        llm.close()


def test_a_policy_raising_on_the_planner_thread_falls_back_to_the_rule_warned_once(
    model: Any, reference: Any, capfd: Any
) -> None:
    _, err = _decode_planning_badly(model, reference, capfd, Raises())
    assert err.count("planner bug") == 1, err
    assert "the calls run by the policy's rule" in err
    assert "a plan was rejected" not in err  # one warning, not two


class OutOfRange:
    """Asks for a copy of an expert the layer does not have."""

    name = "out-of-range"

    def decide(self, call: HookCall) -> Plan:
        return Plan(prefetch=[(call.layer, 10_000)])


def test_an_invalid_plan_is_checked_on_the_planner_thread_and_dropped_named(
    model: Any, reference: Any, capfd: Any
) -> None:
    """The planner thread checks each plan (spice_plan_check); the hook's thread drops an
    invalid one, counts it, and the warning names the problem as a synchronous
    rejection's does."""
    stats, err = _decode_planning_badly(model, reference, capfd, OutOfRange())
    assert stats["prefetch_issued"] == 0
    assert err.count("a plan was rejected") == 1, err
    assert "names expert 10000" in err, err


def test_disable_and_close_join_the_planner_mid_plan(model: Any) -> None:
    llm = load(model)
    runtime = _fresh_tier(llm)

    def mid_plan(policy: Targets) -> None:
        deadline = time.monotonic() + 5.0
        while not policy.seen and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL: the planner enters decide and sleeps there
        assert policy.seen, "the planner never called the policy"

    first = Targets(n_targets=0, sleep_s=0.3)
    runtime.enable_policy(first, asynchronous=AsyncParams(max_lag=4))  # type: ignore[arg-type]
    llm.eval(llm.tokenize(b"Hello", add_bos=True))  # posts; the planner sleeps in decide
    mid_plan(first)
    start = time.monotonic()
    second = Targets(n_targets=0, sleep_s=0.3)
    runtime.enable_policy(second, asynchronous=AsyncParams(max_lag=4))  # restart: joins the first
    # waited for the plan in progress: every decide that started came back (timing the
    # wait instead failed on a loaded machine, where this thread saw `seen` late)
    assert first.finished == len(first.seen)
    llm.eval([100])
    mid_plan(second)
    llm.close()  # joins the planner in the middle of its sleep
    assert time.monotonic() - start < 5.0


def test_the_simulator_applies_plans_at_the_calls_libspice_does(model: Any) -> None:
    """Differential: the same calls through libspice's planner (deterministic mode) and
    the simulator's model of it, the same policy -- every snapshot shows the same
    experts on their way or resident."""
    lag = 2
    llm = load(model)
    try:
        runtime = _fresh_tier(llm)
        native = Targets(n_targets=8)
        runtime.enable_policy(native, asynchronous=AsyncParams(deterministic_lag=lag))  # type: ignore[arg-type]
        _decode(llm, 3)
        runtime.disable()
        layers = llm.spice_layers()
    finally:
        llm.close()
    n_expert = tuple(info.n_expert if info.is_moe else 0 for info in layers)
    workload = Workload(len(layers), n_expert, native.calls[0].ids.shape[1], native.calls[0].hidden.shape[1])
    for c in native.calls:  # a pass from the first MoE layer on is one step
        if not workload.steps or c.layer <= workload.steps[-1].calls[-1].layer:
            workload.steps.append(SimStep([], decode=c.n_tokens == 1))
        workload.steps[-1].calls.append(c)
    costs = Costs(
        expert_bytes=tuple(info.bytes_per_expert for info in layers),
        bus_gbps=8.0,
        bus_latency_us=5.0,
        rest_us=((1, 50.0),),
        device_expert_us=((1, 1.0),),
        host_expert_us=((1, 5.0),),
    )
    twin = Targets(n_targets=8)
    result = Simulator(workload, costs, budget_bytes=10**12).run(
        "twin", twin, asynchronous=AsyncModel(deterministic_lag=lag)
    )
    assert twin.targets == native.targets
    # libspice's planner also plans the last `lag` snapshots, whose plans no call is left to
    # use; the model plans a snapshot only when a call needs its plan
    assert 0 <= len(native.seen) - len(twin.seen) <= lag and len(twin.seen) > 8 + lag
    for i, (a, b) in enumerate(zip(native.seen, twin.seen, strict=False)):
        assert np.array_equal(a != RESIDENCY_ABSENT, b != RESIDENCY_ABSENT), i
    assert result.plan_lag_layers == lag


class FetchRule:
    """Installs a rule that fetches every miss (Plan.rule, the same object each time);
    decides each decode step at its first MoE layer only (resume_layer), so the engine
    plans the other calls by the rule."""

    name = "fetch-rule"

    def __init__(self, first_moe: int, install: bool = True) -> None:
        self.rule = Rule(miss=MISS_FETCH) if install else None
        self.first_moe = first_moe

    def decide(self, call: HookCall) -> Plan:
        return Plan(rule=self.rule, resume_layer=self.first_moe if call.n_tokens == 1 else -1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_plan_installs_a_rule_for_the_calls_the_engine_plans(
    model: Any, reference: Any, asynchronous: bool
) -> None:
    llm = load(model)
    try:
        first = next(info.il for info in llm.spice_layers() if info.is_moe)
        fetched = {}
        for install in (False, True):
            runtime = _fresh_tier(llm, "50%")
            params = AsyncParams(deterministic_lag=1) if asynchronous else None
            runtime.enable_policy(FetchRule(first, install), asynchronous=params)  # type: ignore[arg-type]
            tokens = _decode(llm, N_DECODE)
            runtime.disable()
            assert tokens == reference.tokens
            stats = llm.spice_stats()
            assert stats["policy_fallbacks"] == 0
            fetched[install] = stats["misses"]["fetched"]
        assert fetched[False] == 0 and fetched[True] > 0
    finally:
        llm.close()


def test_ctrl_c_stops_generation_planning_asynchronously(model: Any) -> None:
    """The hook never enters Python when asynchronous, so Ctrl-C is seen as the decode
    step returns: generation stops within a step, the planner joined on the way out."""
    argv = [
        sys.executable, "-m", "pyspice", "generate", "-m", str(model), "-p", "Once upon a time",
        "-n", "60000", "-c", "65536", "--temp", "0", "-t", "1", "--policy", "spice:exact",
        "--planning", "async", "--device-budget", "25%",
    ]  # fmt: skip
    # a child of a non-interactive shell may start with SIGINT ignored: restore the default
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(4.0)  # loaded (about a second) and decoding (60000 tokens take minutes)
        assert proc.poll() is None, "finished before the SIGINT"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10.0)
        assert time.monotonic() - sent < 5.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    assert "pyspice: interrupted" in err


def test_deciding_time_is_split_into_its_parts(model: Any, reference: Any) -> None:
    """policy_ns by part (deciding time): the rule's planning, and asynchronous
    planning's taking plans and an entry, and posting snapshots; the rest is merging
    plan lists. A row with no policy decides by the rule alone."""
    llm = load(model)
    try:
        llm.set_device("50%", 8.0, 5.0)
        exact = greedy_run(llm, "exact", n_decode=N_DECODE).stats
        part = exact["per_call"]
        assert part["rule_us"] > 0 and part["take_us"] == 0 and part["post_us"] == 0
        assert part["rule_us"] == pytest.approx(exact["policy_us_per_call"], rel=1e-9)

        llm.spice_engine.set_planning(Planning(asynchronous=True))
        spice = greedy_run(llm, "spice:exact", n_decode=N_DECODE).stats
        part = spice["per_call"]
        assert part["rule_us"] > 0 and part["take_us"] > 0 and part["post_us"] > 0
        assert part["rule_us"] + part["take_us"] + part["post_us"] <= spice["policy_us_per_call"] * (1 + 1e-9)
    finally:
        llm.close()
