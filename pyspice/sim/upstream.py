"""llama.cpp's own rows on the simulator's hardware model, and upstream's GPU expert cache.

Bench's llama.cpp rows (pyspice.measure.upstream_rows) load the model with
plain llama.cpp: `upstream` (-ngl 99, every weight on the GPU),
`upstream-ncmoe` (--n-cpu-moe N: the routed experts of the first N blocks on
the CPU, the rest on the GPU) and `upstream-cpu-exps` (-ot exps=CPU, every
routed expert on the CPU). None has a hook: no policy, no hook call, no copy.
Their prices are the simulator's own (`Costs`, from
pyspice.sim.hardware.target_costs), per decoded token and layer:

- a MoE layer whose experts are on the host costs what `stock` costs there:
  the layer's non-expert time (`rest_us`), llama.cpp's own path beyond our
  host executor (`stock_layer_us`, fitted to stock), the host executor's call
  and k host activations. stock runs the same graph: the experts on the host,
  the rest on the GPU, a split at every MoE layer;
- a MoE layer whose experts are on the device runs inside llama.cpp's graph
  without a split: its non-expert work costs what the device takes to read the
  layer's weights (`rest_us` of the profile with `device_layer_us` at 0: the
  fit reads that term off the gaps between hook calls, which hold the graph
  split, docs/results/gpu.md), and its experts k device activations at their
  bytes' reading (`device_expert_us`; not `device_call_us` nor
  `device_act_overhead_us`, which are our pool executor's launch, collect and
  synchronisation per call);
- dense layers and the time outside the layers keep the fitted terms where the
  graph splits anywhere (they were read off graphs that split); a graph with
  no split at all (`upstream`, and `upstream-ncmoe` at N = 0) costs the
  layers' reading alone and, outside them, the output head's reading at the
  device's bandwidth (what target_costs prices there for a profile without a
  fitted `step_us`).

Decode in these rows does not depend on which experts a token picks (nothing
is cached or copied, one activation costs the same as another at one token),
so a token's time is that sum over the layers; an all-host placement gives
exactly what the simulator gives stock (tests/unit/test_sim_upstream.py).

Repacking: upstream-cpu-exps holds the experts in llama.cpp's CPU buffers,
repacked where the build repacks their type, where stock holds them in plain
pinned memory. A one-token mat-vec reads the same bytes either way (repacking
speeds up the batched products of a prompt), so the row is priced as stock.
The records measured it at 0.97-0.99 of stock (docs/results/gpu.md), within
3% of that assumption.

`upstream-moecache` is upstream llama.cpp's GPU cache of host-held experts
(`--moe-cache-mib`, with every routed expert held on the host as --cpu-moe
holds them): each decode token the graph reads the router's ids back to the
host synchronously, the per-layer LRU banks are updated and the misses
uploaded before the layer runs; the layer's experts then run on the device
from their slots, or, with `--moe-cache-cpu-share`, that share of the misses
runs on the host instead (not uploaded). Modelled as one more simulator row
(`moecache_result`): the budget split evenly over the MoE layers (each layer's
LRU holds budget / layers / slot bytes experts, at least one), the readback
one bus round trip per MoE layer (two copies' latency and the ids' bytes; on a
profile whose latency is folded into its bandwidth that is nearly free, so it
is a floor: the hook's split, which also stops the graph at every MoE layer,
measured 150-160 us on the H200), the uploads the tier's demand copies,
waited for in order, each started at the profile's time per copy; non-expert
work as in a graph without a split. Multi-token batches (a prompt) take
llama.cpp's CPU path and leave the cache as it was: upstream caches
single-token decode. Which misses the CPU share takes is not upstream's
documented choice: here the ones the router ranks last. It is simulated only,
never checked against a measured row (its build is not among ours).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pyspice.policy.base import ACTION_DEVICE, ACTION_HOST, RESIDENCY_ABSENT, HookCall, Plan, PolicyBase
from pyspice.policy.context import PolicyContext
from pyspice.policy.registry import (
    ALL_LAYERS_NGL,
    UPSTREAM,
    UPSTREAM_CPU_EXPS,
    UPSTREAM_MOECACHE,
    UPSTREAM_NCMOE,
)
from pyspice.sim.costs import Costs, interpolate
from pyspice.sim.hardware import HardwareProfile, Value, policy_profile, target_costs
from pyspice.sim.simulator import SimResult, Simulator
from pyspice.sim.targets import TargetModel
from pyspice.sim.workload import Workload

NOT_CHECKED = "simulated, not checked against a measured row"
ID_BYTES = 4  # the router's ids read back per token and expert (int32)


def split_free_costs(profile: HardwareProfile, target: TargetModel, workload: Workload) -> Costs:
    """The simulator's costs of `target` on `profile` for a graph that never splits: the
    profile without its `device_layer_us` (read off the hook's split graph) nor a
    fitted `step_us`, so a layer costs its weights' reading and a token's time outside
    the layers the output head's; nothing of the hook, no executor floor."""
    values = dict(profile.values)
    values["device_layer_us"] = Value(0.0, "estimate", "a layer inside llama.cpp's graph: no split")
    values.pop("step_us", None)
    costs = target_costs(replace(profile, values=values), target, workload)
    return replace(
        costs,
        hook_us=0.0,
        python_call_us=0.0,
        copy_issue_us=0.0,
        device_call_us=0.0,
        device_act_overhead_us=0.0,
        stock_layer_us=0.0,
        async_layer_us=0.0,
    )


def placement_tpot_ms(costs: Costs, free: Costs, workload: Workload, on_device: frozenset[int]) -> float:
    """A decoded token's time in llama.cpp's own graph with the experts of the MoE layers
    `on_device` on the device and every other MoE layer's on the host (module
    docstring). `costs`: target_costs of the profile; `free`: split_free_costs."""
    k = workload.n_expert_used
    moe = set(workload.moe_layers)
    split = not moe <= on_device
    on_host = costs.stock_layer_us + costs.host_call_us + k * interpolate(costs.host_expert_us, 1)
    device = interpolate(free.rest_us, 1) + k * interpolate(costs.device_expert_us, 1)
    rest = interpolate(costs.rest_us if split else free.rest_us, 1)
    total = costs.step_us if split else free.step_us
    for il in range(workload.n_layers):
        if il in on_device and il in moe:
            total += device
        else:
            total += rest + (on_host if il in moe else 0.0)
    return total * costs.layer_scale / 1e3


@dataclass(frozen=True)
class Priced:
    tpot_ms: float | None
    note: str  # the placement priced, or why it is not


def device_layers(name: str, placement: Mapping[str, Any] | None, workload: Workload) -> frozenset[int] | str:
    """The trace's MoE layers whose experts llama.cpp's row `name` held on the GPU, from
    the record's placement of it (bench's llama_cpp_rows entry), or why not."""
    moe = workload.moe_layers
    if placement is None:
        return "its placement is not in the record (bench's llama_cpp_rows)"
    if placement.get("skipped"):
        return f"it did not run: {placement['skipped']}"
    ngl = int(placement.get("n_gpu_layers") or 0)
    if ngl < ALL_LAYERS_NGL:
        return f"-ngl {ngl}: llama.cpp on the CPU, or layers split by -ngl, is not modelled"
    if name == UPSTREAM:
        return frozenset() if placement.get("overrides") else frozenset(moe)
    if name == UPSTREAM_CPU_EXPS:
        return frozenset()
    if name == UPSTREAM_NCMOE:
        gpu, layers = placement.get("gpu_expert_layers"), placement.get("expert_layers")
        if gpu is None or not layers:
            return "the record does not say how many expert layers it held on the GPU"
        # the last gpu of `layers` expert layers; a trace of another depth keeps the share
        n = round(int(gpu) * len(moe) / int(layers))
        return frozenset(moe[len(moe) - n :]) if n else frozenset()
    return f"{name} is not one of llama.cpp's rows"


def price_row(
    name: str, placement: Mapping[str, Any] | None, costs: Costs, free: Costs, workload: Workload
) -> Priced:
    """llama.cpp's row `name` of a record, priced (module docstring)."""
    on_device = device_layers(name, placement, workload)
    if isinstance(on_device, str):
        return Priced(None, f"llama.cpp's own row: not predicted: {on_device}")
    n = len(workload.moe_layers)
    where = (
        "every expert on the device"
        if len(on_device) == n
        else "every expert on the host (priced as stock)"
        if not on_device
        else f"{len(on_device)} of {n} expert layers on the device"
    )
    return Priced(placement_tpot_ms(costs, free, workload, on_device), f"llama.cpp's own row: {where}")


class MoeCache(PolicyBase):
    """upstream-moecache as the simulator runs it: per-layer LRU banks of the budget split
    evenly over the MoE layers; a decode call's hits run from their slots, its misses
    are uploaded (demand fetches, waited for) into the least recently used slots, save
    `cpu_share` of them, run on the host; a batch runs on the host and leaves the banks
    as they were. Deciding costs nothing here: the readback is the row's hook_us."""

    name = UPSTREAM_MOECACHE

    def __init__(self, cpu_share: float = 0.0) -> None:
        if not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"the CPU share of misses is a fraction in [0, 1], not {cpu_share}")
        self.cpu_share = cpu_share
        self.capacity: dict[int, int] = {}
        self.banks: dict[int, OrderedDict[int, None]] = {}  # least recently used first
        self._owed = 0.0  # the share's fraction of a miss carried to the next call

    def attach(self, ctx: PolicyContext) -> None:
        moe = ctx.moe_layers
        per_layer = (ctx.budget_bytes or 0) / max(1, len(moe))
        slot = max(1, ctx.slot_bytes)
        self.capacity = {il: min(ctx.n_expert[il], max(1, int(per_layer // slot))) for il in moe}
        self.banks = {il: OrderedDict() for il in moe}
        self._owed = 0.0

    def decide(self, call: HookCall) -> Plan:
        ids = np.asarray(call.ids)
        if ids.shape[0] != 1:
            return Plan(actions=np.full(ids.shape, ACTION_HOST, np.int32))
        layer = call.layer
        bank = self.banks[layer]
        if call.residency is not None:  # what the tier holds is what the bank holds
            for e in [e for e in bank if call.residency[layer, e] == RESIDENCY_ABSENT]:
                del bank[e]
        selected = list(dict.fromkeys(int(e) for e in ids.ravel()))  # the router's order
        misses = [e for e in selected if e not in bank]
        self._owed += self.cpu_share * len(misses)
        n_host = min(len(misses), int(self._owed))
        self._owed -= n_host
        on_host = set(misses[len(misses) - n_host :]) if n_host else set()
        uploads = [e for e in misses if e not in on_host]
        evict: list[tuple[int, int]] = []
        room = self.capacity[layer] - len(bank)
        for victim in [e for e in bank if e not in selected]:  # least recently used first
            if room >= len(uploads):
                break
            evict.append((layer, victim))
            del bank[victim]
            room += 1
        if room < len(uploads):  # a bank smaller than the call's experts: the rest on the host
            on_host.update(uploads[room:])
            uploads = uploads[:room]
        for e in selected:
            if e not in on_host:
                bank[e] = None
                bank.move_to_end(e)
        actions = np.where(np.isin(ids, sorted(on_host)), ACTION_HOST, ACTION_DEVICE).astype(np.int32)
        return Plan(actions=actions, fetch=uploads, evict=evict)


def check_moecache_profile(profile: HardwareProfile) -> None:
    """A GPU cache of host-held experts needs a GPU: not the emulated device, not edge
    mode's RAM tier."""
    if profile.simulates_source:
        raise ValueError(
            f"{UPSTREAM_MOECACHE} is a GPU cache of host-held experts: simulate it on a GPU hardware "
            f"profile (h200, rtx4060, ...), not {profile.name!r}"
        )


def readback_us(costs: Costs, n_expert_used: int) -> float:
    """One bus round trip per MoE layer: the ids down, the go-ahead back."""
    return 2 * costs.bus_latency_us + n_expert_used * ID_BYTES / (costs.bus_gbps * 1e3)


def moecache_costs(profile: HardwareProfile, target: TargetModel, workload: Workload) -> Costs:
    """upstream-moecache's costs: a graph without a split, the readback per MoE layer in
    place of a hook call, uploads started at the profile's time per copy."""
    costs = target_costs(profile, target, workload)
    free = split_free_costs(profile, target, workload)
    return replace(
        free,
        hook_us=readback_us(costs, workload.n_expert_used),
        copy_issue_us=costs.copy_issue_us,
    )


def moecache_result(
    workload: Workload,
    profile: HardwareProfile,
    target: TargetModel,
    budget_bytes: int,
    cpu_share: float = 0.0,
) -> SimResult:
    """upstream-moecache on a tier of `budget_bytes` (module docstring)."""
    check_moecache_profile(profile)
    costs = moecache_costs(profile, target, workload)
    sim = Simulator(workload, costs, budget_bytes, profile=policy_profile(profile, costs))
    return sim.run(UPSTREAM_MOECACHE, MoeCache(cpu_share), policy_us=0.0)
