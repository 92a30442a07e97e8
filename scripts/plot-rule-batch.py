#!/usr/bin/env python3
"""Plot the simulator's A/B of the rule's batch costs (docs/results/rule-batch-costs.md):
per target cell and level, prefill time and decode TPOT with the per-expert choice over
the per-activation rule, for a 32-token and a 128-token prompt.

    scripts/plot-rule-batch.py docs/results/rule-batch-costs-sim.json \\
        -o docs/results/rule-batch-costs-sim.png

Below 1 is faster with the per-expert choice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LEVELS = ("spice:exact@async", "spice:balanced@det1", "spice:fast@det1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    rows = json.loads(args.json.read_text())["rows"]
    keys = ("prompt_tokens", "target", "profile", "budget", "policy", "rule")
    by = {tuple(r[k] for k in keys): r for r in rows}
    cells = sorted({(r["target"], r["profile"], r["budget"]) for r in rows})
    prompts = sorted({r["prompt_tokens"] for r in rows})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(prompts), 2, figsize=(13, 4.2 * len(prompts)), squeeze=False)
    width = 0.8 / len(LEVELS)
    for row, prompt in enumerate(prompts):
        for col, (metric, label) in enumerate((("prefill_ms", "prefill time"), ("tpot_ms", "decode TPOT"))):
            ax = axes[row][col]
            for i, level in enumerate(LEVELS):
                ratios = []
                for cell in cells:
                    new = by.get((prompt, *cell, level, "per_expert_choice"))
                    old = by.get((prompt, *cell, level, "per_activation"))
                    ratios.append(new[metric] / old[metric] if new and old and old[metric] else float("nan"))
                xs = [j + (i - (len(LEVELS) - 1) / 2) * width for j in range(len(cells))]
                ax.bar(xs, ratios, width, label=level)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(cells)))
            ax.set_xticklabels([f"{t.split('-')[0]}\n{p}\n{b}" for t, p, b in cells], fontsize=8)
            ax.set_ylim(0.6, 1.1)
            ax.set_ylabel(f"{label}: per-expert / per-activation")
            ax.set_title(f"{prompt}-token prompt: {label}")
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle("The rule's misses weighed per expert against each activation alone (simulator)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
