"""The learned routing-history predictor: it finds rules the co-occurrence table cannot,
saves and loads, and its decode-time look-ahead sees the features it was fitted on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.policy.spice import history_predictor, routing_history
from pyspice.policy.spice.history_lookahead import HistoryLookahead

E, K = 16, 4


def _blocks(b: np.ndarray) -> np.ndarray:
    return (b[:, None] % 4) * 4 + np.arange(K)


def planted(n: int = 600, seq: int = 50, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0 picks a random block; layer 1 the block after the previous token's layer-1
    block (time, not layer 0, decides it); layer 2 layer 0's block again."""
    rng = np.random.default_rng(seed)
    b0 = rng.integers(0, 4, size=n)
    b1 = np.zeros(n, dtype=np.int64)
    first = np.zeros(n, dtype=bool)
    first[::seq] = True
    for t in range(n):
        b1[t] = rng.integers(0, 4) if first[t] else (b1[t - 1] + 1) % 4
    ids = np.stack([_blocks(b0), _blocks(b1), _blocks(b0)], axis=1).astype(np.int32)
    return ids, first


def test_it_learns_what_the_previous_token_says_and_counts_cannot() -> None:
    ids, first = planted()
    cut = 500
    model = routing_history.fit(ids[:cut], first[:cut], E, max_depth=2)
    ours = routing_history.evaluate(model, ids[cut:], first[cut:])
    baseline = history_predictor.cooccurrence(ids[:cut], first[:cut], E, 2)
    base = history_predictor.evaluate(baseline, ids[cut:], first[cut:])
    # depth 1 averages layer 0 -> 1 (the previous token decides: 1.0 against chance) and
    # layer 1 -> 2 (layer 2 repeats layer 0, two layers back: block 1 of the features)
    assert ours[1] > 0.95 and base[1] < 0.7
    assert ours[2] > 0.95  # layer 0 -> 2: the same block


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    ids, first = planted(200)
    model = routing_history.fit(ids, first, E, max_depth=1)
    path = tmp_path / "h.npz"
    model.save(path)
    back = routing_history.RoutingHistory.load(path)
    assert (back.n_layer, back.n_expert, back.k) == (3, E, K)
    assert np.array_equal(back.weights, model.weights)
    (tmp_path / "bad.npz").write_bytes(b"not a file of arrays")
    with pytest.raises(ValueError, match="pyspice trace fit"):
        routing_history.RoutingHistory.load(tmp_path / "bad.npz")


def test_the_decode_lookahead_sees_the_fitted_features() -> None:
    ids, first = planted()
    model = routing_history.fit(ids, first, E, max_depth=2)
    look = HistoryLookahead(model, [1, 2, 3])  # the model's MoE layers 1..3
    prev, has_prev = routing_history.previous_tokens(ids.astype(np.int64), first)
    for t in range(3):  # one sequence's first tokens, in decode order
        for j, il in enumerate((1, 2, 3)):
            look.observe(il, ids[t, j][None])
            rolled = look.rollout_logits(il, ids[t, j], 8)
            assert [layer for layer, _ in rolled] == [1 + j + d for d in range(1, min(2, 2 - j) + 1)]
            for d, (_layer, logits) in enumerate(rolled, 1):
                row = slice(t, t + 1)
                feats = routing_history.features(ids[row], prev[row], j, d, E, has_prev[row])
                np.testing.assert_allclose(logits, model.logits(j, d, feats)[0], rtol=1e-5, atol=1e-5)
    look.reset()
    assert (look.previous == -1).all() and look.last == -1
    with pytest.raises(ValueError, match="fitted on 3 MoE layers"):
        HistoryLookahead(model, [1, 2])
