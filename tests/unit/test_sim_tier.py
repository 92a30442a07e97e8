"""The simulated copy engine follows spice-store.c's rules (demand overtakes queued prefetches)."""

from __future__ import annotations

from pyspice.policy import RESIDENCY_ABSENT, RESIDENCY_COPYING, RESIDENCY_QUEUED, RESIDENCY_RESIDENT
from pyspice.sim.tier import OK, PRIORITY_DEMAND, PRIORITY_PREFETCH, REFUSED_BUDGET, REFUSED_STATE, SimTier

# 1000 bytes at 1 GB/s = 1000 ns, plus 1 us latency: every copy occupies the bus 2000 ns
COPY_NS = 2000


def make_tier(budget_experts: int = 8, queue: int = 64) -> SimTier:
    return SimTier(
        n_expert=(8, 8),
        expert_bytes=(1000, 1000),
        budget_bytes=budget_experts * 1000,
        bandwidth_gbps=1.0,
        latency_us=1.0,
        prefetch_queue_max=queue,
    )


def test_demand_overtakes_queued_prefetches() -> None:
    tier = make_tier()
    for e in (0, 1, 2):
        assert tier.request(1, e, PRIORITY_PREFETCH) == OK
    tier.now_ns = 10  # prefetch (1, 0) is on the bus; (1, 1) and (1, 2) wait
    assert tier.request(0, 5, PRIORITY_DEMAND) == OK
    assert tier.ready_at(1, 0) == COPY_NS  # a started copy keeps its place
    assert tier.ready_at(0, 5) == 2 * COPY_NS  # the demand copy goes next
    assert tier.ready_at(1, 1) == 3 * COPY_NS
    assert tier.ready_at(1, 2) == 4 * COPY_NS
    assert tier.state(1, 0) == RESIDENCY_COPYING
    assert tier.state(1, 1) == RESIDENCY_QUEUED


def test_upgrading_a_queued_prefetch_moves_it_ahead() -> None:
    tier = make_tier()
    for e in (0, 1, 2):
        tier.request(1, e, PRIORITY_PREFETCH)
    tier.now_ns = 10
    tier.request(1, 2, PRIORITY_DEMAND)  # needed now: overtakes (1, 1)
    assert tier.ready_at(1, 2) == 2 * COPY_NS
    assert tier.ready_at(1, 1) == 3 * COPY_NS


def test_copies_land_at_the_first_poll_after_their_end() -> None:
    tier = make_tier()
    tier.request(0, 0, PRIORITY_DEMAND)
    tier.now_ns = COPY_NS - 1
    tier.poll()
    assert tier.state(0, 0) == RESIDENCY_COPYING
    tier.now_ns = COPY_NS
    assert tier.state(0, 0) == RESIDENCY_COPYING  # lookups ask the device nothing
    tier.poll()
    assert tier.state(0, 0) == RESIDENCY_RESIDENT
    assert tier.states()[0, 0] == RESIDENCY_RESIDENT
    assert tier.counters[0].copy_ns == COPY_NS  # booked as it lands


def test_budget_queue_bound_and_in_flight_evictions_are_refused() -> None:
    tier = make_tier(budget_experts=2, queue=1)
    assert tier.request(0, 0, PRIORITY_DEMAND) == OK
    assert tier.request(0, 1, PRIORITY_PREFETCH) == OK  # queued behind (0, 0)
    assert tier.request(0, 2, PRIORITY_DEMAND) == REFUSED_BUDGET
    assert tier.evict(0, 0) == REFUSED_STATE  # on the bus
    assert tier.evict(0, 1) == OK  # still queued: cancelled
    assert tier.state(0, 1) == RESIDENCY_ABSENT
    assert tier.counters[0].prefetch_cancelled == 1
    assert tier.counters[0].bytes_h2d == 1000
    assert tier.request(0, 3, PRIORITY_PREFETCH) == OK
    assert tier.request(0, 4, PRIORITY_PREFETCH) in (REFUSED_STATE, REFUSED_BUDGET)
    tier2 = make_tier(budget_experts=8, queue=1)
    tier2.request(0, 0, PRIORITY_DEMAND)
    assert tier2.request(0, 1, PRIORITY_PREFETCH) == OK
    assert tier2.request(0, 2, PRIORITY_PREFETCH) == REFUSED_STATE  # the queue holds one


def test_pinned_experts_stay() -> None:
    tier = make_tier()
    tier.request(0, 0, PRIORITY_DEMAND)
    tier.now_ns = COPY_NS
    tier.poll()
    assert tier.pin(0, 0) == OK
    assert tier.evict(0, 0) == REFUSED_STATE
    tier.unpin(0, 0)
    assert tier.evict(0, 0) == OK
    assert tier.used_bytes == 0
