"""SPICE's look-ahead from expert ids: the routing-history predictor as a RoutePredictor.

A trace of routing alone (an imported recording) has no hidden rows, and a
model without a sidecar has no draft predictor; both still have each call's
expert ids. `HistoryLookahead` rolls out the next MoE layers' logits from the
ids of the layer being routed, through a fitted HistoryPredictor's
co-occurrence and popularity tables (its previous-token term needs the
previous token's ids at the target layer, which a look-ahead at layer l does
not have yet, so its weight moves to the other two).

Its `rollout_logits(layer, ids, depth)` takes the call's ids where the other
predictors take the hidden row: `reads_ids` tells the policy which to pass.
Logits are log-probabilities, so the softmax confidence SPICE compares with
tau is the predicted probability mass of the top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pyspice.policy.spice.history_predictor import HistoryPredictor

F32 = npt.NDArray[np.float32]
_FLOOR = 1e-6  # probability of an expert never seen after these ids (log of it: a finite logit)


class HistoryLookahead:
    """Rollouts over the model's MoE layers (`moe_layers`, in order) by a predictor
    fitted on the same layers' ids."""

    reads_ids = True

    def __init__(self, predictor: HistoryPredictor, moe_layers: Sequence[int]) -> None:
        if predictor.n_layer != len(moe_layers):
            raise ValueError(
                f"the routing-history predictor was fitted on {predictor.n_layer} MoE layers, "
                f"this model has {len(moe_layers)}: fit one on a trace of this model"
            )
        self.predictor = predictor
        self.moe_layers = tuple(moe_layers)
        self.index = {il: j for j, il in enumerate(self.moe_layers)}
        # per depth, the (same, prior) weights, the previous-token share spread over them
        mix = []
        for same, _prev, prior in predictor.weights:
            total = same + prior
            mix.append((same / total, prior / total) if total > 0 else (1.0, 0.0))
        w = np.array(mix, dtype=np.float64).reshape(-1, 2)
        # a decode call runs one rollout: per MoE layer j, every depth's co-occurrence rows
        # pre-weighted ([depth, n_expert, n_expert]) and its prior term ([depth, n_expert]),
        # so a rollout is one gather-and-sum over the call's k ids and one add
        self.same: list[npt.NDArray[np.float64]] = []
        self.prior: list[npt.NDArray[np.float64]] = []
        k = max(1, predictor.k)
        for j in range(predictor.n_layer):
            depths = min(predictor.max_depth, predictor.n_layer - 1 - j)
            self.same.append(predictor.same[:depths, j] * (w[:depths, 0] / k)[:, None, None])
            self.prior.append(predictor.prior[j + 1 : j + 1 + depths] * w[:depths, 1][:, None])

    def rollout_logits(self, layer: int, ids: npt.NDArray[np.integer], depth: int) -> list[tuple[int, F32]]:
        """ids [k] or [n, k] of MoE layer `layer` -> [(layer + d, logits [n_expert] or [n, n_expert])]
        for d = 1 .. min(depth, the predictor's depth, the layers left)."""
        j = self.index.get(layer)
        if j is None or depth <= 0:
            return []
        same = self.same[j][:depth]
        if not len(same):
            return []
        prior = self.prior[j][: len(same)]
        ids = np.asarray(ids)
        if ids.ndim == 1:
            scores = same[:, ids].sum(axis=1) + prior  # [depth, n_expert]
        else:
            scores = same[:, ids].sum(axis=2) + prior[:, None]  # [depth, n, n_expert]
        logits = np.log(np.maximum(scores, _FLOOR)).astype(np.float32)
        return [(self.moe_layers[j + 1 + d], logits[d]) for d in range(len(same))]
