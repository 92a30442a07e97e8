"""`pyspice trace stats`: the routing regime of traces, side by side.

One column per trace: its geometry, how skewed its experts' popularity is,
how soon a layer selects an expert again, the hit rates of per-layer LRU
caches and of Belady's MIN (the offline optimum) at 12.5%, 25% and 50% of a
layer's experts, and how well layer l's experts predict layer l+1's
(co-occurrence recall@k). Each trace is read as one decode stream, token by
token, every MoE layer its own cache; docs/results/real-routing.md says what
each figure means and what the real DeepSeek-V2-Lite routing gives.

A TRACE is a trace directory (recorded by generate/bench --trace or
calibrate, or imported by `pyspice trace import`), or a folder of traces of
one model (one `generate --trace` run per prompt), read as its sequences in
natural name order. --json prints the figures of one trace as one object, of
several as {"traces": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pyspice.cli.common import note
from pyspice.cli.numbers import integer
from pyspice.outputs import atomic_output, check_output
from pyspice.sim.regime import BUDGETS, REUSE_BUCKETS, REUSE_QUANTILES, Regime, read_routing, regime


def register(actions: Any) -> None:
    p = actions.add_parser(
        "stats",
        help="the routing regime of traces: popularity, reuse, LRU and MIN hits, cross-layer recall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "traces", nargs="+", type=Path, metavar="TRACE", help="trace directories, or folders of traces"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="also draw the figures side by side into this PNG"
    )
    p.add_argument(
        "--sequences",
        type=integer(1, hint="how many of each trace's first sequences to read"),
        metavar="N",
        help="read only the first N sequences (prompts) of each trace",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        check_output(args.plot, list(args.traces), "--plot")
    regimes = []
    for path in args.traces:
        routing = read_routing(path)
        if args.sequences is not None:
            routing = routing.first_sequences(args.sequences)
        regimes.append(regime(routing))
        for line in regimes[-1].notes:
            note(f"{routing.name}: {line}")
    if args.json:
        docs = [r.to_dict() for r in regimes]
        print(json.dumps(docs[0] if len(docs) == 1 else {"traces": docs}, indent=1))
    else:
        print(format_table(regimes))
    if args.plot is not None:
        plot(regimes, args.plot)
        note(f"plot written to {args.plot}")
    return 0


# ---- the table -----------------------------------------------------------------------


def _share(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _pick(figure: str, key: str) -> Callable[[Regime], str]:
    """A cell: one entry of one of a Regime's dicts (shares to 3 places, counts whole)."""

    def cell(r: Regime) -> str:
        value = getattr(r, figure)[key]
        return str(value) if isinstance(value, int) else _share(value)

    return cell


def _rows() -> list[tuple[str, Callable[[Regime], str]]]:
    rows: list[tuple[str, Callable[[Regime], str]]] = [
        ("model", lambda r: r.model),
        ("source", lambda r: f"{r.source} ({r.kind})"),
        ("MoE layers / experts / k", lambda r: f"{r.layers} / {r.experts} / {r.k}"),
        ("tokens", lambda r: str(r.tokens)),
        ("sequences", lambda r: str(r.sequences)),
        (
            "top-25% experts' share (uniform)",
            lambda r: f"{_share(r.top_shares['25%'])} ({r.uniform_shares['25%']:.2f})",
        ),
        (
            "top-50% experts' share (uniform)",
            lambda r: f"{_share(r.top_shares['50%'])} ({r.uniform_shares['50%']:.2f})",
        ),
    ]
    for _low, _high, label in REUSE_BUCKETS:
        rows.append((f"reuse distance {label} token(s)", _pick("reuse_shares", label)))
    rows.append(("first use", lambda r: _share(r.reuse_shares["first"])))
    rows.append(
        (
            "reuse distance " + "/".join(q for q, _ in REUSE_QUANTILES),
            lambda r: "/".join(
                "-" if math.isnan(r.reuse_quantiles[q]) else f"{r.reuse_quantiles[q]:g}"
                for q, _ in REUSE_QUANTILES
            ),
        )
    )
    for label, _share_of in BUDGETS:
        rows += [
            (f"slots at {label}", _pick("slots", label)),
            ("  LRU hit", _pick("lru_hit", label)),
            ("  MIN hit", _pick("min_hit", label)),
            ("  LRU hit, serial", _pick("lru_serial_hit", label)),
            ("  MIN hit, with bypass", _pick("min_bypass_hit", label)),
        ]
    rows += [
        ("co-occurrence recall@k", lambda r: _share(r.cooc_recall)),
        ("popularity recall@k", lambda r: _share(r.popular_recall)),
        ("random recall@k (k / experts)", lambda r: _share(r.random_recall)),
        ("fitted / tested sequences", lambda r: f"{r.split.fit_sequences} / {r.split.test_sequences}"),
    ]
    return rows


