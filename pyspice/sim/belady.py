"""Belady's MIN: the fewest misses any replacement policy can have over a trace.

The cache holds `slots` equal-size experts; each hook call needs its distinct
experts resident at once (a miss loads one); when a load finds the cache full,
MIN evicts the resident expert whose next use is farthest in the future
(never one the current call needs). With demand loading and equal sizes this
is optimal (Belady 1966; Mattson et al. 1970). `pooled` runs one cache over
all layers' experts; `per_layer` splits the slots equally between MoE layers
and runs MIN in each. Misses are counted per activation, as the engine counts
them: a call's tokens that share a missing expert all miss.

Where expert sizes differ (a quant mix gives some layers bigger experts),
`size_aware` fills a byte budget and evicts farthest-next-use first until the
new expert fits: a heuristic, not a bound, and labelled so.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyspice.policy.base import (
    ACTION_DEVICE,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    HookCall,
    Plan,
    PolicyBase,
)
from pyspice.policy.context import PolicyContext
from pyspice.sim.workload import Workload

Key = tuple[int, int]
_NEVER = 1 << 62


@dataclass(frozen=True)
class BeladyResult:
    mode: str  # "pooled", "per-layer" or "size-aware (heuristic)"
    slots: int  # total slots (size-aware: experts of mean size the budget holds)
    activations: int  # decode activations
    misses: int  # decode activations whose expert was not resident
    loads: int  # experts loaded during decode
    bytes_loaded: int

    @property
    def fallback_rate(self) -> float:
        return self.misses / self.activations if self.activations else 0.0


def _requests(workload: Workload) -> list[tuple[bool, list[tuple[Key, int]]]]:
    """Per call: (decode?, [(expert key, activations of it)])."""
    out = []
    for step in workload.steps:
        for call in step.calls:
            keys: dict[Key, int] = {}
            for e in call.ids.ravel().tolist():
                keys[(call.layer, int(e))] = keys.get((call.layer, int(e)), 0) + 1
            out.append((step.decode, sorted(keys.items())))
    return out


def _next_uses(calls: Sequence[tuple[bool, list[tuple[Key, int]]]]) -> list[list[int]]:
    """For each call and each of its keys, the index of the key's next call (or never)."""
    nxt: dict[Key, int] = {}
    result: list[list[int]] = [[] for _ in calls]
    for i in range(len(calls) - 1, -1, -1):
        result[i] = [nxt.get(key, _NEVER) for key, _ in calls[i][1]]
        for key, _ in calls[i][1]:
            nxt[key] = i
    return result


def _min(
    calls: Sequence[tuple[bool, list[tuple[Key, int]]]],
    capacity: dict[int, float] | float,
    size: dict[int, int],
    group: dict[int, int],
    nbytes_of: dict[int, int],
) -> tuple[int, int, int, int]:
    """MIN with eviction by farthest next use. `capacity` is per group (a layer, or one
    pool) in the units of `size` (1 per expert for slots, bytes for size-aware)."""
    next_use = _next_uses(calls)
    resident: dict[Key, int] = {}  # key -> next use
    heaps: dict[int, list[tuple[int, Key]]] = {}
    used: dict[int, float] = {}
    acts = misses = loads = nbytes = 0
    for i, (decode, keys) in enumerate(calls):
        needed = {key for key, _ in keys}
        for (key, count), nu in zip(keys, next_use[i], strict=True):
            g = group[key[0]]
            cap = capacity[g] if isinstance(capacity, dict) else capacity
            if decode:
                acts += count
            if key not in resident:
                if decode:
                    misses += count
                    loads += 1
                    nbytes += nbytes_of[key[0]]
                heap = heaps.setdefault(g, [])
                deferred = []
                while used.get(g, 0) + size[key[0]] > cap and heap:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue  # stale entry
                    if victim in needed:
                        deferred.append((neg, victim))
                        continue
                    del resident[victim]
                    used[g] -= size[victim[0]]
                for item in deferred:
                    heapq.heappush(heap, item)
                if used.get(g, 0) + size[key[0]] > cap:
                    continue  # cannot hold it even alone: it stays a miss every time
                used[g] = used.get(g, 0) + size[key[0]]
            resident[key] = nu
            heapq.heappush(heaps.setdefault(g, []), (-nu, key))
    return acts, misses, loads, nbytes


