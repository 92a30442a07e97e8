"""SPICE: speculative prefetch + surrogate substitution + cost-aware fetch-or-host.

One policy object per variant (quality level or ablation, see config.py).
Per hook call, for a decode step:

1. look ahead (lookahead.py): the predictor, anchored at this layer's MoE
   input, predicts the next layers' experts, depth adapted to confidence;
2. handle this layer's misses (misses.py): device / host / surrogate / fetch;
3. plan prefetches and evictions (planner.py) around what step 2 keeps busy.

A prompt batch looks ahead H_min layers by votes: the experts its tokens are
predicted to pick next, the most picked first.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from pyspice.policy.base import HookCall, Plan
from pyspice.policy.context import PolicyContext
from pyspice.policy.spice.config import SpiceConfig, spice_config
from pyspice.policy.spice.cost import CostModel
from pyspice.policy.spice.lookahead import Predictor, RouterLookahead, look_ahead, look_ahead_batch
from pyspice.policy.spice.misses import MissHandler
from pyspice.policy.spice.planner import PrefetchPlanner


class SpicePolicy:
    def __init__(self, config: SpiceConfig | str) -> None:
        self.config = spice_config(config) if isinstance(config, str) else config
        self.name = self.config.name
        self.ctx: PolicyContext | None = None

    @property
    def lossless(self) -> bool:
        """Whether this variant never substitutes (the engine loads surrogates only if not)."""
        return self.config.lossless

    def attach(self, ctx: PolicyContext) -> None:
        cfg = self.config
        self.ctx = ctx
        self.cost = CostModel.from_context(ctx)
        k = max(1, ctx.n_expert_used)
        moe = ctx.moe_layers
        self.h_min = {il: self.cost.h_min(il, k, k) for il in moe}
        self.h_max = {il: max(self.h_min[il], cfg.h_max) for il in moe}
        if not cfg.deep:
            self.h_min = dict.fromkeys(moe, 1)
            self.h_max = dict.fromkeys(moe, 1)
        predictor: Predictor | None = ctx.predictor
        if predictor is None:
            predictor = RouterLookahead(ctx, max(self.h_max.values(), default=1))
        self.predictor: Predictor = predictor
        self.planner = PrefetchPlanner(ctx, reserved_bytes=ctx.reserved_bytes)
        errors = ctx.surrogate_error if ctx.surrogates_loaded else None
        if not cfg.lossless and errors is None:
            print(
                f"pyspice: {self.name}: no surrogates loaded (give a sidecar with --sidecar, "
                "or build one with `pyspice calibrate`): misses are fetched or run exactly on the host",
                file=sys.stderr,
            )
        self.misses = MissHandler(cfg, self.cost, errors)
        self.n_prefetch = max(1, math.ceil(cfg.prefetch_share * k))

    def decide(self, call: HookCall) -> Plan:
        assert self.ctx is not None, "attach() first"
        residency = call.residency
        if residency is None:
            raise RuntimeError(f"policy {self.name!r} needs a device tier: pass --device-budget")
        layer = call.layer
        ids = call.ids
        decision = self.misses.decide(layer, ids, call.weights, residency)
        self.planner.note_use(layer, ids[0].tolist() if call.n_tokens == 1 else np.unique(ids).tolist())
        if not self.config.prefetch:
            return Plan(actions=decision.actions, fetch=decision.fetch)
        if call.n_tokens == 1:
            predictions = look_ahead(
                self.predictor,
                layer,
                call.hidden[0],
                self.ctx.n_expert_used,
                self.h_min[layer],
                self.h_max[layer],
                self.config.tau,
            )
            predictions.experts = [row[: self.n_prefetch] for row in predictions.experts]
        else:  # a prompt batch: what the next layers' tokens will pick, by votes
            predictions = look_ahead_batch(
                self.predictor, layer, call.hidden, self.ctx.n_expert_used, self.h_min[layer]
            )
        fetch_bytes = len(decision.fetch) * int(self.ctx.expert_bytes[layer])
        prefetch = self.planner.plan(layer, predictions, residency, decision.busy, fetch_bytes)
        return Plan(
            actions=decision.actions, fetch=decision.fetch, prefetch=prefetch.prefetch, evict=prefetch.evict
        )
