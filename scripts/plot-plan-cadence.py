#!/usr/bin/env python3
"""Plot the simulator's decode TPOT of asynchronous SPICE planning at every layer
(and every 2nd) against every 4th, per target cell, level and mode, from the JSON
that docs/results/async-planning-smolmoe.md (session 43) keeps:

    scripts/plot-plan-cadence.py docs/results/async-every-layer-sim-5b025de.json \\
        -o docs/results/async-every-layer-sim.png

Below 1 is faster than every 4th layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LEVELS = ("spice:exact", "spice:balanced", "spice:fast")
MODES = ("det1", "async")
SHORT = {"qwen2-57b-a14b": "Qwen2-57B", "deepseek-v2-lite": "DSV2-Lite"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tpot: dict[tuple[str, str, str, str, str, int], float] = {}
    for r in json.loads(args.json.read_text())["rows"]:
        level, mode = r["policy"].split("@")
        target = r["target"].split(":")[0]
        tpot[(target, r["profile"], r["budget"], level, mode, int(r["plan_every"]))] = float(r["tpot_ms"])
    cells = sorted({k[:3] for k in tpot}, key=lambda c: (c[0] != "qwen2-57b-a14b", c[1], c[2]))

    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 4.5), sharey=True)
    width = 0.13
    for ax, mode in zip(axes, MODES, strict=True):
        for j, level in enumerate(LEVELS):
            for n, every in enumerate((2, 1)):
                ys = [tpot[(*c, level, mode, every)] / tpot[(*c, level, mode, 4)] for c in cells]
                xs = [i + (2 * j + n - 2.5) * width for i in range(len(cells))]
                ax.bar(
                    xs,
                    ys,
                    width,
                    label=f"{level}, every {'layer' if every == 1 else '2nd'}",
                    color=f"C{j}",
                    alpha=0.45 if every == 2 else 0.95,
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{SHORT.get(t, t)}\n{p} {b}" for t, p, b in cells], fontsize=8)
        ax.set_title("deterministic, lag 1 (det1)" if mode == "det1" else "free-running")
        ax.set_ylim(0.8, 1.12)
    axes[0].set_ylabel("decode TPOT / every 4th layer (simulated)")
    axes[1].legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle("Asynchronous SPICE planning: how often a decode step plans (below 1: faster)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
