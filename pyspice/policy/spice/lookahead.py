"""Which experts the next MoE layers will want: the paper's Algorithm 1.

Anchored at the current MoE input h_l, a predictor rolls out predicted router
logits for the next MoE layers. Depth adapts: at least H_min layers (eq. 4:
far enough ahead for a prefetch to land in time), then onward while the
confidence -- the probability mass of the predicted top-K -- stays at or
above tau, never beyond H_max.

Two predictors share one interface, `rollout_logits(layer, hidden, depth) ->
[(layer, logits)]`: the sidecar's draft predictor (learned low-rank state
transitions + the target's routers, `pyspice.policy.predictor`) and, without
a sidecar, the cross-layer baseline below (each later layer's router applied
to the current input), so SPICE still runs, only less accurately.

This runs on every decode hook call, so it works on all depths at once
(one [depth, n_expert] array) instead of a Python loop per depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import exp
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.policy.context import AffinePredictor, PolicyContext, RoutePredictor

F32 = npt.NDArray[np.float32]
# what a rollout starts from: the call's input row(s), or its expert ids for a predictor
# that reads ids (history_lookahead.HistoryLookahead)
Anchor = npt.NDArray[Any]


class RouterLookahead:
    """Cross-layer baseline: router of layer l+d on the current MoE input. The next
    `depth_max` routers after each layer are stacked once, so a rollout is one matmul."""

    def __init__(self, ctx: PolicyContext, depth_max: int) -> None:
        moe = ctx.moe_layers
        routers = {il: ctx.router(il) for il in moe}
        self.ahead: dict[int, tuple[list[int], F32]] = {}
        for i, il in enumerate(moe):
            nxt = []
            for m in moe[i + 1 : i + 1 + depth_max]:
                if routers[m] is None:
                    break
                nxt.append(m)
            if nxt:
                stacked = np.concatenate([np.asarray(routers[m], dtype=np.float32) for m in nxt])
                self.ahead[il] = (nxt, np.ascontiguousarray(stacked))

    def affine_map(self, layer: int, depth: int) -> tuple[list[int], F32, F32 | None]:
        """(layers, G [depth * n_expert, n_embd], no offset): logits = G h."""
        entry = self.ahead.get(layer)
        if entry is None or depth <= 0:
            return [], np.zeros((0, 0), np.float32), None
        layers, stacked = entry
        n_expert = stacked.shape[0] // len(layers)
        layers = layers[:depth]
        return layers, stacked[: len(layers) * n_expert], None

    def rollout_logits(self, layer: int, hidden: F32, depth: int) -> list[tuple[int, F32]]:
        """hidden [n_embd] or [n, n_embd] -> [(layer, logits [n_expert] or [n, n_expert])]."""
        layers, logits = Rollout(self).stacked_logits(layer, hidden, depth)
        return [(il, logits[..., i, :]) for i, il in enumerate(layers)]


class Rollout:
    """A predictor's rollouts, made cheap for the hook calls that plan: a predictor with an
    affine map (the sidecar's draft predictor, the router baseline) has it kept per (layer,
    depth) as one contiguous matrix, so a decode rollout is one matrix-vector product and
    an in-place add; any other predictor goes through its rollout_logits."""

    def __init__(self, predictor: RoutePredictor) -> None:
        self.predictor = predictor
        self.affine = predictor.affine_map if isinstance(predictor, AffinePredictor) else None
        self.maps: dict[int, tuple[list[int], F32, F32 | None, int]] = {}

    def rollout_logits(self, layer: int, hidden: Anchor, depth: int) -> list[tuple[int, F32]]:
        return self.predictor.rollout_logits(layer, hidden, depth)

    def stacked_logits(self, layer: int, hidden: Anchor, depth: int) -> tuple[list[int], F32]:
        """(layers, logits [..., depth, n_expert]) for hidden [n_embd] or [n, n_embd]."""
        if self.affine is None:
            return _stack(self.predictor.rollout_logits(layer, hidden, depth))
        key = layer * 1024 + depth
        entry = self.maps.get(key)
        if entry is None:
            layers, g_mat, offset = self.affine(layer, depth)
            n_expert = g_mat.shape[0] // max(1, len(layers))
            if offset is not None and not offset.any():
                offset = None
            entry = self.maps[key] = (list(layers), np.ascontiguousarray(g_mat), offset, n_expert)
        layers, g_mat, offset, n_expert = entry
        if not layers:
            return [], np.zeros((0, 0), np.float32)
        if hidden.ndim == 1:
            logits = g_mat @ hidden
            if offset is not None:
                logits += offset
            return layers, logits.reshape(len(layers), n_expert)
        logits = hidden @ g_mat.T
        if offset is not None:
            logits += offset
        return layers, logits.reshape(*hidden.shape[:-1], len(layers), n_expert)


@dataclass
class Predictions:
    """Predicted top-K experts of the next MoE layers, nearest first."""

    layers: list[int]
    experts: list[list[int]]  # per layer, most wanted first
    confidence: F32  # probability mass of each layer's top-K (computed only when looking past H_min)

    def __len__(self) -> int:
        return len(self.layers)


NO_CONFIDENCE = np.zeros(0, dtype=np.float32)
VOTERS = 16  # tokens of a prompt batch whose predictions vote (look_ahead_batch)
NO_PREDICTIONS = Predictions([], [], NO_CONFIDENCE)


def _confidence(logits: F32, top: npt.NDArray[np.intp]) -> F32:
    """Probability mass of each row's top-K (softmax of the logits)."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.take_along_axis(p, top, axis=-1).sum(axis=-1) / p.sum(axis=-1)  # type: ignore[no-any-return]


