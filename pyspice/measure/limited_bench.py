"""`bench --memory-limit`: every row in a child process of its own (isolated_row.py),
in a memory cgroup of its own with the same limit (memlimit.py), after the
model's pages are dropped from the page cache (pagecache.py).

Rows run one after the other, never beside each other, so that one row's page
cache is not another's. The parent holds no mapping of the model while a row
runs (the prompt is tokenized from the vocabulary alone, before any row).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspice.measure.isolated_row import RowSpec
from pyspice.measure.memlimit import CgroupLayout, MemoryCgroup
from pyspice.measure.pagecache import drop, resident_bytes


@dataclass
class RowOutcome:
    """What one row's child reported, and how it ended."""

    spec: RowSpec
    status: str = "ok"  # ok | oom-killed | error | crashed
    message: str = ""
    load: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    returncode: int = 0
    cgroup_peak: int | None = None
    cgroup_limit: int = 0
    oom_kills: int = 0
    limit_hits: int = 0
    cached_before: int = 0  # the model's bytes still in the page cache after the drop
    vm_hwm: int = 0

    @property
    def cold(self) -> dict[str, Any] | None:
        return self.runs[0] if self.runs else None

    @property
    def warm(self) -> list[dict[str, Any]]:
        return self.runs[1:]

    @property
    def tokens(self) -> list[int]:
        return self.runs[0]["tokens"] if self.runs else []

    @property
    def tokens_consistent(self) -> bool:
        return all(r["tokens"] == self.tokens for r in self.runs)

    @property
    def timing_only(self) -> bool:
        """The row replayed recorded routing: its outputs are not the model's."""
        return bool(self.spec.config.get("replay_routing"))

    @property
    def auto(self) -> dict[str, Any] | None:
        """What an `auto` row chose (simulated), as its child reported it at load."""
        choice = self.load.get("auto")
        return choice if isinstance(choice, dict) else None


def tokenize(model: Path, text: str) -> list[int]:
    """The prompt's tokens (with BOS, as pyspice.Llama.tokenize gives them) from the
    model's vocabulary alone: no weights are mapped or read."""
    import llama_cpp
    from llama_cpp._internals import LlamaModel

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    vocab = LlamaModel(path_model=str(model), params=params, verbose=False)
    try:
        return list(vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False))
    finally:
        vocab.close()  # type: ignore[no-untyped-call]


def run_row(spec: RowSpec, cgroup: MemoryCgroup) -> RowOutcome:
    """Start the row's child inside `cgroup`, read its reports until it ends, classify."""
    outcome = RowOutcome(spec, cgroup_limit=cgroup.limit)
    read_fd, write_fd = os.pipe()
    cmd = cgroup.command_inside([sys.executable, "-m", "pyspice.measure.isolated_row"])
    try:
        proc = subprocess.Popen(
            [*cmd, str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=sys.stderr,  # the parent's stdout is the table or the JSON
            pass_fds=(write_fd,),
            text=True,
        )
    finally:
        os.close(write_fd)
    assert proc.stdin is not None
    try:
        proc.stdin.write(spec.to_json())
        proc.stdin.close()
    except BrokenPipeError:  # the child died before reading: its exit status says why
        pass
    stage = "before it started"  # where the child was when it last reported
    with os.fdopen(read_fd, "r") as reports:
        for line in reports:
            event = json.loads(line)
            kind = event.pop("event")
            if kind == "start":
                stage = "while loading the model"
            elif kind == "load":
                outcome.load = event
                stage = "in the cold run"
            elif kind == "run":
                outcome.runs.append(event)
                stage = f"in warm run {len(outcome.runs)}"
            elif kind == "done":
                outcome.vm_hwm = int(event["vm_hwm"])
            elif kind == "error":
                outcome.status, outcome.message = "error", str(event["message"])
    outcome.returncode = proc.wait()
    outcome.cgroup_peak = cgroup.peak()
    outcome.oom_kills = cgroup.oom_kills()
    outcome.limit_hits = cgroup.limit_hits()
    if not outcome.vm_hwm:  # ended early: the last report's
        outcome.vm_hwm = int((outcome.runs[-1] if outcome.runs else outcome.load).get("vm_hwm", 0))
    if outcome.oom_kills and outcome.returncode != 0:
        outcome.status = "oom-killed"
        outcome.message = f"killed by the OOM killer under the {cgroup.limit}-byte limit {stage}"
    elif outcome.returncode != 0 and outcome.status == "ok":
        outcome.status = "crashed"
        rc = outcome.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        outcome.message = f"{how} {stage}"
    return outcome


def run_limited_bench(
    specs: Sequence[RowSpec],
    layout: CgroupLayout,
    limit: int,
    files: Sequence[Path],
    progress: Callable[[str], None] | None = None,
) -> list[RowOutcome]:
    """Each row in turn: drop `files` (the model, its sidecar) from the page cache,
    make a cgroup with `limit`, run the row in it, remove the cgroup."""
    outcomes = []
    for i, spec in enumerate(specs):
        for path in files:
            drop(path)
        cached = sum(resident_bytes(p) for p in files)
        cgroup = MemoryCgroup(layout, f"pyspice-bench-{os.getpid()}-{i}", limit)
        try:
            if progress:
                progress(
                    f"row {spec.row}: cgroup v{layout.version} {cgroup.path}, limit {cgroup.limit} bytes"
                )
            outcome = run_row(spec, cgroup)
        finally:
            cgroup.remove()
        outcome.cached_before = cached
        if progress:
            progress(
                f"row {spec.row}: {outcome.status}" + (f" ({outcome.message})" if outcome.message else "")
            )
        outcomes.append(outcome)
    return outcomes
