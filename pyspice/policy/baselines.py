"""Baseline policies: what users would run instead of SPICE, behind the same hook.

All of them are lossless (every activation runs exactly, on the device tier
or on the host); they differ only in what they keep on the device and when
they move it. Each reads residency from the call and the budget and expert
sizes from the PolicyContext given to `attach`.

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
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_HOST,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    HookCall,
    Plan,
    PolicyBase,
    held_bytes,
)
from pyspice.policy.context import PolicyContext

Key = tuple[int, int]


def _actions(call: HookCall, action: int) -> npt.NDArray[np.int32]:
    return np.full((call.n_tokens, call.n_expert_used), action, dtype=np.int32)


def _require_device(call: HookCall, policy: str) -> npt.NDArray[np.int8]:
    if call.residency is None:
        raise RuntimeError(f"policy {policy!r} needs a device tier: pass --device-budget")
    return call.residency


class HostOnly(PolicyBase):
    """Every routed expert on the host; the device tier (if any) stays empty."""

    name = "host"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=_actions(call, ACTION_HOST))


class StaticLayers(PolicyBase):
    """Whole layers resident, in order, as far as the budget goes (llama.cpp
    --n-cpu-moe N keeps the LAST N layers' experts on the CPU, i.e. the first
    ones on the GPU). Each resident layer is loaded on its first call; after
    that nothing moves."""

    name = "static"

    def __init__(self) -> None:
        self.resident_layers: frozenset[int] = frozenset()
        self.loaded: set[int] = set()

    def attach(self, ctx: PolicyContext) -> None:
        budget = ctx.budget_bytes or 0
        chosen = []
        for il in ctx.moe_layers:
            layer_bytes = ctx.n_expert[il] * ctx.expert_bytes[il]
            if layer_bytes > budget:
                break
            budget -= layer_bytes
            chosen.append(il)
        self.resident_layers = frozenset(chosen)
        self.loaded = set()
        n_moe = len(ctx.moe_layers)
        print(
            f"pyspice: static: {len(chosen)} of {n_moe} MoE layers resident "
            f"(llama.cpp --n-cpu-moe {n_moe - len(chosen)})",
            file=sys.stderr,
        )

    def decide(self, call: HookCall) -> Plan:
        if call.layer not in self.resident_layers:
            return Plan(actions=_actions(call, ACTION_HOST))
        fetch: list[int] = []
        if call.layer not in self.loaded:
            self.loaded.add(call.layer)
            fetch = list(range(call.n_expert))
        return Plan(actions=_actions(call, ACTION_DEVICE), fetch=fetch)


class OnDemand(PolicyBase):
    """Fetch every expert a layer needs when it needs it and keep nothing:
    each call first evicts whatever an earlier call brought in."""

    name = "ondemand"

    def decide(self, call: HookCall) -> Plan:
        residency = _require_device(call, self.name)
        evictable = (residency != RESIDENCY_ABSENT) & (residency != RESIDENCY_COPYING)
        evictable[call.layer, np.unique(call.ids)] = False  # needed now
        layers, experts = np.nonzero(evictable)
        return Plan(
            actions=_actions(call, ACTION_DEVICE),
            evict=list(zip(layers.tolist(), experts.tolist(), strict=True)),
        )


class LruCache(PolicyBase):
    """One pooled slot cache over all layers, least recently used out first;
    misses are fetched synchronously (demand copies)."""

    name = "lru"

    def __init__(self) -> None:
        self.ctx: PolicyContext | None = None
        self.recency: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def attach(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.recency = OrderedDict()

    def decide(self, call: HookCall) -> Plan:
        assert self.ctx is not None, "attach() first"
        residency = _require_device(call, self.name)
        layer = call.layer
        needed = [int(e) for e in np.unique(call.ids)]
        for e in needed:
            self.recency[(layer, e)] = None
            self.recency.move_to_end((layer, e))
        absent = [e for e in needed if residency[layer, e] == RESIDENCY_ABSENT]
        evict = self._make_room(residency, len(absent) * self.ctx.expert_bytes[layer], set(needed), layer)
        return Plan(actions=_actions(call, ACTION_DEVICE), evict=evict)

    def _make_room(self, residency: npt.NDArray[np.int8], need: int, keep: set[int], layer: int) -> list[Key]:
        assert self.ctx is not None
        budget = self.ctx.budget_bytes or 0
        used = held_bytes(residency, self.ctx.bytes_vector())
        evict: list[Key] = []
        forget: list[Key] = []
        if used + need <= budget:
            return evict
        for key in self.recency:  # oldest first
            if used + need <= budget:
                break
            l_key, e_key = key
            state = residency[l_key, e_key]
            if state == RESIDENCY_ABSENT:
                forget.append(key)  # it never landed (no slot) or left
                continue
            if (l_key == layer and e_key in keep) or state == RESIDENCY_COPYING:
                continue  # needed now, or a copy in flight (cannot be taken back)
            evict.append(key)
            used -= self.ctx.expert_bytes[l_key]
        for key in forget + evict:
            del self.recency[key]
        return evict


class AdapMoE(PolicyBase):
    """AdapMoE-like: per-layer LRU caches whose sizes follow each layer's
    miss cost, plus a prefetch of the next MoE layer's experts predicted by
    applying that layer's router to the current MoE input (its gate).

    Capacities start equal and are re-split every `resize_every` calls in
    proportion to (misses x cost of a miss) per layer; the cost of a miss is
    the layer's expert copy time on the profiled bus (bytes / bandwidth +
    latency), or its expert bytes when no profile was measured."""

    name = "adapmoe"

    def __init__(self, resize_every: int = 64) -> None:
        self.resize_every = resize_every
        self.ctx: PolicyContext | None = None
        self.capacity: dict[int, int] = {}  # experts per layer
        self.recency: dict[int, OrderedDict[int, None]] = {}
        self.misses: dict[int, int] = {}
        self.calls = 0
        self.routers: dict[int, npt.NDArray[np.float32] | None] = {}

    def attach(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        layers = ctx.moe_layers
        budget = ctx.budget_bytes or 0
        per_layer = budget / max(1, len(layers))
        self.capacity = {il: max(1, int(per_layer // ctx.expert_bytes[il])) for il in layers}
        self.recency = {il: OrderedDict() for il in layers}
        self.misses = {il: 0 for il in layers}
        self.calls = 0
        # read the routers now: a first call should not pay for opening the model file
        self.routers = {il: ctx.router(il) for il in layers}

    # -- sizing ----------------------------------------------------------------

    def miss_cost(self, layer: int) -> float:
        assert self.ctx is not None
        nbytes = self.ctx.expert_bytes[layer]
        profile = self.ctx.profile
        if profile is None:
            return float(nbytes)
        return float(nbytes / (profile.bus_gbps * 1e3) + profile.bus_latency_us)  # us per copy

    def resize(self) -> None:
        """Give each layer slots in proportion to misses x miss cost (at least one)."""
        assert self.ctx is not None
        layers = list(self.capacity)
        weight = {il: (self.misses[il] + 1) * self.miss_cost(il) for il in layers}
        total_w = sum(weight.values())
        budget = self.ctx.budget_bytes or 0
        for il in layers:
            share = budget * weight[il] / total_w
            self.capacity[il] = max(1, min(self.ctx.n_expert[il], int(share // self.ctx.expert_bytes[il])))
        self.misses = {il: 0 for il in layers}

    # -- decisions -------------------------------------------------------------

    def _router(self, layer: int) -> npt.NDArray[np.float32] | None:
        if layer not in self.routers:
            assert self.ctx is not None
            self.routers[layer] = self.ctx.router(layer)
        return self.routers[layer]

    def predict_next(self, call: HookCall) -> tuple[int | None, list[int]]:
        """The next MoE layer and the experts its router picks for the current input."""
        assert self.ctx is not None
        nxt = self.ctx.next_moe_layer(call.layer)
        if nxt is None:
            return None, []
        weights = self._router(nxt)
        if weights is None:
            return nxt, []
        logits = np.asarray(call.hidden, dtype=np.float32) @ weights.T  # [n_tokens, n_expert]
        k = min(call.n_expert_used, logits.shape[1])
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        return nxt, [int(e) for e in np.unique(top)]

    def _fit(
        self, layer: int, residency: npt.NDArray[np.int8], incoming: list[int], keep: set[int]
    ) -> list[int]:
        """Evict this layer's least recent experts so that incoming ones fit its capacity."""
        order = self.recency[layer]
        held = [e for e in order if residency[layer, e] != RESIDENCY_ABSENT]
        for e in list(order):
            if residency[layer, e] == RESIDENCY_ABSENT and e not in incoming:
                del order[e]
        over = len(held) + len(incoming) - self.capacity[layer]
        evict = []
        for e in held:
            if over <= 0:
                break
            if e in keep or residency[layer, e] == RESIDENCY_COPYING:
                continue
            evict.append(e)
            del order[e]
            over -= 1
        return evict

    def decide(self, call: HookCall) -> Plan:
        assert self.ctx is not None, "attach() first"
        residency = _require_device(call, self.name)
        layer = call.layer
        self.calls += 1
        if self.calls % self.resize_every == 0:
            self.resize()
        needed = [int(e) for e in np.unique(call.ids)]
        absent = [e for e in needed if residency[layer, e] == RESIDENCY_ABSENT]
        self.misses[layer] += len(absent)
        evict = [(layer, e) for e in self._fit(layer, residency, absent, set(needed))]
        for e in needed:
            self.recency[layer][e] = None
            self.recency[layer].move_to_end(e)

        prefetch: list[Key] = []
        nxt, predicted = self.predict_next(call)
        if nxt is not None and predicted:
            wanted = [e for e in predicted if residency[nxt, e] == RESIDENCY_ABSENT][: self.capacity[nxt]]
            if wanted:
                evict += [(nxt, e) for e in self._fit(nxt, residency, wanted, set(predicted))]
                for e in wanted:
                    self.recency[nxt][e] = None
                    self.recency[nxt].move_to_end(e)
                prefetch = [(nxt, e) for e in wanted]
        return Plan(actions=_actions(call, ACTION_DEVICE), evict=evict, prefetch=prefetch)
