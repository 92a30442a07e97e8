"""Property tests of the expert store and its copy engine, on an injected clock.

Random operation sequences against a standalone store (no model); after every
step the invariants the tiered store promises must hold. Time only moves when
the test says so, so nothing here depends on how fast the machine is. Every test
runs on each device kind that can run without a GPU: the emulated bus, and the
disk tier, whose copies are real reads of a file (landing by the same virtual
timeline on this clock), their bytes checked against the file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspice.runtime import DEVICE_DISK, DEVICE_EMULATED, Store, StoreParams

OK, BUDGET, STATE = 0, 6, 7
ABSENT, QUEUED, COPYING, RESIDENT = 0, 1, 2, 3
N_LAYERS, N_EXPERT = 3, 6
EXPERT_BYTES = [4096, 8192, 6144]  # different quant types: copies move each expert's own bytes
SLOT = max(EXPERT_BYTES)  # ... but every slot is the largest's, and each charges that much
BANDWIDTH_GBPS = 1.0  # 1 byte per ns: an 8192-byte copy occupies the bus 8192 ns + latency
LATENCY_US = 0.5


def occupancy(il: int) -> int:
    return int(LATENCY_US * 1e3 + EXPERT_BYTES[il] / BANDWIDTH_GBPS)


MakeStore = Callable[..., Store]


@pytest.fixture(scope="module", params=["emulated", "disk"])
def make_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MakeStore:
    """make_store(slots, queue=4): a store of `slots` largest experts on the device kind
    of this parametrization. The disk kind reads a file holding the layers' experts back
    to back (the standalone store's layout), random bytes."""
    path: Path | None = None
    if request.param == "disk":
        path = tmp_path_factory.mktemp("disk") / "experts.bin"
        rng = np.random.default_rng(0)
        path.write_bytes(rng.integers(0, 256, sum(N_EXPERT * b for b in EXPERT_BYTES), np.uint8).tobytes())

    def make(slots: int, queue: int = 4) -> Store:
        params = StoreParams(
            SLOT * slots,
            BANDWIDTH_GBPS,
            LATENCY_US,
            prefetch_queue_max=queue,
            manual_clock=True,
            device_kind=DEVICE_DISK if path is not None else DEVICE_EMULATED,
            path=str(path) if path is not None else None,
        )
        return Store(params, [N_EXPERT] * N_LAYERS, EXPERT_BYTES)

    make.path = path  # type: ignore[attr-defined]
    return make


expert = st.tuples(st.integers(0, N_LAYERS - 1), st.integers(0, N_EXPERT - 1))
op = st.one_of(
    st.tuples(st.just("demand"), expert),
    st.tuples(st.just("prefetch"), expert),
    st.tuples(st.just("evict"), expert),
    st.tuples(st.just("pin"), expert),
    st.tuples(st.just("unpin"), expert),
    st.tuples(st.just("wait"), expert),
    st.tuples(st.just("advance"), st.integers(0, 20_000)),
)


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 6), ops=st.lists(op, max_size=60))
def test_store_invariants(make_store: MakeStore, slots: int, ops: list[tuple[str, object]]) -> None:
    store = make_store(slots)
    pins: dict[tuple[int, int], int] = {}
    cancelled: set[tuple[int, int]] = set()
    issued_bytes = 0
    for name, arg in ops:
        if name == "advance":
            store.advance(int(arg))  # type: ignore[call-overload]
        else:
            il, e = arg  # type: ignore[misc]
            key = (il, e)
            before = store.state(il, e)
            if name in ("demand", "prefetch"):
                status = store.request(il, e, demand=name == "demand")
                assert status in (OK, BUDGET, STATE)
                if status == OK and before == ABSENT:
                    issued_bytes += EXPERT_BYTES[il]
                    cancelled.discard(key)
                if status == BUDGET:
                    assert store.used_bytes + SLOT > store.budget_bytes or store.n_free == 0
            elif name == "evict":
                status = store.evict(il, e)
                if pins.get(key, 0) > 0 and before != ABSENT:
                    assert status == STATE, "a pinned expert was evicted"
                    assert store.state(il, e) == before
                elif status == OK and before == QUEUED:
                    cancelled.add(key)
                    issued_bytes -= EXPERT_BYTES[il]
                if status == STATE and pins.get(key, 0) == 0:
                    assert before == COPYING  # only an in-flight copy can refuse
            elif name == "pin":
                if store.pin(il, e) == OK:
                    pins[key] = pins.get(key, 0) + 1
                else:
                    assert before == ABSENT
            elif name == "unpin":
                if store.unpin(il, e) == OK:
                    pins[key] -= 1
            else:  # wait
                ready = store.ready_at(il, e)
                now = store.now()
                status, stall = store.wait(il, e)
                if before == ABSENT:
                    assert status == STATE
                else:
                    assert status == OK
                    # landed: no stall; pending: exactly its remaining time
                    assert stall == (max(0, ready - now) if before in (QUEUED, COPYING) else 0)
                    assert store.state(il, e) == RESIDENT
                    expect_bytes(make_store, store, il, e)
        # budget: the slots of the experts on the device or on their way never exceed it
        occupied = [
            (l2, e2) for l2 in range(N_LAYERS) for e2 in range(N_EXPERT) if store.state(l2, e2) != ABSENT
        ]
        assert store.used_bytes == SLOT * len(occupied) <= store.budget_bytes
        assert len(occupied) == store.n_slots - store.n_free
        # cancelled prefetches never land
        for l2, e2 in cancelled:
            assert store.state(l2, e2) == ABSENT
        # stats add up: traffic is what was issued and not cancelled
        c = store.counters()
        assert c.bytes_h2d == issued_bytes
        assert c.prefetch_used + c.prefetch_cancelled <= c.prefetch_issued


