"""Baseline policies on a real model: lossless at 25% and 50% budgets, and
doing what they claim (copies, hits, nothing after warm-up)."""

from __future__ import annotations

import numpy as np
import pytest

from .golden import greedy_run, load

POLICIES = ["host", "static", "ondemand", "lru", "adapmoe"]
N_DECODE = 12


@pytest.mark.parametrize("budget", ["25%", "50%"])
@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")])
def test_baselines_are_lossless(synth_model, arch: str, quant: str, budget: str) -> None:
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device(budget, 8.0, 5.0, manual_clock=True)
        stats = {}
        for name in POLICIES:
            got = greedy_run(llm, name, n_decode=N_DECODE)
            assert got.tokens == ref.tokens, name
            assert np.array_equal(got.logits, ref.logits), name
            assert got.stats["policy_fallbacks"] == 0, name
            stats[name] = got.stats
        assert stats["host"]["hit_rate"] == 0.0 and stats["host"]["bytes_per_token"] == 0.0
        if budget == "50%":
            assert stats["lru"]["bytes_per_token"] > 0 and stats["lru"]["hit_rate"] > 0
            assert stats["ondemand"]["bytes_per_token"] >= stats["lru"]["bytes_per_token"]
            assert stats["ondemand"]["hit_rate"] == 0.0  # keeps nothing: every activation is a miss
    finally:
        llm.close()


def test_static_copies_nothing_after_warm_up(synth_model) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        llm.set_policy("static")
        llm.reset()
        llm.eval(llm.tokenize(b"Warm up the static layers", add_bos=True))
        llm.spice_reset_stats()
        for token in range(100, 116):
            llm.eval([token])
        stats = llm.spice_stats()
        assert stats["bytes_per_token"] == 0.0
        assert stats["hit_rate"] == 0.5  # two of four MoE layers resident, every activation there hits
    finally:
        llm.close()
