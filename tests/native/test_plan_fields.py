"""What a plan tells the engine besides actions and copies:

- Plan.resume_layer (spice_policy_call.resume_il): a policy that decides the
  decode calls up to a later layer in advance is not called in between, the
  default plan runs there (exact), and a prompt batch always calls it;
- Plan.evict_from (spice_policy_call.evict_from): a prefetch that does not fit
  the budget takes room from the listed layers, the least recently selected
  resident expert first, never one the plan's prefetch list keeps; the output
  stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import RESIDENCY_ABSENT, RESIDENCY_RESIDENT, HookCall, Plan

from .golden import PROMPT, greedy_run, load, prompt_length

N_DECODE = 6


class ResumeAt:
    """Asks to be called again only at MoE layer `first` (the next token's, once there)."""

    name = "resume-at"

    def __init__(self, first: int) -> None:
        self.first = first
        self.calls: list[tuple[int, int]] = []

    def decide(self, call: HookCall) -> Plan:
        self.calls.append((call.layer, call.n_tokens))
        return Plan(resume_layer=self.first)


class MakeRoom:
    """Notes every call's selection; at the `step`-th decode call of layer `at` it
    prefetches one absent expert of layer `target`, room from layer `victims` (keeping
    the expert of it selected least recently when `keep_oldest`)."""

    name = "make-room"

    def __init__(self, at: int, target: int, victims: int, keep_oldest: bool, step: int) -> None:
        self.at, self.target, self.victims, self.keep_oldest = at, target, victims, keep_oldest
        self.step = step
        self.last_use: dict[tuple[int, int], int] = {}
        self.clock = 0
        self.before: np.ndarray | None = None
        self.kept: list[tuple[int, int]] = []
        self.expected = -1

    def oldest(self, residency: np.ndarray, exclude: set[int]) -> int:
        held = np.flatnonzero(residency[self.victims] == RESIDENCY_RESIDENT).tolist()
        return min((self.last_use.get((self.victims, e), 0), e) for e in held if e not in exclude)[1]

    def decide(self, call: HookCall) -> Plan:
        self.clock += 1
        for e in call.ids.ravel().tolist():
            self.last_use[(call.layer, e)] = self.clock
        if self.before is not None or call.n_tokens != 1 or call.layer != self.at:
            return Plan()
        self.step -= 1
        if self.step > 0:
            return Plan()
        assert call.residency is not None
        self.before = call.residency.copy()
        absent = np.flatnonzero(self.before[self.target] == RESIDENCY_ABSENT)
        prefetch = [(self.target, int(absent[0]))]
        if self.keep_oldest:
            self.kept = [(self.victims, self.oldest(self.before, set()))]
        # the engine's choice, by the recency as it is now (later calls change it)
        self.expected = self.oldest(self.before, {e for _, e in self.kept})
        return Plan(prefetch=prefetch + self.kept, evict_from=[self.victims])


@pytest.fixture(scope="module")
def model(synth_model):  # type: ignore[no-untyped-def]
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    ref = greedy_run(llm, "stock", n_decode=N_DECODE)
    yield llm, ref
    llm.close()


@pytest.mark.parametrize("keep_oldest", [False, True])
def test_room_comes_from_the_least_recently_selected_expert(model, keep_oldest: bool) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    moe = [info.il for info in llm.spice_layers() if info.is_moe]
    first, last = moe[0], moe[-1]
    # late in the run, when decode steps have ordered the experts' recency
    policy = MakeRoom(at=last, target=last, victims=first, keep_oldest=keep_oldest, step=N_DECODE - 1)
    llm.set_device("25%", 8.0, 5.0)
    llm.set_policy(policy)
    runtime = llm._spice_runtime
    assert runtime is not None
    runtime.preload()  # fills the tier in layer order: the first layer is full, the last empty
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    for _ in range(N_DECODE):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    assert np.array_equal(llm.scores[: llm.n_tokens], ref.logits)  # exact throughout
    assert policy.before is not None
    after = runtime.residency()
    assert after is not None
    gone = [
        e
        for e in range(after.shape[1])
        if policy.before[first, e] == RESIDENCY_RESIDENT and after[first, e] == RESIDENCY_ABSENT
    ]
    kept = {e for _, e in policy.kept}
    assert gone == [policy.expected]
    held = np.flatnonzero(policy.before[first] == RESIDENCY_RESIDENT).tolist()
    assert policy.expected != min(e for e in held if e not in kept)  # recency, not expert order, chose
    assert not kept & set(gone)
    assert llm.spice_stats()["policy_fallbacks"] == 0


def test_an_evict_from_layer_that_is_no_moe_layer_is_refused(model, capfd) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model

    class Bad:
        name = "bad-evict-from"

        def decide(self, call: HookCall) -> Plan:
            return Plan(evict_from=[99])

    got = greedy_run(llm, Bad(), n_decode=N_DECODE)
    assert np.array_equal(got.logits, ref.logits)
    assert got.stats["policy_fallbacks"] == got.stats["hook_calls"] > 0
    assert "evict_from[0] names layer 99, which is not an MoE layer" in capfd.readouterr().err


def test_calls_decided_in_advance_are_skipped_and_stay_exact(model) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    moe = [info.il for info in llm.spice_layers() if info.is_moe]
    policy = ResumeAt(moe[0])
    got = greedy_run(llm, policy, n_decode=N_DECODE)
    assert np.array_equal(got.logits, ref.logits)
    n_prompt = prompt_length(llm)
    assert [c for c in policy.calls if c[1] > 1] == [(il, n_prompt) for il in moe]  # a batch always asks
    assert [c for c in policy.calls if c[1] == 1] == [(moe[0], 1)] * N_DECODE  # once per token
    stats = got.stats
    assert stats["policy_fallbacks"] == 0
    quiet = N_DECODE * (len(moe) - 1)
    assert stats["policy_quiet_share"] == pytest.approx(quiet / stats["hook_calls"])


def test_without_resume_every_call_asks(model) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    policy = ResumeAt(-1)
    got = greedy_run(llm, policy, n_decode=N_DECODE)
    assert np.array_equal(got.logits, ref.logits)
    assert len(policy.calls) == got.stats["hook_calls"]
    assert got.stats["policy_quiet_share"] == 0.0
