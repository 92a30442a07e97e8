"""The routing-history predictor on synthetic id traces with planted structure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.policy.spice.history_predictor import (
    HistoryPredictor,
    cooccurrence_baseline,
    evaluate,
    fit,
    recall_at_k,
)

E, K, L = 16, 2, 4


def planted_layer_rule(n_tok: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer l+1's experts are a fixed permutation of layer l's: co-occurrence is exact."""
    rng = np.random.default_rng(seed)
    perm = np.random.default_rng(0).permutation(E)
    ids = np.zeros((n_tok, L, K), dtype=np.int64)
    for t in range(n_tok):
        ids[t, 0] = rng.choice(E, K, replace=False)
        for layer in range(1, L):
            ids[t, layer] = perm[ids[t, layer - 1]]
    first = np.zeros(n_tok, dtype=bool)
    first[::50] = True
    return ids, first


def planted_token_rule(n_tok: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's ids repeat the previous token's at that layer (layers independent):
    only the token history predicts, co-occurrence cannot."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n_tok, L, K), dtype=np.int64)
    first = np.zeros(n_tok, dtype=bool)
    first[::50] = True
    for t in range(n_tok):
        for layer in range(L):
            if first[t] or rng.random() < 0.1:
                ids[t, layer] = rng.choice(E, K, replace=False)
            else:
                ids[t, layer] = ids[t - 1, layer]
    return ids, first


def test_recall_at_k_counts_overlap() -> None:
    scores = np.array([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.8, 0.9]])
    truth = np.array([[0, 2], [2, 3]])
    assert recall_at_k(scores, truth) == pytest.approx(0.75)


def test_layer_rule_is_recalled_exactly() -> None:
    ids, first = planted_layer_rule(2000, 1)
    pred = fit(ids, first, E)
    held_ids, held_first = planted_layer_rule(500, 2)
    rec = evaluate(pred, held_ids, held_first)
    assert rec[1] == pytest.approx(1.0)
    assert rec[3] == pytest.approx(1.0)


def test_token_history_beats_cooccurrence() -> None:
    ids, first = planted_token_rule(3000, 3)
    pred = fit(ids, first, E)
    held_ids, held_first = planted_token_rule(1000, 4)
    rec = evaluate(pred, held_ids, held_first)
    base = evaluate(cooccurrence_baseline(pred), held_ids, held_first)
    assert base[1] < 0.3  # layers are independent: about k/E
    assert rec[1] > 0.8  # 90% of tokens repeat the previous one
    assert pred.weights[0][1] > 0.0  # the fit chose the history term


def test_save_load_round_trip(tmp_path: Path) -> None:
    ids, first = planted_layer_rule(500, 5)
    pred = fit(ids, first, E)
    path = tmp_path / "hist.npz"
    pred.save(path)
    back = HistoryPredictor.load(path)
    assert (back.n_layer, back.n_expert, back.k) == (L, E, K)
    np.testing.assert_array_equal(back.predict(0, 1, ids[:10, 0]), pred.predict(0, 1, ids[:10, 0]))


def test_load_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "other.npz"
    np.savez(path, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a routing-history predictor"):
        HistoryPredictor.load(path)


def test_out_of_range_ids_are_refused() -> None:
    ids, first = planted_layer_rule(100, 6)
    with pytest.raises(ValueError, match="expert ids must lie"):
        fit(ids, first, E - 4)
