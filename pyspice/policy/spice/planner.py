"""Prefetch planner: what to copy ahead, what to cancel, where room may come from.

- The union of the predicted sets goes to the low-priority queue, nearest
  layer first and most probable first within a layer, up to the queue bound.
  A plan applied `lag` MoE layers after its call (asynchronous planning) comes
  too late for the layers within that distance: their prefetches serve only
  the next token's call of them, so they queue after every layer the plan
  still reaches (a prompt batch, which predicts most experts of every layer,
  would otherwise fill the queue with them).
- Nothing resident or already on its way is queued again.
- Queued prefetches gone stale (for a layer already passed, or no longer
  predicted for a layer inside the horizon) are cancelled: evicting a queued
  copy cancels it (one already on the bus cannot be taken back).
- Room is made by evicting the experts with the least predicted use: never a
  predicted one nor one this call runs; the layer that comes up last in the
  layer cycle first (the layers just run are needed again only at the next
  token, the next token's first layers soon), and a victim must be needed
  later than the expert it makes room for. The plan says so declaratively:
  Plan.evict_from lists the layers farthest first, counted from the layer
  where the plan lands (`lag` layers after its own; only those beyond the
  horizon while they are at least as many as the horizon's; else all, and
  the prefetch list also names the resident predictions, which keeps them);
  the engine then picks within a layer the expert selected least recently. The
  engine sees every hook call, also those the policy lets it answer in
  advance (Plan.resume_layer), so its recency is complete where the policy's
  would not be; and the victim search is the part that costs most in Python
  inside the graph.

The engine enforces the byte budget: a prefetch that finds no room there is
dropped with the ones after it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
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
    evict: list[Key]  # stale prefetches to cancel
    evict_from: Sequence[int]  # layers a prefetch may take room from, most evictable first


class PrefetchPlanner:
    """Runs on the hook calls that plan, where one numpy call on a tiny array costs more
    than the Python it would replace: experts are plain ints (layer * width + expert)
    and the residency table is read as one bytes object."""

    def __init__(self, ctx: PolicyContext, queue_max: int = 64, lag: int = 0) -> None:
        self.ctx = ctx
        self.queue_max = queue_max
        self.lag = lag  # MoE layers from a call to where its plan is applied
        self.width = max(1, ctx.max_expert)  # an expert's int key: layer * width + expert
        moe = list(ctx.moe_layers)
        n_moe = max(1, len(moe))
        pos = np.zeros(ctx.n_layers, dtype=np.int64)
        for i, il in enumerate(moe):
            pos[il] = i
        # distance[current][layer]: MoE layers from `current` until `layer` runs again,
        # with the current layer itself a full cycle away
        distance = np.zeros((ctx.n_layers, ctx.n_layers), dtype=np.int64)
        # farthest[current]: MoE layers ordered by that distance, farthest first (the plan's
        # evict_from; an int32 array, which the engine copies into the plan in one move)
        self.farthest: dict[int, array[int]] = {}
        for cur in moe:
            d = (pos - pos[cur]) % n_moe
            d[cur] = n_moe
            distance[cur] = d
            self.farthest[cur] = array("i", sorted(moe, key=lambda il: -int(d[il])))
        # a plan's room is ordered from the layer where it lands (`lag` MoE layers on): by
        # then that layer has run and is the one needed again last. Ordered from the layer
        # that planned, it was listed last (never a victim) and the planning layer first. In
        # the simulator, planning at every layer one layer late, landing order cut TPOT in all
        # 8 target x profile x budget cells: 2.8-3.6% at 25%, 0.4-1.9% at 50%
        # (docs/results/planning.md)
        self.room_order = {cur: self.farthest[moe[(i + max(0, lag)) % n_moe]] for i, cur in enumerate(moe)}
        self.distance_lists: list[list[int]] = distance.tolist()
        self.n_moe = n_moe
        self.reset()

    def reset(self) -> None:
        self.queued: dict[int, int] = {}  # our prefetches not yet landed -> distance when queued

    def plan(
        self,
        current: int,
        pred: Predictions,
        residency: npt.NDArray[np.int8],
        busy: list[int],
        cells: bytes | None = None,
    ) -> PrefetchPlan:
        """`busy`: experts of the current layer this call runs on the device or fetches
        (a queued copy of one is awaited, not cancelled); `cells`: residency.tobytes()
        if the caller has it already (a cell is one index away, `cells[layer * width +
        expert]`, and counting states is bytes.count: far cheaper than numpy calls on a
        table this small)."""
        width = self.width
        if residency.shape[1] != width:
            raise ValueError(f"residency table has {residency.shape[1]} columns; the context says {width}")
        if cells is None:
            cells = residency.tobytes()
        dist = self.distance_lists[current]
        layers, chosen = pred.layers, pred.experts
        horizon = len(layers)

        # our prefetches: landed or dropped ones are forgotten, stale ones cancelled
        evict: list[int] = []
        queued = self.queued
        on_the_way = RESIDENCY_QUEUED in cells or RESIDENCY_COPYING in cells
        if queued and not on_the_way:
            queued.clear()  # nothing on its way at all (the common case): all landed or dropped
        if queued:
            wanted = {il * width + e for il, experts in zip(layers, chosen, strict=True) for e in experts}
            for key in [k for k in queued if cells[k] != RESIDENCY_QUEUED]:
                if cells[key] != RESIDENCY_COPYING:
                    del queued[key]
            for key in [k for k in queued if cells[k] == RESIDENCY_QUEUED]:
                il = key // width
                if (
                    key in wanted
                    or horizon < dist[il] <= queued[key]
                    or (il == current and key - il * width in busy)
                ):
                    continue  # still wanted, beyond this call's horizon and approaching, or awaited now
                evict.append(key)
                del queued[key]
        cancelled = [divmod(k, width) for k in evict]
        if not layers:
            return PrefetchPlan([], cancelled, ())

        # where room may come from: the layers needed last first. Where the layers beyond
        # the horizon are at least as many as those inside it, only they are listed, and no
        # prediction can be a victim; else every layer, and the plan lists the resident
        # predictions too, which keeps them (a prefetch only takes from layers needed later)
        reach = dist[layers[-1]]
        beyond = self.n_moe - reach
        evict_from = self.room_order[current]
        keep_resident = beyond < reach
        if not keep_resident:
            evict_from = evict_from[:beyond]
        room = self.queue_max - ((cells.count(RESIDENCY_QUEUED) if on_the_way else 0) - len(evict))
        pairs: list[Key] = []  # nearest layer the plan still reaches, most probable first
        copies = 0
        order: Iterable[tuple[int, list[int]]] = zip(layers, chosen, strict=True)
        if self.lag > 0 and dist[layers[0]] <= self.lag:  # only then: planning runs on the hook's thread
            lag = self.lag
            order = sorted(order, key=lambda pair: dist[pair[0]] <= lag)  # stable: layers passed last
        for il, experts in order:
            base, d = il * width, dist[il]
            for e in experts:
                state = cells[base + e]
                if state == RESIDENCY_ABSENT:
                    if copies >= room:
                        break  # the queue is full from here on
                    copies += 1
                    queued[base + e] = d
                    pairs.append((il, e))
                elif state == RESIDENCY_RESIDENT and keep_resident:
                    pairs.append((il, e))
            else:
                continue
            break
        if not copies:
            return PrefetchPlan([], cancelled, ())
        return PrefetchPlan(pairs, cancelled, evict_from)
