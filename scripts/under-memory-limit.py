#!/usr/bin/env python3
"""Run one command inside a memory cgroup of its own, as `bench --memory-limit`
runs each row, and say how it fared: cgroup peak, times it hit the limit, OOM kills.

For measurements other than bench's under a memory limit, e.g. the lossy levels'
perplexity in edge mode (eval ppl holds every position's logits, ~190 MiB
more than a decode, so its limit is the rule applied to the eval process itself:
docs/results/edge-mode.md):

    .venv/bin/python scripts/under-memory-limit.py 433MiB --drop ~/.cache/pyspice/models/X.gguf -- \\
        .venv/bin/python -m pyspice eval ppl -m smolmoe-b -f text.txt --token-by-token ...

--drop FILE (repeatable) drops each file's pages from the page cache first, so the
command starts cold as a bench row does. The command's exit status is this
script's; the report goes to stderr. Needs root and a memory controller
(pyspice.measure.memlimit says which).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pyspice.cli.bench_limited import parse_memory_limit
from pyspice.measure.memlimit import CgroupError, MemoryCgroup, system_layout
from pyspice.measure.pagecache import drop
from pyspice.units import format_bytes


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("under-memory-limit: give the command after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("limit", help="bytes, or with a unit: 228MiB, 2GiB")
    ap.add_argument(
        "--drop", action="append", default=[], type=Path, help="drop this file's cached pages first"
    )
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        ap.error("give the command after --")
    limit = parse_memory_limit(args.limit)
    if not isinstance(limit, int):
        ap.error(f"the limit must be a size here, not {limit!r}")
    for path in args.drop:
        drop(path.expanduser())
    try:
        cgroup = MemoryCgroup(system_layout(), f"pyspice-under-limit-{os.getpid()}", limit)
    except CgroupError as exc:
        print(f"under-memory-limit: {exc}", file=sys.stderr)
        return 2
    try:
        rc = subprocess.call(cgroup.command_inside(command))
        peak = cgroup.peak()
        print(
            f"under-memory-limit: limit {format_bytes(cgroup.limit)}, "
            f"peak {format_bytes(peak) if peak is not None else 'unknown'}, "
            f"limit reached {cgroup.limit_hits()} times, OOM kills {cgroup.oom_kills()}, exit {rc}",
            file=sys.stderr,
        )
        return rc
    finally:
        cgroup.remove()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
