"""LoRE surrogates: y_e(h) ≈ α·S(h) + B·A·h per (layer, expert).

Fit targets are the routed experts' outputs recomputed in numpy from the
dequantized GGUF expert weights (`gguf.quants.dequantize`, one expert at a
time): y = down · (silu(gate · h) ⊙ (up · h)) in float32. They are float32
recomputations, not the bits ggml's quantized kernels produce (those
quantize activations first): fit targets, not a reference.

Fit for one expert, over the tokens routed to it (rows H [n, d], shared-expert
outputs S [n, d] before their gate, exact outputs Y [n, d]):
1. ridge regression of Y and S on H gives residuals; α is the least-squares
   coefficient of S's residual on Y's (so α, like B·A, is chosen jointly);
2. reduced-rank regression of Z = Y - α S on H: the ridge fit's fitted values
   are projected on their top-r right singular vectors Q, B = Q, A = (M Q)ᵀ
   with M the ridge coefficients;
3. α is refitted for the rank-r B·A, and A recomputed for that α.
Without a shared expert α = 0. λ grows as the token count falls below the
width (rarely used experts are shrunk towards "shared expert alone").
Relative error ||Y - Ŷ|| / ||Y|| is measured on held-out tokens only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


class LayerExperts:
    """One MoE layer's routed experts of a GGUF, dequantized one expert at a time."""

    def __init__(self, reader: Any, layer: int) -> None:
        tensors = {t.name: t for t in reader.tensors}
        try:
            self._gate = tensors[f"blk.{layer}.ffn_gate_exps.weight"]
            self._up = tensors[f"blk.{layer}.ffn_up_exps.weight"]
            self._down = tensors[f"blk.{layer}.ffn_down_exps.weight"]
        except KeyError as exc:
            raise ValueError(f"layer {layer} has no routed expert tensors ({exc})") from None
        self.layer = layer
        self.n_embd = int(self._gate.shape[0])
        self.n_ff = int(self._gate.shape[1])
        self.n_expert = int(self._gate.shape[2])

    @staticmethod
    def _one(tensor: Any, e: int, rows: int, cols: int) -> F32:
        from gguf.quants import dequantize

        raw = np.asarray(tensor.data)[e]
        out = dequantize(raw, tensor.tensor_type)
        return np.ascontiguousarray(np.asarray(out, dtype=np.float32).reshape(rows, cols))

    def weights(self, e: int) -> tuple[F32, F32, F32]:
        """(gate [n_ff, n_embd], up [n_ff, n_embd], down [n_embd, n_ff]) of expert e, float32."""
        return (
            self._one(self._gate, e, self.n_ff, self.n_embd),
            self._one(self._up, e, self.n_ff, self.n_embd),
            self._one(self._down, e, self.n_embd, self.n_ff),
        )

    def bytes_per_expert(self) -> int:
        return int(sum(np.asarray(t.data)[0].nbytes for t in (self._gate, self._up, self._down)))


def expert_forward(h: npt.ArrayLike, gate: F32, up: F32, down: F32) -> F32:
    """SwiGLU expert output rows for input rows h [n, n_embd] (float32)."""
    x = np.asarray(h, dtype=np.float32)
    g = x @ gate.T
    act = g / (1.0 + np.exp(-g)) * (x @ up.T)
    out: F32 = act @ down.T
    return out


@dataclass(frozen=True)
class LoreConfig:
    rank: int = 8  # rank stored in the sidecar
    report_ranks: tuple[int, ...] = (1, 2, 4, 8)  # held-out errors measured at these ranks too
    ridge: float = 1e-2  # λ = ridge · mean eigenvalue of HᵀH · max(1, n_embd / n)
    max_train_tokens: int = 2048  # per expert
    max_heldout_tokens: int = 512  # per expert
    min_tokens: int = 4  # fewer: rank 0 (α only)
    heldout_every: int = 5  # token blocks of 64: every 5th is held out
    seed: int = 0


