"""The table, JSON document and plot of `bench --memory-limit` (limited_bench.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspice.measure.bench import PolicyResult, median, plot
from pyspice.measure.limited_bench import RowOutcome

_MIB = 2**20
_RUN_KEYS = ("tpot_ms", "prefill_tps", "read_bytes_per_token", "rchar_per_token", "tier_bytes_per_token")


def warm_median(outcome: RowOutcome) -> dict[str, float | None]:
    """The median of the warm runs, key by key (None where no warm run has the key)."""
    out: dict[str, float | None] = {}
    for key in _RUN_KEYS:
        values = [float(r[key]) for r in outcome.warm if r.get(key) is not None]
        out[key] = median(values) if values else None
    return out


def same_tokens(outcome: RowOutcome, base: RowOutcome | None) -> str:
    if not outcome.runs:
        return "-"
    if outcome.timing_only:  # replayed routing (every repeat from the trace's start)
        return "timing only" if outcome.tokens_consistent else "NO (runs differ)"
    if base is None or not base.runs or base.timing_only:
        return "-"
    if not outcome.tokens_consistent:
        return "NO (runs differ)"
    return "yes" if outcome.tokens == base.tokens else "NO"


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def format_limited_table(outcomes: Sequence[RowOutcome], baseline: str, limit: int, version: int) -> str:
    base = next((o for o in outcomes if o.spec.row == baseline), None)
    base_tpot = warm_median(base)["tpot_ms"] if base else None
    header = (
        f"{'row':<16} {'status':<10} {'load s':>6} {'MiB read':>8} {'prefill t/s':>11} {'warm':>8} "
        f"{'TPOT ms':>8} {'warm':>8} {'x ' + baseline:>11} {'read MiB/tok':>12} "
        f"{'warm':>7} {'rchar':>7} {'tier':>7} {'cg peak MiB':>11} {'HWM MiB':>8} "
        f"{'OOM':>4} {'lim hits':>8} {'same tokens':>11}"
    )
    lines = [header, "-" * len(header)]
    for o in outcomes:
        cold, warm = o.cold or {}, warm_median(o)
        ratio = f"{warm['tpot_ms'] / base_tpot:.2f}" if warm["tpot_ms"] is not None and base_tpot else "-"
        lines.append(
            f"{o.spec.row:<16} {o.status:<10} {_num(o.load.get('seconds'), '.2f'):>6} "
            f"{_num(o.load.get('io', {}).get('read_bytes'), '.1f', _MIB):>8} "
            f"{_num(cold.get('prefill_tps'), '.1f'):>11} {_num(warm['prefill_tps'], '.1f'):>8} "
            f"{_num(cold.get('tpot_ms'), '.3f'):>8} {_num(warm['tpot_ms'], '.3f'):>8} {ratio:>11} "
            f"{_num(cold.get('read_bytes_per_token'), '.3f', _MIB):>12} "
            f"{_num(warm['read_bytes_per_token'], '.3f', _MIB):>7} "
            f"{_num(warm['rchar_per_token'], '.3f', _MIB):>7} "
            f"{_num(warm['tier_bytes_per_token'], '.3f', _MIB):>7} "
            f"{_num(o.cgroup_peak, '.1f', _MIB):>11} {_num(o.vm_hwm or None, '.1f', _MIB):>8} "
            f"{o.oom_kills:>4} {o.limit_hits:>8} {same_tokens(o, base):>11}"
        )
    lines.append(
        f"(each row in its own process and memory cgroup v{version}, limit {limit / _MIB:.1f} MiB, after "
        "the model's pages were dropped from the page cache; load: seconds and MiB read_bytes; first "
        "prefill/TPOT/read columns: the cold run (first after the drop), "
        f"'warm': median of the later runs in the same process; x {baseline}: warm "
        "TPOT ratio, below 1 is faster; read = /proc/<pid>/io read_bytes (block-layer reads, mmap faults "
        "included), rchar = bytes returned by read(), tier = the disk tier's own counter, each per decoded "
        "token; cg peak = the cgroup's peak usage (page cache included); HWM = peak RSS (VmHWM); lim hits = "
        "times a charge met the limit (reclaim ran))"
    )
    for o in outcomes:
        if o.message:
            lines.append(f"{o.spec.row}: {o.status}: {o.message}")
        if o.cached_before:
            lines.append(
                f"{o.spec.row}: {o.cached_before / _MIB:.1f} MiB of the model stayed in the page cache "
                "after the drop (mapped by another process): its cold start was partly warm"
            )
    return "\n".join(lines)


def limited_document(outcomes: Sequence[RowOutcome], baseline: str, header: dict[str, Any]) -> dict[str, Any]:
    base = next((o for o in outcomes if o.spec.row == baseline), None)
    rows = {}
    for o in outcomes:
        rows[o.spec.row] = {
            "policy": o.spec.policy,
            "ram_budget": o.spec.config.get("ram_budget"),  # the row's own or the command's; None: no tier
            "status": o.status,
            "message": o.message,
            "returncode": o.returncode,
            "load": o.load,
            "cold": o.cold,
            "warm": o.warm,
            "warm_median": warm_median(o),
            "cgroup_peak": o.cgroup_peak,
            "cgroup_limit": o.cgroup_limit,
            "oom_kills": o.oom_kills,
            "limit_hits": o.limit_hits,
            "vm_hwm": o.vm_hwm,
            "cached_after_drop": o.cached_before,
            "tokens": o.tokens,
            "same_tokens": same_tokens(o, base),
        }
        if o.auto is not None:
            rows[o.spec.row]["auto"] = o.auto
    return {**header, "baseline": baseline, "rows": rows}


def limited_plot(outcomes: Sequence[RowOutcome], baseline: str, path: str, title: str) -> None:
    """bench's plot of the warm runs of the rows that ran (an OOM-killed row has none)."""
    results = {}
    for o in outcomes:
        if o.warm:
            res = PolicyResult(o.spec.row)
            res.tpot_ms = [float(r["tpot_ms"]) for r in o.warm]
            res.prefill_tps = [float(r["prefill_tps"]) for r in o.warm]
            results[o.spec.row] = res
    plot(results, baseline, path, title)
