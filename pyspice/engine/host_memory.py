"""How much memory this process may use, and what that means for how a MoE should run.

A model larger than the memory it may use runs from llama.cpp's mmap with the
page cache re-reading its weights at every token; edge mode (`--ram-budget`)
keeps the routed experts in the file and reads the ones a token needs. The
other way round, a model that fits runs faster from RAM: edge mode reads every
missed expert from disk (on smolmoe-b it decoded at 0.5x upstream's speed with
the file in RAM, docs/results/edge-mode.md). `memory_advice` says which
case a run is in, once, before the model loads.

"The memory it may use" is the kernel's MemAvailable (free memory plus the page
cache it can reclaim), or this process's memory cgroup limit where that is
smaller (a container, or a row of `bench --memory-limit`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from pyspice.units import format_bytes

# the share of the memory available a suggested RAM budget plans to fill with the
# model's weights and pool: the rest is the KV cache, buffers and the process itself
ADVICE_USABLE = 0.8
# and what the Python process running it holds besides the model (pyspice's floor row:
# ~110 MiB anonymous on smolmoe-b, docs/results/edge-mode.md)
PROCESS_BYTES = 128 << 20
CGROUP_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as a page-rounded 2^63 - 1


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (None: unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return None


def mount_entries(mounts: str) -> list[tuple[str, str, list[str]]]:
    """(mount point, file system type, options) of each /proc/mounts line."""
    entries = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            entries.append((fields[1], fields[2], fields[3].split(",")))
    return entries


def own_cgroup_path(self_cgroup: str, version: int) -> str:
    """This process's cgroup path in the v1 memory hierarchy or the v2 one (/proc/self/cgroup)."""
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if version == 2 and hier == "0" and controllers == "":
            return path
        if version == 1 and "memory" in controllers.split(","):
            return path
    return "/"


def cgroup_memory_limit(mounts: str, self_cgroup: str) -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, v1 memory.limit_in_bytes),
    None where there is none or it cannot be read."""
    for mount, fstype, opts in mount_entries(mounts):
        if fstype == "cgroup2":
            limit_file = Path(mount) / own_cgroup_path(self_cgroup, 2).lstrip("/") / "memory.max"
        elif fstype == "cgroup" and "memory" in opts:
            limit_file = Path(mount) / own_cgroup_path(self_cgroup, 1).lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < CGROUP_V1_UNLIMITED:
            return int(text)
    return None


def memory_for_this_process() -> int | None:
    """MemAvailable, or this process's cgroup limit where smaller (None: unknown)."""
    available = host_memory_available()
    try:
        limit = cgroup_memory_limit(Path("/proc/mounts").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError:
        limit = None
    known = [m for m in (available, limit) if m is not None]
    return min(known) if known else None


def memory_advice(
    name: str, file_bytes: int, routed_bytes: int, available: int | None, ram_budget_given: bool
) -> str | None:
    """One line for a MoE run whose memory does not suit how it was asked to run: a model
    larger than `available` without --ram-budget (with the budget that would fit), or one
    that fits twice over with it. None otherwise, or when `available` is unknown."""
    if available is None or routed_bytes <= 0:
        return None
    size, room_text = format_bytes(file_bytes), format_bytes(available)
    if not ram_budget_given and file_bytes > available:
        rest = file_bytes - routed_bytes
        room = int(ADVICE_USABLE * available) - rest - PROCESS_BYTES
        if room < routed_bytes // 100:
            return (
                f"warning: {name} is {size}, more than the {room_text} of memory this process may use, "
                f"and its {format_bytes(rest)} of weights other than the routed experts, with the "
                "process itself, leave no room for them: llama.cpp will read weights back from disk "
                "at every token"
            )
        share = max(1, min(90, 100 * room // routed_bytes))
        return (
            f"warning: {name} is {size}, more than the {room_text} of memory this process may use: "
            "llama.cpp will read its weights back from disk at every token as the page cache drops "
            f"them; --ram-budget {share}% keeps the routed experts in the file and reads those a token "
            f"needs into a {format_bytes(share * routed_bytes // 100)} RAM pool (README.md, Running a "
            "model larger than RAM)"
        )
    if ram_budget_given and 2 * file_bytes <= available:
        return (
            f"{name} ({size}) fits in the {room_text} of memory this process may use: without "
            "--ram-budget every expert stays in RAM, which is faster than reading missed ones from disk"
        )
    return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing
    elsewhere). Setting up a policy frees many arrays of tens of KiB (the draft
    predictor composes its maps a layer at a time in float64): glibc keeps such
    blocks in its heap once a larger one has been freed (its mmap threshold rises),
    so they stayed resident, 5.7 MiB after `spice:exact` attached on smolmoe-b,
    counted against edge mode's memory limit."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
