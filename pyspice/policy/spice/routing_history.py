"""The routing-history predictor: layer l+d's experts from expert ids alone, learned.

A recording of a real model's routing has expert ids but no hidden rows, so
the draft predictor cannot run on it; a model without a sidecar has none
either. Both have the ids, and in a decode the ids of the token's earlier
layers and of the previous token at every layer are known before layer l+d
routes. This predictor is a softmax regression per (MoE layer l, depth d)
over five multi-hot blocks:

    0: this token's experts at l        1: at l-1        2: at l-2
    3: the previous token's at l+d      4: the previous token's at l

(a block with nothing to say, before a sequence's first token or the first
layers, is zero), trained on soft targets (each of the k true experts 1/k)
from the co-occurrence start (block 0 = log P(f at l+d | e at l) / k). Count
tables mixed linearly (history_predictor.py) reach 0.47 recall@k at depth 1 on
DeepSeek-V2-Lite's recorded routing; this reaches about 0.63: the previous
token's experts and the earlier layers only help once their weights are
learned jointly (docs/results/real-routing.md).

Pure numpy; ids are int [T, L, k] over the MoE layers with a bool [T] marking
each sequence's first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pyspice.outputs import atomic_output
from pyspice.policy.spice.history_predictor import multi_hot, recall_at_k

F32 = npt.NDArray[np.float32]
IDS = npt.NDArray[np.integer]
FORMAT = "pyspice-routing-history-2"
BLOCKS = 5  # the feature blocks of the module's docstring
FIT_TOKENS = 40_000  # training tokens per (layer, depth), sampled from the fit part
STEPS = 80  # full-batch Adam steps
LEARNING_RATE = 0.05
L2 = 1e-4
_FLOOR = 1e-4  # co-occurrence probability floor for the starting weights


@dataclass(frozen=True)
class RoutingHistory:
    """weights [L, D, BLOCKS * E + 2, E]: per MoE layer l and depth d, the logit of each
    expert of layer l+d per active feature, then a zero row (what an absent block reads)
    and the bias (all zero where l+d >= L)."""

    n_layer: int
    n_expert: int
    k: int
    weights: F32

    @property
    def max_depth(self) -> int:
        return int(self.weights.shape[1])

    def depths(self, layer: int, depth: int) -> int:
        """How many of `depth` layers ahead of MoE layer `layer` it predicts."""
        return max(0, min(depth, self.max_depth, self.n_layer - 1 - layer))

    def logits(self, layer: int, depth: int, features: npt.NDArray[np.intp]) -> F32:
        """[n, E] logits of layer+depth for n rows of active feature indices ([n, m]; -1
        for an absent block reads the zero row)."""
        w = self.weights[layer, depth - 1]
        rows = np.where(features >= 0, features, w.shape[0] - 2)
        out: F32 = w[rows].sum(axis=1) + w[-1]
        return out

    def logits_ahead(self, layer: int, features: npt.NDArray[np.intp]) -> F32:
        """[D', E] logits of layers layer+1 .. layer+D' for one decode row's features per
        depth ([D', m]): one gather over all depths (a decode call's rollout)."""
        n = features.shape[0]
        w = self.weights[layer, :n]
        rows = np.where(features >= 0, features, w.shape[1] - 2)
        out: F32 = w[np.arange(n)[:, None], rows].sum(axis=1) + w[:, -1]
        return out

    def save(self, path: Path) -> None:
        with atomic_output(Path(path), suffix=".npz") as tmp:
            np.savez(
                tmp,
                format=np.array(FORMAT),
                shape=np.array([self.n_layer, self.n_expert, self.k], dtype=np.int64),
                weights=self.weights.astype(np.float32),
            )

    @classmethod
    def load(cls, path: Path) -> RoutingHistory:
        if not Path(path).is_file():
            raise ValueError(
                f"routing-history predictor {path} does not exist (fit one with `pyspice trace fit`)"
            )
        try:
            z = np.load(Path(path), allow_pickle=False)
        except (OSError, ValueError):
            # numpy's own words here would suggest loading the file unsafely: not ours to say
            raise ValueError(
                f"{path}: not a routing-history predictor (not a .npz of arrays); fit one with "
                "`pyspice trace fit`"
            ) from None
        with z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise ValueError(
                    f"{path}: not a routing-history predictor ({FORMAT}); refit it: `pyspice trace fit`"
                )
            n_layer, n_expert, k = (int(v) for v in z["shape"])
            weights = z["weights"].astype(np.float32)
        if weights.shape[0] != n_layer or weights.shape[2:] != (BLOCKS * n_expert + 2, n_expert):
            raise ValueError(f"{path}: weights of shape {weights.shape} do not match its header")
        return cls(n_layer, n_expert, k, weights)


def features(
    ids: IDS, prev: IDS | None, layer: int, depth: int, n_expert: int, has_prev: npt.NDArray[np.bool_]
) -> npt.NDArray[np.intp]:
    """Active feature indices [T, 5k] (-1 where a block is absent) for rows of one token
    each: ids [T, L, k] of the tokens, prev [T, L, k] of their previous tokens (has_prev
    False where there is none)."""
    n_tok, n_layer, k = ids.shape
    out = np.full((n_tok, BLOCKS, k), -1, dtype=np.intp)
    for block, src in ((0, layer), (1, layer - 1), (2, layer - 2)):
        if src >= 0:
            out[:, block] = block * n_expert + ids[:, src]
    if prev is not None:
        for block, src in ((3, layer + depth), (4, layer)):
            if src < n_layer:
                out[:, block] = np.where(has_prev[:, None], block * n_expert + prev[:, src], -1)
    return out.reshape(n_tok, BLOCKS * k)


def previous_tokens(ids: IDS, first: npt.NDArray[np.bool_]) -> tuple[IDS, npt.NDArray[np.bool_]]:
    """Each token's previous token's ids, and whether it has one (not a sequence's first)."""
    prev = np.zeros_like(ids)
    prev[1:] = ids[:-1]
    has = ~np.asarray(first, dtype=bool)
    if has.size:
        has[0] = False
    return prev, has


def _dense(feats: npt.NDArray[np.intp], width: int) -> F32:
    x = np.zeros((feats.shape[0], width), dtype=np.float32)
    rows = np.repeat(np.arange(feats.shape[0]), feats.shape[1])
    cols = feats.ravel()
    keep = cols >= 0
    x[rows[keep], cols[keep]] = 1.0
    x[:, -1] = 1.0  # bias
    return x


def _start(ids: IDS, layer: int, depth: int, n_expert: int, width: int) -> F32:
    """Starting weights: block 0 = log co-occurrence / k (the baseline's table,
    history_predictor.count_tables' `same`), everything else zero."""
    k = ids.shape[2]
    counts = multi_hot(ids[:, layer], n_expert).T @ multi_hot(ids[:, layer + depth], n_expert)
    p = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    w = np.zeros((width, n_expert), dtype=np.float32)
    w[:n_expert] = (np.log(np.maximum(p, _FLOOR)) / k).astype(np.float32)
    return w


def _train(x: F32, y: F32, w: F32) -> F32:
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for step in range(1, STEPS + 1):
        z = x @ w
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = x.T @ (p - y) / np.float32(len(x)) + np.float32(L2) * w
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= np.float32(LEARNING_RATE) * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    return w


def fit(
    ids: IDS,
    first: npt.NDArray[np.bool_],
    n_expert: int,
    max_depth: int = 4,
    *,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> RoutingHistory:
    """One softmax regression per (layer, depth) on the given (calibration) tokens."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 3 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [tokens, >= 2 MoE layers, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert ids must lie in 0..{n_expert - 1}")
    n_tok, n_layer, k = ids.shape
    max_depth = max(1, min(max_depth, n_layer - 1))
    width = BLOCKS * n_expert + 2  # features, the zero row, the bias
    weights = np.zeros((n_layer, max_depth, width, n_expert), dtype=np.float32)
    prev, has_prev = previous_tokens(ids, first)
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n_tok, FIT_TOKENS, replace=False)) if n_tok > FIT_TOKENS else np.arange(n_tok)
    jobs = [(j, d) for j in range(n_layer - 1) for d in range(1, min(max_depth, n_layer - 1 - j) + 1)]
    for done, (j, d) in enumerate(jobs):
        feats = features(ids[sample], prev[sample], j, d, n_expert, has_prev[sample])
        y = np.zeros((len(sample), n_expert), dtype=np.float32)
        np.put_along_axis(y, ids[sample, j + d], np.float32(1.0 / k), axis=1)
        weights[j, d - 1] = _train(_dense(feats, width), y, _start(ids[sample], j, d, n_expert, width))
        if progress is not None:
            progress(done + 1, len(jobs))
    return RoutingHistory(n_layer, n_expert, k, weights)


def evaluate(model: RoutingHistory, ids: IDS, first: npt.NDArray[np.bool_]) -> dict[int, float]:
    """Mean recall@k over layers, per depth, on (held-out) tokens."""
    ids = np.asarray(ids, dtype=np.int64)
    prev, has_prev = previous_tokens(ids, first)
    out: dict[int, float] = {}
    for d in range(1, model.max_depth + 1):
        rs = [
            recall_at_k(
                model.logits(j, d, features(ids, prev, j, d, model.n_expert, has_prev)), ids[:, j + d]
            )
            for j in range(model.n_layer - d)
        ]
        out[d] = float(np.mean(rs))
    return out
