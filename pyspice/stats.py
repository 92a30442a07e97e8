"""The one stats record (docs/design.md section 11), built from raw counters.

The native runtime counts events (hook calls, activations, hits, misses by
outcome, bytes, nanoseconds); the API measures wall time of prefill and
decode. This module turns both into the record every surface prints
(`generate --json`, `bench --json`, `/stats`, `Llama.spice_stats()`).
Pure Python: no native imports, so the record is testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Counters:
    """Raw event counts for one layer or for the whole model."""

    hook_calls: int = 0
    activations: int = 0  # routed-expert activations (token x selected expert)
    hits: int = 0  # activation's expert resident (or its copy landed) when the call began
    misses_fetched: int = 0  # waited on a demand copy
    misses_host: int = 0  # executed on the host
    misses_surrogate: int = 0  # replaced by the low-rank surrogate
    dropped: int = 0  # lossy ablation: contributed nothing
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    bytes_h2d: int = 0  # host-to-device bytes copied
    copy_ns: int = 0  # time the copy engine spent copying
    stall_ns: int = 0  # time compute waited on copies
    policy_ns: int = 0  # time spent deciding plans
    policy_calls: int = 0
    policy_fallbacks: int = 0  # plans that raised or failed validation -> exact fallback
    store_ns: int = 0  # device-tier bookkeeping on the hook's thread 0 (not counting stalls)
    policy_quiet: int = 0  # calls the policy decided in advance (Plan.resume_layer): not called
    # the mechanism's cost per call on the hook's thread 0, and the device-interface operations it made
    hook_ns: int = 0  # inside hook calls, entry to return (executors included)
    gap_ns: int = 0  # from the end of one hook call to the start of the next
    store_polls: int = 0  # polls of the device tier (one per hook call with a tier)
    device_copies: int = 0  # copies handed to the device
    device_waits: int = 0  # blocking waits on a copy
    device_launches: int = 0  # launches of device work (a device that computes)
    device_collects: int = 0  # collections of device results
    launch_ns: int = 0
    collect_ns: int = 0
    # a disk tier (edge mode): what was read from the model file
    disk_read_bytes: int = 0  # widened to the file system's alignment
    disk_reads: int = 0
    scratch_reads: int = 0  # experts read for one call only (host actions on absent experts)
    scratch_ns: int = 0  # time waiting for them
    # asynchronous planning (policy on the planner thread, plans applied at later calls)
    async_posted: int = 0  # snapshots handed to the planner
    async_skipped: int = 0  # snapshots replaced by a newer one before the planner took them
    async_applied: int = 0  # plans applied
    async_stale: int = 0  # plans dropped: older than the lag bound when they arrived
    async_lag_calls: int = 0  # sum over applied plans of hook calls from snapshot to use
    async_wait_ns: int = 0  # the hook waiting for the planner (deterministic mode)
    planner_ns: int = 0  # the planner thread's time in the policy
    exec_ns: int = 0  # inside hook calls: running the experts (thread 0, after planning)
    call_ns: int = 0  # inside hook calls: reading it, checking ids, booking, preparing the executors
    async_wakes: int = 0  # posts that woke a parked planner (a futex wake on the hook's thread)
    # of policy_ns: the engine's rule, and asynchronous planning's collecting plans and posting
    rule_ns: int = 0
    async_take_ns: int = 0
    async_post_ns: int = 0
    async_rows_by_hook: int = 0  # snapshots whose hidden rows the hook's thread copied (planner busy)

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def misses(self) -> int:
        return self.misses_fetched + self.misses_host + self.misses_surrogate + self.dropped


@dataclass
class Timing:
    """Wall-clock facts measured around llama_decode by the API layer."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decoded_tokens: int = 0  # tokens generated after the first
    decode_s: float = 0.0  # wall time spent producing those tokens


