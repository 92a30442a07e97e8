"""The simulated device tier: the twin of libspice's expert store with its
emulated device (native/src/spice-store.c, spice-store-plan.c's begin_call,
spice-device-emulated.c), on the simulator's clock.

It follows the C code rule for rule, so a simulated run and an emulated one
move the same copies at the same virtual times (tests/native/test_store_twin.py
drives both with the same operations and compares them):

- Copies wait in the store's queue -- demand first, then prefetches, each in
  the order asked for -- until the bus can start one. The bus is one serial
  timeline: a copy starts when the bus is free (possibly in the past of now:
  the store catches the timeline up whenever it looks) and lands latency +
  bytes / bandwidth later. Every operation first starts what the bus could
  have started by now; a started copy can no longer be overtaken or cancelled.
- Landed copies become resident only at a poll (`poll`, once per hook call,
  in `begin_call`) or a wait; lookups (`state`, `states`) read the table as of
  then, plus the store's own changes since.
- A prefetch is refused when the queue of not-started prefetches is full; a
  request when no slot record or budget is left; pinned experts and started
  copies cannot be evicted. copy_ns is booked when a copy lands. Device
  operations (polls, copies started, waits) count against the layer of the
  hook call in progress. Times are integer nanoseconds, as in C.
"""

from __future__ import annotations

from collections import deque
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
from pyspice.units import slot_bytes as slot_bytes_of

PRIORITY_PREFETCH = 0
PRIORITY_DEMAND = 1
PREFETCH_QUEUE_DEFAULT = 64  # SPICE_PREFETCH_QUEUE_DEFAULT in spice-store.c

# spice_status values the store returns
OK = 0
REFUSED_BUDGET = 6  # SPICE_ERR_BUDGET: no slot or budget left
REFUSED_STATE = 7  # SPICE_ERR_STATE: prefetch queue full, copy started, pinned, nothing pending

Key = tuple[int, int]


@dataclass
class Copy:
    layer: int
    expert: int
    priority: int
    was_prefetch: bool
    nbytes: int
    issue_ns: int
    seq: int  # request order: the tie-break among copies queued at the same time
    started: bool = False
    start_ns: int = 0
    end_ns: int = 0

    def before(self, other: Copy) -> bool:
        """Queue order (copy_before in spice-store.c)."""
        return (-self.priority, self.issue_ns, self.seq) < (-other.priority, other.issue_ns, other.seq)


