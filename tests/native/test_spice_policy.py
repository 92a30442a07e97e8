"""The SPICE policy on a real model: `spice:exact` and the ablations give the
reference's tokens and logits (both architectures, budgets 25% and 50%), and
really prefetch: copies are issued ahead and turn into hits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

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


@pytest.fixture(scope="module")
def lossy_model(synth_model, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model and a sidecar calibrated for it (rank 2), made once for this module."""
    from pydoc_data.topics import topics

    from pyspice.cli.main import main

    model = synth_model("qwen2moe", "tiny", "Q8_0")
    tmp = tmp_path_factory.mktemp("lossy")
    text = tmp / "t.txt"
    # enough text that every expert gets held-out tokens (an expert's error is unknown without them,
    # and an unknown error is never substituted)
    text.write_text("".join(topics[k] for k in ("assert", "with", "for", "while", "if")), encoding="utf-8")
    sidecar = tmp / "m.spice.gguf"
    argv = ["calibrate", "-m", str(model), "-o", str(sidecar), "-f", str(text), "-c", "128"]
    assert main([*argv, "--tokens", "1024", "--rank", "2", "--draft-rank", "4"]) == 0
    return model, sidecar


def test_lossy_levels_load_surrogates_and_use_them(lossy_model) -> None:
    from pyspice.policy.spice import SpicePolicy, spice_config

    model, sidecar = lossy_model
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


def test_a_level_runs_by_its_models_thresholds_and_loads_only_the_surrogates_it_trusts(
    lossy_model, tmp_path, capfd
) -> None:
    """The thresholds tuned into a sidecar are what spice:balanced / spice:fast run by, and
    the engine loads only the surrogates within the level's error limit; a sidecar without
    them runs the shared constants, said once."""
    from pyspice.formats.sidecar import Sidecar, with_levels
    from pyspice.policy.spice import QUALITY_LEVELS, SurrogateThresholds

    model, calibrated = lossy_model
    sidecar = tmp_path / "tuned.spice.gguf"
    sidecar.write_bytes(calibrated.read_bytes())
    errors = np.concatenate([s.error for s in Sidecar.load(sidecar, model).data.surrogates.values()])
    limit = float(np.nanmedian(errors))  # about half of them trusted
    trusted = int(np.count_nonzero(errors <= limit))
    assert 0 < trusted < errors.size
    with_levels(sidecar, {"spice:fast": SurrogateThresholds(1.0, limit)}, "test")

    llm = load(model, sidecar=str(sidecar))
    try:
        llm.set_device("50%", 8.0, 5.0)
        capfd.readouterr()
        lossy = greedy_run(llm, "spice:fast", n_decode=N_DECODE)
        assert llm.spice_surrogates().count == trusted, (trusted, errors.size)
        assert lossy.stats["misses"]["surrogate"] > 0 and lossy.stats["policy_fallbacks"] == 0
        assert "shared" not in capfd.readouterr().err  # fast has its own thresholds
        # balanced has none in this sidecar: the shared constants, said once, and its own subset
        greedy_run(llm, "spice:balanced", n_decode=2)
        greedy_run(llm, "spice:balanced", n_decode=2)
        err = capfd.readouterr().err
        assert err.count("spice:balanced: the sidecar has no surrogate thresholds tuned") == 1, err
        shared = QUALITY_LEVELS["spice:balanced"].surrogate_max_error
        assert llm.spice_surrogates().count == int(np.count_nonzero(errors <= shared))
    finally:
        llm.close()


def test_a_lossy_level_plans_one_layer_late_by_default_and_repeats_run_to_run(
    lossy_model, tmp_path, monkeypatch
) -> None:
    """With a core for the planner, spice:fast plans on the planner thread in the
    deterministic mode (each plan applied exactly one MoE layer late): its substitutions
    do not depend on the planner's timing, so two runs give the same logits."""
    from pyspice.engine import planning as planning_module
    from pyspice.formats.sidecar import with_levels
    from pyspice.policy.spice import SurrogateThresholds

    monkeypatch.setattr(planning_module, "usable_cores", lambda: 64)  # a core for the planner
    model, calibrated = lossy_model
    sidecar = tmp_path / "wide.spice.gguf"
    sidecar.write_bytes(calibrated.read_bytes())
    # every miss with any surrogate is substituted: what the planner's timing would move
    with_levels(sidecar, {"spice:fast": SurrogateThresholds(1.0, 1e9)}, "test")
    llm = load(model, sidecar=str(sidecar))
    try:
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)  # copies land by the layer, not the clock
        first = greedy_run(llm, "spice:fast", n_decode=N_DECODE)
        assert llm.spice_engine.planning_label == "det1"
        planning = first.stats["planning"]
        assert planning["asynchronous"] and planning["lag_layers"] == 1 and planning["applied"] > 0
        assert first.stats["misses"]["surrogate"] > 0 and first.stats["policy_fallbacks"] == 0
        again = greedy_run(llm, "spice:fast", n_decode=N_DECODE)
        assert again.tokens == first.tokens and np.array_equal(again.logits, first.logits)
        assert again.stats["misses"] == first.stats["misses"]
        # asked for, a lossy level plans free-running or inline as before
        llm.spice_engine.set_planning(planning_module.Planning(asynchronous=False))
        greedy_run(llm, "spice:fast", n_decode=2)
        assert llm.spice_engine.planning_label == "sync"
    finally:
        llm.close()
