"""The device tier a budget turns into, and the checks that refuse one the machine cannot hold."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pyspice.engine.host_memory import host_memory_available
from pyspice.runtime import DEVICE_CUDA, StoreParams, device_memory
from pyspice.units import Budget, format_bytes

# The emulated device when no --emulate-bandwidth/latency is given: a PCIe 4.0 x8
# link as seen by real copies (RTX 4060-class machines).
DEFAULT_EMULATED_GBPS = 12.0
DEFAULT_EMULATED_LATENCY_US = 10.0

# A real device measures its own copies; these only seed the store's guess of
# when a queued prefetch lands (PCIe 4.0 x16 as seen by pinned copies).
REAL_BUS_GUESS_GBPS = 25.0
REAL_BUS_GUESS_LATENCY_US = 10.0

# Device memory a real budget leaves free for ggml's own buffers (the
# executor's activations, the other layers' weights when offloaded).
REAL_DEVICE_MARGIN = 0.9


@dataclass(frozen=True)
class DeviceTier:
    """What a device budget turned into (printed once by the CLI)."""

    budget: str
    budget_bytes: int
    holds: int  # experts the budget holds: one slot each, as large as the largest expert
    experts: int
    expert_bytes: int  # a tier holding every expert (units.whole_tier_bytes): what 100% means
    bandwidth_gbps: float
    latency_us: float
    emulated: bool
    device_name: str = ""
    disk: bool = False  # edge mode: slots in RAM, experts read from the model file

    def describe(self) -> str:
        if self.disk:
            return (
                f"{self.device_name}: RAM budget {self.budget} = {format_bytes(self.budget_bytes)} of "
                f"{format_bytes(self.expert_bytes)} for every routed expert, {self.holds} of "
                f"{self.experts} experts; disk estimated at {self.bandwidth_gbps:g} GB/s + "
                f"{self.latency_us:g} us per read"
            )
        kind = "emulated device" if self.emulated else (self.device_name or "device")
        return (
            f"{kind}: budget {self.budget} = {format_bytes(self.budget_bytes)} of "
            f"{format_bytes(self.expert_bytes)} for every routed expert, "
            f"{self.holds} of {self.experts} experts"
            + (
                f", bus {self.bandwidth_gbps:g} GB/s + {self.latency_us:g} us per copy"
                if self.emulated
                else ""
            )
        )


def store_params(
    spec: Budget,
    whole_tier: int,
    *,
    real: bool,
    bandwidth_gbps: float | None,
    latency_us: float | None,
    manual_clock: bool,
    executor: int = 0,
    exec_fault_after: int = 0,
) -> StoreParams:
    """The store's parameters for a budget over `whole_tier` (units.whole_tier_bytes),
    after checking that the device (real) or this machine (emulated) can hold it."""
    budget_bytes = spec.resolve(whole_tier)
    if real:
        check_real_budget(spec, budget_bytes)
        return StoreParams(
            budget_bytes=budget_bytes,
            bandwidth_gbps=REAL_BUS_GUESS_GBPS,
            latency_us=REAL_BUS_GUESS_LATENCY_US,
            device_kind=DEVICE_CUDA,
            executor=executor,
            exec_fault_after=exec_fault_after,
        )
    check_emulated_budget(spec, budget_bytes, whole_tier)
    return StoreParams(
        budget_bytes=budget_bytes,
        bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else DEFAULT_EMULATED_GBPS,
        latency_us=latency_us if latency_us is not None else DEFAULT_EMULATED_LATENCY_US,
        manual_clock=manual_clock,
        executor=executor,
        exec_fault_after=exec_fault_after,
    )


def automatic_budget(whole_tier: int) -> int:
    """Bytes for a real device tier when none is given (docs/design.md section 11): the
    GPU's free memory now, less the margin ggml's buffers need, and never more
    than all routed experts."""
    free, _ = device_memory(0)
    return int(min(whole_tier, REAL_DEVICE_MARGIN * free))


def check_real_budget(spec: Budget, budget_bytes: int) -> None:
    """A real device's budget must fit its free memory, with room left for ggml."""
    free, total = device_memory(0)
    if budget_bytes > REAL_DEVICE_MARGIN * free:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} does not fit CUDA device 0: "
            f"{format_bytes(free)} of {format_bytes(total)} are free and "
            f"{1 - REAL_DEVICE_MARGIN:.0%} of that stays for ggml's buffers; give a smaller --device-budget"
        )


def check_emulated_budget(spec: Budget, budget_bytes: int, whole_tier: int) -> None:
    """The emulated device keeps its slots in host memory: a budget the machine
    cannot hold would end in swapping or the OOM killer mid-run, so refuse it now."""
    try:
        physical = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        physical = 0
    if physical and budget_bytes > physical:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} is more than this machine's "
            f"{format_bytes(physical)} of memory, which holds the emulated device; give a smaller "
            "--device-budget (e.g. 25%)"
        )
    need = min(budget_bytes, whole_tier)  # a budget above the model holds all of it
    free = host_memory_available()
    if free is not None and need > free:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} does not fit this machine: the emulated "
            f"device keeps {format_bytes(need)} of expert copies in host memory and only "
            f"{format_bytes(free)} is available; give a smaller --device-budget (e.g. 25%)"
        )
