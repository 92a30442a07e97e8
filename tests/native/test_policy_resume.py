"""Plan.resume_layer (spice_policy_call.resume_il): a policy that decides the decode
calls up to a later layer in advance is not called in between, the default plan
runs there (exact), and a prompt batch always calls it."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import HookCall, Plan

from .golden import greedy_run, load, prompt_length

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


@pytest.fixture(scope="module")
def model(synth_model):  # type: ignore[no-untyped-def]
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    ref = greedy_run(llm, "stock", n_decode=N_DECODE)
    yield llm, ref
    llm.close()


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
