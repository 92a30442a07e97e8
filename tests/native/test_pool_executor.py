"""The slot-pool executor on every build: an emulated tier asked for the pool
executor lays its slots out as a CUDA tier's (kind regions, block-multiple
strides, a zero slot) and runs device pairs through the same persistent
mul_mat_id graphs, on ggml's CPU backend. Its rows must be bit-identical to
the host executor's, so whole decodes stay bit-identical to the reference,
and a steady-state decode call launches at most once and collects once."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pyspice.runtime import DecodeFailedError

from .golden import AllDevice, greedy_run, load

N_DECODE = 8


# Q5_K_M mixes types across layers and kinds (two graph classes, stride lcm);
# Q4_0/Q8_0 have 18- and 34-byte blocks (strides a multiple of them and of 256).
@pytest.mark.parametrize(
    "arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M"), ("qwen2moe", "Q8_0"), ("deepseek2", "Q4_0")]
)
def test_pool_rows_are_bit_identical_to_the_reference(synth_model, arch: str, quant: str) -> None:
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool")
        everything = greedy_run(llm, "exact", n_decode=N_DECODE)  # preloaded: every pair on the pool graph
        assert np.array_equal(everything.logits, ref.logits)
        per_call = everything.stats["per_call"]
        assert everything.stats["hit_rate"] == 1.0
        assert per_call["launches"] > 0, "the pool executor never ran"
        # one launch per decode call; a prompt batch may chunk into several 32-token launches
        assert per_call["launches"] <= 1.0 + 1e-9 or everything.stats["prompt_tokens"] > 32

        llm.set_policy("stock")
        llm.set_device("50%", 8.0, 5.0, manual_clock=True, executor="pool")
        mixed = greedy_run(llm, AllDevice(), n_decode=N_DECODE)  # fetched on demand, then hits
        assert np.array_equal(mixed.logits, ref.logits)
    finally:
        llm.close()


def test_a_steady_decode_call_launches_once_and_collects_once(synth_model) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        llm.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool")
        greedy_run(llm, "exact", n_decode=2)  # warm: graphs built, tier preloaded
        llm.spice_reset_stats()
        prompt = llm.tokenize(b"one two", add_bos=True)
        llm.eval(prompt)
        llm.spice_reset_stats()
        for token in (5, 6, 7, 8):
            llm.eval([token])
        per_call = llm.spice_stats()["per_call"]
        assert per_call["launches"] == 1.0 and per_call["collects"] == 1.0
    finally:
        llm.close()


def test_the_pool_is_opt_in_and_named(synth_model) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        with pytest.raises(ValueError, match="device-executor 'fast'"):
            llm.set_device("50%", 8.0, 5.0, manual_clock=True, executor="fast")
        llm.set_device("100%", 8.0, 5.0, manual_clock=True)  # auto: the host executor reads the slots
        run = greedy_run(llm, "exact", n_decode=2)
        assert run.stats["per_call"]["launches"] == 0.0
    finally:
        llm.close()


# A device that fails mid-decode (the test-only fault hook exec_fault_after): the
# decode stops with the reason as DecodeFailedError -- a failed collect used to stop
# it as if Ctrl-C had been pressed (KeyboardInterrupt) -- and the instance goes on.
@pytest.mark.parametrize("fault,what", [(3, "launch 4 refused"), (-3, "collect 4 refused")])
def test_a_device_failure_stops_the_decode_with_its_reason(synth_model, fault: int, what: str) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        engine = llm.spice_engine
        engine.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool", exec_fault_after=fault)
        with pytest.raises(DecodeFailedError, match=f"could not .*{what}"):
            greedy_run(llm, "exact", n_decode=N_DECODE)
        llm.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool")
        again = greedy_run(llm, "exact", n_decode=N_DECODE)
        assert np.array_equal(again.logits, ref.logits)
    finally:
        llm.close()


def test_the_profile_says_where_a_launch_goes_and_only_when_asked(synth_model, monkeypatch, capfd) -> None:
    """SPICE_CUDA_PROFILE=1 (read when the executor is made) prints, when it is freed, the
    executor's launches and their time by step: the diagnosis the 2026-12-04 H200 run
    needed (spice:exact's launches took 60-110 us, the other rows' 12-20)."""
    path = synth_model("qwen2moe", "tiny", "Q4_K")
    for asked in (False, True):
        if asked:
            monkeypatch.setenv("SPICE_CUDA_PROFILE", "1")
        else:
            monkeypatch.delenv("SPICE_CUDA_PROFILE", raising=False)
        llm = load(path)
        try:
            llm.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool")
            greedy_run(llm, "exact", n_decode=2)
        finally:
            llm.close()
        line = re.search(
            r"SPICE_CUDA_PROFILE: pool executor: (\d+) calls, (\d+) launches; per launch: staging [\d.]+ us, "
            r"upload [\d.]+, graph [\d.]+, download [\d.]+; 0 calls first finished an uncollected one",
            capfd.readouterr().err,
        )
        if asked:
            assert line is not None and int(line.group(2)) >= int(line.group(1)) > 0
        else:
            assert line is None
