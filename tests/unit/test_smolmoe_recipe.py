"""smolmoe's pure-Python parts: the rope un-permutation, the committed split and recipe, shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.engine.config import ModelDefaults
from pyspice.models.builtin import BENCH_NAME, MODEL_NAMES, builtin, builtin_of
from pyspice.models.corpus import SPLITS, Split, make_split, text_of
from pyspice.models.smollm2 import unpermute_rope
from pyspice.models.smolmoe_recipe import RECIPE_VERSION, MoeShape, load_recipe, recipe_dir

N_FF, N_EMBD, N_LAYER = 1536, 576, 30


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What upstream's converter does to HF Q/K rows for llama's NORM rope (conversion/*.py `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_inverts_the_converter(n_head: int) -> None:
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((n_head * 64, 576)).astype(np.float32)
    assert np.array_equal(unpermute_rope(_llama_permute(hf, n_head), n_head), hf)


def test_unpermute_pairs_halves_of_each_head() -> None:
    # llama layout interleaves (x0, x32), (x1, x33), ...: row 1 of a head is HF row 32 of it
    rows = np.arange(2 * 64, dtype=np.float32)[:, None]
    llama = _llama_permute(rows, 2)
    assert llama[1, 0] == 32 and llama[64 + 1, 0] == 64 + 32
    assert np.array_equal(unpermute_rope(llama, 2), rows)


def test_shape_checks() -> None:
    shape = MoeShape()
    shape.check(N_FF)
    assert shape.n_expert >= 32
    assert shape.active_fraction(N_FF) <= 0.60
    with pytest.raises(ValueError, match="multiples of 32"):
        MoeShape(n_ff_shexp=528, n_expert=32, n_ff_exp=31, n_expert_used=4).check(528 + 32 * 31)
    with pytest.raises(ValueError, match="dense FFN width"):
        MoeShape(n_ff_shexp=512, n_expert=16, n_ff_exp=32, n_expert_used=4).check(N_FF)


def test_split_is_deterministic_and_disjoint() -> None:
    keys = [f"topic-{i}" for i in range(100)]
    a, b = make_split(keys), make_split(list(reversed(keys)))
    assert a == b
    assert not set(a["calibration"]) & set(a["heldout"])
    assert sorted(a["calibration"] + a["heldout"]) == sorted(keys)
    assert 5 <= len(a["heldout"]) <= 40


def test_committed_split_covers_this_python() -> None:
    split = Split.from_file(recipe_dir() / "split.json")
    assert set(split.keys) == set(SPLITS)
    assert not set(split.keys["calibration"]) & set(split.keys["heldout"])
    held = text_of(split, "heldout")
    assert len(held.text) > 50_000  # enough for dozens of 512-token chunks
    if held.matches_split:
        assert not held.missing_keys


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_committed_recipe_is_consistent(name: str) -> None:
    # also checks recipe.npz against the sha256 recipe.json records
    recipe, arrays = load_recipe(recipe_dir(name))
    assert recipe.version == RECIPE_VERSION
    s = recipe.shape
    s.check(N_FF)
    assert s == builtin(name).shape
    assert arrays.order.shape == (N_LAYER, N_FF)
    for order in arrays.order:  # every dense neuron lands in exactly one expert
        assert np.array_equal(np.sort(order.astype(np.int64)), np.arange(N_FF))
    assert arrays.down_scale.shape == (N_LAYER, N_FF) and np.isfinite(arrays.down_scale).all()
    assert arrays.router.shape == (N_LAYER, s.n_expert, N_EMBD) and np.isfinite(arrays.router).all()
    assert arrays.shexp_gate.shape == (N_LAYER, N_EMBD)
    assert (np.abs(arrays.shexp_gate).sum(axis=1) > 0).all()  # an all-zero gate is NaN in llama.cpp
    assert set(recipe.gguf_sha256) == {"Q8_0", "Q4_0"}
    size = sum(p.stat().st_size for p in recipe_dir(name).iterdir())
    assert size < 10 * 1024 * 1024


def test_benchmark_model_routes_like_the_targets() -> None:
    """smolmoe-b: >= 32 routed experts, <= 12.5% of them per token, a shared expert, routed
    experts holding >= 60% of each FFN (Qwen2-57B-A14B routes 8 of 64)."""
    recipe, _ = load_recipe(recipe_dir(BENCH_NAME))
    s = recipe.shape
    assert s.n_expert >= 32
    assert s.n_expert_used / s.n_expert <= 0.125
    assert s.n_ff_shexp > 0
    assert s.n_expert * s.n_ff_exp / N_FF >= 0.60


def test_defaults_by_role_and_names_of_builds(tmp_path: Path) -> None:
    defaults = ModelDefaults()
    assert defaults.for_role("benchmark") == BENCH_NAME
    assert defaults.for_role("quality") in MODEL_NAMES
    with pytest.raises(ValueError, match="role"):
        defaults.for_role("chat")
    assert builtin_of(tmp_path / "smolmoe-b-r1-0123abcd-Q8_0.gguf") == "smolmoe-b"
    assert builtin_of(tmp_path / "smolmoe-r1-6dbdc2b2-Q4_0.gguf") == "smolmoe"
    assert builtin_of(tmp_path / "other-r1-6dbdc2b2-Q4_0.gguf") is None
    assert builtin_of(tmp_path / "smolmoe.gguf") is None