@dataclass
class ExpertFit:
    alpha: float
    A: F32  # [r, n_embd]
    B: F32  # [n_embd, r]
    n_train: int
    n_heldout: int
    error: float  # held-out relative error at the stored rank (nan: no held-out tokens)
    error_by_rank: dict[int, float] = field(default_factory=dict)
    error_shared: float = float("nan")  # S alone (α = 1)
    error_drop: float = 1.0


class _Ridge:
    """Ridge regression on rows H, in primal (n >= d) or dual (n < d) form."""

    def __init__(self, H: F64, lam_scale: float) -> None:
        self.H = H
        n, d = H.shape
        self.primal = n >= d
        if self.primal:
            gram = H.T @ H
            lam = lam_scale * max(float(np.trace(gram)) / d, 1e-12)
            self._chol = np.linalg.cholesky(gram + lam * np.eye(d))
        else:
            kern = H @ H.T
            lam = lam_scale * max(float(np.trace(kern)) / d, 1e-12)
            self._chol = np.linalg.cholesky(kern + lam * np.eye(n))

    def _solve(self, rhs: F64) -> F64:
        y = np.linalg.solve(self._chol, rhs)
        out: F64 = np.linalg.solve(self._chol.T, y)
        return out

    def coef(self, Z: F64) -> F64:
        """M [d, m] minimising ||Z - H M||² + λ||M||² for targets Z [n, m]."""
        if self.primal:
            return self._solve(self.H.T @ Z)
        out: F64 = self.H.T @ self._solve(Z)
        return out

    def fitted(self, Z: F64) -> F64:
        out: F64 = self.H @ self.coef(Z)
        return out


def _rel_error(Y: F64, pred: F64) -> float:
    den = float(np.linalg.norm(Y))
    return float(np.linalg.norm(Y - pred)) / den if den > 0 else float("nan")


def fit_expert(
    H: npt.ArrayLike,
    Y: npt.ArrayLike,
    S: npt.ArrayLike | None,
    ranks: Sequence[int],
    ridge: float = 1e-2,
    min_tokens: int = 4,
) -> dict[int, tuple[float, F32, F32]]:
    """(α, A [r, d], B [d, r]) for each rank in `ranks` (rank 0 allowed: α only)."""
    Hm = np.asarray(H, dtype=np.float64)
    Ym = np.asarray(Y, dtype=np.float64)
    Sm = np.asarray(S, dtype=np.float64) if S is not None else None
    n, d = Hm.shape
    out: dict[int, tuple[float, F32, F32]] = {}

    def alpha_for(resid_target: F64) -> float:
        if Sm is None:
            return 0.0
        den = float((Sm * Sm).sum())
        return float((Sm * resid_target).sum()) / den if den > 0 else 0.0

    if n < max(min_tokens, 1):
        a0 = alpha_for(Ym) if n > 0 else 0.0
        for r in ranks:
            out[r] = (a0, np.zeros((0, d), np.float32), np.zeros((d, 0), np.float32))
        return out
    ridge_ = _Ridge(Hm, ridge * max(1.0, d / n))
    alpha = 0.0
    if Sm is not None:
        ry = Ym - ridge_.fitted(Ym)
        rs = Sm - ridge_.fitted(Sm)
        den = float((rs * rs).sum())
        alpha = float((rs * ry).sum()) / den if den > 0 else 0.0
    Z = Ym - alpha * Sm if Sm is not None else Ym
    fitted = ridge_.fitted(Z)
    _, _, vt = np.linalg.svd(fitted, full_matrices=False)
    for r in ranks:
        rr = min(r, vt.shape[0])
        if rr <= 0:
            out[r] = (alpha_for(Ym), np.zeros((0, d), np.float32), np.zeros((d, 0), np.float32))
            continue
        Q = vt[:rr].T  # [d, r]
        C = ridge_.coef(Z @ Q)  # [d, r]: h -> code
        a_r = alpha_for(Ym - Hm @ C @ Q.T) if Sm is not None else 0.0
        if Sm is not None:
            C = ridge_.coef((Ym - a_r * Sm) @ Q)
        out[r] = (a_r, np.ascontiguousarray(C.T, dtype=np.float32), np.ascontiguousarray(Q, dtype=np.float32))
    return out