def expect_bytes(make_store: MakeStore, store: Store, il: int, e: int) -> None:
    """On the disk kind a landed copy holds the file's bytes of that expert."""
    path = make_store.path  # type: ignore[attr-defined]
    if path is None:
        return
    start = sum(N_EXPERT * b for b in EXPERT_BYTES[:il]) + e * EXPERT_BYTES[il]
    with open(path, "rb") as fh:
        fh.seek(start)
        assert store.read_slot(il, e, EXPERT_BYTES[il]) == fh.read(EXPERT_BYTES[il])


def test_demand_overtakes_queued_prefetches_but_not_a_copy_in_flight(make_store: MakeStore) -> None:
    store = make_store(slots=6)
    assert store.request(0, 0, demand=False) == OK  # starts at once: in flight
    assert store.request(0, 1, demand=False) == OK  # queued behind it
    assert store.request(0, 2, demand=False) == OK  # queued
    assert store.state(0, 0) == COPYING and store.state(0, 1) == QUEUED
    assert store.request(1, 3, demand=True) == OK
    t = occupancy(0)
    assert store.ready_at(0, 0) == t  # the copy in flight keeps its place
    assert store.ready_at(1, 3) == t + occupancy(1)  # then the demand copy
    assert store.ready_at(0, 1) == t + occupancy(1) + occupancy(0)  # then the prefetches, in order
    assert store.ready_at(0, 2) == t + occupancy(1) + 2 * occupancy(0)


def test_upgrading_a_queued_prefetch_moves_it_ahead(make_store: MakeStore) -> None:
    store = make_store(slots=6)
    for e in range(3):
        store.request(2, e, demand=False)
    store.request(2, 2, demand=True)  # upgrade the last one
    assert store.ready_at(2, 2) < store.ready_at(2, 1)


def test_prefetch_in_time_costs_nothing_late_one_stalls_its_remainder(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    store.request(1, 0, demand=False)
    store.advance(occupancy(1) + 1)
    assert store.wait(1, 0) == (OK, 0)
    store.request(1, 1, demand=False)
    store.advance(1000)
    assert store.wait(1, 1) == (OK, occupancy(1) - 1000)
    c = store.counters()
    assert (c.prefetch_issued, c.prefetch_used, c.stall_ns) == (2, 2, occupancy(1) - 1000)


def test_queue_bound_and_budget_are_reported(make_store: MakeStore) -> None:
    store = make_store(slots=3, queue=1)
    assert store.request(0, 0, demand=False) == OK  # in flight: not queued
    assert store.request(0, 1, demand=False) == OK  # the one queued prefetch
    assert store.request(0, 2, demand=False) == STATE  # queue full
    assert store.request(0, 2, demand=True) == OK  # demand copies are not bounded by it
    assert store.n_slots == 3  # 3 x 8192 bytes: three slots, though experts of 4096 are smaller
    assert store.request(0, 3, demand=True) == BUDGET  # a slot each, whatever the expert's size
    assert store.used_bytes == 3 * SLOT


def test_other_device_data_is_charged_to_the_same_budget(make_store: MakeStore) -> None:
    store = make_store(slots=2)  # 2 x 8192 bytes
    assert store.reserve(8192) == OK  # e.g. surrogate matrices
    assert store.request(1, 0, demand=True) == OK  # 8192: exactly full
    assert store.request(0, 0, demand=True) == BUDGET
    assert store.reserve(1) == BUDGET
    assert store.reserve(-8192) == OK
    assert store.request(0, 0, demand=True) == OK
    assert store.used_bytes == 2 * SLOT  # the 4096-byte expert takes a whole slot


def test_a_wait_moves_the_queue_on(make_store: MakeStore) -> None:
    """Like a poll, a wait that lands a copy starts the queued one the device now has
    room for, so the state a caller reads afterwards is the state the next operation
    acts on (an evict then refuses only what it saw in flight). Hypothesis found the
    case: demand, demand, wait on the first, evict the second."""
    store = make_store(2)
    assert store.request(2, 2, demand=True) == OK and store.request(2, 0, demand=True) == OK
    assert (store.state(2, 2), store.state(2, 0)) == (COPYING, QUEUED)
    store.wait(2, 2)
    assert (store.state(2, 2), store.state(2, 0)) == (RESIDENT, COPYING)
    assert store.evict(2, 0) == STATE
