"""The simulator's disk tier (edge mode): widened reads, the reader pool, host actions
read into scratch, the read bound, and the `disk` hardware profile. The same rules
against libspice on a real decode: tests/native/test_sim_disk_twin.py."""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pyspice.policy import make_policy
from pyspice.policy.profile import BatchCost, CostProfile
from pyspice.policy.rows import parse_rows
from pyspice.policy.spice import SpicePolicy, spice_config
from pyspice.sim.belady import _requests, belady, read_bound
from pyspice.sim.costs import Costs
from pyspice.sim.disk import (
    DISK_ALIGN,
    PRIORITY_HOST_READ,
    DiskDevice,
    DiskRules,
    ExpertReads,
    SimDiskTier,
    widened,
)
from pyspice.sim.hardware import DISK, load_profile, policy_profile
from pyspice.sim.report import SimConfig, format_tables, simulate_all
from pyspice.sim.simulator import Simulator, scratch_experts
from pyspice.sim.tier import OK, PRIORITY_DEMAND, PRIORITY_PREFETCH
from pyspice.sim.workload import Workload

from .test_sim_report import _tiny_moe

EXPERT = 10_000  # bytes of one expert in the hand-made tiers below


def test_reads_are_widened_to_the_alignment_and_cut_at_the_end_of_the_file() -> None:
    assert widened(0, 4096) == 4096
    assert widened(100, 4096) == 8192  # straddles two blocks
    assert widened(4096, 1) == 4096
    assert widened(8200, 50, file_size=8300) == 8300 - 8192  # the last block is short
    assert widened(100, 50, align=1) == 50  # no O_DIRECT: what was asked for


