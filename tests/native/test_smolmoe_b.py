"""The benchmark model: smolmoe-b builds to the committed bytes and keeps the lossless guarantee.

smolmoe-b routes 4 of 32 experts, the regime the policies are measured in, so
the golden check runs on it too: the exact paths and the device-tier
baselines at 25% give the reference's logits bit for bit over a prompt batch
and a few greedy steps, and dropping an expert changes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.models.smolmoe_recipe import file_sha256, load_recipe, recipe_dir

from .conftest import ModelFactory
from .golden import greedy_run, load, prompt_length
from .test_golden import DropSecondExpert

N_DECODE = 8
N_MOE_LAYERS = 30


@pytest.fixture(scope="session")
def smolmoe_b(builtin_model: ModelFactory) -> Path:
    return builtin_model("smolmoe-b")


def test_build_is_the_committed_file(smolmoe_b: Path) -> None:
    recipe, _ = load_recipe(recipe_dir("smolmoe-b"))
    assert file_sha256(smolmoe_b) == recipe.gguf_sha256["Q8_0"]


def test_lossless_policies_match_reference(smolmoe_b: Path) -> None:
    llm = load(smolmoe_b)
    try:
        n_prompt = prompt_length(llm)
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        assert ref.stats["hook_calls"] == 0 and np.isfinite(ref.logits).all()
        for policy in ("exact", "exact-py"):
            got = greedy_run(llm, policy, n_decode=N_DECODE)
            assert got.tokens == ref.tokens, policy
            assert np.array_equal(got.logits, ref.logits), policy
            assert len(got.stats["layers"]) == N_MOE_LAYERS
            for il, rec in got.stats["layers"].items():
                assert rec["hook_calls"] == 1 + N_DECODE, f"{policy} layer {il}"
                assert rec["activations"] == (n_prompt + N_DECODE) * 4  # top-4
        llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        for policy in ("lru", "ondemand"):
            got = greedy_run(llm, policy, n_decode=N_DECODE)
            assert np.array_equal(got.logits, ref.logits), policy
            assert got.stats["policy_fallbacks"] == 0, policy
        assert got.stats["bytes_per_token"] > 0  # the tier really copied experts
        dropped = greedy_run(llm, DropSecondExpert(), n_decode=N_DECODE)
        assert dropped.stats["misses"]["dropped"] > 0
        assert not np.array_equal(dropped.logits, ref.logits), "dropping an expert did not change the logits"
    finally:
        llm.close()
