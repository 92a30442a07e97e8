"""Baseline policies: what users would run instead of SPICE, behind the same hook.

All of them are lossless (every activation runs exactly, on the device tier
or on the host); they differ only in what they keep on the device and when
they move it. Each is nothing but a per-activation rule (pyspice.policy.rule)
that it declares once it is attached: the engine plans every hook call from
it in libspice, with no Python per call, as the designs they stand for do
(the llama.cpp forks' LRU remaps ids in C); the simulator applies the same
rule's twin.

| name       | stands for                                                      |
|------------|-----------------------------------------------------------------|
| `host`     | llama.cpp `-ot exps=CPU` / `--cpu-moe`: every routed expert on the host |
| `static`   | llama.cpp `--n-cpu-moe N`: whole layers resident up to the budget |
| `ondemand` | MoE-On-Demand: fetch each miss synchronously, keep nothing       |
| `lru`      | slot cache with LRU eviction, synchronous fetch on miss          |
| `adapmoe`  | AdapMoE-like: next-layer gate prefetch, per-layer cache sizes by miss cost |
"""

from __future__ import annotations

import sys

from pyspice.policy.base import ACTION_HOST
from pyspice.policy.context import PolicyContext
from pyspice.policy.rule import (
    KEEP_LAYER_LRU,
    KEEP_LRU,
    KEEP_NONE,
    MISS_FETCH,
    Rule,
    RulePolicyBase,
)


class HostOnly(RulePolicyBase):
    """Every routed expert on the host; the device tier (if any) stays empty."""

    name = "host"

    def rule(self) -> Rule:
        return Rule(resident_action=ACTION_HOST)


class StaticLayers(RulePolicyBase):
    """Whole layers resident, in order, as far as the budget goes (llama.cpp
    --n-cpu-moe N keeps the LAST N layers' experts on the CPU, i.e. the first
    ones on the GPU). Each resident layer is loaded on its first call; after
    that nothing moves."""

    name = "static"

    def __init__(self) -> None:
        self.resident_layers: tuple[int, ...] = ()

    def attach(self, ctx: PolicyContext) -> None:
        budget = ctx.budget_bytes or 0
        chosen = []
        for il in ctx.moe_layers:
            layer_bytes = ctx.n_expert[il] * ctx.slot_bytes  # each expert takes a slot
            if layer_bytes > budget:
                break
            budget -= layer_bytes
            chosen.append(il)
        self.resident_layers = tuple(chosen)
        n_moe = len(ctx.moe_layers)
        print(
            f"pyspice: static: {len(chosen)} of {n_moe} MoE layers resident "
            f"(llama.cpp --n-cpu-moe {n_moe - len(chosen)})",
            file=sys.stderr,
        )

    def rule(self) -> Rule:
        return Rule(whole_layers=self.resident_layers)


class OnDemand(RulePolicyBase):
    """Fetch every expert a layer needs when it needs it and keep nothing:
    each call first evicts whatever an earlier call brought in."""

    name = "ondemand"

    def rule(self) -> Rule:
        return Rule(miss=MISS_FETCH, keep=KEEP_NONE)


class LruCache(RulePolicyBase):
    """One pooled slot cache over all layers, least recently selected out first;
    misses are fetched synchronously (demand copies)."""

    name = "lru"

    def rule(self) -> Rule:
        return Rule(miss=MISS_FETCH, keep=KEEP_LRU)


class AdapMoE(RulePolicyBase):
    """AdapMoE-like: per-layer LRU caches whose sizes follow each layer's miss
    cost, plus a prefetch of the next MoE layer's experts predicted by applying
    that layer's router to the current MoE input (its gate).

    Capacities start equal and are re-split every `resize_every` calls in
    proportion to (misses + 1) x the layer's expert copy time on the tier's bus."""

    name = "adapmoe"

    def __init__(self, resize_every: int = 64) -> None:
        self.resize_every = resize_every
        self._rule = Rule()

    def attach(self, ctx: PolicyContext) -> None:
        layers = ctx.moe_layers
        per_layer = (ctx.budget_bytes or 0) / max(1, len(layers))
        capacity = tuple(
            max(1, int(per_layer // ctx.slot_bytes)) if ctx.n_expert[il] else 0 for il in range(ctx.n_layers)
        )
        routers = ctx.rule_routers()
        self._rule = Rule(
            miss=MISS_FETCH,
            keep=KEEP_LAYER_LRU,
            capacity=capacity,
            resize_every=self.resize_every,
            prefetch_next=routers is not None,
            routers=routers,
        )

    def rule(self) -> Rule:
        return self._rule
