#!/usr/bin/env python3
"""The hook thread's deciding time per decode call, by part, from `pyspice bench --json`
records: a bar per row, stacked as the rule's plan, taking finished plans, posting the
snapshot, and the rest (merging plan lists; a Python policy's whole call where it
decides synchronously), against issue 19's 3 us line. A markdown table on stdout too.

    scripts/plot-deciding-parts.py "50%=docs/results/dsv2lite4-sidecar-50pct.json" \\
        "25%=docs/results/dsv2lite4-sidecar-25pct.json" -o deciding-parts.png

Each argument is LABEL=FILE (one record). The parts are the counters `rule_us`,
`take_us`, `post_us` of the record's last repeat (per_call_decode), beside that repeat's
deciding time; rows that decide in Python per call (exact-py, NAME@sync) are left out
unless --all: at 80-180 us they would flatten the rest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGET_US = 3.0  # issue 19: deciding time per decode call, at most
PARTS = ("rule_us", "take_us", "post_us")
LABELS = ("rule", "take plans", "post snapshot", "rest")


def parts_of(row: dict[str, Any]) -> tuple[float, float, float, float]:
    """(rule, take, post, rest) us per decode call in the record's last repeat."""
    runs = row.get("policy_us_per_decode_call_runs") or [row["policy_us_per_decode_call"]]
    total = float(runs[-1])
    pc = row.get("per_call_decode") or row["per_call"]
    rule, take, post = (float(pc.get(k, 0.0)) for k in PARTS)
    return rule, take, post, max(0.0, total - rule - take - post)


def decides_in_python(name: str) -> bool:
    return name == "exact-py" or name.endswith("@sync")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="LABEL=FILE, one bench --json record each")
    ap.add_argument("-o", "--output", type=Path, help="PNG to write (default: the table only)")
    ap.add_argument("--all", action="store_true", help="include rows that decide in Python per call")
    args = ap.parse_args()
    panels: list[tuple[str, dict[str, tuple[float, float, float, float]]]] = []
    for spec in args.records:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: expected LABEL=FILE")
        policies = json.loads(Path(path).read_text())["policies"]
        rows = {
            name: parts_of(row)
            for name, row in policies.items()
            if row.get("hook_calls", 0) > 0 and (args.all or not decides_in_python(name))
        }
        panels.append((label, rows))
    print("| record | row | " + " | ".join(LABELS) + " | deciding us |")
    print("|---|---|" + "---|" * (len(LABELS) + 1))
    for label, rows in panels:
        for name, parts in rows.items():
            cells = " | ".join(f"{p:.2f}" for p in parts)
            print(f"| {label} | {name} | {cells} | {sum(parts):.2f} |")
    if args.output is not None:
        plot(panels, args.output)
        print(f"\nplot: {args.output}")
    return 0


def plot(panels: list[tuple[str, dict[str, tuple[float, float, float, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (label, rows) in zip(axes[0], panels, strict=True):
        names = list(rows)
        bottom = [0.0] * len(names)
        for i, part in enumerate(LABELS):
            values = [rows[n][i] for n in names]
            ax.bar(names, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.axhline(TARGET_US, color="black", linestyle="--", linewidth=1, label="issue 19: 3 us")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    axes[0][0].set_ylabel("deciding us per decode call (last repeat)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
