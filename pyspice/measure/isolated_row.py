"""One row of `bench --memory-limit` in a child process of its own, inside a memory
cgroup (memlimit.py), so that each row's limit, peak and page faults are its own.

The parent starts `python -m pyspice.measure.isolated_row FD` through /bin/sh,
which first writes its own pid into the cgroup's cgroup.procs, so the child is
limited from its first instruction. The row's RowSpec comes as JSON on stdin;
the child reports on file descriptor FD, one JSON object a line, as it goes:
`start`, `load` once the model is loaded, `run` after each run (the first is the cold
start: the parent dropped the model's pages from the page cache just before;
the next ones are warm: same process, nothing dropped), then `done`, or
`error` with the message of an exception. A row the OOM killer ends just stops
reporting: the parent reads what came and the cgroup's OOM count.

Each run's bytes come from /proc/self/io, for the prefill and the decode
separately: read_bytes (what the process made the block layer fetch,
page faults of an mmap included) and rchar (bytes returned by read() calls,
from the cache or not); beside them, the tier's own counter when its stats
record has one (DISK_COUNTER).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import IO, Any

UPSTREAM = "upstream"
# the disk tier's own count of bytes read, in a pyspice row's stats record
DISK_COUNTER = "disk_read_bytes"
_PATH_FIELDS = ("model", "sidecar")  # RunConfig fields that are paths


@dataclass(frozen=True)
class RowSpec:
    """What a child runs: `policy` ("upstream": plain llama_cpp.Llama with mmap on,
    as upstream users run it; else a pyspice policy) on the model of `config` (the
    fields of a pyspice RunConfig, as JSON), `runs` times on the same prompt."""

    row: str
    policy: str
    config: dict[str, Any]
    prompt_tokens: list[int]
    n_predict: int
    runs: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> RowSpec:
        return RowSpec(**json.loads(text))


def config_fields(config: Any) -> dict[str, Any]:
    """A RunConfig as JSON-able fields (paths as strings)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, Path):
            value = str(value)
        elif is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)  # e.g. RunConfig.planning
        out[f.name] = value
    return out


def run_config(spec: RowSpec) -> Any:
    from pyspice.engine.config import RunConfig
    from pyspice.engine.planning import Planning

    values = dict(spec.config)
    for name in _PATH_FIELDS:
        if values.get(name) is not None:
            values[name] = Path(values[name])
    if isinstance(values.get("planning"), dict):
        values["planning"] = Planning(**values["planning"])
    return RunConfig(**values)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (every thread's, living or ended)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def peak_rss() -> int:
    """VmHWM of /proc/self/status, in bytes: the highest resident set so far."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in ("read_bytes", "rchar")}


@dataclass
class _Phase:
    seconds: float = 0.0
    io: dict[str, int] = field(default_factory=dict)
    tier_bytes: int | None = None


def _tier_bytes(llm: Any) -> int | None:
    if not hasattr(llm, "spice_stats"):
        return None
    value = llm.spice_stats().get(DISK_COUNTER)
    return int(value) if value is not None else None


def _timed_eval(llm: Any, tokens: list[int], phase: _Phase) -> None:
    start = time.perf_counter()
    llm.eval(tokens)
    phase.seconds += time.perf_counter() - start


def run_once(llm: Any, spec: RowSpec) -> dict[str, Any]:
    """One run: the prompt, then n_predict greedy tokens (the first from the prompt's
    logits), with each phase's wall time of eval alone and its bytes."""
    from pyspice.engine.decode_trace import greedy_next

    spice = hasattr(llm, "spice_reset_stats")
    llm.reset()
    if spice:
        llm.spice_reset_stats()
    prefill, decode = _Phase(), _Phase()
    if spice:  # every row and repeat replays the same routing, as the in-process bench does
        llm.spice_engine.replay_prompt()
    io0 = proc_io()
    _timed_eval(llm, list(spec.prompt_tokens), prefill)
    io1 = proc_io()
    if spice:
        llm.spice_engine.replay_decode(len(spec.prompt_tokens))
    tier1 = _tier_bytes(llm)
    tokens = [greedy_next(llm)]
    for _ in range(spec.n_predict - 1):
        _timed_eval(llm, [tokens[-1]], decode)
        tokens.append(greedy_next(llm))
    io2 = proc_io()
    tier2 = _tier_bytes(llm)
    prefill.io, decode.io = _io_delta(io0, io1), _io_delta(io1, io2)
    if tier1 is not None and tier2 is not None:
        prefill.tier_bytes, decode.tier_bytes = tier1, tier2 - tier1
    steps = max(1, spec.n_predict - 1)
    out: dict[str, Any] = {
        "prefill_tps": len(spec.prompt_tokens) / prefill.seconds if prefill.seconds else 0.0,
        "tpot_ms": decode.seconds * 1e3 / steps,
        "prefill_io": prefill.io,
        "decode_io": decode.io,
        "read_bytes_per_token": decode.io["read_bytes"] / steps,
        "rchar_per_token": decode.io["rchar"] / steps,
        "tier_bytes_per_token": None if decode.tier_bytes is None else decode.tier_bytes / steps,
        "prefill_tier_bytes": prefill.tier_bytes,
        "tokens": tokens,
        "vm_hwm": peak_rss(),
    }
    if spice:
        stats = llm.spice_stats()
        out["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, dict))}
    return out


def load(spec: RowSpec) -> Any:
    """The row's model: plain llama_cpp.Llama (mmap on, upstream's defaults) for
    `upstream`, else pyspice.Llama of the row's RunConfig."""
    config = run_config(spec)
    if spec.policy == UPSTREAM:
        # lazy: llama_cpp loads libllama on import. PlainLlama is llama_cpp.Llama with
        # llama.cpp's load reasons in its errors (no overrides given: nothing else differs)
        from pyspice.engine.plain_llama import PlainLlama

        run = config.resolve()
        return PlainLlama(str(run.model), **run.context_params(), use_mmap=True, verbose=False)
    from pyspice.api import Llama

    return Llama.from_config(config, note=lambda message: print(f"pyspice: {message}", file=sys.stderr))


def child(spec: RowSpec, out: IO[str]) -> int:
    def emit(event: str, **values: Any) -> None:
        out.write(json.dumps({"event": event, **values}) + "\n")
        out.flush()

    try:
        emit("start", vm_hwm=peak_rss())
        io0, start = proc_io(), time.perf_counter()
        llm = load(spec)
        loaded: dict[str, Any] = {"seconds": time.perf_counter() - start, "io": _io_delta(io0, proc_io())}
        choice = llm.spice_auto_choice if spec.policy != UPSTREAM else None
        if choice is not None:  # what `auto` chose, and every candidate's simulated TPOT
            loaded["auto"] = choice.record()
        emit("load", **loaded, vm_hwm=peak_rss())
        for i in range(spec.runs):
            emit("run", index=i, cold=i == 0, **run_once(llm, spec))
        llm.close()
        emit("done", vm_hwm=peak_rss())
        return 0
    except Exception as exc:  # reported to the parent, which says which row failed
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m pyspice.measure.isolated_row FD  (a RowSpec as JSON on stdin)", file=sys.stderr
        )
        return 2
    spec = RowSpec.from_json(sys.stdin.read())
    with os.fdopen(int(argv[1]), "w") as out:
        return child(spec, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
