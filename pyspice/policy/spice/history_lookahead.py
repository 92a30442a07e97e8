"""SPICE's look-ahead from expert ids: the routing-history predictor as a RoutePredictor.

A trace of routing alone (an imported recording) has no hidden rows, and a
model without a sidecar has no draft predictor; both still have each call's
expert ids. `HistoryLookahead` rolls out the next MoE layers' logits from the
ids the decode has seen (pyspice.policy.spice.routing_history): the call's,
this token's at the two layers before, and the previous token's at the
target layer and at this one. The policy shows it every call's ids
(`observe`) and, knowing it by its type, passes the ids where the other
predictors take the hidden row. Softmax of the logits is the predicted distribution, so the
confidence SPICE compares with tau is its mass on the top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pyspice.policy.spice.routing_history import BLOCKS, RoutingHistory

F32 = npt.NDArray[np.float32]


class HistoryLookahead:
    """Rollouts over the model's MoE layers (`moe_layers`, in order) by a predictor
    fitted on the same layers' ids; it keeps the ids of this token and the last one."""

    def __init__(self, model: RoutingHistory, moe_layers: Sequence[int]) -> None:
        if model.n_layer != len(moe_layers):
            raise ValueError(
                f"the routing-history predictor was fitted on {model.n_layer} MoE layers, "
                f"this model has {len(moe_layers)}: fit one on a trace of this model (`pyspice trace fit`)"
            )
        self.model = model
        self.moe_layers = tuple(moe_layers)
        self.index = {il: j for j, il in enumerate(self.moe_layers)}
        n, k = model.n_layer, model.k
        self.absent = np.full(k, -1, dtype=np.intp)
        self.current = np.full((n, k), -1, dtype=np.intp)  # this token's ids, per MoE layer
        self.previous = np.full((n, k), -1, dtype=np.intp)  # the last token's
        self.last = -1  # the MoE layer index seen last: a lower one starts the next token

    def reset(self) -> None:
        """Forget what was seen (a policy attaching to a new run)."""
        self.current.fill(-1)
        self.previous.fill(-1)
        self.last = -1

    def observe(self, layer: int, ids: npt.NDArray[np.integer]) -> None:
        """A hook call's ids ([n, k]; of a prompt batch its last token's)."""
        j = self.index.get(layer)
        if j is None:
            return
        if j <= self.last:
            self.previous, self.current = self.current, self.previous
            self.current.fill(-1)
        row = np.asarray(ids).reshape(-1, np.shape(ids)[-1])[-1]
        k = min(self.model.k, row.shape[0])
        self.current[j, :k] = row[:k]
        self.last = j

    def _block(self, block: int, row: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        offset = block * self.model.n_expert
        return np.where(row >= 0, row + offset, -1)

    def rollout_logits(self, layer: int, ids: npt.NDArray[np.integer], depth: int) -> list[tuple[int, F32]]:
        """ids [k] (a decode call) or [n, k] (a prompt batch: its own ids only) of MoE layer
        `layer` -> [(layer + d, logits [n_expert] or [n, n_expert])] for d = 1 .. as far as
        the predictor and the model reach, at most `depth`."""
        j = self.index.get(layer)
        if j is None:
            return []
        m = self.model
        reach = m.depths(j, depth)
        ids = np.asarray(ids)
        k = m.k
        out: list[tuple[int, F32]] = []
        if ids.ndim == 2:
            own = np.full((ids.shape[0], BLOCKS * k), -1, dtype=np.intp)
            own[:, :k] = ids[:, :k]
            for d in range(1, reach + 1):
                out.append((self.moe_layers[j + d], m.logits(j, d, own)))
            return out
        if reach == 0:
            return out
        # one row of feature indices per depth; only block 3 (the previous token at the
        # target layer) differs between depths
        feats = np.empty((reach, BLOCKS * k), dtype=np.intp)
        feats[:, :k] = self._block(0, ids[:k].astype(np.intp))
        for block in (1, 2):
            feats[:, block * k : (block + 1) * k] = self._block(
                block, self.current[j - block] if j - block >= 0 else self.absent
            )
        feats[:, 3 * k : 4 * k] = self._block(3, self.previous[j + 1 : j + 1 + reach])
        feats[:, 4 * k :] = self._block(4, self.previous[j])
        logits = m.logits_ahead(j, feats)
        return [(self.moe_layers[j + d], logits[d - 1]) for d in range(1, reach + 1)]
