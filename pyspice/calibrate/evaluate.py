"""Measurements behind `pyspice eval predictor` and `pyspice eval surrogate` (on a recorded trace).

Predictor recall: for every MoE layer l and depth d whose target layer m (the
d-th MoE layer after l) exists, predict exactly K = n_expert_used experts of
m from layer l's input and count the share of m's true top-K that is among
them. The cross-layer baseline applies m's router to l's input directly; the
draft rolls the transitions forward (Algorithm 1). Recall by confidence bin
groups the draft's predictions by their confidence (mass of the predicted
top-K).

Surrogate error: on held-out tokens routed to each expert, the relative error
||y - ŷ|| / ||y|| of the surrogate, of the shared expert alone (α = 1) and of
dropping the expert (1 by definition), against the expert outputs recomputed
in float32 from the dequantized weights (see lore_fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.calibrate.lore_fit import LayerExperts, expert_forward, surrogate_forward
from pyspice.formats.sidecar import TruncatedSurrogates
from pyspice.formats.trace import TraceReader
from pyspice.policy.predictor import DraftPredictor, gate_probs, top_k

CONFIDENCE_BINS = 5


def recall_rows(pred_ids: npt.NDArray[Any], true_ids: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Per row: share of true_ids [n, k] found among pred_ids [n, k']."""
    hits = (pred_ids[:, :, None] == true_ids[:, None, :]).any(axis=1).sum(axis=1)
    out: npt.NDArray[np.float64] = hits / float(true_ids.shape[1])
    return out


@dataclass
class PredictorEval:
    depths: list[int]
    baseline_recall: list[float]
    draft_recall: list[float]
    pairs: list[int]  # (token, layer) predictions per depth
    bins: list[list[tuple[float, float]]] = field(default_factory=list)  # [depth][bin] confidence range
    bin_share: list[list[float]] = field(default_factory=list)  # [depth][bin] share of predictions
    bin_recall: list[list[float]] = field(default_factory=list)  # [depth][bin] draft recall (nan: empty)

    def to_json(self) -> dict[str, Any]:
        return {
            "depths": self.depths,
            "baseline_recall": self.baseline_recall,
            "draft_recall": self.draft_recall,
            "predictions": self.pairs,
            "confidence_bins": [[list(b) for b in row] for row in self.bins],
            "confidence_share": self.bin_share,
            "confidence_recall": [[None if v != v else v for v in row] for row in self.bin_recall],
        }


def evaluate_predictor(trace: TraceReader, predictor: DraftPredictor, max_depth: int = 3) -> PredictorEval:
    k = trace.meta.n_expert_used
    layers = trace.meta.moe_layers
    depths = list(range(1, max_depth + 1))
    base_sum = np.zeros(max_depth)
    draft_sum = np.zeros(max_depth)
    count = np.zeros(max_depth, dtype=np.int64)
    confs: list[list[np.ndarray]] = [[] for _ in range(max_depth)]
    recs: list[list[np.ndarray]] = [[] for _ in range(max_depth)]
    cache: dict[int, dict[str, np.ndarray]] = {}

    def load(il: int) -> dict[str, np.ndarray]:
        if il not in cache:
            cache[il] = trace.layer(il, ("hidden", "ids"))
        return cache[il]

    for j, il in enumerate(layers):
        for old in [x for x in cache if x < il]:
            del cache[old]  # keeps at most max_depth + 1 layers in memory
        h = load(il)["hidden"].astype(np.float32)
        draft = predictor.rollout(il, h, max_depth)
        for d in depths:
            if j + d >= len(layers):
                break
            m = layers[j + d]
            true_ids = load(m)["ids"]
            base = gate_probs(h @ predictor.routers[m].T, predictor.gating)
            base_sum[d - 1] += recall_rows(top_k(base, k), true_ids).sum()
            count[d - 1] += true_ids.shape[0]
            if d - 1 < len(draft) and draft[d - 1][0] == m:
                probs = draft[d - 1][1]
                rec = recall_rows(top_k(probs, k), true_ids)
                draft_sum[d - 1] += rec.sum()
                confs[d - 1].append(np.sort(probs, axis=1)[:, -k:].sum(axis=1) / probs.sum(axis=1))
                recs[d - 1].append(rec)
    keep = [i for i in range(max_depth) if count[i] > 0]
    bins: list[list[tuple[float, float]]] = []
    shares: list[list[float]] = []
    bin_recall: list[list[float]] = []
    for i in keep:
        conf = np.concatenate(confs[i]) if confs[i] else np.zeros(0)
        rec = np.concatenate(recs[i]) if recs[i] else np.zeros(0)
        order = np.argsort(conf, kind="stable")
        parts = np.array_split(order, CONFIDENCE_BINS) if len(order) else []
        bins.append([(float(conf[p[0]]), float(conf[p[-1]])) for p in parts if len(p)])
        shares.append([len(p) / len(order) for p in parts if len(p)])
        bin_recall.append([float(rec[p].mean()) for p in parts if len(p)])
    return PredictorEval(
        depths=[depths[i] for i in keep],
        baseline_recall=[float(base_sum[i] / count[i]) for i in keep],
        draft_recall=[float(draft_sum[i] / count[i]) for i in keep],
        pairs=[int(count[i]) for i in keep],
        bins=bins,
        bin_share=shares,
        bin_recall=bin_recall,
    )


