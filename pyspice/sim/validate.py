"""Simulated TPOT against measured `pyspice bench` TPOT (issue 10, item 5).

For the emulated profile the simulator models exactly what bench runs: the
same copy rules (spice-store.c), this machine's per-layer and per-expert
times (`pyspice probe`), each policy's measured microseconds per call, the
emulator's slot fill and sleep wake-up. The error shows what the model gets
wrong about compute, overlap and policy behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 0.15


def parse_compare(text: str) -> dict[str, Path]:
    """`25%=bench-25.json,50%=bench-50.json` -> {budget: path}."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        budget, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--compare wants BUDGET=BENCH_JSON entries, got {item!r}")
        out[budget.strip()] = Path(path.strip())
    return out


def compare(rows: Sequence[Mapping[str, Any]], benches: Mapping[str, Path]) -> list[dict[str, Any]]:
    """One entry per simulated row that bench also measured (same budget and policy)."""
    measured = {budget: json.loads(path.read_text())["policies"] for budget, path in benches.items()}
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
    lines.append(f"(bench: median of repeats; largest error {worst:.1%}, tolerance {TOLERANCE:.0%})")
    return "\n".join(lines)