@dataclass
class StatsSnapshot:
    total: Counters = field(default_factory=Counters)
    layers: dict[int, Counters] = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _counter_record(c: Counters, decoded_tokens: int) -> dict[str, Any]:
    return {
        "hook_calls": c.hook_calls,
        "activations": c.activations,
        "hit_rate": _ratio(c.hits, c.activations),
        "misses": {
            "fetched": c.misses_fetched,
            "host": c.misses_host,
            "surrogate": c.misses_surrogate,
            "dropped": c.dropped,
        },
        "fallback_rate": _ratio(c.misses, c.activations),
        "prefetch_issued": c.prefetch_issued,
        "prefetch_used": c.prefetch_used,
        "prefetch_cancelled": c.prefetch_cancelled,
        "bytes_per_token": _ratio(c.bytes_h2d, decoded_tokens),
        "stall_ms_per_token": _ratio(c.stall_ns / 1e6, decoded_tokens),
        # per call the policy served, asked or decided in advance: what it costs per hook call
        "policy_us_per_call": _ratio(c.policy_ns / 1e3, c.policy_calls + c.policy_quiet),
        "policy_quiet_share": _ratio(c.policy_quiet, c.policy_calls + c.policy_quiet),
        "policy_fallbacks": c.policy_fallbacks,
        "store_us_per_call": _ratio(c.store_ns / 1e3, c.hook_calls),
        "disk_read_bytes": c.disk_read_bytes,
        "disk_read_bytes_per_token": _ratio(c.disk_read_bytes, decoded_tokens),
        "disk_scratch_reads": c.scratch_reads,
        "disk_scratch_ms_per_token": _ratio(c.scratch_ns / 1e6, decoded_tokens),
        "per_call": _per_call_record(c),
        "planning": _planning_record(c),
    }


def _planning_record(c: Counters) -> dict[str, Any]:
    """Asynchronous planning: how many plans came, how late (in hook calls, i.e.
    MoE layers), how many were too late and dropped. All zero when synchronous."""
    return {
        "asynchronous": c.async_posted > 0,
        "posted": c.async_posted,
        "skipped": c.async_skipped,
        "applied": c.async_applied,
        "stale": c.async_stale,
        "wakes": c.async_wakes,
        "rows_by_hook": c.async_rows_by_hook,
        "lag_layers": _ratio(c.async_lag_calls, c.async_applied),
        "wait_us_per_call": _ratio(c.async_wait_ns / 1e3, c.hook_calls),
        "planner_us_per_plan": _ratio(c.planner_ns / 1e3, c.async_applied + c.async_stale),
    }


def _per_call_record(c: Counters) -> dict[str, float]:
    """What the mechanism costs per hook call: thread 0's time in and between
    hook calls, and how many device-interface operations each call made.
    Launch and collect are zero where the device does not compute (emulated)."""
    n = c.hook_calls
    return {
        "hook_us": _ratio(c.hook_ns / 1e3, n),
        "exec_us": _ratio(c.exec_ns / 1e3, n),
        "call_us": _ratio(c.call_ns / 1e3, n),
        "gap_us": _ratio(c.gap_ns / 1e3, n),
        "store_us": _ratio(c.store_ns / 1e3, n),
        "stall_us": _ratio(c.stall_ns / 1e3, n),  # waiting for copies (per_call_decode: the decode calls')
        "polls": _ratio(c.store_polls, n),
        "copies": _ratio(c.device_copies, n),
        "waits": _ratio(c.device_waits, n),
        "launches": _ratio(c.device_launches, n),
        "collects": _ratio(c.device_collects, n),
        "launch_us": _ratio(c.launch_ns / 1e3, n),
        "collect_us": _ratio(c.collect_ns / 1e3, n),
        # deciding (policy_us_per_decode_call) by part: the rule, and asynchronous planning's
        # taking plans and an entry, and posting the snapshot (the rest: merging plan lists)
        "rule_us": _ratio(c.rule_ns / 1e3, n),
        "take_us": _ratio(c.async_take_ns / 1e3, n),
        "post_us": _ratio(c.async_post_ns / 1e3, n),
    }


def stats_record(snapshot: StatsSnapshot) -> dict[str, Any]:
    """The docs/design.md section 11 record. Per-token figures divide by decoded tokens only."""
    t = snapshot.timing
    record: dict[str, Any] = {
        "tpot_ms": _ratio(t.decode_s * 1e3, t.decoded_tokens),
        "prefill_tps": _ratio(t.prefill_tokens, t.prefill_s),
    }
    record.update(_counter_record(snapshot.total, t.decoded_tokens))
    record["layers"] = {
        str(il): _counter_record(c, t.decoded_tokens) for il, c in sorted(snapshot.layers.items())
    }
    return record


STATS_KEYS = (
    "tpot_ms",
    "prefill_tps",
    "hook_calls",
    "activations",
    "hit_rate",
    "misses",
    "fallback_rate",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_cancelled",
    "bytes_per_token",
    "stall_ms_per_token",
    "policy_us_per_call",
    "policy_quiet_share",
    "policy_fallbacks",
    "per_call",
    "planning",
    "layers",
)