def test_expert_reads_come_from_the_files_own_offsets(tmp_path: Path) -> None:
    from pyspice.formats.model_info import read_header

    path = _tiny_moe(tmp_path / "m.gguf", tied=False)
    reads = ExpertReads.from_model(path, direct=True)
    header = read_header(path)
    gate = next(t for t in header.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    stride = gate.nbytes // 4
    assert stride == 3 * 8 * 4
    n, nbytes = reads.of(1, 2)
    assert n == 3  # gate, up, down: one read each
    mats = [t for t in header.tensors if t.name.startswith("blk.1.ffn_") and "_exps" in t.name]
    offsets = [header.data_offset + t.offset + 2 * stride for t in mats]
    assert nbytes == sum(widened(off, stride, header.file_size) for off in offsets)
    # each matrix widened to its 4 KiB block (the file is small: the last is cut at its end)
    assert all(off % DISK_ALIGN + stride <= DISK_ALIGN for off in offsets)
    assert nbytes == sum(
        min(off // DISK_ALIGN * DISK_ALIGN + DISK_ALIGN, header.file_size) - off // DISK_ALIGN * DISK_ALIGN
        for off in offsets
    )
    assert ExpertReads.from_model(path, direct=False).of(1, 2) == (3, 3 * stride)


def test_a_lone_read_takes_what_the_probe_measured_and_readers_share_the_bandwidth() -> None:
    gbps, probe_us = 1.0, 125.0
    fixed = DiskRules.fixed_latency_us(probe_us, gbps)
    assert fixed == pytest.approx(125.0 - 65.536)
    disk = DiskDevice(gbps, fixed, readers=4)
    r = disk.submit(64 * 1024, 1, PRIORITY_DEMAND, now=0)
    assert disk.finish(r) == pytest.approx(125_000, abs=2)
    # 40 expert-sized reads at once: 4 readers keep the disk busy, so they take bytes / bandwidth
    disk = DiskDevice(gbps, fixed, readers=4)
    rs = [disk.submit(60_000, 3, PRIORITY_PREFETCH, now=0) for _ in range(40)]
    last = max(disk.finish(r) for r in rs)
    assert last == pytest.approx(40 * 60_000 / gbps + fixed * 1e3, rel=0.01)


def test_readers_take_demand_and_host_reads_before_queued_prefetches() -> None:
    disk = DiskDevice(1.0, 0.0, readers=1)
    first = disk.submit(1000, 1, PRIORITY_PREFETCH, now=0)  # a reader takes it at once
    queued = [disk.submit(1000, 1, PRIORITY_PREFETCH, now=0) for _ in range(3)]
    demand = disk.submit(1000, 1, PRIORITY_DEMAND, now=10)
    host = disk.submit(1000, 1, PRIORITY_HOST_READ, now=20)
    assert disk.finish(first) == 1000  # a started read runs to its end
    assert disk.finish(host) == 2000 and disk.finish(demand) == 3000
    assert [disk.finish(q) for q in queued] == [4000, 5000, 6000]
    assert disk.totals(10**9)[:3] == (6000, 6, 6)


def disk_tier(slots: int, readers: int = 4) -> SimDiskTier:
    return SimDiskTier(
        n_expert=(8, 8),
        expert_bytes=(EXPERT, EXPERT),
        budget_bytes=slots * EXPERT,
        bandwidth_gbps=1.0,
        latency_us=10.0,
        rules=DiskRules(ExpertReads.unaligned((8, 8), (EXPERT, EXPERT)), 10.0, readers),
    )


def test_the_store_hands_the_disk_twice_its_readers_and_those_reads_are_made() -> None:
    tier = disk_tier(slots=16, readers=2)
    for e in range(8):
        assert tier.request(0, e, PRIORITY_PREFETCH) == OK
    started = [e for e in range(8) if tier.copies[(0, e)].started]
    assert started == [0, 1, 2, 3]  # 2 x 2 readers handed over
    for e in range(8):
        tier.evict(0, e)  # the queued ones are cancelled; the handed-over ones cannot be
    assert {e for e in range(8) if tier.holds(0, e)} == {0, 1, 2, 3}
    tier.now_ns = 10**9
    tier.poll()
    nbytes, reads, experts, scratch = tier.read_totals(tier.now_ns)
    assert (nbytes, reads, experts, scratch) == (4 * EXPERT, 12, 4, 0)
    assert sum(k.prefetch_cancelled for k in tier.counters) == 4


def test_a_copy_lands_at_the_first_poll_after_its_read() -> None:
    tier = disk_tier(slots=4)
    tier.request(1, 3, PRIORITY_DEMAND)
    done = tier.disk.log[-1].done_ns
    assert done == EXPERT + 10_000  # 10 us fixed latency + 10 us transfer
    tier.now_ns = done - 1
    tier.poll()
    assert not tier.holds(1, 3) or (1, 3) not in tier.resident
    tier.now_ns = done
    tier.poll()
    assert (1, 3) in tier.resident
    assert tier.counters[1].copy_ns == done  # the read's own time


def test_host_actions_without_a_slot_are_read_into_scratch() -> None:
    from pyspice.policy import ACTION_DEVICE, ACTION_HOST

    ids = np.array([[1, 2], [2, 3]], np.int32)
    actions = np.array([[ACTION_HOST, ACTION_DEVICE], [ACTION_HOST, ACTION_HOST]], np.int32)
    # expert 2 runs on the device in this call (it has a slot): its host action reads nothing
    assert scratch_experts(ids, actions, 8) == [1, 3]
    tier = disk_tier(slots=4)
    waited = tier.read_for_host(0, [1, 3])
    assert waited > 0 and tier.now_ns == waited
    assert tier.read_totals(tier.now_ns) == (2 * EXPERT, 6, 2, 2)
    assert not tier.holds(0, 1)  # nothing of it stays


def _workload(seed: int, tokens: int = 60, n_layers: int = 3, n_expert: int = 8, k: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    # some locality: each token keeps one of the previous token's experts per layer
    ids = np.zeros((tokens, n_layers, k), np.int32)
    for t in range(tokens):
        for j in range(n_layers):
            keep = ids[t - 1, j, 0] if t and rng.random() < 0.6 else rng.integers(n_expert)
            rest = rng.choice([e for e in range(n_expert) if e != keep], k - 1, replace=False)
            ids[t, j] = [keep, *rest]
    return Workload.from_arrays(n_layers, list(range(n_layers)), n_expert, ids, prompt_tokens=4)


def _disk_costs(n_layers: int = 3, n_expert: int = 8) -> Costs:
    widths = [EXPERT + 4096 * (e % 3) for e in range(n_expert)]  # alignment makes reads differ
    reads = ExpertReads(tuple(tuple((3, w) for w in widths) for _ in range(n_layers)))
    return Costs(
        expert_bytes=(EXPERT,) * n_layers,
        bus_gbps=1.0,
        bus_latency_us=50.0,
        rest_us=((1, 100.0),),
        device_expert_us=((1, 5.0),),
        host_expert_us=((1, 5.0),),
        device_shares_host=True,
        disk=DiskRules(reads, 20.0),
    )


def test_every_host_activation_of_a_host_policy_is_a_read() -> None:
    wl = _workload(0)
    costs = _disk_costs()
    result = Simulator(wl, costs, 6 * EXPERT).run("host", make_policy("host"), policy_us=0.0)
    assert result.hit_rate == 0.0
    per_token = 3 * 2  # layers x top-k, distinct within a call
    assert result.disk_expert_reads_per_token == per_token
    assert result.scratch_reads == per_token * wl.decoded_tokens
    assert result.bytes_per_token == 0  # nothing copied into a slot
    assert result.scratch_ms_per_token is not None and result.scratch_ms_per_token > 0


def _brute_force_bytes(wl: Workload, slots: int, weight: dict[tuple[int, int], int]) -> int:
    """The least bytes by trying every set of experts to keep after every call."""
    calls = _requests(wl)

    @functools.cache
    def best(i: int, held: frozenset[tuple[int, int]]) -> int:
        if i == len(calls):
            return 0
        decode, keys = calls[i]
        need = {key for key, _ in keys}
        cost = sum(weight[key] for key in need - held) if decode else 0
        pool = sorted(held | need)
        return cost + min(
            best(i + 1, frozenset(keep))
            for r in range(min(slots, len(pool)) + 1)
            for keep in itertools.combinations(pool, r)
        )

    return best(0, frozenset())


def test_the_read_bound_is_the_least_bytes_of_any_schedule() -> None:
    rng = random.Random(0)
    for _ in range(40):
        n_layers, n_expert, k = rng.randint(1, 2), rng.randint(2, 5), rng.randint(1, 2)
        tokens = rng.randint(3, 8)
        ids = np.array(
            [[rng.sample(range(n_expert), k) for _ in range(n_layers)] for _ in range(tokens)], np.int32
        )
        wl = Workload.from_arrays(
            n_layers, list(range(n_layers)), n_expert, ids, prompt_tokens=rng.choice([0, 2])
        )
        slots = rng.randint(1, 3)
        weight = {(il, e): rng.choice([3, 4, 5]) for il in range(n_layers) for e in range(n_expert)}
        bound = read_bound(wl, lambda il, e, w=weight: w[(il, e)], slots)
        assert bound.bound_bytes == _brute_force_bytes(wl, slots, weight)
        assert bound.bound_bytes <= bound.min_bytes
        unit = read_bound(wl, lambda il, e: 1, slots)
        assert unit.reads == unit.bound_bytes == _brute_force_bytes(wl, slots, dict.fromkeys(weight, 1))


def test_bypass_never_misses_more_than_demand_loading() -> None:
    wl = _workload(3)
    for slots in (2, 4, 8):
        with_bypass = read_bound(wl, lambda il, e: 1, slots)
        demand = belady(wl, (EXPERT,) * 3, slots * EXPERT)[0]
        assert with_bypass.misses <= demand.misses


def test_no_lossless_policy_reads_fewer_bytes_than_the_bound() -> None:
    costs = _disk_costs()
    assert costs.disk is not None
    for seed in (1, 2):
        wl = _workload(seed)
        bound = read_bound(wl, costs.disk.reads.bytes_of, 6)
        floor = bound.bound_bytes / wl.decoded_tokens
        sim = Simulator(wl, costs, 6 * EXPERT, context_extra={"host_weights_in_memory": False})
        for name in ("host", "lru", "ondemand", "adapmoe", "spice:exact"):
            got = sim.run(name, make_policy(name), policy_us=0.0).disk_read_bytes_per_token
            assert got is not None and got >= floor - 1e-9, name
        exact = sim.run("exact", None, policy_us=0.0, preload=True).disk_read_bytes_per_token
        assert exact is not None and exact >= floor - 1e-9


def test_spice_preloads_a_device_tier_but_not_the_disk_tier_it_fills_itself() -> None:
    """SpicePolicy.preloads_tier of a level configured to preload, as the engine and the
    simulator read it once attached: on the disk tier every miss is read into the pool
    and kept, so no preload."""
    wl = _workload(1)
    for host_weights_in_memory, preloads in ((True, True), (False, False)):
        policy = SpicePolicy(replace(spice_config("spice:exact"), preload=True))
        sim = Simulator(
            wl, _disk_costs(), 6 * EXPERT, context_extra={"host_weights_in_memory": host_weights_in_memory}
        )
        sim.run("spice:exact", policy, policy_us=0.0)
        assert policy.preloads_tier is preloads  # type: ignore[union-attr]


def _probe(model: Path, disk: bool) -> CostProfile:
    return CostProfile(
        version=1,
        model=str(model),
        model_sha="",
        threads=2,
        n_layers=2,
        n_moe_layers=2,
        expert_bytes={"F32/F32/F32": 288},
        bus_gbps=12.0,
        bus_latency_us=10.0,
        bus_source="emulated (set by the user)",
        device_expert_us=2.0,
        device_source="emulated: the host's own time (CPU-only build)",
        batches=[BatchCost(1, 2.0, 50.0), BatchCost(8, 1.0, 20.0)],
        disk_gbps=0.5 if disk else None,
        disk_latency_us=200.0 if disk else None,
    )


def test_the_disk_profile_takes_the_probes_disk_else_its_own(tmp_path: Path) -> None:
    shipped = load_profile(DISK)
    assert shipped.disk and shipped.probe is None
    assert shipped.values["bus_gbps"].source == "measured" and shipped.values["bus_gbps"].note
    model = _tiny_moe(tmp_path / "m.gguf", tied=False)
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(json.dumps(_probe(model, disk=True).to_json()))
    measured = load_profile(DISK, probe_file)
    assert measured.probe is not None
    assert (measured["bus_gbps"], measured["bus_latency_us"]) == (0.5, 200.0)
    probe_file.write_text(json.dumps(_probe(model, disk=False).to_json()))
    older = load_profile(DISK, probe_file)  # a probe from before the disk was measured
    assert older.probe is not None and older["bus_gbps"] == shipped["bus_gbps"]


@pytest.mark.parametrize("with_probe", [False, True])
def test_the_disk_profile_simulates_the_recorded_model_on_its_file(tmp_path: Path, with_probe: bool) -> None:
    model = _tiny_moe(tmp_path / "m.gguf", tied=False)
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(json.dumps(_probe(model, disk=True).to_json()))
    prof = load_profile(DISK, probe_file if with_probe else None)
    ids = np.tile(np.array([[0, 1], [2, 3]], np.int32), (12, 1, 1))
    ids[::3] = np.array([[2, 3], [0, 1]], np.int32)
    wl = Workload.from_arrays(2, [0, 1], 4, ids, prompt_tokens=4)
    policies = tuple(parse_rows("exact,lru,spice:exact"))
    cfg = SimConfig((prof,), ("50%",), policies, None, (288, 288), model=model)
    rows = simulate_all(wl, cfg)
    assert [r["policy"] for r in rows] == ["exact", "lru", "spice:exact", "belady"]
    assert all(r["target"] == "source" and r["disk_read_bytes_per_token"] is not None for r in rows)
    bound = rows[-1]["disk_read_bytes_per_token"]
    assert bound > 0 and all(r["disk_read_bytes_per_token"] >= bound - 1e-9 for r in rows)
    assert rows[-1]["read_bound"]["bound_bytes_per_token"] == bound
    assert "read MiB/tok" in format_tables(rows) and "x bound" in format_tables(rows)
    # policies weigh a copy as the disk and know a host action reads first
    policy = policy_profile(prof, rows and _costs_of(prof, wl, model))
    assert policy is not None and policy.device_emulated


def _costs_of(prof, wl: Workload, model: Path) -> Costs:  # type: ignore[no-untyped-def]
    from pyspice.sim.hardware import disk_costs

    return disk_costs(prof, wl, model, (288, 288))


def test_lossless_policies_run_without_the_sidecars_surrogates() -> None:
    """The engine loads surrogates for lossy policies only (Engine._sync_surrogates);
    charged to a lossless policy's tier they took its whole budget on the disk tier."""
    from pyspice.sim import report
    from pyspice.sim.targets import load_target

    wl = _workload(4)

    extra = {"reserved_bytes": 10**12, "surrogates_loaded": True}
    seen: list[int] = []
    real = report.Simulator

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            seen.append(int(self.context_extra.get("reserved_bytes", 0)))

    report.Simulator = Spy  # type: ignore[misc]
    try:
        rows = simulate_all(
            wl,
            SimConfig(
                (load_profile("rtx4060"),),
                ("50%",),
                tuple(parse_rows("lru,spice:balanced")),
                load_target("qwen2-57b-a14b:Q5_K_M"),
                (1000,) * 3,
            ),
            context_extra=extra,
        )
    finally:
        report.Simulator = real  # type: ignore[misc]
    assert seen == [0, 10**12]  # lru (lossless) without, spice:balanced with the reservation
    assert rows[0]["hit_rate"] > 0
