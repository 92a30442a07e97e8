"""Fitting the draft predictor's transitions: ridge regression with rank truncation.

For consecutive MoE layers l -> m, with X the inputs of layer l and Y those of
layer m over the same tokens (rows), the full ridge map T minimises
||Yc - Xc T||² + λ||T||² on centred data. Rank truncation is reduced-rank
regression: project the fitted values Xc T onto their top-r right singular
vectors Q, so T_r = T Q Qᵀ is the best rank-r map in the fitted-value sense.
As a Transition: V = (T Q)ᵀ, U = Q, bias = ȳ - U V x̄.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pyspice.policy.predictor import Transition

F32 = npt.NDArray[np.float32]


def ridge_lambda(gram_trace: float, dim: int, ridge: float) -> float:
    """λ relative to the data's scale: `ridge` times the mean eigenvalue of the Gram matrix."""
    return float(ridge) * max(gram_trace / max(dim, 1), 1e-12)


def fit_transition(x: npt.ArrayLike, y: npt.ArrayLike, rank: int, ridge: float = 1e-3) -> Transition:
    """Low-rank affine map y ≈ bias + U V x fitted on rows of x [n, d_in], y [n, d_out]."""
    X = np.asarray(x, dtype=np.float64)
    Y = np.asarray(y, dtype=np.float64)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"x and y need the same rows, got {X.shape[0]} and {Y.shape[0]}")
    if X.shape[0] < 2:
        raise ValueError("fitting a transition needs at least 2 tokens")
    mx, my = X.mean(axis=0), Y.mean(axis=0)
    Xc, Yc = X - mx, Y - my
    n, d = Xc.shape
    if n >= d:
        gram = Xc.T @ Xc
        lam = ridge_lambda(float(np.trace(gram)), d, ridge)
        T = np.linalg.solve(gram + lam * np.eye(d), Xc.T @ Yc)  # [d_in, d_out]
    else:  # dual form: T = Xcᵀ (Xc Xcᵀ + λI)⁻¹ Yc, cost n²d
        kern = Xc @ Xc.T
        lam = ridge_lambda(float(np.trace(kern)), d, ridge)
        T = Xc.T @ np.linalg.solve(kern + lam * np.eye(n), Yc)
    fitted = Xc @ T
    r = max(1, min(rank, *fitted.shape))
    _, _, vt = np.linalg.svd(fitted, full_matrices=False)
    Q = vt[:r].T  # [d_out, r]
    V = (T @ Q).T  # [r, d_in]
    bias = my - Q @ (V @ mx)
    return Transition(U=Q.astype(np.float32), V=V.astype(np.float32), bias=bias.astype(np.float32))


def transition_r2(t: Transition, x: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """Share of y's variance (about its mean) the transition explains on rows x -> y."""
    Y = np.asarray(y, dtype=np.float64)
    pred = t.apply(np.asarray(x, dtype=np.float32)).astype(np.float64)
    ss_res = float(((Y - pred) ** 2).sum())
    ss_tot = float(((Y - Y.mean(axis=0)) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