@dataclass
class SurrogateEval:
    ranks: list[int]
    # per layer: mean over experts with tokens of the relative error
    layers: list[int]
    surrogate: list[list[float]]  # [layer][rank]
    shared: list[float]
    drop: list[float]
    per_expert: dict[int, dict[str, list[float]]] = field(default_factory=dict)

    def means(self) -> dict[str, Any]:
        def m(values: Sequence[float]) -> float:
            v = [x for x in values if x == x]
            return float(np.mean(v)) if v else float("nan")

        return {
            "ranks": self.ranks,
            "surrogate": [m([row[i] for row in self.surrogate]) for i in range(len(self.ranks))],
            "shared_alone": m(self.shared),
            "drop": m(self.drop),
        }


def _rel(y: npt.NDArray[np.float64], pred: npt.NDArray[np.float64] | None) -> float:
    den = float(np.linalg.norm(y))
    if den == 0:
        return float("nan")
    return float(np.linalg.norm(y if pred is None else y - pred)) / den


def evaluate_surrogates(
    trace: TraceReader,
    model_reader: Any,
    sidecar: Any,
    ranks: Sequence[int],
    max_tokens_per_expert: int = 256,
) -> SurrogateEval:
    """Relative errors per expert on the trace's tokens; surrogates truncated to each rank."""
    has_shared = "shared" in trace.meta.fields
    fields = ("hidden", "ids", "shared") if has_shared else ("hidden", "ids")
    out = SurrogateEval(ranks=list(ranks), layers=[], surrogate=[], shared=[], drop=[])
    sources = [TruncatedSurrogates(sidecar, r) for r in ranks]
    for il in trace.meta.moe_layers:
        data = trace.layer(il, fields)
        experts = LayerExperts(model_reader, il)
        errs: list[list[float]] = [[] for _ in ranks]
        shared_e: list[float] = []
        drop_e: list[float] = []
        for e in range(experts.n_expert):
            rows = np.flatnonzero((data["ids"] == e).any(axis=1))[:max_tokens_per_expert]
            if len(rows) == 0:
                for lst in errs:
                    lst.append(float("nan"))
                shared_e.append(float("nan"))
                drop_e.append(float("nan"))
                continue
            h = data["hidden"][rows].astype(np.float32)
            s = data["shared"][rows].astype(np.float32) if has_shared else None
            y = expert_forward(h, *experts.weights(e)).astype(np.float64)
            for i, src in enumerate(sources):
                entry = src.surrogate(il, e)
                errs[i].append(
                    _rel(y, surrogate_forward(h, s, *entry)) if entry is not None else float("nan")
                )
            shared_e.append(_rel(y, s.astype(np.float64)) if s is not None else float("nan"))
            drop_e.append(_rel(y, None))
        out.layers.append(il)
        out.surrogate.append([float(np.nanmean(x)) if np.isfinite(x).any() else float("nan") for x in errs])
        out.shared.append(float(np.nanmean(shared_e)) if np.isfinite(shared_e).any() else float("nan"))
        out.drop.append(float(np.nanmean(drop_e)) if np.isfinite(drop_e).any() else float("nan"))
        out.per_expert[il] = {f"r{r}": errs[i] for i, r in enumerate(ranks)} | {
            "shared": shared_e,
            "drop": drop_e,
        }
    return out