@dataclass
class LayerCounters:
    bytes_h2d: int = 0
    copy_ns: int = 0
    stall_ns: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    store_polls: int = 0
    device_copies: int = 0
    device_waits: int = 0


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
    call_layer: int = -1  # the hook call in progress (device operations count against it)
    bus_free_ns: int = 0  # the emulated bus: when the last started copy lands
    # the bus's busy spans (start, end) of started copies, oldest first, for what bus traffic
    # costs the host (Costs.bus_host_slowdown); spans older than the last query are dropped
    busy_spans: deque[tuple[int, int]] = field(default_factory=deque)
    n_slots: int = 0  # slot records (set from the budget, as spice_store_create does)
    slot_bytes: int = 0  # every slot's size and each held expert's charge: the largest expert
    _seq: int = 0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.latency_us < 0:
            raise ValueError("bus bandwidth must be positive and latency non-negative")
        self.counters = [LayerCounters() for _ in self.n_expert]
        self.slot_bytes = slot_bytes_of(self.expert_bytes, self.n_expert)
        if not self.n_slots:
            total = sum(self.n_expert)
            self.n_slots = min(self.budget_bytes // self.slot_bytes, total) if self.slot_bytes else 0

    @property
    def n_layers(self) -> int:
        return len(self.n_expert)

    @property
    def max_expert(self) -> int:
        return max(self.n_expert, default=0)

    def occupancy_ns(self, nbytes: int) -> int:
        return int(self.latency_us * 1e3 + nbytes / self.bandwidth_gbps)

    def _op_counters(self) -> LayerCounters:
        return self.counters[self.call_layer if 0 <= self.call_layer < self.n_layers else 0]

    # -- the queue and the bus ----------------------------------------------------

    def _queued(self) -> list[Copy]:
        return [c for c in self.copies.values() if not c.started]

    # -- the device (spice_device_i): the emulated bus here; pyspice.sim.disk's
    # SimDiskTier overrides these five with the disk device's rules

    def _can_start(self, now: int) -> bool:
        """copy_can_start: one serial bus, free by now."""
        return self.bus_free_ns <= now

    def _issue(self, c: Copy, now: int) -> None:
        """copy_issue: the copy starts when the bus is free (possibly in the past of now)."""
        c.start_ns = max(self.bus_free_ns, c.issue_ns)
        c.end_ns = c.start_ns + self.occupancy_ns(c.nbytes)
        self.bus_free_ns = c.end_ns
        self.busy_spans.append((c.start_ns, c.end_ns))

    def bus_busy_ns(self, t0: int, t1: int) -> int:
        """How long the bus is busy within [t0, t1) with the copies started so far (one
        serial bus: the spans do not overlap). Spans ending before t0 are forgotten."""
        spans = self.busy_spans
        while spans and spans[0][1] <= t0:
            spans.popleft()
        return sum(max(0, min(end, t1) - max(start, t0)) for start, end in spans if start < t1)

    def _landed_by(self, c: Copy, now: int) -> bool:
        """copy_poll: a started copy has landed by now."""
        return c.end_ns <= now

    def _done_ns(self, c: Copy) -> int:
        """copy_wait: when a wait for the started copy c returns."""
        return c.end_ns

    def _copy_ns(self, c: Copy) -> int:
        """copy_ns: the time the copy took, booked as it lands."""
        return c.end_ns - c.start_ns

    def _start_copies(self, now: int) -> None:
        """start_copies: hand the device what it can have started by now, in queue order."""
        while self._can_start(now):
            queued = self._queued()
            if not queued:
                return
            c = queued[0]
            for other in queued[1:]:
                if other.before(c):
                    c = other
            self._issue(c, now)
            c.started = True
            self._op_counters().device_copies += 1

    def _land(self, key: Key) -> None:
        c = self.copies.pop(key)
        self.resident.add(key)
        if c.was_prefetch:
            self.from_prefetch.add(key)
        else:
            self.from_prefetch.discard(key)
        self.counters[c.layer].copy_ns += self._copy_ns(c)

    def _poll(self) -> None:
        now = self.now_ns
        self._start_copies(now)
        for key, c in list(self.copies.items()):
            if c.started and self._landed_by(c, now):
                self._land(key)
        self._start_copies(now)

    def poll(self) -> None:
        """spice_store_poll: landed copies become resident, queued ones start."""
        self._op_counters().store_polls += 1
        self._poll()

    def refresh(self) -> int:
        """A poll the simulator makes for its own bookkeeping (at the start and end of
        decoding), counted nowhere. Returns now."""
        self._poll()
        return self.now_ns

    def queued_prefetches(self) -> int:
        return sum(1 for c in self.copies.values() if c.priority == PRIORITY_PREFETCH and not c.started)

    # -- operations (spice_store_* in spice-store.c) ------------------------------

    def holds(self, layer: int, expert: int) -> bool:
        key = (layer, expert)
        return key in self.resident or key in self.copies

    def request(self, layer: int, expert: int, priority: int) -> int:
        now = self.now_ns
        self._start_copies(now)  # what has started by now can no longer be overtaken
        key = (layer, expert)
        if key in self.resident:
            return OK
        copy = self.copies.get(key)
        if copy is not None:
            if priority == PRIORITY_DEMAND and not copy.started:
                copy.priority = PRIORITY_DEMAND  # overtakes the other queued prefetches
            return OK
        if priority == PRIORITY_PREFETCH and self.queued_prefetches() >= self.prefetch_queue_max:
            return REFUSED_STATE
        nbytes = self.expert_bytes[layer]
        held = len(self.resident) + len(self.copies)
        if held >= self.n_slots or self.used_bytes + self.slot_bytes > self.budget_bytes:
            return REFUSED_BUDGET
        self.used_bytes += self.slot_bytes
        self._seq += 1
        self.copies[key] = Copy(
            layer, expert, priority, priority == PRIORITY_PREFETCH, nbytes, issue_ns=now, seq=self._seq
        )
        self.from_prefetch.discard(key)
        self.filled.discard(key)
        k = self.counters[layer]
        k.bytes_h2d += nbytes
        if priority == PRIORITY_PREFETCH:
            k.prefetch_issued += 1
        self._start_copies(now)
        return OK

    def evict(self, layer: int, expert: int) -> int:
        self._start_copies(self.now_ns)
        key = (layer, expert)
        if key not in self.resident and key not in self.copies:
            return OK
        if self.pins.get(key, 0) > 0:
            return REFUSED_STATE
        copy = self.copies.get(key)
        if copy is not None:
            if copy.started:
                return REFUSED_STATE  # on the bus (or landed unseen): a transfer cannot be taken back
            k = self.counters[layer]
            k.bytes_h2d -= copy.nbytes
            if copy.was_prefetch:
                k.prefetch_cancelled += 1
            del self.copies[key]
        self.resident.discard(key)
        self.from_prefetch.discard(key)
        self.filled.discard(key)
        self.used_bytes -= self.slot_bytes
        return OK

    def begin_call(self, layer: int, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """spice_store_begin_call: poll once, note the selection's recency, and say
        which activations find their expert resident (ids outside the layer: no hit)."""
        self.call_layer = layer
        self.poll()
        self.use_clock += 1
        picked = np.asarray(ids)
        hit = np.zeros(picked.shape, dtype=np.bool_)
        for index, e in np.ndenumerate(picked):
            if 0 <= int(e) < self.n_expert[layer]:
                hit[index] = (layer, int(e)) in self.resident
                self.last_use[(layer, int(e))] = self.use_clock
        return hit

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

    def unpin(self, layer: int, expert: int) -> int:
        key = (layer, expert)
        if self.pins.get(key, 0) == 0:
            return REFUSED_STATE
        self.pins[key] -= 1
        if self.pins[key] == 0:
            del self.pins[key]
        return OK

    def state(self, layer: int, expert: int) -> int:
        """As of the last poll and the tier's own changes since."""
        key = (layer, expert)
        if key in self.resident:
            return RESIDENCY_RESIDENT
        copy = self.copies.get(key)
        if copy is None:
            return RESIDENCY_ABSENT
        return RESIDENCY_COPYING if copy.started else RESIDENCY_QUEUED

    def ready_at(self, layer: int, expert: int) -> int:
        """When the expert's pending copy lands (0: none pending); a queued copy's is
        projected behind the copies ahead of it."""
        now = self.now_ns
        self._start_copies(now)
        target = self.copies.get((layer, expert))
        if target is None:
            return 0
        if target.started:
            return target.end_ns
        cursor = max([now] + [c.end_ns for c in self.copies.values() if c.started])
        for c in self._queued():
            if c is target or c.before(target):
                cursor += self.occupancy_ns(c.nbytes)
        return cursor

    def wait(self, layer: int, expert: int) -> int:
        """spice_store_wait on the manual clock: the clock moves to when the expert's
        copy lands (waiting out the copies the bus carries first); books the stall and
        a prefetch's first use. Returns the stall, or raises for an absent expert."""
        key = (layer, expert)
        if not self.holds(layer, expert):  # refused before the queue moves, as in libspice
            raise ValueError(f"wait on ({layer}, {expert}), which the tier does not hold")
        self._start_copies(self.now_ns)
        stall = 0
        target = self.copies.get(key)
        if target is not None:
            # queued: the copies ahead of it go first (a caller that needs it sooner asks
            # for it as demand first, as a plan does), so the wait is what ready_at said
            while not target.started:
                first = min((c for c in self.copies.values() if c.started), key=lambda c: c.start_ns)
                stall += self._wait_copy(first)
                self._start_copies(self.now_ns)
            stall += self._wait_copy(target)
            self._start_copies(self.now_ns)  # room on the device again, as after a poll
        k = self.counters[layer]
        k.stall_ns += stall
        if key in self.from_prefetch:
            self.from_prefetch.discard(key)
            k.prefetch_used += 1
        return stall

    def _wait_copy(self, c: Copy) -> int:
        self._op_counters().device_waits += 1
        done = self._done_ns(c)
        stall = max(0, done - self.now_ns)
        self.now_ns = max(self.now_ns, done)
        self._land((c.layer, c.expert))
        return stall

    def states(self) -> npt.NDArray[np.int8]:
        """The residency table a HookCall carries: RESIDENCY_* per (layer, expert)."""
        table = np.zeros((self.n_layers, self.max_expert), dtype=np.int8)
        for layer, expert in self.resident:
            table[layer, expert] = RESIDENCY_RESIDENT
        for (layer, expert), c in self.copies.items():
            table[layer, expert] = RESIDENCY_COPYING if c.started else RESIDENCY_QUEUED
        return table

    def reset_counters(self) -> None:
        self.counters = [LayerCounters() for _ in self.n_expert]
