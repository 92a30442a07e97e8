"""The SPICE policy on a real model: `spice:exact` and the ablations give the
reference's tokens and logits (both architectures, budgets 25% and 50%), and
really prefetch: copies are issued ahead and turn into hits."""

from __future__ import annotations

from dataclasses import replace

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


def test_lossy_levels_load_surrogates_and_use_them(synth_model, tmp_path) -> None:
    from pydoc_data.topics import topics

    from pyspice.cli.main import main
    from pyspice.policy.spice import SpicePolicy, spice_config

    model = synth_model("qwen2moe", "tiny", "Q8_0")
    text = tmp_path / "t.txt"
    # enough text that every expert gets held-out tokens (an expert's error is unknown without them,
    # and an unknown error is never substituted)
    text.write_text("".join(topics[k] for k in ("assert", "with", "for", "while", "if")), encoding="utf-8")
    sidecar = tmp_path / "m.spice.gguf"
    argv = [
        "calibrate",
        "-m",
        str(model),
        "-o",
        str(sidecar),
        "-f",
        str(text),
        "-c",
        "128",
        "--tokens",
        "1024",
    ]
    assert main([*argv, "--rank", "2", "--draft-rank", "4"]) == 0
    llm = load(model, sidecar=str(sidecar))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        llm.set_device("50%", 8.0, 5.0)
        # every miss with any surrogate is substituted: the level's thresholds opened wide
        wide = replace(
            spice_config("spice:fast"), name="wide", surrogate_max_weight=1.0, surrogate_max_error=1e9
        )
        lossy = greedy_run(llm, SpicePolicy(wide), n_decode=N_DECODE)
        assert llm.spice_surrogates().count > 0
        assert lossy.stats["misses"]["surrogate"] > 0, (llm._surrogate_errors(0), lossy.stats["misses"])
        assert lossy.stats["policy_fallbacks"] == 0
        assert not np.array_equal(lossy.logits, ref.logits)
        # a lossless level unloads them and is the reference again
        exact = greedy_run(llm, "spice:exact", n_decode=N_DECODE)
        assert llm.spice_surrogates().count == 0
        assert np.array_equal(exact.logits, ref.logits) and exact.tokens == ref.tokens
    finally:
        llm.close()
