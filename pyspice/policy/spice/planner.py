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

Bookkeeping over the residency table the engine hands the policy, in numpy
arrays (it runs on every decode hook call). What the plan asks for never
exceeds the byte budget (the store would refuse it anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import RESIDENCY_ABSENT, RESIDENCY_COPYING, RESIDENCY_QUEUED, RESIDENCY_RESIDENT
from pyspice.policy.context import PolicyContext
from pyspice.policy.spice.lookahead import Predictions

Key = tuple[int, int]


@dataclass
class PrefetchPlan:
    prefetch: list[Key]
    evict: list[Key]


class PrefetchPlanner:
    def __init__(self, ctx: PolicyContext, queue_max: int = 64, reserved_bytes: int = 0) -> None:
        self.ctx = ctx
        self.queue_max = queue_max
        self.budget = (ctx.budget_bytes or 0) - reserved_bytes
        self.bytes = ctx.bytes_vector()
        moe_bytes = {int(self.bytes[il]) for il in ctx.moe_layers}
        # every expert the same size (the common case): free bytes from one count
        self.uniform = moe_bytes.pop() if len(moe_bytes) == 1 else 0
        moe = list(ctx.moe_layers)
        self.n_moe = max(1, len(moe))
        pos = np.zeros(ctx.n_layers, dtype=np.int64)
        for i, il in enumerate(moe):
            pos[il] = i
        # distance[current][layer]: MoE layers from `current` until `layer` runs again,
        # with the current layer itself a full cycle away
        self.distance = np.zeros((ctx.n_layers, ctx.n_layers), dtype=np.int64)
        # farthest[current]: MoE layers ordered by that distance, farthest first
        self.farthest: dict[int, list[int]] = {}
        for cur in moe:
            d = (pos - pos[cur]) % self.n_moe
            d[cur] = self.n_moe
            self.distance[cur] = d
            self.farthest[cur] = sorted(moe, key=lambda il: -int(d[il]))
        self.distance_lists: list[list[int]] = self.distance.tolist()
        self.byte_list: list[int] = [int(b) for b in self.bytes]
        self.reset()

    def reset(self) -> None:
        self.queued: dict[Key, int] = {}  # our prefetches not yet landed -> distance when queued
        width = max(1, self.ctx.max_expert)
        self.last_use: list[list[int]] = [[0] * width for _ in range(self.ctx.n_layers)]
        self.clock = 0

    def note_use(self, layer: int, experts: list[int]) -> None:
        self.clock += 1
        row = self.last_use[layer]
        for e in experts:
            row[e] = self.clock

    def free_bytes(self, state: npt.NDArray[np.int8]) -> int:
        if self.uniform:
            return self.budget - int(np.count_nonzero(state)) * self.uniform
        held = np.count_nonzero(state != RESIDENCY_ABSENT, axis=1)
        return self.budget - int(held @ self.bytes[: state.shape[0]])

    def plan(
        self,
        current: int,
        pred: Predictions,
        residency: npt.NDArray[np.int8],
        busy: list[int],
        fetch_bytes: int,
    ) -> PrefetchPlan:
        """`busy`: experts of the current layer this call runs on the device or fetches
        (never evicted); `fetch_bytes`: bytes of the demand fetches this call makes.

        Runs on every decode hook call, where a numpy call on a tiny array costs more
        than the Python it would replace: rows of the residency table are read as
        lists, and numpy is used only to count over the whole table."""
        dist = self.distance_lists[current]
        horizon = len(pred)
        rows: dict[int, list[int]] = {}

        def row(il: int) -> list[int]:
            r = rows.get(il)
            if r is None:
                r = rows[il] = residency[il].tolist()
            return r

        predicted: set[Key] = set()
        candidates: list[tuple[int, Key]] = []  # (distance, key): nearest layer, most probable first
        for il, experts in zip(pred.layers, pred.experts, strict=True):
            r, d = row(il), dist[il]
            for e in experts:
                predicted.add((il, e))
                if r[e] == RESIDENCY_ABSENT:
                    candidates.append((d, (il, e)))

        # our prefetches: landed or dropped ones are forgotten, stale ones cancelled
        evict: list[Key] = []
        for key, issued_at in list(self.queued.items()):
            s = row(key[0])[key[1]]
            if s != RESIDENCY_QUEUED:
                if s != RESIDENCY_COPYING:
                    del self.queued[key]
                continue
            if (
                key in predicted
                or horizon < dist[key[0]] <= issued_at
                or (key[0] == current and key[1] in busy)
            ):
                continue  # still wanted, beyond this call's horizon and approaching, or awaited now
            evict.append(key)
            del self.queued[key]
        if not candidates:
            return PrefetchPlan([], evict)

        n_queued = int(np.count_nonzero(residency == RESIDENCY_QUEUED)) - len(evict)
        free = self.free_bytes(residency) - fetch_bytes + sum(self.byte_list[k[0]] for k in evict)
        victims: list[tuple[int, Key]] | None = None
        prefetch: list[Key] = []
        for depth, key in candidates:
            if n_queued >= self.queue_max:
                break
            need = self.byte_list[key[0]]
            if free < need:
                if victims is None:
                    victims = self._victims(current, row, busy, predicted, depth, len(candidates))
                while free < need and victims and victims[-1][0] > depth:
                    v = victims.pop()[1]
                    evict.append(v)
                    free += self.byte_list[v[0]]
                if free < need:
                    break  # nearer predictions came first; nothing farther may displace them
            prefetch.append(key)
            self.queued[key] = depth
            free -= need
            n_queued += 1
        return PrefetchPlan(prefetch, evict)

    def _victims(
        self,
        current: int,
        row: Callable[[int], list[int]],
        busy: list[int],
        predicted: set[Key],
        nearest: int,
        count: int,
    ) -> list[tuple[int, Key]]:
        """Evictable experts as (distance, key), best victim LAST, gathered from the
        farthest layers inward until `count` are found or the layers get as near as
        `nearest` (nothing nearer may be evicted for it)."""
        dist = self.distance_lists[current]
        found: list[tuple[int, Key]] = []
        for il in self.farthest[current]:
            d = dist[il]
            if d <= nearest or len(found) >= count:
                break
            r = row(il)
            skip = busy if il == current else ()
            held = [
                e
                for e, s in enumerate(r)
                if s == RESIDENCY_RESIDENT and e not in skip and (il, e) not in predicted
            ]
            if held:
                last = self.last_use[il]
                held.sort(key=last.__getitem__)  # least recent first
                found.extend((d, (il, e)) for e in held)
        found.reverse()  # pop() takes the farthest, least recent first
        return found
