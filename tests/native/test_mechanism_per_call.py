"""What the mechanism does per hook call, seen from a real model under the engine:

- residency is current at every policy call: a policy sees the copy it asked
  for in flight (COPYING) on a slow emulated bus, then resident -- also
  through the HookCall the engine reuses from one decode step to the next;
- a steady-state decode call polls the device once and makes no more device
  operations than its plan asked for (copies started = copies asked for,
  waits at most the demand fetches, launches and collections at most one);
- the per-call counters reach the stats record.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import (
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
    HookCall,
    Plan,
)

from .golden import PROMPT, AllDevice, greedy_run, load

N_DECODE = 8
MAX_DECODE = 200  # the context holds the prompt and this many tokens


class WatchOneCopy:
    """At the first decode call of layer `at`, prefetches an absent expert of layer
    `target` that the call does not run; then notes that expert's residency at every
    later call, as the HookCall carries it."""

    name = "watch-one-copy"

    def __init__(self, at: int, target: int) -> None:
        self.at, self.target = at, target
        self.watched: tuple[int, int] | None = None
        self.seen: list[int] = []

    def decide(self, call: HookCall) -> Plan:
        residency = call.residency
        assert residency is not None
        if self.watched is not None:
            self.seen.append(int(residency[self.watched]))
            return Plan()
        if call.n_tokens != 1 or call.layer != self.at:
            return Plan()
        absent = np.flatnonzero(residency[self.target] == RESIDENCY_ABSENT).tolist()
        e = next(e for e in absent if e not in call.ids.ravel().tolist())
        self.watched = (self.target, e)
        return Plan(prefetch=[self.watched])


@pytest.fixture(scope="module")
def llm(synth_model):  # type: ignore[no-untyped-def]
    model = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    yield model
    model.close()


def test_a_policy_sees_its_copy_in_flight_then_resident(llm) -> None:  # type: ignore[no-untyped-def]
    moe = [info.il for info in llm.spice_layers() if info.is_moe]
    expert_bytes = llm.spice_layers()[moe[-1]].bytes_per_expert
    # a bus slow enough that the copy spans many hook calls: 20 ms for one expert
    llm.set_device("50%", expert_bytes / 20e6, 10.0)
    policy = WatchOneCopy(at=moe[0], target=moe[-1])
    llm.set_policy(policy)
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    for _ in range(MAX_DECODE):  # decode until the policy has seen the copy land
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        if RESIDENCY_RESIDENT in policy.seen:
            break
    seen = policy.seen
    assert RESIDENCY_COPYING in seen, f"never saw the copy in flight: {seen}"
    assert RESIDENCY_RESIDENT in seen, f"never saw it land in {MAX_DECODE} tokens: {seen}"
    first_resident = seen.index(RESIDENCY_RESIDENT)
    assert all(s == RESIDENCY_COPYING for s in seen[:first_resident]), seen  # started at once on an idle bus
    assert RESIDENCY_QUEUED not in seen


def test_steady_state_decode_makes_only_the_device_operations_the_plan_asked_for(llm) -> None:  # type: ignore[no-untyped-def]
    llm.set_device("25%", 8.0, 5.0)
    run = greedy_run(llm, AllDevice(), n_decode=N_DECODE)  # every miss is a demand fetch
    assert run.stats["policy_fallbacks"] == 0
    c = llm._spice_runtime.counters()  # type: ignore[union-attr]
    assert c.hook_calls > 0
    assert c.store_polls == c.hook_calls  # one poll per call, none per lookup
    assert c.device_launches <= c.hook_calls and c.device_collects == c.device_launches
    # every copy started was one the plans asked for: AllDevice asks for each miss
    moe = [info for info in llm.spice_layers() if info.is_moe]
    expert_bytes = moe[0].bytes_per_expert
    assert all(info.bytes_per_expert == expert_bytes for info in moe)
    assert c.device_copies * expert_bytes == c.bytes_h2d
    assert 0 < c.device_copies <= c.misses_fetched  # AllDevice: one demand copy per expert it misses
    assert c.device_waits <= c.device_copies
    if not llm._spice_runtime.device_is_real():  # type: ignore[union-attr]
        assert c.device_launches == 0 and c.launch_ns == 0 and c.collect_ns == 0  # the host computes
    per_call = run.stats["per_call"]
    assert per_call["polls"] == pytest.approx(1.0)
    assert per_call["hook_us"] > 0 and per_call["gap_us"] > 0
    assert per_call["copies"] == pytest.approx(c.device_copies / c.hook_calls)
