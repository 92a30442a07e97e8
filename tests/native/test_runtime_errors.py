"""Failure handling (docs/design.md section 6, issue acceptance): bad policies, bad plans,
Ctrl-C, a dense model, a model loaded with settings the hook cannot use."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from pyspice.api import Llama
from pyspice.policy import ACTION_SURROGATE, HookCall, Plan
from pyspice.runtime import IncompatibleModelError, Runtime

from .dense_model import write_dense_llama
from .golden import greedy_run, load


class Raises:
    name = "raises"

    def decide(self, call: HookCall) -> Plan:
        raise ZeroDivisionError("policy bug")


class BadPlan:
    def __init__(self, plan_for: object) -> None:
        self.name = "bad-plan"
        self.plan_for = plan_for

    def decide(self, call: HookCall) -> Plan:
        return self.plan_for(call)  # type: ignore[operator, no-any-return]


class InterruptAfter:
    """Raises KeyboardInterrupt on its n-th call, as Ctrl-C would inside a policy."""

    name = "interrupt"

    def __init__(self, n: int) -> None:
        self.calls = 0
        self.n = n

    def decide(self, call: HookCall) -> Plan:
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return Plan()


@pytest.fixture(scope="module")
def model(synth_model):  # type: ignore[no-untyped-def]
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    ref = greedy_run(llm, "stock", n_decode=8)
    yield llm, ref
    llm.close()


def test_a_raising_policy_falls_back_to_exact_and_warns_once(model, capfd) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    got = greedy_run(llm, Raises(), n_decode=8)
    assert np.array_equal(got.logits, ref.logits)
    assert got.stats["policy_fallbacks"] == got.stats["hook_calls"] > 0
    err = capfd.readouterr().err
    assert err.count("raised ZeroDivisionError: policy bug") == 1


PLANS = {
    "wrong shape": (lambda c: Plan(actions=np.zeros((c.n_tokens, c.n_expert_used + 1), np.int32)), "shape"),
    "unknown action": (
        lambda c: Plan(actions=np.full((c.n_tokens, c.n_expert_used), 9, np.int32)),
        "not a known action",
    ),
    "float actions": (
        lambda c: Plan(actions=np.zeros((c.n_tokens, c.n_expert_used), np.float32)),
        "integers",
    ),
    # range-checked before any cast: int32 would wrap 2**32 + 3 to 3 (DROP), silently
    "action beyond int32 (lists)": (
        lambda c: Plan(actions=[[2**32 + 3] * c.n_expert_used for _ in range(c.n_tokens)]),
        "not an action value",
    ),
    "action beyond int32 (int64 array)": (
        lambda c: Plan(actions=np.full((c.n_tokens, c.n_expert_used), 2**32 + 3, np.int64)),
        "not an action value",
    ),
    "action 2**40 (wraps to device)": (
        lambda c: Plan(actions=np.full((c.n_tokens, c.n_expert_used), 2**40, np.int64)),
        "not an action value",
    ),
    "fetch id beyond int32": (lambda c: Plan(fetch=[np.int64(2**32 + 1)]), "fit in int32"),
    "bad fetch id": (lambda c: Plan(fetch=[c.n_expert]), "is not an expert id"),
    "bad prefetch layer": (lambda c: Plan(prefetch=[(99, 0)]), "not an MoE layer"),
    "bad resume layer": (lambda c: Plan(resume_layer=99), "neither -1 nor an MoE layer"),
    "surrogate without sidecar": (
        lambda c: Plan(actions=np.full((c.n_tokens, c.n_expert_used), ACTION_SURROGATE, np.int32)),
        "no surrogates are loaded",
    ),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_an_invalid_plan_is_named_and_runs_exact(model, capfd, case: str) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    make_plan, words = PLANS[case]
    got = greedy_run(llm, BadPlan(make_plan), n_decode=8)
    assert np.array_equal(got.logits, ref.logits)
    assert got.stats["policy_fallbacks"] == got.stats["hook_calls"] > 0
    err = capfd.readouterr().err
    assert words in err
    assert err.count("pyspice:") == 1  # warned once, not once per call


def test_ctrl_c_in_a_policy_stops_the_decode_and_the_model_still_works(model) -> None:  # type: ignore[no-untyped-def]
    llm, ref = model
    policy = InterruptAfter(n=3)
    llm.set_policy(policy)
    llm.reset()
    prompt = llm.tokenize(b"Stop me if you can", add_bos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.eval(prompt)
    assert llm.n_tokens == 0  # the interrupted batch did not count
    # the next generation is unaffected: same as the reference
    again = greedy_run(llm, "exact", n_decode=8)
    assert np.array_equal(again.logits, ref.logits)


def test_the_hook_on_a_dense_model_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write_dense_llama(tmp_path / "dense.gguf")
    # as the CLI resolves it (RunConfig.resolve): a dense model runs stock, and says so
    said: list[str] = []
    llm = Llama(str(path), policy="exact", n_ctx=64, verbose=False, spice_note=said.append)
    assert llm.spice_policy == "stock" and any("dense" in line and "'stock'" in line for line in said)
    llm.close()
    # stock works on it: pyspice.Llama stays a drop-in llama_cpp.Llama
    llm = Llama(str(path), policy="stock", n_ctx=64, verbose=False)
    assert llm.create_completion("hi", max_tokens=2)["choices"]
    with pytest.raises(IncompatibleModelError, match="no MoE layers"):
        llm.set_policy("exact")
    llm.close()


def test_a_model_with_repacked_experts_is_refused(synth_model) -> None:  # type: ignore[no-untyped-def]
    """Plain llama_cpp.Llama lets the CPU backend repack Q4_0 (AVX2 and up): the hook cannot read that."""
    if not llama_cpp.llama_cpp._lib.ggml_cpu_has_avx2():
        pytest.skip("this CPU does not repack Q4_0")
    plain = llama_cpp.Llama(str(synth_model("qwen2moe", "tiny", "Q4_0")), n_ctx=64, verbose=False)
    try:
        address = ctypes.cast(plain._ctx.ctx, ctypes.c_void_p).value
        assert address is not None
        with pytest.raises(IncompatibleModelError, match="repacked"):
            Runtime(address)
    finally:
        plain.close()
