"""Count tables of routing history, and the co-occurrence baseline they give.

SPICE's ids-only look-ahead is the learned predictor of routing_history.py;
these tables are what its recall is reported beside (`pyspice trace fit`):
mixed linearly, they reach only the co-occurrence baseline's recall (0.472
against 0.469 at depth 1 on DeepSeek-V2-Lite's recorded routing), which is
why the learned one exists.

A recording of a real model's routing carries expert ids but no hidden rows,
so the draft predictor (which rolls hidden states forward through the target's
routers) cannot run on it. This predictor reads what such a trace has:

- the same token's ids at layer l (the layer being routed now), through the
  co-occurrence P(f at l+d | e at l), counted per layer pair and depth;
- the previous token's ids at layer l+d (consecutive tokens of one sequence
  reuse experts), through P(f at l+d, token t | e' at l+d, token t-1);
- the layer's popularity P(f at l+d), a prior for rare pairs.

Each source is a row-normalised count matrix, so a token's score for expert f
is a mean of conditional probabilities; the three are mixed per depth with
weights chosen on a slice of the calibration tokens (a small simplex grid,
highest recall@k wins). With the prior and history weights at zero it is the
co-occurrence baseline (layer l's ids -> layer l+1's) the recall is reported
beside.

Pure numpy; ids arrays are int [T, L, k] with a bool [T] marking each
sequence's first token (whose previous-token history is empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pyspice.outputs import atomic_output

IDS = npt.NDArray[np.integer]
F64 = npt.NDArray[np.float64]
FORMAT = "pyspice-history-predictor-1"
# mixing weights tried per depth: the simplex in steps of 0.1 (66 points)
GRID_STEP = 0.1


def multi_hot(ids: IDS, n_expert: int) -> F64:
    """[T, k] ids -> [T, E] 0/1 rows."""
    out = np.zeros((ids.shape[0], n_expert), dtype=np.float64)
    np.put_along_axis(out, ids.astype(np.int64), 1.0, axis=1)
    return out


def _row_normalise(counts: F64) -> F64:
    total = counts.sum(axis=-1, keepdims=True)
    out: F64 = counts / np.maximum(total, 1.0)
    return out


def _previous_rows(hot: F64, first: npt.NDArray[np.bool_]) -> F64:
    """Row t holds row t-1, zero at each sequence's first token."""
    prev = np.zeros_like(hot)
    prev[1:] = hot[:-1]
    prev[first] = 0.0
    return prev


def recall_at_k(scores: npt.NDArray[np.floating], truth: IDS) -> float:
    """Mean share of the true k ids among the k highest scores."""
    k = truth.shape[1]
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    hits = (top[:, :, None] == truth[:, None, :]).any(axis=2).sum()
    return float(hits) / float(truth.size)