def belady(workload: Workload, expert_bytes: Sequence[int], budget_bytes: int) -> list[BeladyResult]:
    """MIN pooled and per layer over equal-size slots, plus the size-aware heuristic
    when sizes differ. A slot is the smallest expert: no policy under the byte
    budget can hold more experts than that, so the pooled count is a true lower
    bound for demand-loading replacement."""
    calls = _requests(workload)
    moe = workload.moe_layers
    sizes = {il: int(expert_bytes[il]) for il in moe}
    n_slots = budget_bytes // min(sizes.values())
    ones = dict.fromkeys(moe, 1)
    results = []
    pooled = _min(calls, float(n_slots), ones, dict.fromkeys(moe, 0), sizes)
    results.append(BeladyResult("pooled", n_slots, *pooled))
    per = n_slots // max(1, len(moe))
    layered = _min(calls, dict.fromkeys(moe, float(per)), ones, {il: il for il in moe}, sizes)
    results.append(BeladyResult("per-layer", per * len(moe), *layered))
    if len(set(sizes.values())) > 1:
        sized = _min(calls, float(budget_bytes), sizes, dict.fromkeys(moe, 0), sizes)
        mean = sum(sizes.values()) / len(sizes)
        results.append(BeladyResult("size-aware (heuristic)", int(budget_bytes // mean), *sized))
    return results


class BeladyOracle(PolicyBase):
    """MIN as a policy, for the simulator only: it knows the whole trace, fetches what a
    call needs on demand and evicts what is used farthest in the future (never what the
    call needs, nor a copy in flight). Its simulated TPOT is that of optimal replacement
    without prefetching; it is a bound, not something that could ship."""

    name = "belady"

    def __init__(self, workload: Workload) -> None:
        self.uses: dict[Key, list[int]] = {}
        for i, (_, keys) in enumerate(_requests(workload)):
            for key, _count in keys:
                self.uses.setdefault(key, []).append(i)
        self.i = 0
        self.expert_bytes: tuple[int, ...] = ()
        self.budget = 0

    def attach(self, ctx: PolicyContext) -> None:
        self.i = 0
        self.expert_bytes = ctx.expert_bytes
        # the tier charges loaded surrogates to its budget: counting them out keeps the
        # oracle from planning into bytes the tier then refuses (a refused demand fetch
        # runs on the host, which made the oracle's row a host run when a sidecar was given)
        self.budget = max(0, (ctx.budget_bytes or 0) - ctx.reserved_bytes)

    def _next_use(self, key: Key) -> int:
        uses = self.uses.get(key, [])
        j = bisect.bisect_right(uses, self.i)
        return uses[j] if j < len(uses) else _NEVER

    def decide(self, call: HookCall) -> Plan:
        residency = call.residency
        if residency is None:
            raise RuntimeError("the Belady oracle needs a device tier")
        layer = call.layer
        needed = {int(e) for e in np.unique(call.ids)}
        held = np.argwhere(residency != RESIDENCY_ABSENT)
        used = sum(self.expert_bytes[int(il)] for il, _ in held)
        need = sum(self.expert_bytes[layer] for e in needed if residency[layer, e] == RESIDENCY_ABSENT)
        candidates = sorted(
            (
                (self._next_use((int(il), int(e))), (int(il), int(e)))
                for il, e in held
                if not (il == layer and int(e) in needed) and residency[il, e] != RESIDENCY_COPYING
            ),
            reverse=True,
        )
        evict = []
        for _, key in candidates:
            if used + need <= self.budget:
                break
            evict.append(key)
            used -= self.expert_bytes[key[0]]
        self.i += 1
        return Plan(actions=np.full(call.ids.shape, ACTION_DEVICE, np.int32), evict=evict)
