"""`pyspice probe`: measure this machine's cost profile for one model.

What policies and the simulator need to weigh a copy against host work:
the bus (bandwidth, latency per copy), host time per expert activation at
several batch sizes, device time per expert, and the rest of a layer's time
(attention, norms, shared experts). Measured by differences on the real
model: the same evaluation with every routed expert executed and with every
routed expert dropped; what the experts add, divided by how many ran, is
their cost; a batch of 1 is measured as decoding runs (KV position 128, a
different token each step). On a CPU-only build the device is emulated: its bus is what the
user set, and its compute is the host's (labelled so). With a real (CUDA)
device the bus is measured from the copy engine's own events while every
expert is fetched once, and device time per expert by the same difference
with every expert resident on the GPU.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pyspice.engine.disk_probe import measure_disk
from pyspice.formats.profile import model_fingerprint
from pyspice.policy import ACTION_DEVICE, ACTION_DROP, HookCall, Plan
from pyspice.policy.base import PolicyBase
from pyspice.policy.profile import PROFILE_VERSION, BatchCost, CostProfile

# KV position decode costs are measured at: about where bench's TPOT is (its
# 128-token prompt); attention at position 0 is cheaper than at any real step
DECODE_POSITION = 128


class DropAll(PolicyBase):
    """Every routed expert contributes nothing: with it, a step's time is the rest of the model.

    It keeps PolicyBase's lossless=True although it drops: it needs no surrogates,
    and so the engine loads none (the tier stays the experts', as in the exact run)."""

    name = "drop-all"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), ACTION_DROP, np.int32))


def _timed_eval(llm: Any, tokens: list[int], repeats: int) -> float:
    """Median seconds of evaluating `tokens` as one batch after a reset."""
    times = []
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


def _exact_and_dropped(llm: Any, tokens: list[int], repeats: int) -> tuple[float, float, float]:
    """(median seconds of `tokens` with every routed expert exact, the same with every
    one dropped, activations per evaluation)."""
    llm.set_policy("exact")
    llm.spice_reset_stats()
    full = _timed_eval(llm, tokens, repeats)
    activations = float(llm.spice_stats()["activations"]) / repeats
    llm.set_policy(DropAll())
    return full, _timed_eval(llm, tokens, repeats), activations


def _type_name(t: int) -> str:
    try:
        return str(gguf.GGMLQuantizationType(t).name)
    except ValueError:
        return f"type{t}"


def measure_decode_step(llm: Any, tokens: list[int], position: int, repeats: int) -> BatchCost:
    """Cost of one decoded token where decoding happens: at KV position `position`
    (`tokens[:position]` evaluated first), a different next token each repeat (the
    same token would route to the same experts and find their weights in cache),
    all routed experts exact versus all dropped, interleaved, with the dropping
    policy's own Python time taken out of the rest of the layer."""
    n_layers = len(llm.spice_layers())
    n_moe = sum(1 for info in llm.spice_layers() if info.is_moe)
    llm.set_policy("exact")
    llm.reset()
    llm.eval(tokens[:position])
    times: dict[str, list[float]] = {"exact": [], "drop": []}
    drop_us: list[float] = []
    activations = 0.0
    for r in range(repeats):
        for kind in ("exact", "drop") if r % 2 == 0 else ("drop", "exact"):
            llm.set_policy("exact" if kind == "exact" else DropAll())
            llm.spice_reset_stats()
            llm.n_tokens = position  # llama_cpp's eval drops the KV cells from here on
            start = time.perf_counter()
            llm.eval([tokens[position + r]])
            times[kind].append(time.perf_counter() - start)
            stats = llm.spice_stats()
            if kind == "drop":
                drop_us.append(float(stats["policy_us_per_call"]))
            else:
                activations = float(stats["activations"])
    exact_us = statistics.median(times["exact"]) * 1e6
    drop_total = statistics.median(times["drop"]) * 1e6
    policy_us = statistics.median(drop_us) * n_moe
    rest_total = drop_total - policy_us
    return BatchCost(
        tokens=1,
        expert_us=max(0.0, exact_us - rest_total) / max(1.0, activations),
        rest_us_per_layer=rest_total / max(1, n_layers),
    )


