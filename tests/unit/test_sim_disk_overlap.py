"""The disk tier's reads on the host's cores (pyspice.sim.disk: DiskRules.overlap,
host_read_us, read_scale) and their fit to edge-mode records (pyspice.sim.fit_disk).

Overlap 1 must price as the disk tier did before the term (the figures below were
taken from that model, on the same workloads); overlap 0 must move a read only
while the host waits; the fit must read known terms back from records the
simulator wrote with them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from pyspice.policy import make_policy
from pyspice.policy.base import ACTION_DEVICE, HookCall, Plan
from pyspice.sim.costs import Costs
from pyspice.sim.disk import DiskClock, DiskDevice, DiskRules, ExpertReads, SimDiskTier
from pyspice.sim.fit import FitTerm
from pyspice.sim.fit_disk import DISK_TERMS, DiskRun, fit_disk, fitted_disk_profile, read_disk_runs
from pyspice.sim.hardware import DISK, HardwareProfile, load_profile, with_probe
from pyspice.sim.simulator import SimResult, Simulator
from pyspice.sim.tier import PRIORITY_DEMAND, PRIORITY_PREFETCH
from pyspice.sim.workload import Workload

from .test_sim_disk import EXPERT, _disk_costs, _probe, _workload
from .test_sim_report import _tiny_moe

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"

# (seed, row) -> (tpot_ms, stall_ms_per_token, scratch_ms_per_token, disk_read_bytes_per_token,
# bus_utilization) of _disk_costs() on _workload(seed), 6 slots, as the disk tier priced
# them before it had an overlap term
BEFORE = {
    (1, "host"): (0.4743565714285714, 0.0, 0.14435657142857145, 84356.57142857143, 0.0),
    (1, "lru"): (0.42814857142857143, 0.09814857142857143, 0.0, 45648.57142857143, 0.2826502148786803),
    (1, "adapmoe"): (0.4271825714285714, 0.09718257142857144, 0.0, 45039.71428571428, 0.27851992356563504),
    (1, "spice:exact"):
        (0.4532982857142857, 0.0, 0.12329828571428571, 70798.28571428571, 0.01009994049960165),
    (1, "exact"): (0.43735857142857143, 0.0, 0.10735857142857143, 60572.857142857145, 0.0),
    (2, "host"): (0.47238171428571424, 0.0, 0.14238171428571428, 82381.71428571429, 0.0),
    (2, "lru"): (0.4321911428571429, 0.10219114285714286, 0.0, 46834.0, 0.2853029975493647),
    (2, "adapmoe"): (0.4315822857142857, 0.10158228571428572, 0.0, 46582.28571428572, 0.284125258682668),
    (2, "spice:exact"):
        (0.45057485714285717, 0.0, 0.12057485714285714, 67003.42857142857, 0.010972649542298981),
    (2, "exact"): (0.4372768571428572, 0.0, 0.10727685714285715, 60134.0, 0.0),
}  # fmt: skip


def _with(costs: Costs, **terms: float) -> Costs:
    assert costs.disk is not None
    return replace(costs, disk=replace(costs.disk, **terms))


@pytest.mark.parametrize("seed", [1, 2])
def test_overlap_one_prices_as_the_disk_tier_did_before(seed: int) -> None:
    wl = _workload(seed)
    costs = _with(_disk_costs(), overlap=1.0, host_read_us=0.0, read_scale=1.0)
    sim = Simulator(wl, costs, 6 * EXPERT, context_extra={"host_weights_in_memory": False})
    for row in ("host", "lru", "adapmoe", "spice:exact", "exact"):
        if row == "exact":
            r = sim.run(row, None, policy_us=0.0, preload=True)
        else:
            r = sim.run(row, make_policy(row), policy_us=0.0)
        got = (r.tpot_ms, r.stall_ms_per_token, r.scratch_ms_per_token, r.disk_read_bytes_per_token,
               r.bus_utilization)  # fmt: skip
        assert got == BEFORE[(seed, row)], row
        assert isinstance(sim.tier, SimDiskTier)
        clock = sim.tier.disk.clock  # one segment: the disk's time is the host's
        assert clock.host == clock.disk and len(clock.host) <= 2


def test_a_read_moves_at_the_overlap_while_the_host_computes_and_at_full_speed_while_it_waits() -> None:
    # 10 us fixed latency + 10 us transfer of 10 kB at 1 GB/s: 20 us of the disk's time
    for overlap, done in ((1.0, 20_000), (0.5, 40_000), (0.0, 100_000 + 20_000)):
        disk = DiskDevice(1.0, 10.0, readers=1, overlap=overlap)
        r = disk.submit(10_000, 3, PRIORITY_PREFETCH, now=0)
        disk.advance(100_000)  # the host computes for 100 us, then waits for the read
        assert disk.finish(r, 100_000) == done  # before 100 us: done while the host computed
        assert disk.host_ns(r) == (0, done)
    # handed over while the disk stands still: it starts at the hand-over, not before
    disk = DiskDevice(1.0, 10.0, readers=1, overlap=0.0)
    disk.advance(50_000)
    r = disk.submit(10_000, 3, PRIORITY_PREFETCH, now=50_000)
    assert disk.finish(r, 100_000) == 120_000 and disk.host_ns(r) == (50_000, 120_000)
    # at overlap 0.25, 40 us of compute moves the disk 10 us; the read's last 10 us are waited
    disk = DiskDevice(1.0, 10.0, readers=1, overlap=0.25)
    r = disk.submit(10_000, 3, PRIORITY_DEMAND, now=0)
    assert disk.finish(r, 40_000) == 50_000


def test_the_clock_maps_both_ways() -> None:
    clock = DiskClock(0.5)
    assert clock.compute_to(1000) == 500
    assert clock.wait_for(700) == 1200
    assert clock.compute_to(1400) == 800
    assert [clock.disk_of(h) for h in (0, 1000, 1100, 1200, 1400, 1500)] == [0, 500, 600, 700, 800, 900]
    assert [clock.host_of(d) for d in (0, 500, 600, 750, 800, 900)] == [0, 1000, 1100, 1300, 1400, 1500]
    frozen = DiskClock(0.0)
    assert frozen.compute_to(1000) == 0 and frozen.wait_for(50) == 1050
    assert frozen.host_of(0) == 0 and frozen.host_of(50) == 1050  # the earliest host time


class Streamer:
    """Reads every call's experts some calls before it -- `ahead` (0: on demand), or, with
    `spread`, a number of calls drawn from 1 to `ahead` for each call -- and lets each go
    once no call it has read for needs it: every call reads its experts, early or not."""

    def __init__(self, wl: Workload, ahead: int, spread: bool = False) -> None:
        self.calls = [(c.layer, sorted({int(e) for e in c.ids.ravel()})) for s in wl.steps for c in s.calls]
        n = len(self.calls)
        drawn = np.random.default_rng(ahead).integers(1, ahead + 1, n) if spread and ahead else None
        self.lead = [int(drawn[j]) if drawn is not None else ahead for j in range(n)]
        self.i = 0

    def decide(self, call: HookCall) -> Plan:
        i, self.i = self.i, self.i + 1
        read_for = [j for j in range(i + 1, len(self.calls)) if j - self.lead[j] <= i]
        later = {(self.calls[j][0], e) for j in read_for for e in self.calls[j][1]}
        mine = {(call.layer, e) for e in self.calls[i][1]}
        evict = [
            (il, e) for il, es in self.calls[max(0, i - 2) : i] for e in es if (il, e) not in later | mine
        ]
        prefetch = [
            (self.calls[j][0], e) for j in read_for if j - self.lead[j] == i for e in self.calls[j][1]
        ]
        return Plan(actions=np.full(call.ids.shape, ACTION_DEVICE, np.int32), prefetch=prefetch, evict=evict)


L, E, K = 4, 16, 2
STREAM_EXPERT = 20_000
STREAM = Costs(
    expert_bytes=(STREAM_EXPERT,) * L,
    bus_gbps=1.0,
    bus_latency_us=40.0,
    rest_us=((1, 60.0),),
    device_expert_us=((1, 5.0),),
    host_expert_us=((1, 5.0),),
    device_shares_host=True,
    disk=DiskRules(ExpertReads.unaligned((E,) * L, (STREAM_EXPERT,) * L), 20.0),
)


def _stream_workload(seed: int, tokens: int = 16) -> Workload:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(tokens)]).astype(
        np.int32
    )
    return Workload.from_arrays(L, list(range(L)), E, ids)


def _stream_run(
    costs: Costs, wl: Workload, ahead: int, spread: bool = False
) -> tuple[SimResult, SimDiskTier]:
    sim = Simulator(wl, costs, 12 * STREAM_EXPERT)
    r = sim.run(f"ahead{ahead}", Streamer(wl, ahead, spread), policy_us=0.0)
    assert isinstance(sim.tier, SimDiskTier)
    return r, sim.tier


def _stream(costs: Costs, wl: Workload, ahead: int) -> tuple[float, float, int]:
    """(TPOT, stall per token, disk time so far) of the Streamer."""
    r, tier = _stream_run(costs, wl, ahead)
    return r.tpot_ms, r.stall_ms_per_token, tier.disk.clock.disk_ns


def test_overlap_zero_serialises_reads_with_compute() -> None:
    wl = _stream_workload(1)
    tokens = wl.decoded_tokens
    hidden = _with(STREAM, overlap=1.0)
    tpot1, stall1, _ = _stream(hidden, wl, 1)
    demand1, _, _ = _stream(hidden, wl, 0)
    assert tpot1 < 0.75 * demand1  # behind compute, a prefetch's read is mostly hidden
    tpot0, stall0, disk_ns = _stream(_with(STREAM, overlap=0.0), wl, 1)
    # the disk moved only while the host waited: every ns of its time was a ns of stall
    assert disk_ns == pytest.approx(stall0 * 1e6 * tokens, abs=tokens)
    # the same compute, and every read's time on top of it
    assert tpot0 - stall0 == pytest.approx(tpot1 - stall1)
    assert stall0 > 3 * stall1


def test_reads_done_while_the_host_computes_cost_it_host_read_us() -> None:
    tier = SimDiskTier(
        n_expert=(8,),
        expert_bytes=(10_000,),
        budget_bytes=4 * 10_000,
        bandwidth_gbps=1.0,
        latency_us=10.0,
        rules=DiskRules(ExpertReads.unaligned((8,), (10_000,)), 10.0, 1, host_read_us=5.0),
    )
    tier.request(0, 1, PRIORITY_PREFETCH)  # 3 preads, done at 20 us
    tier.now_ns = 100_000  # the host computed meanwhile
    tier.poll()
    assert tier.read_for_host(0, []) == 15_000  # 3 preads x 5 us, paid before the call goes on
    assert tier.now_ns == 115_000 and tier.contention_ns == 15_000
    assert tier.read_for_host(0, []) == 0  # paid once
    # a read the host waits for costs it nothing more than the wait
    waited = tier.read_for_host(0, [2])
    assert waited == 20_000 and tier.read_for_host(0, []) == 0 and tier.contention_ns == 15_000


class SyntheticPricing:
    """Records priced by the Streamer at 0, 1 and 3 calls ahead, one routing per run."""

    def __init__(self, seeds: Mapping[str, int]) -> None:
        self.workloads = {budget: _stream_workload(seed) for budget, seed in seeds.items()}

    def predict(self, run: DiskRun, terms: Mapping[str, float]) -> dict[str, tuple[float, float]]:
        costs = _with(
            STREAM,
            read_scale=terms.get("disk_read_scale", 1.0),
            overlap=terms.get("disk_overlap", 1.0),
            host_read_us=terms.get("disk_host_read_us", 0.0),
        )
        wl = self.workloads[run.budget]
        results = {f"ahead{d}": _stream_run(costs, wl, d, spread=True)[0] for d in (0, 1, 4)}
        return {row: (r.tpot_ms, r.hit_rate) for row, r in results.items()}


def _records(pricing: SyntheticPricing, terms: Mapping[str, float], hits: bool) -> list[DiskRun]:
    """The runs the pricing gives with `terms`, as records keep them (`hits`: with hit rates)."""
    runs = []
    for budget in pricing.workloads:
        got = pricing.predict(DiskRun("", budget, {}), terms)
        measured_hit = {row: hit for row, (_, hit) in got.items()} if hits else {}
        runs.append(DiskRun(f"synthetic:{budget}", budget, {row: ms for row, (ms, _) in got.items()},
                            measured_hit=measured_hit))  # fmt: skip
    return runs


def test_the_fit_recovers_known_terms_from_synthetic_records() -> None:
    pricing = SyntheticPricing({"a": 1, "b": 2})
    truth = {"disk_read_scale": 2.0, "disk_overlap": 0.6, "disk_host_read_us": 4.0}
    fit = fit_disk(pricing, _records(pricing, truth, hits=True))
    assert fit.error < 0.005 and all(fit.told.values())
    assert fit.terms["disk_read_scale"] == pytest.approx(2.0, abs=0.05)
    assert fit.terms["disk_overlap"] == pytest.approx(0.6, abs=0.05)
    assert fit.terms["disk_host_read_us"] == pytest.approx(4.0, abs=1.0)


def test_records_priced_without_the_terms_fit_back_to_the_pricing_without_them() -> None:
    pricing = SyntheticPricing({"a": 3})
    fit = fit_disk(pricing, _records(pricing, {}, hits=False), steps=5, evals=20)  # a short search
    assert fit.error < 0.02
    assert fit.terms["disk_read_scale"] == pytest.approx(1.0, abs=0.05)
    assert fit.terms["disk_overlap"] >= 0.9


def test_edge_mode_records_are_read_with_each_rows_warm_tpot() -> None:
    runs = read_disk_runs(RESULTS / "auto-policy-smolmoe-b.json")
    assert [r.budget for r in runs] == ["25%", "50%", "25%"]  # the RAM-tier runs, no device ones
    assert all(set(r.measured_ms) == {"exact", "static", "lru", "adapmoe", "spice"} for r in runs)
    limited = runs[2]
    assert "memory limit" in limited.conditions
    assert limited.measured_ms["exact"] == pytest.approx((20.88351449215441 + 21.050739222234355) / 2)
    assert runs[0].routing is not None and "routing-samples" in runs[0].routing


def test_the_fitted_terms_travel_in_the_profile_and_a_probe_keeps_them(tmp_path: Path) -> None:
    shipped = load_profile(DISK)
    for key in DISK_TERMS:  # the shipped profile carries them, each saying how it was obtained
        assert key in shipped.values and "sim fit" in shipped.values[key].note, key
    model = _tiny_moe(tmp_path / "m.gguf", tied=False)
    probed = with_probe(shipped, _probe(model, disk=True))
    assert probed["bus_gbps"] == 0.5  # the probe's disk
    assert all(probed.optional(k) == shipped.optional(k) for k in DISK_TERMS)
    terms = [FitTerm("disk_overlap", 0.25, "test"), FitTerm("disk_read_scale", 2.0, "test"),
             FitTerm("disk_host_read_us", 0.0, "untold", fitted=False)]  # fmt: skip
    runs = [DiskRun("r.json:1", "25%", {"exact": 1.0})]
    # a base whose untold term is not its value without the term
    base_doc = json.loads(resources.files("pyspice.sim").joinpath("profiles", "disk.json").read_text())
    base_doc["values"]["disk_host_read_us"]["value"] = 40.0
    base = HardwareProfile.from_json(base_doc)
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(fitted_disk_profile(base, terms, runs, "fitted")))
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(json.dumps(_probe(model, disk=True).to_json()))
    fitted = load_profile(str(path), probe_file)
    assert fitted.disk and fitted.probe is not None and fitted["bus_gbps"] == 0.5
    assert (fitted.optional("disk_overlap"), fitted.optional("disk_read_scale")) == (0.25, 2.0)
    # an untold term prices as the fit priced it, at its value without the term, not the base's
    assert fitted.optional("disk_host_read_us") == DISK_TERMS["disk_host_read_us"][2] != 40.0


def test_a_probe_carrying_fitted_terms_prices_with_them(tmp_path: Path) -> None:
    """`pyspice sim fit --save-to-probe` writes this machine's terms into its probe, where
    auto's pricing of the disk tier (with_probe) takes them over the shipped profile's."""
    from pyspice.policy.profile import CostProfile

    shipped = load_profile(DISK)
    model = _tiny_moe(tmp_path / "m.gguf", tied=False)
    own = {"disk_overlap": 0.3, "disk_read_scale": 1.7, "disk_host_read_us": 12.0}
    probe = dataclasses.replace(_probe(model, disk=True), disk_terms=own)
    again = CostProfile.from_json(json.loads(json.dumps(probe.to_json())))  # as saved and read back
    priced = with_probe(shipped, again)
    assert {k: priced.optional(k) for k in DISK_TERMS} == own
    assert "--save-to-probe" in priced.values["disk_overlap"].note
    with pytest.raises(ValueError, match="unknown disk term 'disk_speed'"):
        with_probe(shipped, dataclasses.replace(probe, disk_terms={"disk_speed": 1.0}))


def test_a_profile_without_the_terms_prices_reads_hidden_behind_compute() -> None:
    doc = json.loads(resources.files("pyspice.sim").joinpath("profiles", "disk.json").read_text())
    for key in DISK_TERMS:
        doc["values"].pop(key, None)
    bare = HardwareProfile.from_json(doc)
    assert (bare.optional("disk_overlap"), bare.optional("disk_read_scale")) == (1.0, 1.0)
    assert bare.optional("disk_host_read_us") == 0.0
