"""LoRE surrogates: y_e(h) ≈ α·S(h) + B·A·h per (layer, expert).

Fit targets are the routed experts' outputs recomputed in numpy from the
dequantized GGUF expert weights (`gguf.quants.dequantize`, one expert at a
time): y = down · (silu(gate · h) ⊙ (up · h)) in float32. They are float32
recomputations, not the bits ggml's quantized kernels produce (those
quantize activations first): fit targets, not a reference.

Fit for one expert, over the tokens routed to it (rows H [n, d], shared-expert
outputs S [n, d] before their gate, exact outputs Y [n, d]):
1. α starts as the least-squares coefficient of Y on S alone;
2. reduced-rank regression of Z = Y - α S on H: the ridge fit's fitted values
   are projected on their top-r right singular vectors Q, B = Q, A = (M Q)ᵀ
   with M the ridge coefficients;
3. α is refitted for that B·A; steps 2-3 alternate a few times (each step
   lowers the training error), and A is recomputed for the final α.
Without a shared expert α = 0. λ grows as the token count falls below the
width (rarely used experts are shrunk towards "shared expert alone").
Relative error ||Y - Ŷ|| / ||Y|| is measured on held-out tokens only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader
from gguf.quants import dequantize

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


def _rel_error(Y: F64, pred: F64) -> float:
    den = float(np.linalg.norm(Y))
    return float(np.linalg.norm(Y - pred)) / den if den > 0 else float("nan")


def _alpha(S: npt.NDArray[np.floating[Any]] | None, target: npt.NDArray[np.floating[Any]]) -> float:
    """Least-squares α of target ≈ α S (0 without a shared expert)."""
    if S is None:
        return 0.0
    den = float(np.vdot(S, S))
    return float(np.vdot(S, target)) / den if den > 0 else 0.0


def fit_expert(
    H: npt.ArrayLike,
    Y: npt.ArrayLike,
    S: npt.ArrayLike | None,
    ranks: Sequence[int],
    ridge: float = 1e-2,
    min_tokens: int = 4,
    *,
    iterations: int = 2,
    seed: int = 0,
) -> dict[int, tuple[float, F32, F32]]:
    """(α, A [r, d], B [d, r]) for each rank in `ranks` (rank 0 allowed: α only).

    The ridge solution's fitted values H M(Z) are never formed: their top
    right singular vectors come from a randomized range finder with one power
    iteration (M(Z) Ω = M(Z Ω), so every product is n x d x (r + 8)). α and
    the subspace are alternated `iterations` times, starting from α of S alone.
    Cost per expert: one HᵀH and a d x d inverse (or, with fewer tokens than the width,
    HHᵀ and an n x n inverse), and O(n d r) products.
    """
    # float32 products (fit targets carry f16 inputs anyway); the inverse is taken in float64
    Hf = np.asarray(H, dtype=np.float32)
    Ym = np.asarray(Y, dtype=np.float32)
    Sm = np.asarray(S, dtype=np.float32) if S is not None else None
    n, d = Hf.shape
    empty = (np.zeros((0, d), np.float32), np.zeros((d, 0), np.float32))
    if n < max(min_tokens, 1) or max(ranks, default=0) <= 0:
        a0 = _alpha(Sm, Ym) if n > 0 else 0.0
        return {r: (a0, *empty) for r in ranks}
    Hm = Hf
    if n >= d:  # primal: (HᵀH + λI)⁻¹ Hᵀ Z
        gram = (Hf.T @ Hf).astype(np.float64)
        lam = ridge * max(1.0, d / n) * max(float(np.trace(gram)) / d, 1e-12)
        ginv = np.linalg.inv(gram + lam * np.eye(d)).astype(np.float32)

        def coef(Z: npt.NDArray[Any]) -> F32:  # ridge coefficients [d, m] for targets Z [n, m]
            out: F32 = ginv @ (Hm.T @ Z.astype(np.float32, copy=False))
            return out

    else:  # dual, fewer tokens than width (wide models): Hᵀ (HHᵀ + λI)⁻¹ Z, n x n work
        kern = (Hf @ Hf.T).astype(np.float64)
        lam = ridge * max(1.0, d / n) * max(float(np.trace(kern)) / d, 1e-12)
        kinv = np.linalg.inv(kern + lam * np.eye(n)).astype(np.float32)

        def coef(Z: npt.NDArray[Any]) -> F32:
            out: F32 = Hm.T @ (kinv @ Z.astype(np.float32, copy=False))
            return out

    rmax = min(max(ranks), n, d)
    rng = np.random.default_rng(seed)
    omega = rng.standard_normal((d, min(rmax + 8, d))).astype(np.float32)
    alpha = _alpha(Sm, Ym)
    Q = np.zeros((d, 0))
    for _ in range(max(1, iterations)):
        Z = Ym - alpha * Sm if Sm is not None else Ym
        basis, _ = np.linalg.qr(Hm @ coef(Z @ omega))  # range of the fitted values F = H M(Z)
        # F = H M(Z) is linear in Z, and Fᵀ b = Zᵀ H (HᵀH+λ)⁻¹ Hᵀ b = Zᵀ (H coef(b)) by symmetry
        basis, _ = np.linalg.qr(Hm @ coef(Z @ (Z.T @ (Hm @ coef(basis)))))  # power step
        ft = Z.T @ (Hm @ coef(basis))  # Fᵀ basis [d, l]
        u, _, _ = np.linalg.svd(ft, full_matrices=False)
        Q = u[:, :rmax]  # top right singular vectors of F
        if Sm is None:
            break
        C = coef(Z @ Q)
        alpha = _alpha(Sm, Ym - (Hm @ C) @ Q.T)
    out: dict[int, tuple[float, F32, F32]] = {}
    for r in ranks:
        rr = min(r, rmax)
        if rr <= 0:
            out[r] = (_alpha(Sm, Ym), *empty)
            continue
        Qr = Q[:, :rr]
        Z = Ym - alpha * Sm if Sm is not None else Ym
        C = coef(Z @ Qr)
        a_r = alpha
        if Sm is not None:  # α for this rank, then the map for that α
            a_r = _alpha(Sm, Ym - (Hm @ C) @ Qr.T)
            C = coef((Ym - a_r * Sm) @ Qr)
        out[r] = (
            a_r,
            np.ascontiguousarray(C.T, dtype=np.float32),
            np.ascontiguousarray(Qr, dtype=np.float32),
        )
    return out


def surrogate_forward(h: npt.ArrayLike, s: npt.ArrayLike | None, alpha: float, A: F32, B: F32) -> F64:
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
            errors[r] = _rel_error(Yt, surrogate_forward(H[ntr:], St, a, A, B)) if len(test) else float("nan")
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
    return GGUFReader(path)
