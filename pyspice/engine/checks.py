"""The numeric settings of a run, each checked by one rule before anything loads.

RunConfig (CLI, scripts, `Llama.from_config`) and Engine.set_device (the API)
call these at their entry points, so a bad value fails in one line naming
the setting, its flag and what is allowed, instead of reaching libspice
(`set_device: invalid argument`), llama.cpp (`Failed to create llama_context`)
or a cffi cast (`OverflowError: can't convert negative number to unsigned`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from pyspice.runtime.constants import EXECUTORS

Note = Callable[[str], None]


def check_at_least(name: str, value: int | None, minimum: int, hint: str = "") -> None:
    """An integer setting of at least `minimum` (None: the default, always fine)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} {value}: must be at least {minimum}" + (f" ({hint})" if hint else ""))


def check_threads(threads: int | None) -> None:
    check_at_least("-t/--threads", threads, 1, "leave it out to use every core")


def warn_threads_above_cores(threads: int, note: Note) -> None:
    """More threads than cores runs as asked, but each decode step then waits on
    oversubscribed cores (2 cores, -t 256: 66 s for 4 tokens): say so once."""
    cores = os.cpu_count() or 1
    if threads > cores:
        note(
            f"warning: -t {threads} is more threads than this machine's {cores} cores; "
            f"running as asked, but -t {cores} or fewer is faster"
        )


def check_bus(bandwidth_gbps: float | None, latency_us: float | None) -> None:
    """An emulated bus: a finite bandwidth above 0 GB/s, a finite latency of 0 us or more."""
    if bandwidth_gbps is not None and not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ValueError(
            f"--emulate-bandwidth {bandwidth_gbps}: must be a number of GB/s above 0 "
            "(PCIe 4.0 x16 is about 25)"
        )
    if latency_us is not None and not (math.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"--emulate-latency {latency_us}: must be a number of microseconds, 0 or more")


def check_executor(executor: str) -> None:
    """A device executor by name: auto, pool or legacy."""
    if executor not in EXECUTORS:
        raise ValueError(
            f"--device-executor {executor!r}: must be one of {', '.join(EXECUTORS)} "
            "(pool: the slot-pool graph; legacy: one graph per expert, CUDA only)"
        )


def check_budget_value(budget: str | int | float | None, what: str = "device budget") -> None:
    """A budget given as a number is whole bytes, at least 1 (a share is the string "25%")."""
    if budget is None or isinstance(budget, str):
        return
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{what} {budget!r}: give bytes as an integer, or a string such as '2GiB' or '25%'")
    check_at_least(what, budget, 1, "bytes; or a string such as '2GiB' or '25%'")


def check_ram_budget_settings(
    ram_budget: str | int | None,
    *,
    device_budget: object = None,
    policy: object = None,
    max_hook_tokens: int | None = 0,
    use_mlock: bool = False,
) -> None:
    """Edge mode's rules, one function for every door (RunConfig, Llama, a policy
    switch): one tier at a time (GPU + RAM + disk is a later step), every
    micro-batch through the hook, since upstream's path has no copy of the experts
    in memory to read, and no mlock, which would pull the mapped experts into RAM.
    Nothing to check without a RAM budget."""
    if ram_budget is None:
        return
    check_budget_value(ram_budget, "--ram-budget")
    if device_budget is not None:
        raise ValueError(
            "--ram-budget and --device-budget cannot be combined yet (a GPU tier over a RAM tier over "
            "the disk is a later step): give one of them"
        )
    if policy == "stock":
        raise ValueError(
            "policy 'stock' leaves the hook off, and with --ram-budget the routed experts are not in "
            "memory for upstream's path: use --policy exact (the bench's 'upstream' row runs plain "
            "llama.cpp from its mmap)"
        )
    if max_hook_tokens not in (0, None):
        raise ValueError(
            "--ram-budget sends every micro-batch through the hook (the experts are not in memory "
            "for upstream's path): leave --max-hook-tokens at 0"
        )
    if use_mlock:
        raise ValueError(
            "--mlock (use_mlock) would lock every mapped page, the routed experts' too, and with "
            "--ram-budget they stay in the file: leave --mlock off"
        )
