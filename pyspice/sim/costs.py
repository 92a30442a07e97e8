"""What the simulator charges: the costs of one (hardware, model) pair
(pyspice.sim.hardware builds them from a profile) and the batch-size tables they
are read from."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pyspice.sim.disk import DiskRules

BatchTable = tuple[tuple[int, float], ...]  # (tokens in the step, microseconds) points


def interpolate(table: BatchTable, tokens: int) -> float:
    """Piecewise linear in log(tokens) between measured batch sizes, flat outside them."""
    points = sorted(table)
    if not points:
        return 0.0
    xs = [math.log(t) for t, _ in points]
    x = math.log(max(1, tokens))
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return points[i - 1][1] * (1 - f) + points[i][1] * f


@dataclass(frozen=True)
class Costs:
    """Times for one (hardware, model) pair. Per-activation times are per token
    through one expert at the step's batch size; `rest` is per token per layer."""

    expert_bytes: tuple[int, ...]  # per layer (0 for dense layers)
    bus_gbps: float
    bus_latency_us: float
    rest_us: BatchTable  # device: non-routed work, per token per layer
    device_expert_us: BatchTable  # device: one activation
    host_expert_us: BatchTable  # host executor: one activation
    step_us: float = 0.0  # per step outside the layers (output head, sampling) not in rest_us
    host_call_us: float = 0.0  # host executor: per call with host work (dispatch, barrier)
    hook_us: float = 0.0  # reaching the policy and applying its plan, per hook call
    python_call_us: float = 0.0  # extra per call for a Python policy (views, plan conversion)
    surrogate_us: float = 0.0  # device: one surrogate activation
    # measured on a real GPU (docs/results/gpu.md); 0 where not measured:
    copy_issue_us: float = 0.0  # the hook's thread, per copy it starts (CUDA calls, polling)
    device_act_overhead_us: float = 0.0  # device: per activation beyond reading its bytes
    bus_host_slowdown: float = 0.0  # host expert work is this much slower while the bus copies
    device_call_us: float = 0.0  # device: per call with device work (the executor's floor)
    stock_layer_us: float = 0.0  # llama.cpp's own path per MoE layer beyond the host's expert work
    async_layer_us: float = 0.0  # the hook's thread, per MoE layer while a planner thread plans
    device_shares_host: bool = False  # emulated device: its compute is the host's
    fill_gbps: float = 0.0  # emulated device: host copy into a slot on first use (0: none)
    wake_us: float = 0.0  # emulated device: a wait that sleeps wakes this much late
    prefetch_queue_max: int = 64
    layer_scale: float = 1.0  # per-token times x this (target depth / trace depth)
    # edge mode's disk tier (pyspice.sim.disk): copies are reads of the model file and a
    # host action on an expert without a slot reads it into scratch; None: a device tier
    disk: DiskRules | None = None
