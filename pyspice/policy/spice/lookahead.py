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
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pyspice.policy.context import PolicyContext

F32 = npt.NDArray[np.float32]


class Predictor(Protocol):
    def rollout_logits(self, layer: int, hidden: F32, depth: int) -> list[tuple[int, F32]]: ...


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

    def rollout_logits(self, layer: int, hidden: F32, depth: int) -> list[tuple[int, F32]]:
        """hidden [n_embd] or [n, n_embd] -> [(layer, logits [n_expert] or [n, n_expert])]."""
        entry = self.ahead.get(layer)
        if entry is None or depth <= 0:
            return []
        layers, stacked = entry
        n_expert = stacked.shape[0] // len(layers)
        layers = layers[:depth]
        logits = hidden @ stacked[: len(layers) * n_expert].T  # [..., depth * n_expert]
        return [(il, logits[..., i * n_expert : (i + 1) * n_expert]) for i, il in enumerate(layers)]


@dataclass
class Predictions:
    """Predicted top-K experts of the next MoE layers, nearest first."""

    layers: list[int]
    experts: list[list[int]]  # per layer, most wanted first
    confidence: F32  # probability mass of each layer's top-K (computed only when looking past H_min)

    def __len__(self) -> int:
        return len(self.layers)


NO_CONFIDENCE = np.zeros(0, dtype=np.float32)
NO_PREDICTIONS = Predictions([], [], NO_CONFIDENCE)


def _confidence(logits: F32, top: npt.NDArray[np.intp]) -> F32:
    """Probability mass of each row's top-K (softmax of the logits)."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.take_along_axis(p, top, axis=-1).sum(axis=-1) / p.sum(axis=-1)  # type: ignore[no-any-return]


def look_ahead(
    predictor: Predictor, layer: int, hidden: F32, k: int, h_min: int, h_max: int, tau: float
) -> Predictions:
    """Algorithm 1: predictions for the next MoE layers, depth adapted by confidence.

    Runs on every decode hook call, so it first rolls out only H_min layers; only when
    the deepest of those is still confident (confidence falls with depth) does it roll
    out to H_max and cut at the first layer below tau."""
    rolled = predictor.rollout_logits(layer, hidden, h_min)
    if not rolled:
        return NO_PREDICTIONS
    if h_max > h_min and len(rolled) == h_min:
        last = rolled[-1][1]
        last_top = np.argpartition(-last, k - 1)[:k] if k < last.shape[0] else np.arange(last.shape[0])
        if float(_confidence(last, last_top)) >= tau:
            rolled = predictor.rollout_logits(layer, hidden, h_max)
            logits = np.stack([lg for _, lg in rolled])
            top = np.argsort(-logits, axis=1)[:, :k]
            conf = _confidence(logits, top)
            low = np.flatnonzero(conf[h_min:] < tau)
            depth = h_min + int(low[0]) if low.size else len(rolled)
            return Predictions([m for m, _ in rolled[:depth]], top[:depth].tolist(), conf[:depth])
    if len(rolled) == 1:
        return Predictions([rolled[0][0]], [np.argsort(-rolled[0][1])[:k].tolist()], NO_CONFIDENCE)
    logits = np.stack([lg for _, lg in rolled])
    top = np.argsort(-logits, axis=1)[:, :k]
    return Predictions([m for m, _ in rolled], top.tolist(), NO_CONFIDENCE)


def look_ahead_batch(predictor: Predictor, layer: int, hidden: F32, k: int, depth: int) -> Predictions:
    """A prompt batch: for each of the next `depth` MoE layers, the experts any token is
    predicted to pick, the most often predicted first (what that layer will need most)."""
    rolled = predictor.rollout_logits(layer, hidden, depth)
    layers: list[int] = []
    experts: list[list[int]] = []
    for il, logits in rolled:
        n_expert = logits.shape[-1]
        kk = min(k, n_expert)
        top = np.argpartition(-logits, kk - 1, axis=-1)[..., :kk]
        votes = np.bincount(top.ravel(), minlength=n_expert)
        chosen = np.flatnonzero(votes)
        layers.append(il)
        experts.append(chosen[np.argsort(-votes[chosen], kind="stable")].tolist())
    return Predictions(layers, experts, np.ones(len(layers), dtype=np.float32))