@dataclass(frozen=True)
class HistoryPredictor:
    """Count tables per (layer, depth) and the mixing weights per depth.

    same [D, L, E, E]: P(f at l+d | e at l) (rows for l+d >= L stay zero);
    prev [L, E, E]: P(f at l, token t | e at l, token t-1);
    prior [L, E]: P(f at l); weights [D, 3]: (same, prev, prior) per depth."""

    n_layer: int
    n_expert: int
    k: int
    same: F64
    prev: F64
    prior: F64
    weights: F64

    @property
    def max_depth(self) -> int:
        return int(self.same.shape[0])

    def sources(
        self, layer: int, depth: int, ids_now: IDS, ids_prev_target: F64 | None
    ) -> tuple[F64, F64, F64]:
        """The three per-token score sources for layer+depth ([T, E] each)."""
        target = layer + depth
        if not 1 <= depth <= self.max_depth or layer < 0 or target >= self.n_layer:
            raise ValueError(
                f"layer {layer} + depth {depth} is outside 0..{self.n_layer - 1} (max depth {self.max_depth})"
            )
        hot_now = multi_hot(ids_now, self.n_expert)
        same = hot_now @ self.same[depth - 1, layer] / self.k
        if ids_prev_target is None:
            prev = np.zeros_like(same)
        else:
            prev = ids_prev_target @ self.prev[target] / self.k
        prior = np.broadcast_to(self.prior[target], same.shape)
        return same, prev, prior

    def scores(self, layer: int, depth: int, ids_now: IDS, prev_target: F64 | None = None) -> F64:
        """[T, E] scores of layer+depth's experts. ids_now: [T, k] ids at `layer`;
        prev_target: [T, E] multi-hot of the previous token's ids at layer+depth
        (None or a zero row where there is no previous token)."""
        same, prev, prior = self.sources(layer, depth, ids_now, prev_target)
        w = self.weights[depth - 1]
        out: F64 = w[0] * same + w[1] * prev + w[2] * prior
        return out

    def predict(
        self, layer: int, depth: int, ids_now: IDS, prev_target: F64 | None = None, top: int | None = None
    ) -> IDS:
        """[T, top] predicted expert ids of layer+depth, best first (top defaults to k)."""
        s = self.scores(layer, depth, ids_now, prev_target)
        n = self.k if top is None else top
        return np.argsort(-s, axis=1, kind="stable")[:, :n]

    def save(self, path: Path) -> None:
        """One .npz file, written atomically."""
        with atomic_output(Path(path), suffix=".npz") as tmp:
            np.savez(
                tmp,
                format=np.array(FORMAT),
                shape=np.array([self.n_layer, self.n_expert, self.k], dtype=np.int64),
                same=self.same.astype(np.float32),
                prev=self.prev.astype(np.float32),
                prior=self.prior.astype(np.float32),
                weights=self.weights,
            )

    @classmethod
    def load(cls, path: Path) -> HistoryPredictor:
        with np.load(Path(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise ValueError(
                    f"{path}: not a routing-history predictor ({FORMAT}); refit it from its trace"
                )
            n_layer, n_expert, k = (int(v) for v in z["shape"])
            return cls(
                n_layer=n_layer,
                n_expert=n_expert,
                k=k,
                same=z["same"].astype(np.float64),
                prev=z["prev"].astype(np.float64),
                prior=z["prior"].astype(np.float64),
                weights=z["weights"].astype(np.float64),
            )


def _check(ids: IDS, first: npt.NDArray[np.bool_], n_expert: int) -> None:
    if ids.ndim != 3:
        raise ValueError(f"ids must be [tokens, layers, k], got shape {ids.shape}")
    if first.shape != (ids.shape[0],):
        raise ValueError(f"first must be [tokens] ({ids.shape[0]}), got shape {first.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert ids must lie in 0..{n_expert - 1}")


def count_tables(
    ids: IDS, first: npt.NDArray[np.bool_], n_expert: int, max_depth: int
) -> tuple[F64, F64, F64]:
    """Row-normalised (same, prev, prior) tables from a trace's ids."""
    _check(ids, first, n_expert)
    n_layer = ids.shape[1]
    hot = [multi_hot(ids[:, layer], n_expert) for layer in range(n_layer)]
    same = np.zeros((max_depth, n_layer, n_expert, n_expert))
    prev = np.zeros((n_layer, n_expert, n_expert))
    prior = np.zeros((n_layer, n_expert))
    for layer in range(n_layer):
        prior[layer] = hot[layer].sum(axis=0)
        prev[layer] = _previous_rows(hot[layer], first).T @ hot[layer]
        for depth in range(1, max_depth + 1):
            if layer + depth < n_layer:
                same[depth - 1, layer] = hot[layer].T @ hot[layer + depth]
    return _row_normalise(same), _row_normalise(prev), _row_normalise(prior)


def _grid(step: float) -> F64:
    n = round(1.0 / step)
    pts = [(a / n, b / n, (n - a - b) / n) for a in range(n + 1) for b in range(n + 1 - a)]
    return np.array(pts, dtype=np.float64)


def fit(
    ids: IDS, first: npt.NDArray[np.bool_], n_expert: int, max_depth: int = 3, tune_share: float = 0.2
) -> HistoryPredictor:
    """Fit on calibration tokens: the tables on the first (1 - tune_share) of
    them, the weights on the rest, then the tables again on all of them."""
    ids = np.asarray(ids)
    first = np.asarray(first, dtype=bool)
    _check(ids, first, n_expert)
    n_tok, n_layer, k = ids.shape
    if n_layer < 2:
        raise ValueError("a routing-history predictor needs at least 2 MoE layers")
    max_depth = min(max_depth, n_layer - 1)
    cut = int(n_tok * (1.0 - tune_share))
    while 0 < cut < n_tok and not first[cut]:
        cut += 1  # split at a sequence boundary so the tuning tokens are unseen prompts
    if cut <= 0 or cut >= n_tok:
        cut = int(n_tok * (1.0 - tune_share))
    grid = _grid(GRID_STEP)
    weights = np.tile(np.array([1.0, 0.0, 0.0]), (max_depth, 1))
    if 0 < cut < n_tok:
        tables = count_tables(ids[:cut], first[:cut], n_expert, max_depth)
        trial = HistoryPredictor(n_layer, n_expert, k, *tables, weights=weights)
        tune_ids, tune_first = ids[cut:], first[cut:].copy()
        tune_first[0] = True
        for depth in range(1, max_depth + 1):
            best = -1.0
            parts = [
                (
                    trial.sources(
                        layer,
                        depth,
                        tune_ids[:, layer],
                        _previous_rows(multi_hot(tune_ids[:, layer + depth], n_expert), tune_first),
                    ),
                    tune_ids[:, layer + depth],
                )
                for layer in range(n_layer - depth)
            ]
            for w in grid:
                r = float(
                    np.mean(
                        [recall_at_k(w[0] * s + w[1] * p + w[2] * q, truth) for (s, p, q), truth in parts]
                    )
                )
                if r > best + 1e-12:
                    best, weights[depth - 1] = r, w
    tables = count_tables(ids, first, n_expert, max_depth)
    return HistoryPredictor(n_layer, n_expert, k, *tables, weights=weights)


def cooccurrence(ids: IDS, first: npt.NDArray[np.bool_], n_expert: int, max_depth: int) -> HistoryPredictor:
    """The co-occurrence baseline counted on these tokens: layer l's ids -> layer l+d's."""
    ids = np.asarray(ids)
    depth = max(1, min(max_depth, ids.shape[1] - 1))
    tables = count_tables(ids, np.asarray(first, dtype=bool), n_expert, depth)
    return cooccurrence_baseline(
        HistoryPredictor(ids.shape[1], n_expert, ids.shape[2], *tables, np.zeros((0, 3)))
    )


def cooccurrence_baseline(predictor: HistoryPredictor) -> HistoryPredictor:
    """The same tables with only the same-token co-occurrence term."""
    w = np.tile(np.array([1.0, 0.0, 0.0]), (predictor.max_depth, 1))
    return HistoryPredictor(
        predictor.n_layer, predictor.n_expert, predictor.k, predictor.same, predictor.prev, predictor.prior, w
    )


def evaluate(predictor: HistoryPredictor, ids: IDS, first: npt.NDArray[np.bool_]) -> dict[int, float]:
    """Mean recall@k over layers, per depth, on held-out tokens."""
    ids = np.asarray(ids)
    first = np.asarray(first, dtype=bool).copy()
    if first.size:
        first[0] = True
    out: dict[int, float] = {}
    for depth in range(1, predictor.max_depth + 1):
        rs = []
        for layer in range(predictor.n_layer - depth):
            prev = _previous_rows(multi_hot(ids[:, layer + depth], predictor.n_expert), first)
            rs.append(recall_at_k(predictor.scores(layer, depth, ids[:, layer], prev), ids[:, layer + depth]))
        out[depth] = float(np.mean(rs))
    return out
