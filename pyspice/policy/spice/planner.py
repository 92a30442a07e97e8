"""Prefetch planner: what to copy ahead, what to cancel, what to evict.

- The union of the predicted sets goes to the low-priority queue, nearest
  layer first and most probable first within a layer, up to the queue bound.
- Nothing resident or already on its way is queued again.
- Queued prefetches gone stale (for a layer already passed, or no longer
  predicted for a layer inside the horizon) are cancelled: evicting a queued
  copy cancels it (one already on the bus cannot be taken back).
- Room is made by evicting the experts with the least predicted use: never a
  predicted one nor one this call runs; among the rest, those whose layer
  comes up last in the layer cycle go first (the layers just run are needed
  again only at the next token, the next token's first layers soon), least
  recently used among equals. A victim must be needed later than the
  expert it makes room for.

Bookkeeping over the residency table the engine hands the policy. What the
plan asks for never exceeds the byte budget (the store would refuse it anyway).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
    held_bytes,
)
from pyspice.policy.context import PolicyContext
from pyspice.policy.spice.lookahead import Predictions

Key = tuple[int, int]


@dataclass
class PrefetchPlan:
    prefetch: list[Key]
    evict: list[Key]


class PrefetchPlanner:
    """Runs on every decode hook call, where one numpy call on a tiny array costs more
    than the Python it would replace: experts are plain ints (layer * width + expert),
    rows of the residency table are read as lists, and numpy only counts over the
    whole table."""

    def __init__(self, ctx: PolicyContext, queue_max: int = 64, reserved_bytes: int = 0) -> None:
        self.ctx = ctx
        self.queue_max = queue_max
        self.budget = (ctx.budget_bytes or 0) - reserved_bytes
        self.bytes = ctx.bytes_vector()
        moe_bytes = {int(self.bytes[il]) for il in ctx.moe_layers}
        # every expert the same size (the common case): free bytes from one count
        self.uniform = moe_bytes.pop() if len(moe_bytes) == 1 else 0
        self.width = max(1, ctx.max_expert)  # an expert's int key: layer * width + expert
        moe = list(ctx.moe_layers)
        self.n_moe = max(1, len(moe))
        pos = np.zeros(ctx.n_layers, dtype=np.int64)
        for i, il in enumerate(moe):
            pos[il] = i
        # distance[current][layer]: MoE layers from `current` until `layer` runs again,
        # with the current layer itself a full cycle away
        distance = np.zeros((ctx.n_layers, ctx.n_layers), dtype=np.int64)
        # farthest[current]: MoE layers ordered by that distance, farthest first
        self.farthest: dict[int, list[int]] = {}
        for cur in moe:
            d = (pos - pos[cur]) % self.n_moe
            d[cur] = self.n_moe
            distance[cur] = d
            self.farthest[cur] = sorted(moe, key=lambda il: -int(d[il]))
        self.distance_lists: list[list[int]] = distance.tolist()
        self.byte_list: list[int] = [int(b) for b in self.bytes]
        self.reset()

    def reset(self) -> None:
        self.queued: dict[int, int] = {}  # our prefetches not yet landed -> distance when queued
        # when each expert (by int key) was last seen selected: one flat machine-int array,
        # not lists of Python ints, which would scatter over the heap (every read inside
        # the graph would be its own cache miss)
        self.last_use = array("q", bytes(8 * self.ctx.n_layers * self.width))
        self.clock = 0

    def note_use(self, layer: int, experts: list[int]) -> None:
        self.clock += 1
        last_use, clock, base = self.last_use, self.clock, layer * self.width
        for e in experts:
            last_use[base + e] = clock

    def free_bytes(self, state: npt.NDArray[np.int8]) -> int:
        if self.uniform:
            return self.budget - int(np.count_nonzero(state)) * self.uniform
        return self.budget - held_bytes(state, self.bytes)

    def plan(
        self,
        current: int,
        pred: Predictions,
        residency: npt.NDArray[np.int8],
        busy: list[int],
        fetch_bytes: int,
        cells: bytes | None = None,
    ) -> PrefetchPlan:
        """`busy`: experts of the current layer this call runs on the device or fetches
        (never evicted); `fetch_bytes`: bytes of the demand fetches this call makes;
        `cells`: residency.tobytes() if the caller has it already.

        The residency table is read as one bytes object: a cell is one index away
        (`cells[layer * width + expert]`) and counting states is bytes.count, both
        far cheaper than numpy calls on a table this small."""
        width = self.width
        if residency.shape[1] != width:
            raise ValueError(f"residency table has {residency.shape[1]} columns; the context says {width}")
        if cells is None:
            cells = residency.tobytes()
        dist = self.distance_lists[current]
        horizon = len(pred)

        predicted: set[int] = set()
        candidates: list[tuple[int, int]] = []  # (distance, key): nearest layer, most probable first
        for il, experts in zip(pred.layers, pred.experts, strict=True):
            base = il * width
            keys = [base + e for e in experts]
            predicted.update(keys)
            d = dist[il]
            candidates += [(d, k) for k in keys if cells[k] == RESIDENCY_ABSENT]

        # our prefetches: landed or dropped ones are forgotten, stale ones cancelled
        evict: list[int] = []
        queued = self.queued
        if queued and RESIDENCY_QUEUED not in cells and RESIDENCY_COPYING not in cells:
            queued.clear()  # nothing on its way at all (the common case): all landed or dropped
        if queued:
            for key in [k for k in queued if cells[k] != RESIDENCY_QUEUED]:
                if cells[key] != RESIDENCY_COPYING:
                    del queued[key]
            for key in [k for k in queued if cells[k] == RESIDENCY_QUEUED]:
                il = key // width
                if (
                    key in predicted
                    or horizon < dist[il] <= queued[key]
                    or (il == current and key - il * width in busy)
                ):
                    continue  # still wanted, beyond this call's horizon and approaching, or awaited now
                evict.append(key)
                del queued[key]
        if not candidates:
            return PrefetchPlan([], [divmod(k, width) for k in evict])

        n_queued = cells.count(RESIDENCY_QUEUED) - len(evict)
        byte_list = self.byte_list
        freed = sum([byte_list[k // width] for k in evict])
        if self.uniform:
            free = self.budget - (len(cells) - cells.count(RESIDENCY_ABSENT)) * self.uniform
            # victims worth gathering: as many as the candidates lack room for
            short = len(candidates) * self.uniform - (free - fetch_bytes + freed)
            count = -(-short // self.uniform)
        else:
            free = self.free_bytes(residency)
            count = len(candidates)
        free += freed - fetch_bytes
        victims: list[tuple[int, int]] | None = None
        prefetch: list[tuple[int, int]] = []
        for depth, key in candidates:
            if n_queued >= self.queue_max:
                break
            need = byte_list[key // width]
            if free < need:
                if victims is None:
                    victims = self._victims(current, cells, busy, predicted, depth, count)
                while free < need and victims and victims[-1][0] > depth:
                    v = victims.pop()[1]
                    evict.append(v)
                    free += byte_list[v // width]
                if free < need:
                    break  # nearer predictions came first; nothing farther may displace them
            prefetch.append(divmod(key, width))
            queued[key] = depth
            free -= need
            n_queued += 1
        return PrefetchPlan(prefetch, [divmod(k, width) for k in evict])

    def _victims(
        self,
        current: int,
        cells: bytes,
        busy: list[int],
        predicted: set[int],
        nearest: int,
        count: int,
    ) -> list[tuple[int, int]]:
        """Evictable experts as (distance, key), best victim LAST, gathered from the
        farthest layers inward until `count` are found or the layers get as near as
        `nearest` (nothing nearer may be evicted for it)."""
        dist = self.distance_lists[current]
        width = self.width
        found: list[tuple[int, int]] = []
        find = cells.find
        for il in self.farthest[current]:
            d = dist[il]
            if d <= nearest or len(found) >= count:
                break
            base = il * width
            end = base + width
            skip = busy if il == current else ()
            held: list[int] = []
            i = find(RESIDENCY_RESIDENT, base, end)  # a C scan from one resident to the next
            while i >= 0:
                if i - base not in skip and i not in predicted:
                    held.append(i)
                i = find(RESIDENCY_RESIDENT, i + 1, end)
            if held:
                held.sort(key=self.last_use.__getitem__)  # least recent first
                found.extend([(d, key) for key in held])
        found.reverse()  # pop() takes the farthest, least recent first
        return found
