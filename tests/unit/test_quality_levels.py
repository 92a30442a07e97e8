"""The lossy levels' surrogate thresholds: a model's own (from its sidecar) where it has
them, the shared constants otherwise, said once; the engine loads only the surrogates a
level may use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.policy import make_policy
from pyspice.policy.spice import (
    LEVEL_BOUNDS,
    QUALITY_LEVELS,
    SpicePolicy,
    SurrogateThresholds,
    level_config,
    spice_config,
)


def test_a_level_takes_the_models_thresholds_when_its_sidecar_has_them() -> None:
    tuned = {"spice:balanced": SurrogateThresholds(0.04, 0.45), "spice:fast": SurrogateThresholds(1.0, 0.6)}
    notes: list[str] = []
    balanced = level_config("spice:balanced", tuned, notes.append)
    fast = level_config("spice:fast", tuned, notes.append)
    assert (balanced.surrogate_max_weight, balanced.surrogate_max_error) == (0.04, 0.45)
    assert (fast.surrogate_max_weight, fast.surrogate_max_error) == (1.0, 0.6)
    # only the thresholds change: the name and everything else are the level's
    shared = spice_config("spice:balanced")
    assert balanced.name == "spice:balanced" and balanced.plan_every == shared.plan_every
    assert notes == []


def test_without_tuned_thresholds_a_level_falls_back_to_the_shared_ones_and_says_so() -> None:
    notes: list[str] = []
    config = level_config("spice:fast", {"spice:balanced": SurrogateThresholds(0.04, 0.45)}, notes.append)
    assert config == QUALITY_LEVELS["spice:fast"]
    assert len(notes) == 1 and "spice:fast" in notes[0] and "shared" in notes[0]
    # no sidecar at all (None): the constants, and nothing to say (there are no surrogates)
    assert level_config("spice:balanced", None, notes.append) == QUALITY_LEVELS["spice:balanced"]
    assert len(notes) == 1


def test_lossless_variants_ignore_tuned_thresholds() -> None:
    tuned = {level: SurrogateThresholds(1.0, 1.0) for level in LEVEL_BOUNDS}
    notes: list[str] = []
    for name in ("spice", "spice:exact", "abl-a"):
        assert level_config(name, tuned, notes.append) == spice_config(name)
        assert level_config(name, {}, notes.append).lossless
    assert notes == []


def test_thresholds_tuned_to_zero_make_a_level_lossless() -> None:
    # what the tuning writes for a level no pair of its grid keeps within the bound
    config = level_config("spice:balanced", {"spice:balanced": SurrogateThresholds(0.0, 0.0)})
    assert config.lossless and SpicePolicy(config).surrogate_limit is None


def test_make_policy_passes_the_models_thresholds_to_the_level() -> None:
    tuned = {"spice:balanced": SurrogateThresholds(0.04, 0.45)}
    policy = make_policy("spice:balanced", tuned)
    assert isinstance(policy, SpicePolicy)
    assert policy.config.surrogate_max_error == 0.45 and policy.surrogate_limit == 0.45
    shared = make_policy("spice:balanced")
    assert isinstance(shared, SpicePolicy) and shared.config == QUALITY_LEVELS["spice:balanced"]


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_thresholds_must_be_finite_and_not_negative(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        SurrogateThresholds(bad, 0.5)
    with pytest.raises(ValueError, match="finite"):
        SurrogateThresholds(0.05, bad)


def test_the_engine_loads_only_the_surrogates_within_the_levels_error_limit() -> None:
    from pyspice.engine.surrogates import budget_rank, within_budget
    from pyspice.formats.sidecar import LayerSurrogates, Sidecar, SidecarData

    n_embd, n_expert, rank = 8, 4, 2
    rng = np.random.default_rng(0)
    layer = LayerSurrogates(
        A=rng.standard_normal((n_expert, rank, n_embd)).astype(np.float32),
        B=rng.standard_normal((n_expert, n_embd, rank)).astype(np.float32),
        alpha=np.ones(n_expert, np.float32),
        rank=np.full(n_expert, rank, np.int32),
        error=np.array([0.3, 0.5, np.nan, 0.9], np.float32),
        error_shared=np.full(n_expert, np.nan, np.float32),
        error_drop=np.ones(n_expert, np.float32),
    )
    data = SidecarData("m", "fp", [0], n_embd, n_expert, 2, lore_rank=rank, surrogates={0: layer})
    sidecar = Sidecar(data, path=Path("m.spice.gguf"), model_path=None)
    per_expert = rank * 2 * n_embd * 2 + 4
    source, cut = within_budget(sidecar, 10**9, 0.5)
    assert cut is None
    assert [source.surrogate(0, e) is not None for e in range(n_expert)] == [True, True, False, False]
    source, cut = within_budget(sidecar, 10**9)  # no limit: every fitted one, as before
    assert [source.surrogate(0, e) is not None for e in range(n_expert)] == [True, True, True, True]
    # the rank cut counts only the trusted ones: 2 of them fit a budget all 4 would not
    budget = int(2 * per_expert / 0.25)
    assert budget_rank(sidecar, budget, 0.5) is None and budget_rank(sidecar, budget) == 1


def test_a_builtin_models_sidecar_of_its_calibration_gets_the_committed_thresholds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace

    from pyspice.formats.sidecar import read_sidecar, with_levels, write_sidecar
    from pyspice.models import builtin as builtin_mod
    from pyspice.models.builtin import BUILTIN, TunedLevels, adopt_tuned_levels
    from tests.unit.test_sidecar import data_for, tiny_model

    model = tiny_model(tmp_path / "smolmoe-b-r1-0123abcd-Q8_0.gguf", 0)  # named as a build of smolmoe-b
    data = data_for(model)
    sidecar = write_sidecar(tmp_path / "smolmoe-b-r1-0123abcd-Q8_0.spice.gguf", data)
    tuned = TunedLevels(
        corpus=data.corpus,
        tokens=data.tokens,
        lore_rank=data.lore_rank,
        balanced=SurrogateThresholds(0.05, 0.45),
        fast=SurrogateThresholds(0.05, 0.6),
        tuned_on="test",
    )
    monkeypatch.setitem(BUILTIN, "smolmoe-b", replace(BUILTIN["smolmoe-b"], tuned=tuned))
    notes: list[str] = []
    assert adopt_tuned_levels(model, sidecar, notes.append)
    assert read_sidecar(sidecar).levels == tuned.levels() and len(notes) == 1
    # once there, there is nothing to write again
    assert not adopt_tuned_levels(model, sidecar, notes.append)
    # a release that commits other thresholds replaces the ones an earlier release wrote
    retuned = replace(tuned, balanced=SurrogateThresholds(0.05, 0.4))
    monkeypatch.setitem(BUILTIN, "smolmoe-b", replace(BUILTIN["smolmoe-b"], tuned=retuned))
    assert adopt_tuned_levels(model, sidecar, notes.append)
    assert read_sidecar(sidecar).levels == retuned.levels() and "replaced" in notes[-1]
    # ... but never a user's own tuning (`pyspice calibrate --levels`)
    with_levels(sidecar, tuned.levels(), "tuned by hand")
    assert not adopt_tuned_levels(model, sidecar, notes.append)
    assert read_sidecar(sidecar).levels == tuned.levels() and len(notes) == 2
    # a sidecar of another calibration (other text, tokens or rank) keeps the shared ones
    other = write_sidecar(sidecar, replace(data, tokens=data.tokens + 1))
    assert not adopt_tuned_levels(model, other, notes.append) and read_sidecar(other).levels == {}
    # and a model that is no built-in one is never touched
    plain = tiny_model(tmp_path / "mine.gguf", 0)
    assert not adopt_tuned_levels(plain, write_sidecar(tmp_path / "mine.spice.gguf", data), notes.append)
    assert builtin_mod.builtin_of(plain) is None and len(notes) == 2


def test_the_committed_thresholds_name_the_calibration_a_first_use_makes() -> None:
    # a built-in model's sidecar made on first use (run_calibration's defaults) must be the one
    # its committed thresholds were tuned on, or they would never be written into it
    import inspect

    from pyspice.calibrate.run import default_corpus_name, run_calibration
    from pyspice.models.builtin import BUILTIN

    defaults = inspect.signature(run_calibration).parameters
    for name, model in BUILTIN.items():
        assert model.tuned is not None, name
        built = Path(f"{name}-r1-0123abcd-Q8_0.gguf")
        assert model.tuned.corpus == default_corpus_name(built), name
        assert model.tuned.tokens == defaults["tokens"].default
        assert model.tuned.lore_rank == defaults["rank"].default
        assert set(model.tuned.levels()) == set(LEVEL_BOUNDS)
