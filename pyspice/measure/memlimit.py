"""Memory cgroups for `bench --memory-limit`: one per row, v1 or v2, whichever
has the memory controller on this machine.

A row's cgroup is made under the cgroup this process is in (its own share of
the hierarchy, never a sibling's): with v1, under this process's memory
cgroup; with v2, under its own cgroup when `memory` is enabled in that one's
cgroup.subtree_control, else under the root when it is enabled there (the
root alone may hold processes and delegate controllers at once). The child
joins through cgroup.procs (both versions have it; it moves the whole process,
where v1's `tasks` moves one thread). Swap is limited too where the kernel
offers it and the machine has swap, so the limit means RAM.

Every path is under `mounts`/`self_cgroup` as read from /proc, so the tests
give a fake root in a temporary directory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pyspice.engine.host_memory import mount_entries, own_cgroup_path

FIX = (
    "run as root on a machine with the cgroup memory controller (cgroup v1 with a 'memory' hierarchy "
    "mounted, or v2 with 'memory' in cgroup.subtree_control), or leave --memory-limit out"
)


# the shell of command_inside: $0 is cgroup.procs, "$@" the command
_JOIN = 'echo $$ > "$0" && exec "$@"'


class CgroupError(RuntimeError):
    """No memory cgroup can be made or used here; the message names the fix."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where rows' cgroups are made: `parent`, a directory of cgroup version 1 or 2."""

    version: int
    parent: Path


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def find_layout(mounts: str, self_cgroup: str) -> CgroupLayout:
    """The place for rows' memory cgroups, from /proc/mounts and /proc/self/cgroup text;
    CgroupError (naming the fix) where there is none this process can write to."""
    reasons = []
    for mount, fstype, opts in mount_entries(mounts):
        if fstype == "cgroup2":
            root = Path(mount)
            if "memory" not in _words(root / "cgroup.controllers"):
                reasons.append(f"cgroup v2 at {mount} has no memory controller")
                continue
            own = root / own_cgroup_path(self_cgroup, 2).lstrip("/")
            for parent in (own, root):
                if "memory" in _words(parent / "cgroup.subtree_control"):
                    return _writable(CgroupLayout(2, parent))
            reasons.append(
                f"cgroup v2 at {mount}: 'memory' is not in cgroup.subtree_control of {own} or {root}"
            )
        elif fstype == "cgroup" and "memory" in opts:
            parent = Path(mount) / own_cgroup_path(self_cgroup, 1).lstrip("/")
            if not parent.is_dir():
                reasons.append(f"this process's memory cgroup {parent} does not exist")
                continue
            return _writable(CgroupLayout(1, parent))
    found = "; ".join(reasons) if reasons else "no cgroup memory controller is mounted (/proc/mounts)"
    raise CgroupError(f"--memory-limit: cannot make a memory cgroup: {found}; {FIX}")


def _writable(layout: CgroupLayout) -> CgroupLayout:
    if not os.access(layout.parent, os.W_OK):
        raise CgroupError(
            f"--memory-limit: cannot make a memory cgroup: {layout.parent} is not writable "
            f"(uid {os.getuid()}); {FIX}"
        )
    return layout


def system_layout() -> CgroupLayout:
    """find_layout of this machine."""
    return find_layout(Path("/proc/mounts").read_text(), Path("/proc/self/cgroup").read_text())


def machine_has_swap() -> bool:
    for line in _lines(Path("/proc/meminfo")):
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) > 0
    return False


# file names by version: limit, peak, swap limit, where OOM kills are counted
_FILES = {
    1: (
        "memory.limit_in_bytes",
        "memory.max_usage_in_bytes",
        "memory.memsw.limit_in_bytes",
        "memory.oom_control",
    ),
    2: ("memory.max", "memory.peak", "memory.swap.max", "memory.events"),
}


class MemoryCgroup:
    """One row's memory cgroup with a limit of `limit` bytes, made on construction,
    removed by remove() (after its processes have exited)."""

    def __init__(self, layout: CgroupLayout, name: str, limit: int, limit_swap: bool | None = None) -> None:
        self.version = layout.version
        self.path = layout.parent / name
        self._limit_f, self._peak_f, self._swap_f, self._oom_f = _FILES[self.version]
        if self.path.exists():  # left by a run that was killed: empty, or rmdir says why not
            self.path.rmdir()
        try:
            self.path.mkdir()
            self._write(self._limit_f, str(limit))
            # memory+swap may not be below memory (v1); v2's swap.max is swap alone. Only
            # where there is swap: on Linux 6.18 with v1, a memsw limit left both
            # failcnt files at 0 on a row that met its limit all along
            swap = self.path / self._swap_f
            if swap.exists() and (limit_swap if limit_swap is not None else machine_has_swap()):
                self._write(self._swap_f, str(limit) if self.version == 1 else "0")
        except OSError as exc:
            self.remove()
            raise CgroupError(
                f"--memory-limit: cannot set up the memory cgroup {self.path}: {exc}; {FIX}"
            ) from None
        self.limit = self.read_limit()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value + "\n")

    @property
    def procs_file(self) -> Path:
        """Write a process id here to move that process into this cgroup."""
        return self.path / "cgroup.procs"

    def command_inside(self, argv: list[str]) -> list[str]:
        """`argv` as a command that joins this cgroup before it runs anything: a shell
        writes its own pid to cgroup.procs, then execs argv (so every page the command
        touches is charged here, from its first)."""
        return ["/bin/sh", "-c", _JOIN, str(self.procs_file), *argv]

    def read_limit(self) -> int:
        """The limit as the kernel holds it (v1 rounds down to whole pages)."""
        text = (self.path / self._limit_f).read_text().strip()
        return -1 if text == "max" else int(text)

    def peak(self) -> int | None:
        """Highest usage since the cgroup was made, page cache included (None: the
        kernel has no peak file, v2 before Linux 5.19)."""
        try:
            return int((self.path / self._peak_f).read_text().strip())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this cgroup (v1: memory.oom_control's
        oom_kill line, Linux 4.13 and later; v2: memory.events)."""
        for line in _lines(self.path / self._oom_f):
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def limit_hits(self) -> int:
        """Times usage reached the limit and reclaim ran (v1 memory.failcnt plus
        memory.memsw.failcnt; v2 the `max` count of memory.events)."""
        if self.version == 1:
            # memory+swap is charged first: where it is limited too, it is the one that fails
            counts = [_lines(self.path / f) for f in ("memory.failcnt", "memory.memsw.failcnt")]
            return sum(int(lines[0]) for lines in counts if lines)
        for line in _lines(self.path / "memory.events"):
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
        return 0

    def remove(self) -> None:
        """rmdir, retried briefly: a process that has just been reaped can still be
        leaving the cgroup."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        self.path.rmdir()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []
