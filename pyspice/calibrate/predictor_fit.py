"""Fitting the draft predictor's transitions: ridge regression with rank truncation.

For consecutive MoE layers l -> m, with X the inputs of layer l and Y those of
layer m over the same tokens (rows), the full ridge map T minimises
||Yc - Xc T||² + λ||T||² on centred data. Rank truncation is reduced-rank
regression: project the fitted values Xc T onto their top-r right singular
vectors Q, so T_r = T Q Qᵀ is the best rank-r map in the fitted-value sense.
As a Transition: V = (T Q)ᵀ, U = Q, bias = ȳ - U V x̄.

With identity=True (the default for the draft predictor) a scaled identity
is taken out first: a = <x̄c, ȳc> / <x̄c, x̄c> on centred data, and the low-rank
map is fitted to y - a x. Consecutive MoE inputs are close, so the rank is
spent on how they differ instead of on copying the input through.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pyspice.policy.predictor import Transition

F32 = npt.NDArray[np.float32]


def ridge_lambda(gram_trace: float, dim: int, ridge: float) -> float:
    """λ relative to the data's scale: `ridge` times the mean eigenvalue of the Gram matrix."""
    return float(ridge) * max(gram_trace / max(dim, 1), 1e-12)


def fit_transition(
    x: npt.ArrayLike, y: npt.ArrayLike, rank: int, ridge: float = 1e-3, *, identity: bool = False
) -> Transition:
    """Affine map y ≈ a x + bias + U V x (a = 0 unless identity) on rows of x [n, d], y [n, d]."""
    X = np.asarray(x, dtype=np.float64)
    Y = np.asarray(y, dtype=np.float64)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"x and y need the same rows, got {X.shape[0]} and {Y.shape[0]}")
    if X.shape[0] < 2:
        raise ValueError("fitting a transition needs at least 2 tokens")
    if identity and X.shape[1] != Y.shape[1]:
        raise ValueError("an identity part needs inputs and outputs of the same width")
    mx, my = X.mean(axis=0), Y.mean(axis=0)
    Xc, Yc = X - mx, Y - my
    n, d = Xc.shape
    gram = Xc.T @ Xc
    # ridge maps for the two targets the fit mixes: T(Yc - a Xc) = Ty - a Tx
    targets = np.concatenate([Yc, Xc], axis=1) if identity else Yc
    if n >= d:
        lam = ridge_lambda(float(np.trace(gram)), d, ridge)
        both = np.linalg.solve(gram + lam * np.eye(d), Xc.T @ targets)
    else:  # dual form: T = Xcᵀ (Xc Xcᵀ + λI)⁻¹ Yc, cost n²d
        kern = Xc @ Xc.T
        lam = ridge_lambda(float(np.trace(kern)), d, ridge)
        both = Xc.T @ np.linalg.solve(kern + lam * np.eye(n), targets)
    d_out = Yc.shape[1]
    Ty, Tx = both[:, :d_out], both[:, d_out:]
    r = max(1, min(rank, n, d_out))
    xx = float(np.trace(gram))
    xy = float((Xc * Yc).sum()) if identity else 0.0
    scale = xy / xx if identity and xx > 0 else 0.0
    # alternate: rank-r map for the current scale, then the scale for that map. The fitted
    # values' right singular vectors are the top eigenvectors of (Xc T)ᵀ(Xc T) = Tᵀ G T: d x d work
    # only, whatever the number of tokens (or, with fewer tokens than the width, an n x d SVD).
    for _ in range(4 if identity else 1):
        T = Ty - scale * Tx if identity else Ty
        if n >= d:
            _, vecs = np.linalg.eigh(T.T @ gram @ T)
            Q = vecs[:, ::-1][:, :r]  # [d_out, r]
        else:  # fewer tokens than the width: the n x d fitted values directly, n² d
            Q = np.linalg.svd(Xc @ T, full_matrices=False)[2][:r].T
        V = (T @ Q).T  # [r, d_in]
        if identity and xx > 0:
            # <Xc, Yc - Xc Vᵀ Qᵀ> = <Xc, Yc> - tr(G Vᵀ Qᵀ)
            scale = (xy - float((gram * (Q @ V)).sum())) / xx
    if identity:  # the rank-r part for the final scale
        V = ((Ty - scale * Tx) @ Q).T
    bias = my - scale * mx - Q @ (V @ mx)
    return Transition(
        U=Q.astype(np.float32), V=V.astype(np.float32), bias=bias.astype(np.float32), scale=scale
    )


def transition_r2(t: Transition, x: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """Share of y's variance (about its mean) the transition explains on rows x -> y."""
    Y = np.asarray(y, dtype=np.float64)
    pred = t.apply(np.asarray(x, dtype=np.float32)).astype(np.float64)
    ss_res = float(((Y - pred) ** 2).sum())
    ss_tot = float(((Y - Y.mean(axis=0)) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
