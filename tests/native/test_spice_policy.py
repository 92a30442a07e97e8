"""The SPICE policy on a real model: `spice:exact` and the ablations give the
reference's tokens and logits (both architectures, budgets 25% and 50%), and
really prefetch: copies are issued ahead and turn into hits."""

from __future__ import annotations

import numpy as np
import pytest

from .golden import greedy_run, load

LOSSLESS = ["spice:exact", "abl-a", "abl-b", "abl-c", "abl-d"]
N_DECODE = 12


@pytest.mark.parametrize("budget", ["25%", "50%"])
@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")])
def test_spice_exact_and_ablations_are_lossless(synth_model, arch: str, quant: str, budget: str) -> None:
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        # a real clock: prefetches land while layers compute, so hits come from them
        llm.set_device(budget, 8.0, 5.0)
        for name in LOSSLESS:
            got = greedy_run(llm, name, n_decode=N_DECODE)
            assert got.tokens == ref.tokens, name
            assert np.array_equal(got.logits, ref.logits), name
            assert got.stats["policy_fallbacks"] == 0, name
            assert got.stats["misses"]["surrogate"] == 0 and got.stats["misses"]["dropped"] == 0, name
            assert got.stats["prefetch_issued"] > 0, name
            assert got.stats["hit_rate"] > 0, name
    finally:
        llm.close()
