"""Recorded `pyspice bench --json` runs, read for the simulator to fit and predict.

A bench record file holds one JSON document per line, one per bench run: the
run's settings (model, prompt, tokens decoded, threads, the routing it
replayed) and one entry per row with its TPOT and the engine's counters, per
call and per layer. `sim fit` reads the counters; `sim --predict` replays the
run and sets its prediction beside each row's TPOT.

A record says how large its device tier was (`device_bytes.slots`) but not as
a budget: the budget is that many bytes over the whole tier of the target the
run's model has (the rows of docs/results/gpu-h200-*.json come out at 25% and
50% exactly).

Rows are named by their label (pyspice.policy.rows), and read back through the
same grammar: `spice:exact@async` is the row that ran as `spice:exact@plan=async`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspice.policy.rows import PolicyRow, parse_row

UPSTREAM_PREFIX = "upstream"  # llama.cpp's own rows (bench's UPSTREAM_ROWS): no hook, no counters


@dataclass(frozen=True)
class LayerCounters:
    """One MoE layer's decode counters of a row: per hook call unless said."""

    layer: int
    hook_calls: int
    host_per_call: float  # activations run on the host (misses)
    fetched_per_call: float  # activations fetched on demand
    hit_rate: float
    per_call: Mapping[str, float]  # the engine's per-call record (stats._per_call_record)


@dataclass(frozen=True)
class RecordedRow:
    name: str
    tpot_ms: float
    hooked: bool  # went through the hook (not stock, not a llama.cpp row)
    tokens: tuple[int, ...] = ()  # what the row decoded
    hit_rate: float = 0.0  # decode
    activations_per_call: float = 0.0
    policy_us: float = 0.0  # deciding, per decode hook call
    per_call: Mapping[str, float] = field(default_factory=dict)  # decode calls
    layers: tuple[LayerCounters, ...] = ()
    slots_bytes: int | None = None  # the device tier's slots (None: no tier)
    bytes_per_token: float = 0.0
    stall_ms_per_token: float = 0.0
    prefetch_issued: int = 0
    prompt_hooked: bool = False  # the prompt's batches went through the hook too
    asynchronous: bool = False  # planned on the planner thread

    @property
    def copies_per_call(self) -> float:
        return float(self.per_call.get("copies", 0.0))

    @property
    def policy_row(self) -> PolicyRow | None:
        """The row its name is (None: llama.cpp's own, or a name the grammar refuses,
        which recorded_row says why of)."""
        if self.name.startswith(UPSTREAM_PREFIX):
            return None
        try:
            return recorded_row(self.name)
        except ValueError:
            return None


def optional_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def recorded_row(name: str) -> PolicyRow:
    """A recorded row's name parsed by the row grammar; a ValueError saying why not."""
    return parse_row(name)


@dataclass(frozen=True)
class RecordedRun:
    source: str  # FILE:LINE
    model: str
    prompt_tokens: int
    n_predict: int
    threads: int
    replay_routing: str | None  # the trace the run replayed (None: the model's own routing)
    rows: Mapping[str, RecordedRow]
    # the trace token its decode replayed first (None: not replayed, or a record from before
    # bench kept it: engine/replay.py's rule gives it)
    replay_decode_start: int | None = None
    # the tier as bench sized it (engine.device.DeviceTier's fields; None: none, or a record
    # from before bench kept it) and the cost profile its policies read
    tier: Mapping[str, Any] | None = None
    cost_profile: str | None = None
    # how each llama.cpp row placed the weights (bench's llama_cpp_rows: n_gpu_layers,
    # overrides, n_cpu_moe, gpu_expert_layers, expert_layers, matched_bytes, skipped)
    llama_cpp: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def stock(self) -> RecordedRow | None:
        return self.rows.get("stock")


