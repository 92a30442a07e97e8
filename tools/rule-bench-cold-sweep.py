#!/usr/bin/env python3
"""The engine's rules on ever colder caches: spice-rule-bench once per amount of memory
touched between two calls (--cold-mib), the rule's p50 per rule as a table and a plot.

A decode step of DeepSeek-V2-Lite's real-shape model moves about 60 MB between two hook
calls (the emulated tier's copies and ggml's weight reads), so the rule's time in a real
run is its time on caches that cold, not on warm ones (docs/results/cpu-overhead.md,
"The rules alone, on cold caches").

    tools/rule-bench-cold-sweep.py --mib 8,32,96,256 --calls 2000 \\
        --json sweep.json --plot sweep.png -- --layers 3 --experts 64 --used 6 --embd 2048 --budget 0.25

Arguments after `--` go to spice-rule-bench as they are (the store's shape, --only).
Run it on an idle machine: the numbers are latencies. `--replot sweep.json --plot
sweep.png` draws a saved sweep again without running anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def parse_rows(stdout: str) -> dict[str, dict[str, float]]:
    """spice-rule-bench's table: a header line, the column names, then a row per rule
    (name, rule p50, rule mean, store p50, store mean, hit)."""
    rows: dict[str, dict[str, float]] = {}
    for line in stdout.splitlines()[2:]:
        cols = line.split()
        if len(cols) != 6:
            raise ValueError(f"spice-rule-bench printed a row this script cannot read: {line!r}")
        name, *values = cols
        rule_p50, rule_mean, store_p50, store_mean, hit = (float(v) for v in values)
        rows[name] = {
            "rule_p50_ns": rule_p50,
            "rule_mean_ns": rule_mean,
            "store_p50_ns": store_p50,
            "store_mean_ns": store_mean,
            "hit": hit,
        }
    if not rows:
        raise ValueError("spice-rule-bench printed no rows")
    return rows


def shape_of(header: str) -> str:
    """The bench's header without the amount touched: what every point of a sweep shares."""
    return header.split(", cold caches")[0]


def markdown(sweep: list[dict[str, Any]]) -> str:
    """One row per amount touched, one column per rule: rule p50 in ns."""
    rules = list(sweep[0]["rules"])
    lines = ["| MiB touched | " + " | ".join(rules) + " |", "|---" * (len(rules) + 1) + "|"]
    for point in sweep:
        cells = [f"{point['rules'][r]['rule_p50_ns']:.0f}" if r in point["rules"] else "-" for r in rules]
        lines.append(f"| {point['mib']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(sweep: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mibs = [p["mib"] for p in sweep]
    for rule in sweep[0]["rules"]:
        ax.plot(mibs, [p["rules"][rule]["rule_p50_ns"] / 1e3 for p in sweep], marker="o", label=rule)
    ax.axhline(3.0, color="black", linewidth=0.8, linestyle="--", label="target: 3 us")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # adapmoe reading its router takes 10x the others
    ax.set_xticks(mibs)
    ax.set_xticklabels([str(m) for m in mibs])
    ax.set_xlabel("MiB touched between two calls")
    ax.set_ylabel("rule p50 (us)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_mib(text: str) -> list[int]:
    try:
        mibs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mib wants whole MiB separated by commas, got {text!r}") from None
    if not mibs or any(not 1 <= m <= 4096 for m in mibs):
        raise argparse.ArgumentTypeError(f"--mib wants values from 1 to 4096, got {text!r}")
    return mibs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=parse_mib, default=parse_mib("8,32,96,256"), help="amounts touched (MiB)")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per amount (default 2000)")
    ap.add_argument("--tool", type=Path, help="spice-rule-bench (default: the one `make build` built)")
    ap.add_argument("--json", type=Path, help="write the sweep here")
    ap.add_argument("--plot", type=Path, help="write a plot of rule p50 against the amount here")
    ap.add_argument("--replot", type=Path, help="draw this saved sweep (--json's file) instead of running")
    ap.add_argument("bench_args", nargs="*", help="after --: spice-rule-bench's own flags")
    args = ap.parse_args()
    if args.replot is not None:
        if args.plot is None:
            ap.error("--replot draws a saved sweep: give --plot FILE too")
        saved = json.loads(args.replot.read_text())
        plot(saved["sweep"], args.plot, shape_of(saved["bench"]))
        print(markdown(saved["sweep"]))
        print(f"wrote {args.plot}")
        return 0
    if args.tool is None:
        from pyspice.build_info import load_build_info

        args.tool = load_build_info().tool("spice-rule-bench")
    sweep: list[dict[str, Any]] = []
    header = ""
    for i, mib in enumerate(args.mib):
        command = [str(args.tool), *args.bench_args, "--calls", str(args.calls), "--cold-mib", str(mib)]
        print(f"[{i + 1}/{len(args.mib)}] {mib} MiB between calls ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"spice-rule-bench failed at {mib} MiB: {done.stderr.strip()}", file=sys.stderr)
            return 1
        header = done.stdout.splitlines()[0]
        sweep.append({"mib": mib, "rules": parse_rows(done.stdout)})
    shape = shape_of(header)
    print(shape)
    print(markdown(sweep))
    if args.json is not None:
        args.json.write_text(json.dumps({"bench": header, "sweep": sweep}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(sweep, args.plot, shape)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
