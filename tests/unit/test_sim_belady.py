"""Belady's MIN on hand-made traces."""

from __future__ import annotations

import numpy as np

from pyspice.policy import make_policy
from pyspice.sim.belady import belady
from pyspice.sim.costs import Costs
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import Workload
from pyspice.units import whole_tier_bytes


def one_layer(seq: list[int], n_expert: int = 4) -> Workload:
    ids = np.asarray(seq, dtype=np.int32).reshape(len(seq), 1, 1)
    return Workload.from_arrays(1, [0], n_expert, ids)


def random_three_layers(seed: int, n_tokens: int) -> Workload:
    """Three layers of 8 experts, one selected per token, uniformly at random."""
    ids = np.random.default_rng(seed).integers(0, 8, size=(n_tokens, 3, 1)).astype(np.int32)
    return Workload.from_arrays(3, [0, 1, 2], 8, ids)


def three_layer_costs() -> Costs:
    """100-byte experts on a 1 GB/s bus; device work cheaper than host work."""
    return Costs(
        expert_bytes=(100, 100, 100),
        bus_gbps=1.0,
        bus_latency_us=1.0,
        rest_us=((1, 10.0),),
        device_expert_us=((1, 1.0),),
        host_expert_us=((1, 2.0),),
    )


def test_min_on_a_textbook_sequence() -> None:
    # capacity 2: 0 1 2 | 0 hit | 1 (evict 2, never used again) | 3 (evict 1: used after 0) | 0 hit | 1
    wl = one_layer([0, 1, 2, 0, 1, 3, 0, 1])
    pooled, per_layer = belady(wl, (100,), 200)
    assert pooled.mode == "pooled" and pooled.slots == 2
    assert (pooled.activations, pooled.misses, pooled.loads) == (8, 6, 6)
    assert pooled.bytes_loaded == 600
    assert per_layer.misses == 6  # one layer: the same cache


def test_enough_slots_means_compulsory_misses_only() -> None:
    wl = one_layer([0, 1, 2, 3, 0, 1, 2, 3, 3, 2])
    pooled = belady(wl, (100,), 400)[0]
    assert pooled.misses == 4


def test_pooled_beats_an_equal_split_when_layers_differ() -> None:
    # layer 0 cycles over 3 experts, layer 1 always uses expert 0: 4 slots pooled fit all
    # of it; split 2 + 2, layer 0 keeps missing
    seq0 = [0, 1, 2] * 4
    ids = np.stack([np.asarray(seq0), np.zeros(12, int)], axis=1).reshape(12, 2, 1)
    wl = Workload.from_arrays(2, [0, 1], 4, ids)
    pooled, per_layer = belady(wl, (100, 100), 400)
    assert pooled.misses == 4
    assert per_layer.misses > pooled.misses


def test_size_aware_variant_only_when_sizes_differ_and_is_labelled() -> None:
    ids = np.zeros((3, 2, 1), int)
    wl = Workload.from_arrays(2, [0, 1], 4, ids)
    assert [r.mode for r in belady(wl, (100, 100), 400)] == ["pooled", "per-layer"]
    mixed = belady(wl, (100, 150), 400)
    assert mixed[-1].mode == "size-aware (heuristic)"
    # MIN runs on the tier's own slots: each as large as the largest expert
    assert mixed[0].slots == 400 // 150


def test_a_whole_tier_is_every_expert_in_a_slot_of_the_largest() -> None:
    assert whole_tier_bytes((100, 0, 150), (4, 0, 4)) == 8 * 150
    assert whole_tier_bytes((100, 100), (4, 4)) == 800  # one size: the routed-expert bytes
    assert whole_tier_bytes((), ()) == 0


def test_no_policy_misses_less_than_min() -> None:
    wl = random_three_layers(seed=0, n_tokens=200)
    costs = three_layer_costs()
    budget = 900  # 9 of 24 experts
    bound = belady(wl, costs.expert_bytes, budget)[0]
    sim = Simulator(wl, costs, budget)
    for name in ("lru", "ondemand", "static"):
        result = sim.run(name, make_policy(name), policy_us=0.0)
        assert result.activations == bound.activations
        assert result.misses >= bound.misses, name


def test_the_oracle_policy_meets_the_min_bound_in_the_simulator() -> None:
    from pyspice.sim.belady import BeladyOracle

    wl = random_three_layers(seed=5, n_tokens=150)
    costs = three_layer_costs()
    bound = belady(wl, costs.expert_bytes, 900)[0]
    result = Simulator(wl, costs, 900).run("belady", BeladyOracle(wl), policy_us=0.0)
    assert result.policy_fallbacks == 0
    assert result.misses == bound.misses
    lru = Simulator(wl, costs, 900).run("lru", make_policy("lru"), policy_us=0.0)
    assert lru.misses > result.misses


def test_the_oracle_leaves_the_tiers_reserved_bytes_alone() -> None:
    """With surrogates loaded the tier charges their bytes to its budget; the oracle once
    planned into them, the tier refused its demand fetches and they ran on the host."""
    from pyspice.sim.belady import BeladyOracle

    wl = random_three_layers(seed=5, n_tokens=150)
    costs = three_layer_costs()
    sim = Simulator(wl, costs, 900, context_extra={"reserved_bytes": 250})
    result = sim.run("belady", BeladyOracle(wl), policy_us=0.0)
    assert result.misses_host == 0  # every miss fetched, as MIN with demand loading does
    assert result.misses == belady(wl, costs.expert_bytes, 900 - 250)[0].misses