def _mass(logits: list[float], ascending: list[int], k: int) -> float:
    """Softmax mass of the top k of one row of logits, given the row's ascending order.
    Plain Python over a few dozen floats: one numpy call per ufunc would cost more
    inside the graph, where each starts with cold caches."""
    m = logits[ascending[-1]]
    ex = [exp(v - m) for v in logits]
    return sum([ex[i] for i in ascending[-k:]]) / sum(ex)


def _confident(row: list[float], ascending: list[int], k: int, tau: float) -> bool:
    """Whether the softmax mass of a row's top k reaches tau. Three logits settle most
    calls: relative to the largest logit l1, the top k sum to at most 1 + (k-1)e^(l2-l1)
    and the rest to at least e^(l[k+1]-l1) + (n-k-1)e^(l[n]-l1), which bounds the mass
    from above; only a bound at or over tau needs every exp (_mass)."""
    n = len(ascending)
    if k >= n:
        return True
    l1 = row[ascending[-1]]
    top = 1.0 + (k - 1) * exp(row[ascending[-2]] - l1)
    rest = exp(row[ascending[-k - 1]] - l1) + (n - k - 1) * exp(row[ascending[0]] - l1)
    if top / (top + rest) < tau:
        return False
    return _mass(row, ascending, k) >= tau


def _stack(rolled: list[tuple[int, F32]]) -> tuple[list[int], F32]:
    """rollout_logits' [(layer, logits)] as (layers, logits [..., depth, n_expert])."""
    if not rolled:
        return [], np.zeros((0, 0), np.float32)
    return [m for m, _ in rolled], np.stack([lg for _, lg in rolled], axis=-2)


def _stacked(predictor: RoutePredictor, layer: int, hidden: Anchor, depth: int) -> tuple[list[int], F32]:
    """(layers, logits [..., depth, n_expert]) in one array, from either predictor interface."""
    if isinstance(predictor, Rollout):
        return predictor.stacked_logits(layer, hidden, depth)
    return _stack(predictor.rollout_logits(layer, hidden, depth))


