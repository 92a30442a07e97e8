"""Simulated TPOT against measured `pyspice bench` TPOT.

For the emulated profile the simulator models exactly what bench runs: the
same copy rules (spice-store.c), this machine's per-layer and per-expert
times (`pyspice probe`), each policy's measured microseconds per call, the
emulator's slot fill and sleep wake-up. The error shows what the model gets
wrong about compute, overlap and policy behaviour.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 0.15


def parse_compare(text: str) -> dict[str, list[Path]]:
    """`25%=a.json+b.json,50%=c.json` -> {budget: [paths]} (several bench runs of one budget pool)."""
    out: dict[str, list[Path]] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        budget, sep, paths = item.partition("=")
        if not sep:
            raise ValueError(f"--compare wants BUDGET=BENCH_JSON[+BENCH_JSON] entries, got {item!r}")
        out[budget.strip()] = [Path(p.strip()) for p in paths.split("+") if p.strip()]
    return out


def pooled(paths: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Bench records of several runs of one configuration: TPOT repeats pooled (median of all),
    per-call and per-token counters averaged over the runs."""
    docs = [json.loads(p.read_text())["policies"] for p in paths]
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(n for d in docs for n in d):
        recs = [d[name] for d in docs if name in d]
        runs = [float(x) for r in recs for x in (r.get("tpot_ms_runs") or [r["tpot_ms"]])]
        out[name] = {
            "tpot_ms": float(statistics.median(runs)),
            "tpot_ms_runs": runs,
            **{
                key: float(statistics.mean(float(r.get(key) or 0.0) for r in recs))
                for key in ("policy_us_per_call", "stall_ms_per_token", "store_us_per_call")
            },
        }
    return out


def measured_policy_us(benches: Mapping[str, Sequence[Path]]) -> dict[str, dict[str, float]]:
    """{budget: {policy: measured us per call}} from the bench runs being compared against."""
    return {
        budget: {name: rec["policy_us_per_call"] for name, rec in pooled(paths).items()}
        for budget, paths in benches.items()
    }


def compare(rows: Sequence[Mapping[str, Any]], benches: Mapping[str, Sequence[Path]]) -> list[dict[str, Any]]:
    """One entry per simulated row that bench also measured (same budget and policy)."""
    measured = {budget: pooled(paths) for budget, paths in benches.items()}
    out = []
    for r in rows:
        bench = measured.get(r["budget"], {}).get(r["policy"])
        if bench is None or r.get("tpot_ms") is None:
            continue
        runs = bench.get("tpot_ms_runs") or [bench["tpot_ms"]]
        sim, real = float(r["tpot_ms"]), float(bench["tpot_ms"])
        out.append(
            {
                "profile": r["profile"],
                "budget": r["budget"],
                "policy": r["policy"],
                "sim_tpot_ms": sim,
                "bench_tpot_ms": real,
                "bench_tpot_ms_min": min(runs),
                "bench_tpot_ms_max": max(runs),
                "error": sim / real - 1.0,
                "within": abs(sim / real - 1.0) <= TOLERANCE,
                "bench_policy_us_per_call": bench.get("policy_us_per_call"),
                "sim_stall_ms_per_token": r.get("stall_ms_per_token"),
                "bench_stall_ms_per_token": bench.get("stall_ms_per_token"),
            }
        )
    return out


def format_comparison(entries: Sequence[Mapping[str, Any]]) -> str:
    header = (
        f"{'budget':>6} {'policy':<9} {'bench TPOT ms':>13} {'(min-max)':>15} {'sim TPOT ms':>11} "
        f"{'error':>7} {'ok':>3} {'pol us/call':>11} {'stall bench/sim':>15}"
    )
    lines = [header, "-" * len(header)]
    for e in entries:
        stall = f"{e['bench_stall_ms_per_token'] or 0:.2f}/{e['sim_stall_ms_per_token'] or 0:.2f}"
        lines.append(
            f"{e['budget']:>6} {e['policy']:<9} {e['bench_tpot_ms']:13.2f} "
            f"{e['bench_tpot_ms_min']:7.2f}-{e['bench_tpot_ms_max']:<7.2f} {e['sim_tpot_ms']:11.2f} "
            f"{e['error']:+7.1%} {'yes' if e['within'] else 'NO':>3} "
            f"{e['bench_policy_us_per_call'] or 0:11.1f} {stall:>15}"
        )
    worst = max((abs(e["error"]) for e in entries), default=0.0)
    lines.append(f"(bench: median of all repeats; largest error {worst:.1%}, tolerance {TOLERANCE:.0%})")
    return "\n".join(lines)
