"""A minimal device tier in pure Python, for driving policies over hand-made traces.

It applies plans the way libspice does (evictions, demand fetches explicit or
implied by device actions, prefetches; a fetch that does not fit the budget
leaves the expert on the host) but copies land instantly: what these tests
check is what the policies decide, not timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyspice.policy import ACTION_DEVICE, RESIDENCY_ABSENT, RESIDENCY_RESIDENT, HookCall, Plan, PolicyContext


@dataclass
class FakeTier:
    ctx: PolicyContext
    residency: np.ndarray = field(init=False)
    copied_bytes: int = 0
    hits: int = 0
    activations: int = 0
    prefetched: set[tuple[int, int]] = field(default_factory=set)
    prefetch_hits: int = 0
    last_use: dict[tuple[int, int], int] = field(default_factory=dict)
    clock: int = 0

    def __post_init__(self) -> None:
        self.residency = np.zeros((self.ctx.n_layers, self.ctx.max_expert), dtype=np.int8)

    def used(self) -> int:
        return int(((self.residency != RESIDENCY_ABSENT).sum(axis=1) * self.ctx.bytes_vector()).sum())

    def _fetch(self, il: int, e: int) -> bool:
        if self.residency[il, e] != RESIDENCY_ABSENT:
            return True
        if self.used() + self.ctx.expert_bytes[il] > (self.ctx.budget_bytes or 0):
            return False
        self.residency[il, e] = RESIDENCY_RESIDENT
        self.copied_bytes += self.ctx.expert_bytes[il]
        return True

    def call(self, policy: object, layer: int, ids: list[int], hidden: np.ndarray | None = None) -> Plan:
        n_embd = 8 if hidden is None else hidden.shape[-1]
        ids_arr = np.asarray([ids], dtype=np.int32)
        call = HookCall(
            layer,
            hidden if hidden is not None else np.zeros((1, n_embd), np.float32),
            np.full((1, self.ctx.n_expert[layer]), 1.0 / self.ctx.n_expert[layer], np.float32),
            ids_arr,
            np.full(ids_arr.shape, 1.0 / len(ids), np.float32),
            None,
            self.residency.copy(),
        )
        self.clock += 1
        for e in ids:
            self.last_use[(layer, e)] = self.clock
        for e in ids:
            self.activations += 1
            if self.residency[layer, e] == RESIDENCY_RESIDENT:
                self.hits += 1
                if (layer, e) in self.prefetched:
                    self.prefetch_hits += 1
                    self.prefetched.discard((layer, e))
        plan: Plan = policy.decide(call)  # type: ignore[attr-defined]
        for il, e in plan.evict:
            self.residency[il, e] = RESIDENCY_ABSENT
        for e in plan.fetch:
            self._fetch(layer, e)
        actions = np.asarray(plan.actions) if plan.actions is not None else None
        for k, e in enumerate(ids):
            if actions is not None and actions[0, k] == ACTION_DEVICE:
                self._fetch(layer, e)
        busy = {e for k, e in enumerate(ids) if actions is None or actions[0, k] == ACTION_DEVICE}
        order = list(plan.evict_from)
        kept = set(plan.prefetch)
        for il, e in plan.prefetch:
            if self.residency[il, e] != RESIDENCY_ABSENT:
                continue  # resident: kept, not copied
            # evict_from: room from the layers listed before this one, least recently selected first
            room = order[: order.index(il)] if il in order else order
            while not self._fetch(il, e) and room:
                held = [
                    (self.last_use.get((room[0], v), 0), v)
                    for v in np.flatnonzero(self.residency[room[0]] == RESIDENCY_RESIDENT).tolist()
                    if not (room[0] == layer and v in busy) and (room[0], v) not in kept
                ]
                if held:
                    self.residency[room[0], min(held)[1]] = RESIDENCY_ABSENT
                else:
                    room = room[1:]
            if self.residency[il, e] == RESIDENCY_ABSENT:
                if order:
                    break  # no room for it, nor for the prefetches after it
                continue
            self.prefetched.add((il, e))
        return plan
