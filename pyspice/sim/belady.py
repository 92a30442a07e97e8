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

On edge mode's disk tier (pyspice.sim.disk) a call need not hold its experts
in slots: one without a slot is read into scratch for that call (bypassing the
cache), and every miss costs a read whether it is fetched or run from scratch,
so the bound that matters is on reads and bytes, with bypass allowed.
`read_bound` gives it (see ReadBound): MIN with bypass for reads, and for bytes
(experts' widened reads differ with their alignment in the file) the least
bytes of any schedule, by a min-cost flow.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
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
    """MIN pooled and per layer over the tier's slots, plus the size-aware heuristic
    when sizes differ. A slot is the largest expert, as libspice lays slots out, so
    the pooled count is the fewest misses of any demand-loading replacement on the
    same tier. The size-aware row counts the budget in the experts' own bytes: what
    an allocator without fixed slots could reach (a heuristic, not a bound)."""
    calls = _requests(workload)
    moe = workload.moe_layers
    sizes = {il: int(expert_bytes[il]) for il in moe}
    n_slots = budget_bytes // max(sizes.values())
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
        self.slot_bytes = 0
        self.budget = 0

    def attach(self, ctx: PolicyContext) -> None:
        self.i = 0
        self.slot_bytes = ctx.slot_bytes  # what each held expert takes of the budget
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
        used = len(held) * self.slot_bytes
        need = sum(self.slot_bytes for e in needed if residency[layer, e] == RESIDENCY_ABSENT)
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
            used -= self.slot_bytes
        self.i += 1
        return Plan(actions=np.full(call.ids.shape, ACTION_DEVICE, np.int32), evict=evict)


# ---- the disk tier: reads and bytes, with bypass -------------------------------------


@dataclass(frozen=True)
class ReadBound:
    """The fewest reads and bytes any lossless policy makes on a disk tier of `slots`
    slots over a trace's decode steps (prompt steps read for free, as the simulator
    counts per decoded token).

    The model: a call needs each of its distinct experts in RAM while it runs, in a
    slot (kept from before: no read) or read for it; after the call, the slots may
    keep any `slots` of the experts held before or used by the call. Every real
    policy is such a schedule (a prefetch is a read made early, a host action on an
    absent expert a read into scratch, a surrogate or a drop is not lossless), and
    the model is looser than the tier (a miss may take the slot of an expert the
    same call uses; reads cost no time), so its optimum is a lower bound on any
    lossless policy's reads and bytes on the same trace and budget. Slots are as
    libspice counts them (budget // the largest expert).

    - `reads` (and `misses`, `min_bytes`): MIN with bypass, which after each call
      keeps the `slots` experts needed soonest (Belady's farthest-next-use rule;
      optimal for the number of reads, all reads counting one);
    - `bound_bytes` (and `bound_reads`): the least widened bytes read, every expert
      weighing what its read costs (ExpertReads), solved exactly as a min-cost flow
      (weighted caching with unit sizes): one unit of flow per slot from the first
      call to the last, keeping an expert between two of its uses is an arc of
      capacity 1 saving its read's bytes at the later use, and a slot may idle
      along the calls. `bound_bytes` <= `min_bytes`; equal when all reads weigh
      the same."""

    slots: int
    activations: int  # decode activations
    misses: int  # MIN: decode activations whose expert was not held
    reads: int  # MIN: expert reads in decode steps (one per distinct missed expert per call)
    min_bytes: int  # MIN: those reads' widened bytes
    bound_reads: int  # the reads of the least-bytes schedule
    bound_bytes: int  # the least widened bytes of any schedule

    @property
    def fallback_rate(self) -> float:
        return self.misses / self.activations if self.activations else 0.0


def _min_bypass(
    calls: Sequence[tuple[bool, list[tuple[Key, int]]]], slots: int, weight: dict[Key, int]
) -> tuple[int, int, int, int]:
    """(activations, misses, reads, bytes) of MIN with bypass over the decode calls."""
    next_use = _next_uses(calls)
    held: dict[Key, int] = {}  # key -> its next use
    acts = misses = reads = nbytes = 0
    for i, (decode, keys) in enumerate(calls):
        for (key, count), nu in zip(keys, next_use[i], strict=True):
            if decode:
                acts += count
                if key not in held:
                    misses += count
                    reads += 1
                    nbytes += weight[key]
            held[key] = nu
        if len(held) > slots or any(nu == _NEVER for nu in held.values()):
            keep = sorted((nu, key) for key, nu in held.items() if nu != _NEVER)[:slots]
            held = {key: nu for nu, key in keep}
    return acts, misses, reads, nbytes


def _least_bytes(
    calls: Sequence[tuple[bool, list[tuple[Key, int]]]], slots: int, weight: dict[Key, int]
) -> tuple[int, int]:
    """(bytes, reads) of the least-bytes schedule: min-cost flow by successive shortest
    paths (Dijkstra on reduced costs; the graph is acyclic, so the first potentials come
    from one pass in call order)."""
    n = len(calls)
    total_bytes = total_reads = 0
    last: dict[Key, int] = {}
    intervals: list[tuple[int, int, int]] = []  # (from call, to call, bytes saved)
    for i, (decode, keys) in enumerate(calls):
        for key, _count in keys:
            if decode:
                total_bytes += weight[key]
                total_reads += 1
                if key in last:
                    intervals.append((last[key], i, weight[key]))
            last[key] = i
    if n < 2 or not intervals or slots <= 0:
        return total_bytes, total_reads
    # arcs: to, capacity, cost, index of the reverse arc; adjacency by node
    to: list[int] = []
    cap: list[int] = []
    cost: list[int] = []
    adj: list[list[int]] = [[] for _ in range(n)]

    def arc(u: int, v: int, c: int, w: int) -> None:
        for a, b, c_ab, w_ab in ((u, v, c, w), (v, u, 0, -w)):
            adj[a].append(len(to))
            to.append(b)
            cap.append(c_ab)
            cost.append(w_ab)

    for g in range(n - 1):
        arc(g, g + 1, slots, 0)
    first_interval = len(to)
    for a, b, w in intervals:
        arc(a, b, 1, -w)
    inf = 1 << 62
    pot = [inf] * n  # shortest distances from call 0 in the acyclic graph
    pot[0] = 0
    for u in range(n):
        if pot[u] == inf:
            continue
        for e in adj[u]:
            if cap[e] > 0 and pot[u] + cost[e] < pot[to[e]]:
                pot[to[e]] = pot[u] + cost[e]
    saved = 0
    units = slots
    sink = n - 1
    while units > 0:
        dist = [inf] * n
        prev = [-1] * n
        dist[0] = 0
        heap = [(0, 0)]
        while heap:
            d, u = heapq.heappop(heap)
            if d > dist[u]:
                continue
            if u == sink:
                break
            pu = pot[u]
            for e in adj[u]:
                if cap[e] > 0:
                    v = to[e]
                    nd = d + cost[e] + pu - pot[v]
                    if nd < dist[v]:
                        dist[v] = nd
                        prev[v] = e
                        heapq.heappush(heap, (nd, v))
        if dist[sink] == inf:
            break
        dsink = dist[sink]
        for v in range(n):
            pot[v] += min(dist[v], dsink)
        path_cost = pot[sink] - pot[0]
        if path_cost >= 0:
            break  # the slots left gain nothing: they idle along the calls
        push, v = units, sink
        while v != 0:
            e = prev[v]
            push = min(push, cap[e])
            v = to[e ^ 1]
        v = sink
        while v != 0:
            e = prev[v]
            cap[e] -= push
            cap[e ^ 1] += push
            v = to[e ^ 1]
        saved -= push * path_cost
        units -= push
    kept = sum(1 for e in range(first_interval, len(to), 2) if cap[e] == 0)
    return total_bytes - saved, total_reads - kept


def read_bound(workload: Workload, weight_of: Callable[[int, int], int], slots: int) -> ReadBound:
    """ReadBound over `workload` for `slots` slots, an expert's read weighing
    `weight_of(layer, expert)` bytes (ExpertReads.bytes_of)."""
    calls = _requests(workload)
    weight = {key: int(weight_of(*key)) for _, keys in calls for key, _ in keys}
    acts, misses, reads, min_bytes = _min_bypass(calls, slots, weight)
    bound_bytes, bound_reads = _least_bytes(calls, slots, weight)
    return ReadBound(slots, acts, misses, reads, min_bytes, bound_reads, bound_bytes)
