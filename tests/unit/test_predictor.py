"""Draft predictor: transition fitting recovers a planted low-rank map; rollout algebra."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.calibrate.predictor_fit import fit_transition, transition_r2
from pyspice.policy.predictor import DraftPredictor, Transition, gate_probs


def test_fit_recovers_a_planted_low_rank_map() -> None:
    rng = np.random.default_rng(0)
    d, r, n = 24, 3, 400
    U = rng.standard_normal((d, r))
    V = rng.standard_normal((r, d))
    c = rng.standard_normal(d)
    X = rng.standard_normal((n, d))
    Y = X @ (U @ V).T + c + 1e-3 * rng.standard_normal((n, d))
    t = fit_transition(X, Y, rank=r, ridge=1e-6)
    assert t.rank == r
    np.testing.assert_allclose(t.U @ t.V, U @ V, atol=1e-2)
    np.testing.assert_allclose(t.bias, c, atol=1e-2)
    assert transition_r2(t, X, Y) > 0.999
    # too small a rank cannot explain it; the dual form (n < d) gives the same answer
    assert transition_r2(fit_transition(X, Y, rank=1), X, Y) < 0.9
    t_dual = fit_transition(X[:20], Y[:20], rank=r, ridge=1e-6)
    assert t_dual.U.shape == (d, r)


def test_fit_with_identity_recovers_scale_plus_low_rank() -> None:
    rng = np.random.default_rng(5)
    d, r, n = 20, 2, 500
    U, V = rng.standard_normal((d, r)), rng.standard_normal((r, d))
    X = rng.standard_normal((n, d))
    Y = 0.7 * X + 0.2 * X @ (U @ V).T + 0.5
    t = fit_transition(X, Y, rank=r, ridge=1e-8, identity=True)
    assert transition_r2(t, X, Y) > 0.999
    # without the identity part, rank 2 cannot carry 0.7·I
    assert transition_r2(fit_transition(X, Y, rank=r, ridge=1e-8), X, Y) < 0.9


def _predictor(rng: np.random.Generator, d: int = 16, e: int = 8, rank: int = 4) -> DraftPredictor:
    layers = [0, 1, 3, 4]
    routers = {il: rng.standard_normal((e, d)).astype(np.float32) for il in layers}
    trans = {
        il: Transition(
            rng.standard_normal((d, rank)).astype(np.float32) * 0.3,
            rng.standard_normal((rank, d)).astype(np.float32) * 0.3,
            rng.standard_normal(d).astype(np.float32),
            scale=0.5,
        )
        for il in layers[:-1]
    }
    return DraftPredictor(layers, routers, trans)


def test_rollout_matches_the_explicit_chain() -> None:
    rng = np.random.default_rng(1)
    p = _predictor(rng)
    h = rng.standard_normal(16).astype(np.float32)
    out = p.rollout(0, h, 5)
    assert [m for m, _ in out] == [1, 3, 4]  # stops at the last MoE layer
    x = h.astype(np.float64)
    for (m, probs), src in zip(out, [0, 1, 3], strict=True):
        t = p.transitions[src]
        x = t.scale * x + t.bias + t.U @ (t.V @ x)
        ref = gate_probs((p.routers[m] @ x).astype(np.float32))
        np.testing.assert_allclose(probs, ref, rtol=1e-4, atol=1e-6)
        assert abs(float(probs.sum()) - 1.0) < 1e-5
    # batched rows give the same as one row at a time
    H = rng.standard_normal((3, 16)).astype(np.float32)
    batch = p.rollout(1, H, 2)
    for i in range(3):
        single = p.rollout(1, H[i], 2)
        for (_, pb), (_, ps) in zip(batch, single, strict=True):
            np.testing.assert_allclose(pb[i], ps, rtol=1e-5, atol=1e-7)


def test_baseline_and_confidence() -> None:
    rng = np.random.default_rng(2)
    p = _predictor(rng)
    h = rng.standard_normal(16).astype(np.float32)
    base = p.baseline(1, h, 3)
    assert [m for m, _ in base] == [3, 4]
    np.testing.assert_allclose(base[0][1], gate_probs(p.routers[3] @ h), rtol=1e-5)
    probs = np.array([0.5, 0.2, 0.2, 0.1], dtype=np.float32)
    assert abs(DraftPredictor.confidence(probs, 2) - 0.7) < 1e-6
    assert DraftPredictor.confidence(probs, 4) == 1.0
    assert p.rollout(4, h, 2) == []


def test_max_depth_cuts_the_rollout() -> None:
    rng = np.random.default_rng(4)
    full = _predictor(rng)
    short = DraftPredictor(full.moe_layers, full.routers, full.transitions, max_depth=2)
    h = rng.standard_normal(16).astype(np.float32)
    assert [m for m, _ in short.rollout(0, h, 3)] == [1, 3]
    for (_, a), (_, b) in zip(short.rollout(0, h, 2), full.rollout(0, h, 2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_rollout_with_confidence_matches_rollout() -> None:
    rng = np.random.default_rng(6)
    p = _predictor(rng)
    h = rng.standard_normal(16).astype(np.float32)
    both = p.rollout_with_confidence(0, h, 3, k=3)
    for (m, probs), (m2, probs2, conf) in zip(p.rollout(0, h, 3), both, strict=True):
        assert m == m2
        np.testing.assert_array_equal(probs, probs2)
        assert conf == pytest.approx(DraftPredictor.confidence(probs, 3), rel=1e-5)


def test_dropping_the_routers_keeps_every_rollout_and_reads_them_again_when_asked() -> None:
    """Once composed, rollouts need only the maps: drop_routers lets the routers go
    (edge mode's memory) and the baseline, which applies them, reads from the source."""
    rng = np.random.default_rng(7)
    p = _predictor(rng)
    kept = dict(p.routers)
    h = rng.standard_normal(16).astype(np.float32)
    rollout = p.rollout(0, h, 3)
    baseline = p.baseline(0, h, 2)
    reads: list[int] = []

    def source(layer: int) -> np.ndarray | None:
        reads.append(layer)
        return kept.get(layer)

    p.drop_routers(source)
    assert (p.n_expert, p.n_embd) == (8, 16)
    for (m, a), (m2, b) in zip(p.rollout(0, h, 3), rollout, strict=True):
        assert m == m2
        np.testing.assert_array_equal(a, b)
    assert reads == []  # a rollout reads none
    for (m, a), (m2, b) in zip(p.baseline(0, h, 2), baseline, strict=True):
        assert m == m2
        np.testing.assert_array_equal(a, b)
    assert reads == [1, 3]
    with pytest.raises(KeyError):
        p.routers[2]  # not a MoE layer of this predictor
