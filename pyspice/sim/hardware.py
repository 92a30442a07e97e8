"""Hardware profiles (data files in pyspice/sim/profiles) and the costs they give a target.

Every number in a profile is a `{"value", "source", "note"}` entry whose
source says how it was obtained: `measured` (on this machine, or in the
profile's note), `derived` (a published peak times a stated efficiency: the
entry then also has `peak` and `efficiency`, and value = peak x efficiency),
`published` (a datasheet figure used as is) or `estimate` (a typical figure
we could not measure or derive, named as such).

Time model (decode is memory-bound; prompt batches may be compute-bound):

    device, per layer and token:  non-expert bytes / device bandwidth + kernel overhead
    device, per expert activation: expert bytes / device bandwidth
    host, per expert activation:   expert bytes / host memory bandwidth
    bus, per copy:                 latency + expert bytes / bus bandwidth

with a batch of n tokens taking max(memory time, 2 x params x n / FLOP rate).

Mapping a source trace to a target (`--target`): the trace keeps its own
routing (layers, experts per layer, top-k, which experts each token picks).
Each trace MoE layer j stands for target MoE layer round(j x (M_t - 1) /
(M_s - 1)) and each of its experts gets that layer's expert bytes, so the
device budget is the same share of (trace-geometry) expert bytes, a copy takes
the target's time per expert and a host activation the target's host time per
expert, and each trace layer costs one average target layer of non-expert
work: the ratios copy/expert : compute/layer : host/expert are the target's.
Per-token figures are then scaled by L_target / L_trace (depth), so TPOT is
per target token. What does not carry over: the source's top-k share (k/E)
and its reuse pattern, which are the source model's.

The `disk` profile is edge mode on this machine (pyspice.sim.disk): the recorded
model itself, its routed experts read from its own file into a RAM slot pool
(`--device-budget` is then the RAM budget), device work = host work. Its disk is
the one `pyspice probe` measured for the model (the saved cost profile, or
--probe) when that profile has the disk's figures, else the committed
profiles/disk.json (this project's CPU machine, measured, with its note); its
compute times are the probe's, or without one derived from the JSON's host
figures over the model's own sizes. Three of its values say how the disk and the
decode share this machine's cores, which the probe, timing the disk alone, cannot
show: `disk_overlap`, `disk_host_read_us` and `disk_read_scale` (pyspice.sim.disk,
DiskRules; absent: 1, 0 and 1, reads at the probe's speed hidden behind compute),
fitted to edge-mode records by `pyspice sim fit` (pyspice.sim.fit_disk). A
probe's disk figures replace the profile's bandwidth and latency; the three are
kept unless the probe carries its own (`disk_terms`, which `pyspice sim fit
--save-to-probe` writes from this machine's runs).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.formats.profile import load_profile as load_cost_profile
from pyspice.policy.profile import EMULATED as EMULATED_SOURCE
from pyspice.policy.profile import PROFILE_VERSION, BatchCost, CostProfile
from pyspice.sim.costs import BatchTable, Costs
from pyspice.sim.disk import READERS, DiskRules, ExpertReads
from pyspice.sim.targets import TargetModel, source_target
from pyspice.sim.workload import Workload
from pyspice.units import parse_budget

SOURCES = ("measured", "derived", "published", "estimate")
EMULATED = "emulated"
DISK = "disk"  # edge mode's disk tier on this machine (profiles/disk.json, or a probe's disk)


@dataclass(frozen=True)
class Value:
    value: float
    source: str
    note: str = ""
    peak: float | None = None
    efficiency: float | None = None

    @staticmethod
    def parse(name: str, doc: Any) -> Value:
        if not isinstance(doc, dict) or "source" not in doc:
            raise ValueError(f"profile value {name!r} needs a source ({', '.join(SOURCES)})")
        source = str(doc["source"])
        if source not in SOURCES:
            raise ValueError(f"profile value {name!r}: source {source!r} is not one of {', '.join(SOURCES)}")
        peak, eff = doc.get("peak"), doc.get("efficiency")
        if source == "derived":
            if peak is None or eff is None:
                raise ValueError(f"profile value {name!r} is derived: give its peak and efficiency")
            value = float(peak) * float(eff)
        else:
            value = float(doc["value"])
        return Value(value, source, str(doc.get("note", "")), peak, eff)

    def label(self) -> str:
        if self.source == "derived":
            return f"{self.value:g} (derived: {self.peak:g} peak x {self.efficiency:g})"
        return f"{self.value:g} ({self.source})"


_FIELDS = (
    "bus_gbps",
    "bus_latency_us",
    "device_mem_gbps",
    "device_tflops",
    "device_memory_gib",
    "device_layer_us",
    "host_mem_gbps",
    "host_gflops",
    "host_call_us",
    "hook_us",
    "python_call_us",
)


# The disk tier's reads and the decode on the same cores (pyspice.sim.disk, DiskRules),
# fitted to edge-mode records (`pyspice sim fit`, pyspice.sim.fit_disk): the share of a
# read's progress that goes on while the host computes, host compute lost per pread then,
# and a read's time while a decode runs over the probe's. Measured only; a probe may
# carry its own (CostProfile.disk_terms).
_DISK_TERMS = ("disk_overlap", "disk_host_read_us", "disk_read_scale")

# What only a run on the hardware itself shows (docs/results/gpu.md): the
# hook's thread's time per copy it starts, the device's time per activation beyond reading
# the expert's bytes, and how much slower the host runs its misses while the bus copies. A
# profile without them gets 0: copies free to the hook's thread and the host, a device
# activation as fast as its bytes.
_MEASURED_ONLY = (
    "copy_issue_us",
    "device_act_overhead_us",
    "bus_host_slowdown",
    # fitted to bench records (`pyspice sim fit`, pyspice/sim/fit.py): the device executor's
    # floor per call, a token's time outside the layers, llama.cpp's own path per MoE layer
    "device_call_us",
    "step_us",
    "stock_layer_us",
    "async_layer_us",
    *_DISK_TERMS,
)
# what an absent measured-only value stands for where it is not 0: reads hidden behind
# compute, as a device's copy engine hides its copies, at the disk's probed speed
_ABSENT = {"disk_overlap": 1.0, "disk_read_scale": 1.0}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    values: dict[str, Value]
    emulated: bool = False
    probe: CostProfile | None = None  # the measured cost profile of an emulated or disk profile
    fill_gbps: float = 0.0
    wake_us: float = 0.0
    disk: bool = False  # edge mode: the bus is the model file's disk, slots are RAM
    # measured deciding time per decode call by bench row (`pyspice sim fit`), which
    # a prediction charges to policies the simulator does not time itself
    deciding_us: dict[str, float] = field(default_factory=dict)

    @property
    def simulates_source(self) -> bool:
        """The profile runs the recorded model itself (its sizes), whatever --target says."""
        return self.emulated or self.disk

    def __getitem__(self, key: str) -> float:
        return self.values[key].value

    def optional(self, key: str) -> float:
        """A value only measured profiles give (_MEASURED_ONLY), 0 where a profile lacks it
        (`disk_overlap`: 1)."""
        if key not in _MEASURED_ONLY:
            raise KeyError(f"{key!r} is a value every profile gives: index the profile")
        return self.values[key].value if key in self.values else _ABSENT.get(key, 0.0)

    @staticmethod
    def from_json(doc: dict[str, Any]) -> HardwareProfile:
        name = str(doc["name"])
        missing = [f for f in _FIELDS if f not in doc.get("values", {})]
        if missing:
            raise ValueError(f"hardware profile {name!r} lacks {', '.join(missing)}")
        values = {k: Value.parse(k, v) for k, v in doc["values"].items()}
        kind = doc.get("kind", "gpu")
        if kind not in ("gpu", DISK):
            raise ValueError(f"hardware profile {name!r}: kind {kind!r} is neither 'gpu' nor '{DISK}'")
        deciding = {str(k): float(v) for k, v in (doc.get("deciding_us") or {}).items()}
        return HardwareProfile(
            name, str(doc.get("description", "")), values, disk=kind == DISK, deciding_us=deciding
        )

    def describe(self) -> list[str]:
        return [f"{self.name}: {self.description}"] + [
            f"  {k:<18} {v.label()}{'  - ' + v.note if v.note else ''}" for k, v in self.values.items()
        ]


def profile_names() -> list[str]:
    files = resources.files("pyspice.sim").joinpath("profiles")
    shipped = sorted(p.name.removesuffix(".json") for p in files.iterdir() if p.name.endswith(".json"))
    return [*shipped, EMULATED]


def load_profile(name: str, probe_path: Path | None = None) -> HardwareProfile:
    """A shipped profile by name, a JSON file by path, or `emulated` (this machine, from `pyspice probe`)."""
    if name == EMULATED:
        if probe_path is None:
            raise ValueError(
                "the emulated profile needs a cost profile: run `pyspice probe` on the source model"
            )
        return emulated_profile(probe_path)
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        profile = HardwareProfile.from_json(json.loads(path.read_text()))
    else:
        res = resources.files("pyspice.sim").joinpath("profiles", f"{name}.json")
        if not res.is_file():
            raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(profile_names())}")
        profile = HardwareProfile.from_json(json.loads(res.read_text()))
    # a disk profile from a file (one `sim fit` wrote) takes a probe as the shipped one does
    if profile.disk and probe_path is not None and probe_path.is_file():
        return with_probe(profile, load_cost_profile(probe_path))
    return profile


def with_probe(profile: HardwareProfile, probe: CostProfile) -> HardwareProfile:
    """A disk profile with a `pyspice probe` cost profile of the recorded model: its
    compute times, and its disk where it measured one (else the profile's own)."""
    values = dict(profile.values)
    if probe.disk_gbps is not None and probe.disk_latency_us is not None:
        how = (
            f"`pyspice probe` of {Path(probe.model).name}: {READERS} readers of expert-sized O_DIRECT "
            "reads of the model file"
        )
        values["bus_gbps"] = Value(probe.disk_gbps, "measured", how)
        values["bus_latency_us"] = Value(
            probe.disk_latency_us,
            "measured",
            f"`pyspice probe` of {Path(probe.model).name}: median random 64 KiB O_DIRECT read",
        )
    for key, value in (probe.disk_terms or {}).items():
        if key not in _DISK_TERMS:
            raise ValueError(f"the probe of {Path(probe.model).name} names an unknown disk term {key!r}")
        values[key] = Value(
            float(value),
            "measured",
            "fitted to this machine's edge-mode runs (`pyspice sim fit --save-to-probe`)",
        )
    return replace(
        profile,
        description=f"{profile.description}; compute from `pyspice probe` of {Path(probe.model).name} "
        f"({probe.threads} threads)",
        values=values,
        probe=probe,
        disk=True,
    )


def measure_fill_gbps(nbytes: int, repeats: int = 200) -> float:
    """Host copy bandwidth for one expert's bytes (the emulator's slot fill), GB/s."""
    src = np.ones(max(1, nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9) / 1e9


def measure_wake_us(sleep_us: float = 10.0, repeats: int = 50) -> float:
    """How late a short sleep wakes (timer slack and scheduling), median microseconds."""
    lates = []
    for _ in range(repeats):
        start = time.perf_counter()
        time.sleep(sleep_us / 1e6)
        lates.append((time.perf_counter() - start) * 1e6 - sleep_us)
    return float(np.median(lates))


def emulated_profile(probe_path: Path) -> HardwareProfile:
    """This machine with its emulated device, from a `pyspice probe` cost profile: the
    bus as the probe's emulation set it, device compute = host compute."""
    return machine_profile(load_cost_profile(probe_path))


def machine_profile(probe: CostProfile) -> HardwareProfile:
    """This machine as a `pyspice probe` cost profile has it: with an emulated device
    (the bus the user set, device compute = host compute) or with its real GPU (bus
    and per-activation device time measured by the probe). `emulated_costs` turns it
    into the simulator's costs for the probed model itself."""
    expert_bytes = max(probe.expert_bytes.values(), default=0)
    emulated = probe.device_emulated
    fill = measure_fill_gbps(expert_bytes) if emulated else 0.0  # a real GPU copies, no host fill
    wake = measure_wake_us()
    values = {
        "bus_gbps": Value(probe.bus_gbps, "measured", probe.bus_source),
        "bus_latency_us": Value(probe.bus_latency_us, "measured", probe.bus_source),
        "wake_us": Value(wake, "measured", "lateness of a 10 us sleep, median of 50"),
    }
    if emulated:
        values["fill_gbps"] = Value(
            fill, "measured", "host copy of one expert into its slot (numpy copy, best of 200)"
        )
    device = "emulated device" if emulated else f"its GPU ({probe.device_source})"
    return HardwareProfile(
        EMULATED,
        f"this machine, {device} ({probe.threads} threads; probe of {Path(probe.model).name})",
        values,
        emulated=True,
        probe=probe,
        fill_gbps=fill,
        wake_us=wake,
    )


def _table(points: list[tuple[int, float]]) -> BatchTable:
    return tuple(sorted(points))


def emulated_costs(profile: HardwareProfile, workload: Workload, expert_bytes: tuple[int, ...]) -> Costs:
    """The source model on this machine, as `pyspice bench` runs it on the probed tier
    (its emulated device, or its GPU where the probe measured one)."""
    probe = profile.probe
    if probe is None:
        raise ValueError(f"hardware profile {profile.name} has no measured cost profile to emulate")
    expert = _table([(b.tokens, b.expert_us) for b in probe.batches])
    rest = _table([(b.tokens, b.rest_us_per_layer) for b in probe.batches])
    shares = probe.device_emulated
    # a real GPU's time per activation is the probe's one-token figure at every batch
    # (decode is what it measured; the pool executor's per-call floor is not in a probe)
    device = expert if shares else _table([(b.tokens, probe.device_expert_us) for b in probe.batches])
    return Costs(
        expert_bytes=expert_bytes,
        bus_gbps=probe.bus_gbps,
        bus_latency_us=probe.bus_latency_us,
        rest_us=rest,
        device_expert_us=device,
        host_expert_us=expert,
        device_shares_host=shares,
        fill_gbps=profile.fill_gbps,
        wake_us=profile.wake_us,
        layer_scale=1.0,
    )


def disk_costs(
    profile: HardwareProfile, workload: Workload, model: Path, expert_bytes: tuple[int, ...]
) -> Costs:
    """The recorded model on this machine's disk tier (module docstring): the reads its
    file takes, the disk as the profile has it, compute from the probe or the profile.
    `expert_bytes`: one routed expert's bytes per layer, as the store charges them."""
    gbps, latency = profile["bus_gbps"], profile["bus_latency_us"]
    rules = DiskRules(
        ExpertReads.from_model(model),
        DiskRules.fixed_latency_us(latency, gbps),
        overlap=profile.optional("disk_overlap"),
        host_read_us=profile.optional("disk_host_read_us"),
        read_scale=profile.optional("disk_read_scale"),
    )
    if profile.probe is not None:
        base = emulated_costs(profile, workload, expert_bytes)
    else:
        derived = target_costs(profile, source_target(model), workload)
        base = replace(derived, expert_bytes=expert_bytes, device_expert_us=derived.host_expert_us)
    return replace(
        base,
        bus_gbps=gbps,
        bus_latency_us=latency,
        device_shares_host=True,  # the host executor runs every expert, from slots or scratch
        device_expert_us=base.host_expert_us,  # a GPU probe's device time is no slot's here
        fill_gbps=0.0,  # the read itself fills the slot
        wake_us=0.0,  # a wait blocks on a reader's condition variable, no timer sleep
        disk=rules,
    )


def _stand_in(j: int, n_src: int, n_tgt: int) -> int:
    return round(j * (n_tgt - 1) / (n_src - 1)) if n_src > 1 else 0


def target_costs(profile: HardwareProfile, target: TargetModel, workload: Workload) -> Costs:
    """Costs of `target` on `profile` laid over the trace's geometry (module docstring)."""
    src_moe = workload.moe_layers
    expert_bytes = [0] * workload.n_layers
    for j, il in enumerate(src_moe):
        expert_bytes[il] = target.expert_bytes[
            target.moe_layers[_stand_in(j, len(src_moe), len(target.moe_layers))]
        ]
    dev_bw = profile["device_mem_gbps"] * 1e3  # bytes per microsecond
    dev_flops = profile["device_tflops"] * 1e6  # FLOP per microsecond
    host_bw = profile["host_mem_gbps"] * 1e3
    host_flops = profile["host_gflops"] * 1e3
    mean_bytes = sum(target.layer_bytes) / target.n_layers
    mean_params = sum(target.layer_params) / target.n_layers
    mean_expert_bytes = sum(target.expert_bytes[il] for il in target.moe_layers) / len(target.moe_layers)
    share = target.n_expert_used / target.n_expert  # tokens of a batch that reach one expert

    def rest(n: int) -> float:  # per token per layer
        return (max(mean_bytes / dev_bw, 2 * mean_params * n / dev_flops) + profile["device_layer_us"]) / n

    def per_act(n: int, bw: float, flops: float) -> float:
        m = max(1.0, n * share)
        return max(mean_expert_bytes / bw, 2 * target.expert_params * m / flops) / m

    batches = (1, 8, 32, 128, 512)
    scale = target.n_layers / workload.n_layers
    head_us = max(target.head_bytes / dev_bw, 0.0)
    outside = profile.optional("step_us") or head_us  # a fitted step holds the head's reading
    return Costs(
        expert_bytes=tuple(expert_bytes),
        bus_gbps=profile["bus_gbps"],
        bus_latency_us=profile["bus_latency_us"],
        rest_us=_table([(n, rest(n)) for n in batches]),
        device_expert_us=_table([(n, per_act(n, dev_bw, dev_flops)) for n in batches]),
        host_expert_us=_table([(n, per_act(n, host_bw, host_flops)) for n in batches]),
        step_us=outside / scale,
        host_call_us=profile["host_call_us"],
        hook_us=profile["hook_us"],
        python_call_us=profile["python_call_us"],
        surrogate_us=0.0,
        copy_issue_us=profile.optional("copy_issue_us"),
        device_act_overhead_us=profile.optional("device_act_overhead_us"),
        bus_host_slowdown=profile.optional("bus_host_slowdown"),
        device_call_us=profile.optional("device_call_us"),
        stock_layer_us=profile.optional("stock_layer_us"),
        async_layer_us=profile.optional("async_layer_us"),
        device_shares_host=False,
        layer_scale=scale,
    )


def policy_profile(profile: HardwareProfile, costs: Costs) -> CostProfile | None:
    """What `pyspice probe` would have measured on the simulated machine (a
    CostProfile), so policies that weigh copies against host work
    (adapmoe, spice) weigh them as on that hardware. The emulated profile hands
    over the measured one itself."""
    if profile.emulated:
        return profile.probe
    if profile.disk and profile.probe is not None:
        # as the engine hands it to policies on its disk tier (profile_for_tier): the bus is the disk
        return replace(
            profile.probe,
            bus_gbps=costs.bus_gbps,
            bus_latency_us=costs.bus_latency_us,
            bus_source=f"disk (simulated: {profile.name})",
        )

    moe_bytes = [b for b in costs.expert_bytes if b > 0]
    host = dict(costs.host_expert_us)
    rest = dict(costs.rest_us)
    return CostProfile(
        version=PROFILE_VERSION,
        model="(simulated target)",
        model_sha="",
        threads=0,
        n_layers=len(costs.expert_bytes),
        n_moe_layers=len(moe_bytes),
        expert_bytes={"simulated": max(moe_bytes, default=0)},
        bus_gbps=costs.bus_gbps,
        bus_latency_us=costs.bus_latency_us,
        bus_source=f"simulated: {profile.name}",
        device_expert_us=dict(costs.device_expert_us)[1],
        # device work that is host work (the disk tier) overlaps nothing, as on an emulated device
        device_source=(
            f"{EMULATED_SOURCE}: the host's (simulated: {profile.name})"
            if costs.device_shares_host
            else f"simulated: {profile.name}"
        ),
        batches=[BatchCost(tokens=n, expert_us=host[n], rest_us_per_layer=rest[n]) for n in sorted(host)],
    )


def budget_bytes(spec: str, routed_bytes: int, target_routed: int | None = None) -> int:
    """A --device-budget entry: a share ("25%") of the simulated whole tier (every routed
    expert in a slot as large as the largest; units.whole_tier_bytes), or
    bytes with a unit ("8GiB"), which for a target mean target bytes (taken as a share)."""
    budget = parse_budget(spec)
    if target_routed is not None and budget.share is None:
        return int(routed_bytes * min(1.0, budget.resolve(target_routed) / target_routed))
    return int(budget.resolve(routed_bytes))