def _row(name: str, doc: Mapping[str, Any], n_predict: int) -> RecordedRow:
    tpot = float(doc.get("tpot_ms") or 0.0)
    hooked = int(doc.get("hook_calls") or 0) > 0
    tokens = tuple(int(t) for t in doc.get("tokens") or ())
    if not hooked:
        return RecordedRow(name, tpot, hooked=False, tokens=tokens)
    layers = []
    for key, layer in sorted((doc.get("layers") or {}).items(), key=lambda kv: int(kv[0])):
        n = int(layer.get("hook_calls") or 0)
        if n == 0:
            continue
        misses = layer.get("misses") or {}
        layers.append(
            LayerCounters(
                layer=int(key),
                hook_calls=n,
                host_per_call=float(misses.get("host", 0)) / n,
                fetched_per_call=float(misses.get("fetched", 0)) / n,
                hit_rate=float(layer.get("hit_rate") or 0.0),
                per_call={k: float(v) for k, v in (layer.get("per_call") or {}).items()},
            )
        )
    device = doc.get("device_bytes") or {}
    slots = device.get("slots")
    return RecordedRow(
        name,
        tpot,
        hooked=True,
        tokens=tokens,
        hit_rate=float(doc.get("decode_hit_rate", doc.get("hit_rate")) or 0.0),
        activations_per_call=float(doc.get("activations") or 0) / max(1, int(doc["hook_calls"])),
        policy_us=float(doc.get("policy_us_per_decode_call", doc.get("policy_us_per_call")) or 0.0),
        per_call={k: float(v) for k, v in (doc.get("per_call_decode") or doc.get("per_call") or {}).items()},
        layers=tuple(layers),
        slots_bytes=int(slots) if isinstance(slots, int) and slots > 0 else None,
        bytes_per_token=float(doc.get("bytes_per_token") or 0.0),
        stall_ms_per_token=float(doc.get("stall_ms_per_token") or 0.0),
        prefetch_issued=int(doc.get("prefetch_issued") or 0),
        asynchronous=bool((doc.get("planning") or {}).get("asynchronous")),
        # a layer's calls are the decode steps alone (the first token comes from the
        # prompt) unless the prompt's batches were hooked too
        prompt_hooked=max((x.hook_calls for x in layers), default=0) > max(0, n_predict - 1),
    )


def read_records(path: Path) -> list[RecordedRun]:
    """Every bench run in a record file (one JSON document per line; a file holding one
    indented document is read as one run)."""
    text = path.read_text()
    try:
        docs = [(1, json.loads(text))]
    except json.JSONDecodeError:
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append((i, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{i}: not a JSON document ({err.msg}); is this a bench --json record?"
                ) from None
    runs = []
    for lineno, doc in docs:
        if not isinstance(doc, dict) or not isinstance(doc.get("policies"), dict):
            raise ValueError(f"{path}:{lineno}: no 'policies' object: not a `pyspice bench --json` record")
        n_predict = int(doc.get("n_predict") or 0)
        runs.append(
            RecordedRun(
                source=f"{path}:{lineno}",
                model=str(doc.get("model", "")),
                prompt_tokens=int(doc.get("prompt_tokens") or 0),
                n_predict=n_predict,
                threads=int(doc.get("threads") or 0),
                replay_routing=doc.get("replay_routing"),
                replay_decode_start=optional_int(doc.get("replay_decode_start")),
                rows={name: _row(name, row, n_predict) for name, row in doc["policies"].items()},
                tier=doc.get("tier") if isinstance(doc.get("tier"), dict) else None,
                cost_profile=doc.get("cost_profile"),
                llama_cpp={
                    str(name): placement
                    for name, placement in (doc.get("llama_cpp_rows") or {}).items()
                    if isinstance(placement, dict)
                },
            )
        )
    return runs


def split_record_spec(spec: str) -> tuple[Path, set[int] | None]:
    """`FILE` -> (FILE, None: every run); `FILE:N[,N...]` -> (FILE, those runs' numbers,
    the N of each run's FILE:N source)."""
    name, sep, lines = spec.rpartition(":")
    if sep and lines.replace(",", "").isdigit() and Path(name).is_file():
        return Path(name), {int(x) for x in lines.split(",") if x}
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{spec}: no such record file (give FILE or FILE:LINE of `pyspice bench --json`)")
    return path, None


def select_runs(paths: list[str]) -> list[RecordedRun]:
    """`FILE` (every run in it) or `FILE:LINE[,LINE...]` (those lines) -> the runs."""
    out: list[RecordedRun] = []
    for spec in paths:
        path, wanted = split_record_spec(spec)
        runs = read_records(path)
        if wanted is not None:
            runs = [r for r in runs if int(r.source.rpartition(":")[2]) in wanted]
            missing = wanted - {int(r.source.rpartition(":")[2]) for r in runs}
            if missing:
                raise ValueError(f"{path} has no bench run on line(s) {', '.join(map(str, sorted(missing)))}")
        out.extend(runs)
    return out
