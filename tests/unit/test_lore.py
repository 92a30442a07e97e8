"""LoRE fitting: a planted alpha·S + B·A·h is recovered, in the primal and the dual (n < d) form."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.calibrate.lore_fit import expert_forward, fit_expert, heldout_mask, surrogate_forward


def planted(n: int, d: int, rank: int, alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    H = rng.standard_normal((n, d)).astype(np.float32)
    S = rng.standard_normal((n, d)).astype(np.float32)
    B = rng.standard_normal((d, rank))
    A = rng.standard_normal((rank, d)) / np.sqrt(d)
    Y = (alpha * S + H @ A.T @ B.T).astype(np.float32)
    return H, S, Y


@pytest.mark.parametrize(("n", "d"), [(400, 32), (60, 96)])  # primal, then dual (fewer tokens than width)
def test_fit_recovers_planted_alpha_and_low_rank_map(n: int, d: int) -> None:
    H, S, Y = planted(n, d, rank=3, alpha=0.6, seed=n)
    fits = fit_expert(H, Y, S, ranks=[1, 3], ridge=1e-6, iterations=4)
    alpha, A, B = fits[3]
    assert alpha == pytest.approx(0.6, abs=1e-2)
    assert A.shape == (3, d) and B.shape == (d, 3)
    err = np.linalg.norm(Y - surrogate_forward(H, S, alpha, A, B)) / np.linalg.norm(Y)
    assert err < 1e-2
    a1, A1, B1 = fits[1]  # one rank short of the planted map: clearly worse
    assert np.linalg.norm(Y - surrogate_forward(H, S, a1, A1, B1)) / np.linalg.norm(Y) > 10 * err


def test_no_shared_expert_means_no_alpha_and_few_tokens_mean_rank_zero() -> None:
    H, _, Y = planted(200, 16, rank=2, alpha=0.0, seed=1)
    alpha, A, _ = fit_expert(H, Y, None, ranks=[2], ridge=1e-6)[2]
    assert alpha == 0.0 and A.shape == (2, 16)
    alpha, A, B = fit_expert(H[:2], Y[:2], None, ranks=[4], min_tokens=4)[4]
    assert A.shape == (0, 16) and B.shape == (16, 0)


def test_expert_forward_is_swiglu_and_heldout_blocks() -> None:
    rng = np.random.default_rng(2)
    h = rng.standard_normal((3, 8)).astype(np.float32)
    gate, up = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    down = rng.standard_normal((8, 4)).astype(np.float32)
    g = h @ gate.T
    ref = (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T
    np.testing.assert_allclose(expert_forward(h, gate, up, down), ref, rtol=1e-5)
    mask = heldout_mask(640, 5)
    assert mask.sum() == 128 and mask[256:320].all() and not mask[:256].any()
