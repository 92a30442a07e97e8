"""Differential test: the simulator's disk tier (pyspice.sim.disk) against libspice's
(spice-device-disk.c, spice-runtime-host-read.c) on a real decode.

A short greedy decode with the routed experts left in the file runs through libspice
under policies whose decisions do not depend on timing (every copy is demand and
waited for in its own call); the same hook calls -- recorded once, routing being the
same under every lossless policy -- go through the simulator's disk tier with the same
budget. Bytes read from the file (widened as O_DIRECT reads them), reads, experts read
into scratch for host actions, bytes copied into slots and outcomes must be equal: the
read layout comes from the file's header in both, the scratch-read and no-slot rules
are the runtime's, the budget and slot count the store's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pyspice.api import Llama
from pyspice.policy import HookCall, Plan, make_policy
from pyspice.policy.base import PolicyBase
from pyspice.sim.costs import Costs
from pyspice.sim.disk import DiskRules, ExpertReads, SimDiskTier
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import SimCall, SimStep, Workload

from .golden import PROMPT, AllDevice, AllHost
from .test_disk_tier import load_on_disk  # the experts left in the file, as the tier test loads them

N_DECODE = 8


class Recorder(PolicyBase):
    """The default plan, every call's routing kept (copies: the arrays are views)."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[SimCall] = []

    def decide(self, call: HookCall) -> Plan:
        self.calls.append(
            SimCall(call.layer, np.array(call.ids, np.int32), np.array(call.weights, np.float32))
        )
        return Plan()


def decode(llm: Llama, policy: Any) -> tuple[Any, Any]:
    """Prompt as one batch, then N_DECODE greedy steps: libspice's counters over the
    whole run and over the decode steps."""
    llm.set_policy(policy)
    llm.reset()
    llm.spice_reset_stats()
    runtime = llm.spice_engine.require_runtime()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    prompt = runtime.counters()
    for _ in range(N_DECODE):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return runtime.counters(), prompt


def workload(llm: Llama, calls: list[SimCall]) -> Workload:
    layers = llm.spice_layers()
    n_expert = tuple(info.n_expert if info.is_moe else 0 for info in layers)
    first = min(il for il, n in enumerate(n_expert) if n)
    wl = Workload(len(layers), n_expert, llm.policy_context().n_expert_used, 0)
    for call in calls:
        if call.layer == first:
            wl.steps.append(SimStep([], decode=call.n_tokens == 1 and bool(wl.steps)))
        wl.steps[-1].calls.append(call)
    return wl


@pytest.mark.parametrize("budget", ["25%", "50%"])
@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q8_0"), ("deepseek2", "Q4_K")])
def test_the_simulated_disk_tier_reads_what_libspice_reads(
    synth_model, arch: str, quant: str, budget: str
) -> None:
    path = synth_model(arch, "tiny", quant)
    llm = load_on_disk(path, budget)
    try:
        recorder = Recorder()
        decode(llm, recorder)
        wl = workload(llm, recorder.calls)
        assert len(wl.steps) == 1 + N_DECODE and not wl.steps[0].decode
        params = llm.spice_engine.device_params
        assert params is not None
        costs = Costs(
            expert_bytes=tuple(info.bytes_per_expert if info.is_moe else 0 for info in llm.spice_layers()),
            bus_gbps=params.bandwidth_gbps,
            bus_latency_us=params.latency_us,
            rest_us=((1, 10.0),),
            device_expert_us=((1, 1.0),),
            host_expert_us=((1, 1.0),),
            device_shares_host=True,
            disk=DiskRules(ExpertReads.from_model(path), read_latency_us=50.0),
        )
        extra = {"host_weights_in_memory": False, "tier_bus": (params.bandwidth_gbps, params.latency_us)}
        sim = Simulator(wl, costs, params.budget_bytes, context_extra=extra)
        for policy in ("exact", "lru", "ondemand", AllHost(), AllDevice()):
            name = policy if isinstance(policy, str) else policy.name
            total, prompt = decode(llm, policy)
            assert total.disk_reads > 0, name
            shipped = make_policy(policy) if isinstance(policy, str) else policy
            result = sim.run(name, shipped, policy_us=0.0, preload=policy == "exact")
            tier = sim.tier
            assert isinstance(tier, SimDiskTier)
            nbytes, reads, _experts, scratch = tier.read_totals(1 << 62)
            where = f"{name} at {budget} on {arch}"
            assert (nbytes, reads, scratch) == (
                total.disk_read_bytes,
                total.disk_reads,
                total.scratch_reads,
            ), where
            assert sum(k.bytes_h2d for k in tier.counters) == total.bytes_h2d, where
            # outcomes of the decode steps (the simulator counts from the first decode step)
            assert (result.hits, result.misses_fetched, result.misses_host) == (
                total.hits - prompt.hits,
                total.misses_fetched - prompt.misses_fetched,
                total.misses_host - prompt.misses_host,
            ), where
            decoded = result.disk_read_bytes_per_token * result.decoded_tokens
            assert decoded == pytest.approx(total.disk_read_bytes - prompt.disk_read_bytes), where
    finally:
        llm.close()
