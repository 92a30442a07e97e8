"""The simulated device tier: slots under a pooled byte budget and a copy engine
on a virtual bus, on the simulator's clock.

This mirrors native/src/spice-store.c rule for rule, so a simulated run and an
emulated one move the same copies at the same virtual times: the bus is one
serial timeline; copies that have started keep their place; every change (a
new copy, an upgrade, a cancellation) re-lays the copies that have not
started, demand copies first, then prefetches, each group in issue order, each
starting when the bus is free and occupying it for latency + bytes /
bandwidth. A copy lands when the clock passes its end. A prefetch is refused
when the queue of not-started prefetches is full; a request is refused when no
slot or budget is left; a started copy cannot be evicted; pinned slots cannot
be evicted. Times are integer nanoseconds, as in the C store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
)

PRIORITY_PREFETCH = 0
PRIORITY_DEMAND = 1
PREFETCH_QUEUE_DEFAULT = 64  # SPICE_PREFETCH_QUEUE_DEFAULT in spice-store.c

OK = 0
REFUSED_BUDGET = 1  # SPICE_ERR_BUDGET: no slot or budget left
REFUSED_STATE = 2  # SPICE_ERR_STATE: prefetch queue full, copy in flight, pinned

Key = tuple[int, int]


@dataclass
class Copy:
    layer: int
    expert: int
    priority: int
    was_prefetch: bool
    nbytes: int
    issue_ns: int
    seq: int  # stands in for the C store's slot number as the final tie-break
    start_ns: int | None = None
    end_ns: int | None = None


@dataclass
class LayerCounters:
    bytes_h2d: int = 0
    copy_ns: int = 0
    stall_ns: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0


@dataclass
class SimTier:
    """The device tier on a manual clock (`now_ns`, advanced by the simulator)."""

    n_expert: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    budget_bytes: int
    bandwidth_gbps: float
    latency_us: float
    prefetch_queue_max: int = PREFETCH_QUEUE_DEFAULT
    now_ns: int = 0
    used_bytes: int = 0
    copies: dict[Key, Copy] = field(default_factory=dict)
    resident: set[Key] = field(default_factory=set)
    from_prefetch: set[Key] = field(default_factory=set)
    pins: dict[Key, int] = field(default_factory=dict)
    filled: set[Key] = field(default_factory=set)  # emulated device: slot bytes already copied in
    counters: list[LayerCounters] = field(default_factory=list)
    last_use: dict[Key, int] = field(default_factory=dict)  # hook call that last selected each expert
    use_clock: int = 0
    _seq: int = 0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.latency_us < 0:
            raise ValueError("bus bandwidth must be positive and latency non-negative")
        self.counters = [LayerCounters() for _ in self.n_expert]

    @property
    def n_layers(self) -> int:
        return len(self.n_expert)

    @property
    def max_expert(self) -> int:
        return max(self.n_expert, default=0)

    def occupancy_ns(self, nbytes: int) -> int:
        return int(self.latency_us * 1e3 + nbytes / self.bandwidth_gbps)

    # -- the timeline -----------------------------------------------------------

    def refresh(self) -> int:
        """Retire every copy that has landed by now."""
        now = self.now_ns
        for key, c in list(self.copies.items()):
            if c.start_ns is not None and c.end_ns is not None and c.end_ns <= now:
                del self.copies[key]
                self.resident.add(key)
                if c.was_prefetch:
                    self.from_prefetch.add(key)
                else:
                    self.from_prefetch.discard(key)
        return now

    def _started(self, c: Copy, now: int) -> bool:
        return c.start_ns is not None and c.start_ns <= now

    def reschedule(self) -> None:
        now = self.refresh()
        cursor = now
        pending: list[Copy] = []
        for c in self.copies.values():
            if self._started(c, now):
                assert c.end_ns is not None
                cursor = max(cursor, c.end_ns)
            else:
                c.start_ns = None
                pending.append(c)
        pending.sort(key=lambda c: (-c.priority, c.issue_ns, c.seq))
        for c in pending:
            c.start_ns = max(cursor, c.issue_ns)
            c.end_ns = c.start_ns + self.occupancy_ns(c.nbytes)
            cursor = c.end_ns

    def queued_prefetches(self, now: int) -> int:
        return sum(
            1 for c in self.copies.values() if c.priority == PRIORITY_PREFETCH and not self._started(c, now)
        )

    def bus_free_at(self) -> int:
        """When the bus has carried every copy issued so far."""
        return max((c.end_ns or 0 for c in self.copies.values()), default=self.now_ns)

    # -- operations (spice_store_* in spice-store.c) ------------------------------

    def holds(self, layer: int, expert: int) -> bool:
        key = (layer, expert)
        return key in self.resident or key in self.copies

    def request(self, layer: int, expert: int, priority: int) -> int:
        now = self.refresh()
        key = (layer, expert)
        if key in self.resident:
            return OK
        copy = self.copies.get(key)
        if copy is not None:
            if (
                priority == PRIORITY_DEMAND
                and copy.priority == PRIORITY_PREFETCH
                and not self._started(copy, now)
            ):
                copy.priority = PRIORITY_DEMAND  # overtakes the other queued prefetches
                self.reschedule()
            return OK
        if priority == PRIORITY_PREFETCH and self.queued_prefetches(now) >= self.prefetch_queue_max:
            return REFUSED_STATE
        nbytes = self.expert_bytes[layer]
        if self.used_bytes + nbytes > self.budget_bytes:
            return REFUSED_BUDGET
        self.used_bytes += nbytes
        self._seq += 1
        self.copies[key] = Copy(
            layer, expert, priority, priority == PRIORITY_PREFETCH, nbytes, issue_ns=now, seq=self._seq
        )
        self.from_prefetch.discard(key)
        self.filled.discard(key)
        k = self.counters[layer]
        k.bytes_h2d += nbytes
        k.copy_ns += self.occupancy_ns(nbytes)
        if priority == PRIORITY_PREFETCH:
            k.prefetch_issued += 1
        self.reschedule()
        return OK

    def evict(self, layer: int, expert: int) -> int:
        now = self.refresh()
        key = (layer, expert)
        if key not in self.resident and key not in self.copies:
            return OK
        if self.pins.get(key, 0) > 0:
            return REFUSED_STATE
        copy = self.copies.get(key)
        if copy is not None:
            if self._started(copy, now):
                return REFUSED_STATE  # in flight: a bus transfer cannot be taken back
            k = self.counters[layer]
            k.bytes_h2d -= copy.nbytes
            k.copy_ns -= self.occupancy_ns(copy.nbytes)
            if copy.was_prefetch:
                k.prefetch_cancelled += 1
            del self.copies[key]
            self.reschedule()
        self.resident.discard(key)
        self.from_prefetch.discard(key)
        self.filled.discard(key)
        self.used_bytes -= self.expert_bytes[layer]
        return OK

    def note_selected(self, layer: int, experts: npt.ArrayLike) -> None:
        """The hook call's selected experts: the recency evict_least_recent reads."""
        self.use_clock += 1
        for e in np.asarray(experts).ravel().tolist():
            self.last_use[(layer, e)] = self.use_clock

    def evict_least_recent(self, layers: Sequence[int], start: int, limit: int, kept: set[Key]) -> int:
        """spice_policy_call.evict_from: evicts the least recently selected resident expert
        of the first of layers[start:limit] that has one neither pinned (run on the device
        by this call) nor in `kept`; returns the index of that layer (the next search
        starts there), or `limit` when none is left."""
        for i in range(start, limit):
            layer = int(layers[i])
            held = [
                (self.last_use.get((layer, e), 0), e)
                for e in range(self.n_expert[layer])
                if (layer, e) in self.resident and (layer, e) not in self.pins and (layer, e) not in kept
            ]
            if held and self.evict(layer, min(held)[1]) == OK:
                return i
        return limit

    def pin(self, layer: int, expert: int) -> int:
        if not self.holds(layer, expert):
            return REFUSED_STATE
        self.pins[(layer, expert)] = self.pins.get((layer, expert), 0) + 1
        return OK

    def unpin(self, layer: int, expert: int) -> None:
        key = (layer, expert)
        self.pins[key] -= 1
        if self.pins[key] == 0:
            del self.pins[key]

    def state(self, layer: int, expert: int) -> int:
        now = self.refresh()
        key = (layer, expert)
        if key in self.resident:
            return RESIDENCY_RESIDENT
        copy = self.copies.get(key)
        if copy is None:
            return RESIDENCY_ABSENT
        return RESIDENCY_COPYING if self._started(copy, now) else RESIDENCY_QUEUED

    def ready_at(self, layer: int, expert: int) -> int:
        """When the expert's copy lands (now if resident)."""
        copy = self.copies.get((layer, expert))
        if copy is None or copy.end_ns is None:
            return self.now_ns
        return copy.end_ns

    def finish_wait(self, layer: int, expert: int, stall_ns: int) -> bool:
        """Book a completed wait the way spice_store_wait does: the stall, and a
        prefetched expert's first use. Returns whether it came from a prefetch."""
        self.refresh()
        key = (layer, expert)
        self.counters[layer].stall_ns += stall_ns
        if key in self.from_prefetch:
            self.from_prefetch.discard(key)
            self.counters[layer].prefetch_used += 1
            return True
        return False

    def states(self) -> npt.NDArray[np.int8]:
        """The residency table a HookCall carries: RESIDENCY_* per (layer, expert)."""
        now = self.refresh()
        table = np.zeros((self.n_layers, self.max_expert), dtype=np.int8)
        for layer, expert in self.resident:
            table[layer, expert] = RESIDENCY_RESIDENT
        for (layer, expert), c in self.copies.items():
            table[layer, expert] = RESIDENCY_COPYING if self._started(c, now) else RESIDENCY_QUEUED
        return table

    def reset_counters(self) -> None:
        self.counters = [LayerCounters() for _ in self.n_expert]