def measure_profile(
    llm: Any,
    model_path: Path,
    *,
    bus_gbps: float,
    bus_latency_us: float,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    repeats: int = 5,
    progress: Any = None,
    real_device: bool = False,
) -> CostProfile:
    """real_device: also measure the real (CUDA) device tier's bus and compute."""
    layers = [info for info in llm.spice_layers() if info.is_moe]
    n_layers = len(llm.spice_layers())
    vocab = llm.n_vocab()
    rng = np.random.default_rng(0)
    batches = []
    for n in batch_sizes:
        if n == 1:  # decode steps: measured where and as decoding runs
            steps = 3 * repeats  # single steps are short and noisy: more of them
            position = max(0, min(DECODE_POSITION, int(llm.n_ctx()) - steps - 1))
            if progress:
                progress(f"one token at KV position {position}: all experts, then none")
            stream = [int(t) for t in rng.integers(100, min(vocab, 30000), size=position + steps)]
            batches.append(measure_decode_step(llm, stream, position, steps))
            continue
        tokens = [int(t) for t in rng.integers(100, min(vocab, 30000), size=n)]
        if progress:
            progress(f"batch of {n}: all experts, then none")
        full, empty, activations = _exact_and_dropped(llm, tokens, repeats)
        expert_s = max(0.0, full - empty)
        batches.append(
            BatchCost(
                tokens=n,
                expert_us=expert_s * 1e6 / max(1.0, activations),
                rest_us_per_layer=empty * 1e6 / n / max(1, n_layers),
            )
        )
    bus_source = "emulated (set by the user)"
    device_us = batches[0].expert_us
    device_source = "emulated: the host's own time (CPU-only build)"
    if real_device:
        if progress:
            progress("real device: bus (every expert fetched once), then device time per expert")
        bus_gbps, bus_latency_us = _measure_bus(llm)
        bus_source = "measured (CUDA events; latency folded into the effective bandwidth)"
        device_us = _measure_device_expert_us(llm, vocab, rng, repeats)
        device_source = "measured: batch of 1, every expert resident, minus every expert dropped"
    llm.set_policy("exact")
    if progress:
        progress("the model file's disk, read as edge mode's tier reads it (O_DIRECT, 4 readers)")
    disk = measure_disk(model_path, max(i.bytes_per_expert for i in layers))
    types = {
        f"{_type_name(i.type_gate)}/{_type_name(i.type_up)}/{_type_name(i.type_down)}": i.bytes_per_expert
        for i in layers
    }
    return CostProfile(
        version=PROFILE_VERSION,
        model=str(model_path),
        model_sha=model_fingerprint(model_path),
        threads=int(llm.n_threads),
        n_layers=n_layers,
        n_moe_layers=len(layers),
        expert_bytes=types,
        bus_gbps=bus_gbps,
        bus_latency_us=bus_latency_us,
        bus_source=bus_source,
        device_expert_us=device_us,
        device_source=device_source,
        batches=batches,
        disk_gbps=disk.gbps,
        disk_latency_us=disk.latency_us,
    )


def _measure_bus(llm: Any) -> tuple[float, float]:
    """Fetch every expert once (a full tier, emptied first) and read back what the
    copy engine timed with CUDA events: (GB/s, 0 us latency)."""
    llm.set_policy("stock")
    llm.set_device(llm.automatic_device_budget())  # every expert, as far as the GPU has room

    class _FetchAll(PolicyBase):
        name = "probe-fetch-all"

        def decide(self, call: HookCall) -> Plan:
            return Plan(actions=np.full((call.n_tokens, call.n_expert_used), ACTION_DEVICE, np.int32))

    llm.set_policy(_FetchAll())
    llm.spice_reset_stats()
    llm.reset()
    llm.eval([int(t) for t in range(100, 164)])
    c = llm.spice_snapshot().total
    if c.copy_ns <= 0 or c.bytes_h2d <= 0:
        raise RuntimeError("probe: the real device copied nothing; cannot measure its bus")
    return c.bytes_h2d / c.copy_ns, 0.0


def _measure_device_expert_us(llm: Any, vocab: int, rng: Any, repeats: int) -> float:
    """Batch of 1 with every expert resident on the device vs every expert dropped."""
    llm.set_policy("stock")
    llm.set_device(llm.automatic_device_budget())  # every expert, as far as the GPU has room
    # `exact` preloads the tier (every expert, where the GPU holds them all)
    full, empty, activations = _exact_and_dropped(llm, [int(rng.integers(100, min(vocab, 30000)))], repeats)
    llm.clear_device()
    return max(0.0, full - empty) * 1e6 / max(1.0, activations)
