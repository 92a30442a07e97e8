#!/usr/bin/env python3
"""Decode TPOT of each policy over stock's in the same bench run, from `pyspice bench
--json` records: a markdown table on stdout and a bar chart. Ratios inside one run are
what survive a shared, noisy machine (stock's own TPOT moved 5.1-6.8 ms between runs
on the H200 of docs/results/cuda-h200-2026-12-04.md).

    scripts/plot-bench-ratios.py "25%=docs/results/cuda-h200-2026-12-04/call3-f4-profile-25.json" \\
        "50%=docs/results/cuda-h200-2026-12-04/call3-f3-profile-50.json" -o ratios.png

Each argument is LABEL=FILE (the file's first record; FILE:N for its N-th, from 0).
Below 1 is faster than stock.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_record(spec: str) -> tuple[str, dict[str, Any]]:
    label, sep, where = spec.partition("=")
    if not sep:
        raise SystemExit(f"plot-bench-ratios: {spec!r} is not LABEL=FILE[:N]")
    path, _, index = where.partition(":")
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    n = int(index) if index else 0
    if n >= len(lines):
        raise SystemExit(f"plot-bench-ratios: {path} has {len(lines)} records, not {n + 1}")
    return label, json.loads(lines[n])


def ratios(record: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """policy -> (TPOT / stock's, TPOT ms, decode hit rate)."""
    policies = record["policies"]
    if "stock" not in policies:
        raise SystemExit("plot-bench-ratios: a record without a stock row has nothing to divide by")
    stock = float(policies["stock"]["tpot_ms"])
    return {
        name: (float(p["tpot_ms"]) / stock, float(p["tpot_ms"]), float(p.get("decode_hit_rate") or 0.0))
        for name, p in policies.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=FILE[:N]")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [load_record(spec) for spec in args.runs]
    table = {label: ratios(record) for label, record in runs}
    policies: list[str] = []
    for label, _ in runs:
        policies += [p for p in table[label] if p not in policies and p != "stock"]

    print("| policy | " + " | ".join(f"{label}: TPOT / stock (ms, decode hit)" for label, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for p in ["stock", *policies]:
        cells = []
        for label, _ in runs:
            r = table[label].get(p)
            cells.append("-" if r is None else f"{r[0]:.3f} ({r[1]:.2f}, {r[2]:.2f})")
        print(f"| {p} | " + " | ".join(cells) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(policies) * len(runs) ** 0.5 + 3), 4.2))
    width = 0.8 / len(runs)
    for i, (label, _) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(policies))]
        ys = [table[label].get(p, (float("nan"),))[0] for p in policies]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels(policies, rotation=20, ha="right")
    ax.set_ylabel("decode TPOT / stock (same run)")
    ax.set_title("below 1: faster than stock")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