def look_ahead(
    predictor: RoutePredictor,
    layer: int,
    hidden: Anchor,
    k: int,
    h_min: int,
    h_max: int,
    tau: float,
    keep: int = 0,
) -> Predictions:
    """Algorithm 1: predictions for the next MoE layers, depth adapted by confidence;
    each layer's top-k most probable first, cut to its `keep` most probable (0: all k).

    Runs on planning decode hook calls, so it first rolls out only H_min layers; only
    when the deepest of those is still confident (confidence falls with depth) does it
    roll out to H_max and cut at the first layer below tau."""
    keep = min(k, keep) if keep > 0 else k
    layers, logits = _stacked(predictor, layer, hidden, h_min)
    if not layers:
        return NO_PREDICTIONS
    order: list[list[int]] = logits.argsort(axis=-1).tolist()  # ascending, per layer
    deeper = h_max > h_min and len(layers) == h_min
    if deeper and _confident(logits[-1].tolist(), order[-1], k, tau):
        layers, logits = _stacked(predictor, layer, hidden, h_max)
        top = np.argsort(-logits, axis=1)[:, :k]
        conf = _confidence(logits, top)
        low = np.flatnonzero(conf[h_min:] < tau)
        depth = h_min + int(low[0]) if low.size else len(layers)
        return Predictions(layers[:depth], top[:depth, :keep].tolist(), conf[:depth])
    return Predictions(list(layers), [row[: -keep - 1 : -1] for row in order], NO_CONFIDENCE)


def look_ahead_batch(
    predictor: RoutePredictor, layer: int, hidden: Anchor, k: int, depth: int, voters: int = VOTERS
) -> Predictions:
    """A prompt batch: for each of the next `depth` MoE layers, the experts any token is
    predicted to pick, the most often predicted first (what that layer will need most).
    At most `voters` tokens, evenly spaced, vote: the planner needs the ranking, and a
    rollout over every token of a long prompt costs more than the plan is worth."""
    n = hidden.shape[0]
    if n > voters:
        hidden = hidden[:: -(-n // voters)]
    layers, logits = _stacked(predictor, layer, hidden, depth)  # [tokens, depth, n_expert]
    if logits.ndim == 2:  # a predictor that gives one prediction for the whole batch
        logits = logits[None]
    experts: list[list[int]] = []
    for d in range(len(layers)):
        row = logits[:, d]
        n_expert = row.shape[-1]
        kk = min(k, n_expert)
        top = np.argpartition(-row, kk - 1, axis=-1)[:, :kk]
        votes = np.bincount(top.ravel(), minlength=n_expert)
        chosen = np.flatnonzero(votes)
        experts.append(chosen[np.argsort(-votes[chosen], kind="stable")].tolist())
    return Predictions(list(layers), experts, np.ones(len(layers), dtype=np.float32))


class FirstLayerPrior:
    """How often each expert of the first MoE layer was picked lately: what a plan at a
    token's end prefetches for the next token's first MoE layer. No look-ahead reaches
    that layer -- its routing follows the token not sampled yet -- and the planner's
    room-taking treats it as needed last for most of a token, so without a prior a
    decode step ran every activation there on the host (smolmoe-b: 124 of 124 over 31
    tokens, with the prompt's 512 a fifth of spice:exact's host activations)."""

    def __init__(self, n_expert: int, decay: float = 0.97) -> None:
        self.counts = np.zeros(max(1, n_expert), dtype=np.float64)
        self.decay = decay  # per call of the layer: a frequency that forgets

    def note(self, ids: npt.NDArray[np.int32]) -> None:
        """A call of the first MoE layer picked these ([tokens, k]; out-of-range ids skipped)."""
        picked = np.asarray(ids).ravel()
        picked = picked[(picked >= 0) & (picked < self.counts.size)]
        self.counts *= self.decay
        self.counts += np.bincount(picked, minlength=self.counts.size)

    def top(self, m: int) -> list[int]:
        """The m experts picked most (ties to the lower id), none never picked."""
        order = np.argsort(-self.counts, kind="stable")[: max(0, m)]
        return [int(e) for e in order if self.counts[e] > 0]


def with_layer(pred: Predictions, layer: int, experts: list[int]) -> Predictions:
    """The predictions with one more layer after the last (nearest first stays true for a
    layer the look-ahead does not reach)."""
    if not experts or layer in pred.layers:
        return pred
    confidence = pred.confidence
    if confidence.size:
        confidence = np.append(confidence, np.float32(1.0))
    return Predictions([*pred.layers, layer], [*pred.experts, experts], confidence)
