"""Edge mode's tier: routed experts stay in the GGUF file, resident ones live in a
RAM slot pool of `--ram-budget` bytes, and copies are reads of the file.

How the model is loaded so llama.cpp never reads the experts: patch 0003 adds
LLAMA_LAZY_MODE_EXPERTS, which maps the stacked routed-expert tensors from the
file without reading them (upstream's lazy tensors, extended to experts, and kept
out of the mapping's MAP_POPULATE / WILLNEED); every other weight stays mmap'd as
upstream runs it, so under a memory limit the kernel can reclaim those pages as it
does for stock llama.cpp. libspice then reads experts itself (O_DIRECT,
spice-device-disk.c) into its slot pool, and a host action on an absent expert
reads it into a scratch buffer for that call: the mapping is never read.
"""

from __future__ import annotations

from pathlib import Path

from pyspice.engine.host_memory import host_memory_available
from pyspice.runtime import DEVICE_DISK, StoreParams
from pyspice.units import Budget, format_bytes

# llama.cpp's enum value patch 0003 adds (include/llama.h, enum llama_lazy_mode)
LLAMA_LAZY_MODE_EXPERTS = 3

# What a disk tier assumes before `pyspice probe` has measured the disk: a
# SATA/NVMe-class SSD as this project's machines see it (about 1 GB/s
# sequential, ~116 us per random 64 KiB direct read). Only policies' estimates
# of when a read lands use them; the reads themselves take what they take.
DEFAULT_DISK_GBPS = 1.0
DEFAULT_DISK_LATENCY_US = 116.0


def disk_store_params(
    spec: Budget,
    whole_tier: int,
    model_path: Path,
    *,
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
    io_threads: int = 0,
    io_fault_after: int = 0,
    manual_clock: bool = False,
) -> StoreParams:
    """The store's parameters for a RAM budget over `whole_tier` (units.whole_tier_bytes)
    with experts read from `model_path`, after checking this machine can hold it."""
    budget_bytes = spec.resolve(whole_tier)
    need = min(budget_bytes, whole_tier)  # a budget above the model holds all of it
    free = host_memory_available()
    if free is not None and need > free:
        raise ValueError(
            f"RAM budget {spec} = {format_bytes(budget_bytes)} does not fit this machine: the slot pool "
            f"would hold {format_bytes(need)} of experts and only {format_bytes(free)} is available; "
            "give a smaller --ram-budget (e.g. 25%)"
        )
    return StoreParams(
        budget_bytes=budget_bytes,
        bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else DEFAULT_DISK_GBPS,
        latency_us=latency_us if latency_us is not None else DEFAULT_DISK_LATENCY_US,
        manual_clock=manual_clock,
        device_kind=DEVICE_DISK,
        path=str(model_path),
        io_threads=io_threads,
        io_fault_after=io_fault_after,
    )
