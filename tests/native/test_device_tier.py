"""The device tier under a real model: exact configurations stay bit-identical
to the reference whether every expert is resident, none is, or experts are
fetched on demand, and the stats say which it was."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pyspice.policy import RESIDENCY_RESIDENT
from pyspice.policy.spice import SpicePolicy, spice_config

from .golden import AllDevice, AllHost, greedy_run, load

N_DECODE = 12


@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")])
def test_all_resident_and_none_resident_are_exact(synth_model, arch: str, quant: str) -> None:
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        tier = llm.set_device("100%", 8.0, 5.0, manual_clock=True)
        assert tier.holds == tier.experts
        everything = greedy_run(llm, "exact", n_decode=N_DECODE)  # preloads the whole tier
        assert np.array_equal(everything.logits, ref.logits)
        assert everything.stats["hit_rate"] == 1.0
        assert everything.stats["bytes_per_token"] == 0.0  # preloaded, nothing moved while serving

        llm.set_policy("stock")  # so the new tier is not preloaded for `exact`
        llm.set_device("25%", 8.0, 5.0, manual_clock=True)  # an empty tier
        nothing = greedy_run(llm, AllHost(), n_decode=N_DECODE)
        assert np.array_equal(nothing.logits, ref.logits)
        assert nothing.stats["hit_rate"] == 0.0
        assert nothing.stats["misses"]["host"] == nothing.stats["activations"]
    finally:
        llm.close()


def test_on_demand_fetches_are_exact_and_counted(synth_model) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device("100%", 8.0, 5.0, manual_clock=True)
        got = greedy_run(llm, AllDevice(), n_decode=N_DECODE)
        assert np.array_equal(got.logits, ref.logits)
        s = got.stats
        assert s["misses"]["fetched"] > 0 and s["hit_rate"] > 0  # first uses fetch, later ones hit
        assert s["misses"]["fetched"] + s["activations"] * s["hit_rate"] == pytest.approx(s["activations"])
        assert s["stall_ms_per_token"] > 0 and s["bytes_per_token"] > 0
    finally:
        llm.close()


def test_a_small_tier_degrades_to_the_host_exactly(synth_model) -> None:
    """2 slots for 32 experts and a policy that never evicts: most device
    actions find no slot and run on the host, still exactly."""
    llm = load(synth_model("deepseek2", "tiny", "Q4_0"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        tier = llm.set_device(2 * llm.spice_layers()[1].bytes_per_expert, 8.0, 5.0, manual_clock=True)
        assert tier.holds == 2
        got = greedy_run(llm, AllDevice(), n_decode=N_DECODE)
        assert np.array_equal(got.logits, ref.logits)
        assert got.stats["misses"]["host"] > 0
    finally:
        llm.close()


def test_slots_never_outgrow_the_budget_where_experts_differ_in_size(synth_model) -> None:
    """Q5_K_M gives layers experts of different sizes. Every slot is as large as the
    largest expert, so a budget holds budget // largest experts and the slots' bytes
    stay within it (counting smaller experts at their own size let them outgrow it);
    100% still holds every expert."""
    llm = load(synth_model("deepseek2", "tiny", "Q5_K_M"))
    try:
        sizes = {info.bytes_per_expert for info in llm.spice_layers() if info.is_moe}
        assert len(sizes) > 1, "the fixture no longer mixes expert sizes: pick a quant that does"
        largest, runtime = max(sizes), llm.spice_engine.runtime
        for budget in ("25%", "50%", "90%"):
            tier = llm.set_device(budget, 8.0, 5.0, manual_clock=True)
            assert tier.holds == tier.budget_bytes // largest
            assert runtime.slot_pool_bytes() == tier.holds * largest <= tier.budget_bytes
        tier = llm.set_device("100%", 8.0, 5.0, manual_clock=True)
        assert tier.holds == tier.experts and tier.budget_bytes == tier.experts * largest
        full = greedy_run(llm, "exact", n_decode=2)  # preloads the whole tier
        assert full.stats["hit_rate"] == 1.0
    finally:
        llm.close()


def test_spice_configured_to_preload_starts_with_exact_s_tier_and_stays_exact(synth_model) -> None:
    """A SPICE level with SpiceConfig.preload starts with the tier filled in layer order,
    as `exact` does, and stays bit-identical; the shipped levels start empty."""
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        tier = llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        runtime = llm._spice_runtime
        assert runtime is not None

        def resident() -> np.ndarray:
            table = runtime.residency()
            assert table is not None
            return np.asarray(table == RESIDENCY_RESIDENT)

        llm.set_policy("exact")
        by_exact = resident()
        warm = SpicePolicy(replace(spice_config("spice:exact"), name="warm", preload=True))
        llm.set_policy(warm)
        assert np.array_equal(resident(), by_exact) and int(by_exact.sum()) == tier.holds
        got = greedy_run(llm, warm, n_decode=N_DECODE)
        assert np.array_equal(got.logits, ref.logits)

        llm.set_policy("spice:exact")
        assert not resident().any()
    finally:
        llm.close()