def surrogate_apply(h: npt.ArrayLike, s: npt.ArrayLike | None, alpha: float, A: F32, B: F32) -> F64:
    """α·S + B·A·h for rows h [n, d] (numpy reference of the executor's arithmetic)."""
    x = np.asarray(h, dtype=np.float64)
    out: F64 = (x @ A.T.astype(np.float64)) @ B.T.astype(np.float64)
    if s is not None and alpha != 0.0:
        out = out + alpha * np.asarray(s, dtype=np.float64)
    return out


def heldout_mask(n_tokens: int, every: int, block: int = 64) -> npt.NDArray[np.bool_]:
    """Tokens in every `every`-th block of `block` tokens are held out (contiguous text, not
    interleaved single tokens, so held-out tokens are not neighbours of training ones)."""
    mask: npt.NDArray[np.bool_] = (np.arange(n_tokens) // block) % every == every - 1
    return mask


@dataclass
class LayerFit:
    layer: int
    experts: list[ExpertFit]
    expert_bytes: int


def fit_layer(
    experts: LayerExperts,
    hidden: npt.ArrayLike,
    ids: npt.ArrayLike,
    shared: npt.ArrayLike | None,
    config: LoreConfig,
) -> LayerFit:
    """Fit every expert of one layer from its trace rows (hidden [T, d], ids [T, k], shared [T, d])."""
    Hall = np.asarray(hidden)
    ids_ = np.asarray(ids)
    Sall = np.asarray(shared) if shared is not None else None
    T = Hall.shape[0]
    held = heldout_mask(T, config.heldout_every)
    rng = np.random.default_rng(config.seed + experts.layer)
    ranks = sorted({config.rank, *config.report_ranks})
    fits: list[ExpertFit] = []
    for e in range(experts.n_expert):
        routed = (ids_ == e).any(axis=1)
        train = np.flatnonzero(routed & ~held)
        test = np.flatnonzero(routed & held)
        if len(train) > config.max_train_tokens:
            train = np.sort(rng.choice(train, config.max_train_tokens, replace=False))
        if len(test) > config.max_heldout_tokens:
            test = np.sort(rng.choice(test, config.max_heldout_tokens, replace=False))
        gate, up, down = experts.weights(e)
        rows = np.concatenate([train, test])
        H = Hall[rows].astype(np.float32)
        Y = expert_forward(H, gate, up, down)
        S = Sall[rows].astype(np.float32) if Sall is not None else None
        ntr = len(train)
        per_rank = fit_expert(
            H[:ntr], Y[:ntr], S[:ntr] if S is not None else None, ranks, config.ridge, config.min_tokens
        )
        Yt = Y[ntr:].astype(np.float64)
        St = S[ntr:] if S is not None else None
        errors: dict[int, float] = {}
        for r, (a, A, B) in per_rank.items():
            errors[r] = _rel_error(Yt, surrogate_apply(H[ntr:], St, a, A, B)) if len(test) else float("nan")
        alpha, A, B = per_rank[config.rank]
        fits.append(
            ExpertFit(
                alpha=alpha,
                A=A,
                B=B,
                n_train=ntr,
                n_heldout=len(test),
                error=errors[config.rank],
                error_by_rank=errors,
                error_shared=(
                    _rel_error(Yt, St.astype(np.float64)) if St is not None and len(test) else float("nan")
                ),
                error_drop=1.0 if len(test) else float("nan"),
            )
        )
    return LayerFit(experts.layer, fits, experts.bytes_per_expert())


def open_gguf(path: str | os.PathLike[str]) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def iter_layers(reader: Any, layers: Sequence[int]) -> Iterator[LayerExperts]:
    for il in layers:
        yield LayerExperts(reader, il)
