"""Low-precision slots (SPICE_SLOT_4BIT/_5BIT), what the lossy levels' device tier
holds: every expert re-quantized to about 4.5 or 5.5 bits, so a budget holds more of them and
each copy moves fewer bytes. It is lossy and opt-in: a lossless policy cannot
ask for it, a policy that does moves the logits only a little, and the exact
policies that run after it on the same instance are still bit-identical to the
reference (the copies are the tier's, never the host's)."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.api import Llama
from pyspice.engine import slot_tier
from pyspice.policy.base import slot_precision
from pyspice.runtime import SLOT_4BIT, SLOT_5BIT, SLOT_EXACT

from .golden import AllDevice, greedy_run, load

N_DECODE = 8


class AllDevice4Bit(AllDevice):
    """Every activation on a tier of 4-bit slots (lossy, so it says so)."""

    name = "all-device-4bit"
    lossless = False
    slot_precision = "4bit"


class AllDevice5Bit(AllDevice4Bit):
    name = "all-device-5bit"
    slot_precision = "5bit"


class LosslessAsking4Bit(AllDevice):
    name = "lossless-asking-4bit"
    slot_precision = "4bit"


@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q8_0"), ("deepseek2", "Q5_K_M")])
def test_4bit_slots_hold_more_and_move_the_logits_a_little(synth_model, arch: str, quant: str) -> None:
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        runtime = llm.spice_engine.runtime
        model_bytes = [info.bytes_per_expert for info in llm.spice_layers()]
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        assert runtime.slot_expert_bytes() == model_bytes and runtime.slot_copies() == (0, 0.0)

        lossy = greedy_run(llm, AllDevice4Bit(), forced=ref.tokens, n_decode=N_DECODE)
        slot_bytes = runtime.slot_expert_bytes()
        moe = [il for il, info in enumerate(llm.spice_layers()) if info.is_moe]
        assert all(0 < slot_bytes[il] < model_bytes[il] for il in moe)
        n_expert = llm.spice_layers()[moe[0]].n_expert
        assert runtime.slot_copies()[0] >= sum(slot_bytes[il] for il in moe) * n_expert
        assert lossy.stats["misses"]["fetched"] > 0  # the copies moved are the 4-bit ones
        assert not np.array_equal(lossy.logits, ref.logits)
        # about 4.5 bits per weight against >= 5.5: a small change, not a broken model
        # about 4.5 bits per weight against 5.5-8.5 on random weights (no outliers to
        # spare): the logits move (0.08-0.13 relative RMS here) but keep their shape; a
        # copy of the wrong expert or matrix, or a misread type, decorrelates them
        rel = float(np.sqrt(np.mean((lossy.logits - ref.logits) ** 2) / np.mean(ref.logits**2)))
        corr = float(np.corrcoef(lossy.logits.ravel(), ref.logits.ravel())[0, 1])
        assert rel < 0.25 and corr > 0.97, f"4-bit slots: relative RMS {rel:.3f}, correlation {corr:.4f}"

        # the same instance, exact slots again: bit-identical (the copies stayed the tier's)
        exact = greedy_run(llm, AllDevice(), n_decode=N_DECODE)
        assert runtime.slot_expert_bytes() == model_bytes
        assert np.array_equal(exact.logits, ref.logits)
    finally:
        llm.close()


def _relative_rms(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))


def test_5bit_slots_sit_between_4bit_and_exact_in_bytes_and_in_error(synth_model) -> None:
    """The 5-bit tier (spice:balanced's) takes Q5_0 copies of a Q8_0 model: more bytes
    per expert than the 4-bit ones and fewer than the model's, and logits nearer the
    reference's than 4-bit slots give. Moving between the precisions remakes the
    copies, and the runtime says which it holds."""
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        runtime = llm.spice_engine.runtime
        model_bytes = [info.bytes_per_expert for info in llm.spice_layers()]
        moe = [il for il, info in enumerate(llm.spice_layers()) if info.is_moe]
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        four = greedy_run(llm, AllDevice4Bit(), forced=ref.tokens, n_decode=N_DECODE)
        bytes4 = runtime.slot_expert_bytes()
        assert runtime.slot_copies_precision() == SLOT_4BIT
        five = greedy_run(llm, AllDevice5Bit(), forced=ref.tokens, n_decode=N_DECODE)
        bytes5 = runtime.slot_expert_bytes()
        assert runtime.slot_copies_precision() == SLOT_5BIT
        need5 = runtime.slot_copies_size(SLOT_5BIT)
        assert runtime.slot_copies()[0] >= need5 > runtime.slot_copies_size(SLOT_4BIT)
        # Q5_0 is 22 bytes per 32 weights, IQ4_NL 18, Q8_0 34
        for il in moe:
            assert bytes4[il] < bytes5[il] < model_bytes[il]
            assert abs(bytes5[il] / model_bytes[il] - 22 / 34) < 0.01, (bytes5[il], model_bytes[il])
        assert five.stats["misses"]["fetched"] > 0
        assert not np.array_equal(five.logits, ref.logits)
        assert _relative_rms(five.logits, ref.logits) < _relative_rms(four.logits, ref.logits)

        greedy_run(llm, AllDevice(), n_decode=1)  # an exact tier frees them
        assert runtime.slot_copies_precision() == SLOT_EXACT and runtime.slot_copies() == (0, 0.0)
    finally:
        llm.close()


def test_the_pool_executor_reads_4bit_slots_as_the_host_executor_does(synth_model) -> None:
    """The pool graph (its emulated, CPU form) over 4-bit slots computes the rows the
    host executor computes over the same copies: bit-identical decodes."""
    llm = load(synth_model("qwen2moe", "tiny", "Q4_K"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device("100%", 8.0, 5.0, manual_clock=True)
        host = greedy_run(llm, AllDevice4Bit(), forced=ref.tokens, n_decode=N_DECODE)
        llm.set_policy("stock")
        llm.set_device("100%", 8.0, 5.0, manual_clock=True, executor="pool")
        pool = greedy_run(llm, AllDevice4Bit(), forced=ref.tokens, n_decode=N_DECODE)
        assert pool.stats["per_call"]["launches"] > 0, "the pool executor never ran"
        assert np.array_equal(pool.logits, host.logits)
        assert not np.array_equal(pool.logits, ref.logits)
    finally:
        llm.close()


def test_a_lossless_policy_cannot_ask_for_lossy_slots(synth_model) -> None:
    with pytest.raises(ValueError, match="lossless but asks for 4bit slots"):
        slot_precision(LosslessAsking4Bit())
    with pytest.raises(ValueError, match="not one of exact, 4bit, 5bit"):
        slot_precision(type("Odd", (), {"lossless": False, "slot_precision": "2bit"})())
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        with pytest.raises(ValueError, match="lossless but asks for 4bit slots"):
            llm.set_policy(LosslessAsking4Bit())
        ref = greedy_run(llm, "stock", n_decode=2)
        again = greedy_run(llm, AllDevice(), n_decode=2)  # the instance goes on, exactly
        assert np.array_equal(again.logits, ref.logits)
    finally:
        llm.close()


def test_a_disk_tier_keeps_exact_slots_and_says_so(synth_model, capfd: pytest.CaptureFixture[str]) -> None:
    """Edge mode's slots hold the bytes read from the file, which are the model's own:
    a policy asking for 4-bit slots gets exact ones there, told once."""
    path = synth_model("qwen2moe", "tiny", "Q4_K")
    ram = load(path)
    try:
        ref = greedy_run(ram, "stock", n_decode=N_DECODE)
    finally:
        ram.close()
    # as golden.load, with the experts left on disk (which needs a hooked policy)
    shape = {"n_ctx": 256, "n_batch": 128, "n_ubatch": 128, "n_threads": 2, "n_threads_batch": 2}
    llm = Llama(str(path), policy="exact", ram_budget="50%", logits_all=True, verbose=False, **shape)
    try:
        assert llm.spice_device is not None and llm.spice_device.disk
        capfd.readouterr()
        runs = [greedy_run(llm, AllDevice4Bit(), n_decode=N_DECODE) for _ in range(2)]
        said = capfd.readouterr().err
        assert said.count("4bit slots are not used on a disk tier") == 1, said
        assert llm.spice_engine.runtime.slot_copies() == (0, 0.0)
        for run in runs:
            assert np.array_equal(run.logits, ref.logits)
    finally:
        llm.close()


def test_copies_that_would_not_fit_in_memory_leave_the_slots_exact(
    synth_model, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        runtime = llm.spice_engine.runtime
        need = runtime.slot_copies_size(SLOT_4BIT)
        assert need > 0 and runtime.slot_copies_size(SLOT_EXACT) == 0
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        experts = sum(i.bytes_per_expert * i.n_expert for i in llm.spice_layers() if i.is_moe)
        # room for the model's experts and the copies, but not 1/0.8 x the copies besides
        monkeypatch.setattr(slot_tier, "memory_for_this_process", lambda: experts + need)
        capfd.readouterr()
        got = greedy_run(llm, AllDevice4Bit(), n_decode=N_DECODE)
        assert "4bit slots need" in capfd.readouterr().err
        assert runtime.slot_copies() == (0, 0.0) and np.array_equal(got.logits, ref.logits)

        monkeypatch.setattr(slot_tier, "memory_for_this_process", lambda: experts + 2 * need)
        greedy_run(llm, AllDevice4Bit(), n_decode=1)
        made = runtime.slot_copies()[0]
        assert need <= made <= need + 4096 * 3 * len(llm.spice_layers())  # the size said is what is made
    finally:
        llm.close()