def format_table(regimes: Sequence[Regime]) -> str:
    """One row per figure, one column per trace."""
    rows = _rows()
    cells = [[r.name for r in regimes]] + [[value(r) for r in regimes] for _, value in rows]
    labels = ["trace"] + [label for label, _ in rows]
    label_width = max(len(label) for label in labels)
    widths = [max(len(row[i]) for row in cells) for i in range(len(regimes))]
    lines = []
    for label, row in zip(labels, cells, strict=True):
        lines.append(
            "  ".join([label.ljust(label_width), *(c.rjust(w) for c, w in zip(row, widths, strict=True))])
        )
        if label == "trace":
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


# ---- the plot ------------------------------------------------------------------------


def plot(regimes: Sequence[Regime], path: Path) -> None:
    """Four panels, the traces side by side in each: LRU and MIN hit by cache size, the
    popularity curve, the reuse-distance shares, and cross-layer recall."""
    # lazy: matplotlib is optional, for --plot only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / max(1, len(regimes))
    shares = [share for _, share in BUDGETS]

    ax = axes[0]
    for i, r in enumerate(regimes):
        c = colors[i % len(colors)]
        ax.plot(shares, [r.min_hit[b] for b, _ in BUDGETS], "-o", color=c, label=f"{r.name} MIN")
        ax.plot(shares, [r.lru_hit[b] for b, _ in BUDGETS], "--s", color=c, label=f"{r.name} LRU")
    ax.set_xticks(shares)
    ax.set_xticklabels([b for b, _ in BUDGETS])
    ax.set_xlabel("cache per layer (share of its experts)")
    ax.set_ylabel("hit rate (per activation)")
    ax.set_ylim(0, 1)
    ax.set_title("LRU (dashed) and Belady's MIN (solid)")
    ax.legend(fontsize=7)

    ax = axes[1]
    for i, r in enumerate(regimes):
        n = len(r.popularity_curve) - 1
        ax.plot(
            [j / n for j in range(n + 1)], r.popularity_curve, color=colors[i % len(colors)], label=r.name
        )
    ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle=":", label="uniform")
    ax.set_xlabel("most used experts of a layer (share of its experts)")
    ax.set_ylabel("share of the layer's activations")
    ax.set_title("popularity (averaged over layers)")
    ax.legend(fontsize=7)

    ax = axes[2]
    buckets = [label for _, _, label in REUSE_BUCKETS] + ["first"]
    for i, r in enumerate(regimes):
        xs = [g + i * width for g in range(len(buckets))]
        ax.bar(xs, [r.reuse_shares[b] for b in buckets], width, color=colors[i % len(colors)], label=r.name)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(buckets))])
    ax.set_xticklabels(buckets)
    ax.set_xlabel("tokens since the layer last selected the expert")
    ax.set_ylabel("share of activations")
    ax.set_title("reuse distance")
    ax.legend(fontsize=7)

    ax = axes[3]
    kinds = [("co-occurrence", "cooc_recall"), ("popularity", "popular_recall"), ("random", "random_recall")]
    for i, r in enumerate(regimes):
        xs = [g + i * width for g in range(len(kinds))]
        ys = [0.0 if math.isnan(getattr(r, a)) else getattr(r, a) for _, a in kinds]
        ax.bar(xs, ys, width, color=colors[i % len(colors)], label=r.name)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(kinds))])
    ax.set_xticklabels([k for k, _ in kinds])
    ax.set_ylabel("recall@k of layer l+1's experts")
    ax.set_ylim(0, 1)
    ax.set_title("predicting layer l+1 from layer l")
    ax.legend(fontsize=7)

    fig.tight_layout()
    with atomic_output(path, ".tmp.png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
