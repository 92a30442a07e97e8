"""`pyspice calibrate`: fit the draft predictor and LoRE surrogates of a MoE model; write its sidecar.

Runs the model on a text (default: the calibration split of the built-in
model's corpus; for any other model smolmoe's, CPython's pydoc_data.topics),
records every MoE layer's inputs, routing and shared-expert output through
the hook, fits per layer a transition to the next MoE layer's input and per
expert a low-rank surrogate, and writes `<model>.spice.gguf`.
Safe to interrupt: run the same command again to continue.

With --levels it calibrates nothing: it tunes the lossy levels' thresholds
(spice:balanced, spice:fast) for the sidecar the model already has, on the
same calibration split, and writes them into it (--dry-run: only print them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyspice.calibrate.levels import plot_record
from pyspice.calibrate.levels_run import LevelsOptions, plot_result, tune_levels
from pyspice.calibrate.run import format_summary, run_calibration, summary_doc
from pyspice.cli import numbers
from pyspice.cli.common import (
    add_model_args,
    add_planning_args,
    add_text_arg,
    note,
    planning_of,
    resolve_model,
)
from pyspice.cli.help_levels import advanced
from pyspice.formats.sidecar import default_sidecar_path

# the fitting's options and their defaults: a plain run uses them, --levels refuses them
FIT_DEFAULTS: dict[str, tuple[str, object]] = {
    "file": ("-f", None),
    "rank": ("--rank", 8),
    "draft_rank": ("--draft-rank", 128),
    "tokens": ("--tokens", 8192),
    "expert_tokens": ("--expert-tokens", 2048),
    "ctx_size": ("-c", 512),
    "work_dir": ("--work-dir", None),
    "keep_work": ("--keep-work", False),
}
# the tuning's options and their defaults (those of LevelsOptions): only with --levels
LEVELS_DEFAULTS: dict[str, tuple[str, object]] = {
    "dry_run": ("--dry-run", False),
    "budgets": ("--budgets", ("25%", "50%")),
    "weights": ("--weights", (0.05,)),
    "errors": ("--errors", (0.5, 0.55, 0.6, 0.65, 0.7)),
    "chunks": ("--chunks", 3),
    "margin": ("--margin", 0.6),
    "validate": ("--no-validate", True),
    "validate_chunks": ("--validate-chunks", 6),
    "planning": ("--planning", "auto"),
    "plan_lag": ("--plan-lag", 0),
    "plot": ("--plot", None),
    "replot": ("--replot", None),
    "merge": ("--merge", []),
}
LEVELS_THREADS = 2  # -t with --levels: the threads the built-in models' levels were tuned at


def budgets_arg(text: str) -> tuple[str, ...]:
    """`25%,50%` -> ("25%", "50%"), each budget checked."""
    numbers.budget_list(text)
    return tuple(b.strip() for b in text.split(",") if b.strip())


def thresholds_arg(text: str) -> tuple[float, ...]:
    """`0.5,0.55` -> (0.5, 0.55); empty items are skipped, so '' is no value."""
    number = numbers.real(0.0)
    return tuple(number(x) for x in text.split(",") if x.strip())


def _default(dest: str) -> Any:
    return {**FIT_DEFAULTS, **LEVELS_DEFAULTS}[dest][1]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the draft predictor and surrogates; write the sidecar", description=__doc__
    )
    add_model_args(p)
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="sidecar path (default: <model>.spice.gguf)"
    )
    add_text_arg(p, "calibration text (default: the calibration split of the model's corpus, else smolmoe's)")
    advanced(
        p.add_argument(
            "--rank", type=int, default=_default("rank"), help="LoRE surrogate rank per expert (default 8)"
        )
    )
    advanced(
        p.add_argument(
            "--draft-rank",
            type=int,
            default=_default("draft_rank"),
            help="rank of each draft transition (default 128)",
        )
    )
    p.add_argument(
        "--tokens", type=int, default=_default("tokens"), help="cap on calibration tokens (default 8192)"
    )
    advanced(
        p.add_argument(
            "--expert-tokens",
            type=int,
            default=_default("expert_tokens"),
            help="cap on training tokens per expert for its surrogate (default 2048)",
        )
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=_default("ctx_size"),
        help="tokens per evaluated chunk (default 512)",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=numbers.THREADS,
        default=None,
        help=f"threads (default: all cores; with --levels {LEVELS_THREADS})",
    )
    advanced(
        p.add_argument(
            "--work-dir",
            type=Path,
            default=None,
            help="where the trace and per-layer fits go (default: under ~/.cache/pyspice/calibrate)",
        )
    )
    advanced(
        p.add_argument(
            "--keep-work", action="store_true", help="keep the trace and per-layer fits afterwards"
        )
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary (with --levels: the grid's record) as JSON"
    )
    _register_levels(p.add_argument_group("tuning the lossy levels (--levels)"))
    p.set_defaults(func=run_calibrate)


def _register_levels(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--levels",
        action="store_true",
        help="tune spice:balanced's and spice:fast's thresholds for the model's calibrated sidecar "
        "(-o) and write them into it; fits nothing",
    )
    g.add_argument("--dry-run", action="store_true", help="with --levels: print the picks, write nothing")
    g.add_argument(
        "--budgets",
        type=budgets_arg,
        default=_default("budgets"),
        help="device budgets every pick must hold at (default 25%%,50%%)",
    )
    advanced(
        g.add_argument(
            "--weights",
            type=thresholds_arg,
            default=_default("weights"),
            help="gate-weight thresholds to try (default 0.05: passes every miss of the built-in models)",
        )
    )
    advanced(
        g.add_argument(
            "--errors",
            type=thresholds_arg,
            default=_default("errors"),
            help="surrogate fit-error thresholds to try (default 0.5,0.55,0.6,0.65,0.7)",
        )
    )
    advanced(
        g.add_argument(
            "--chunks",
            type=numbers.integer(1),
            default=_default("chunks"),
            help="512-token calibration chunks scored per grid cell (default 3)",
        )
    )
    advanced(
        g.add_argument(
            "--margin",
            type=numbers.real(0.0, 1.0),
            default=_default("margin"),
            help="share of each level's perplexity bound a pick may use on calibration text (default 0.6)",
        )
    )
    advanced(
        g.add_argument(
            "--validate",
            action=argparse.BooleanOptionalAction,
            default=_default("validate"),
            help="check each level's pick on the corpus's held-out split against the level's full "
            "bound, and fall back to the next pair down where it fails (default: on)",
        )
    )
    advanced(
        g.add_argument(
            "--validate-chunks",
            type=numbers.integer(1),
            default=_default("validate_chunks"),
            help="512-token held-out chunks scored per check (default 6)",
        )
    )
    # the cells plan as the lossy levels do at these threads (auto)
    add_planning_args(g)
    advanced(
        g.add_argument(
            "--plot",
            type=Path,
            default=None,
            metavar="PNG",
            help="draw perplexity change vs host cut over the grid",
        )
    )
    advanced(
        g.add_argument(
            "--replot",
            type=Path,
            default=None,
            metavar="JSON",
            help="run nothing: plot an earlier run's --json record to --plot",
        )
    )
    advanced(
        g.add_argument(
            "--merge",
            type=Path,
            action="append",
            default=[],
            metavar="JSON",
            help="an earlier run's --json record (same model and budgets): its cells join this grid, "
            "a pair measured on more chunks winning; needs --dry-run",
        )
    )


def _given(args: argparse.Namespace, options: dict[str, tuple[str, object]]) -> list[str]:
    return [flag for dest, (flag, default) in options.items() if getattr(args, dest) != default]


def run_calibrate(args: argparse.Namespace) -> int:
    if args.levels:
        return run_levels(args)
    given = _given(args, LEVELS_DEFAULTS)
    if given:
        raise ValueError(f"{', '.join(given)}: only with --levels")
    model = resolve_model(args, sidecar=False)  # the sidecar is what this command makes
    result = run_calibration(
        model,
        args.output,
        args.file,
        rank=args.rank,
        draft_rank=args.draft_rank,
        tokens=args.tokens,
        expert_tokens=args.expert_tokens,
        n_ctx=args.ctx_size,
        threads=args.threads,
        work_dir=args.work_dir,
        keep_work=args.keep_work,
        progress=not args.json,
    )
    if args.json:
        json.dump(summary_doc(result), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_summary(result))
    note(f"sidecar written: {result.sidecar}")
    return 0


def levels_options(args: argparse.Namespace) -> LevelsOptions:
    """The LevelsOptions of the parsed --levels options."""
    given = _given(args, FIT_DEFAULTS)
    if given:
        raise ValueError(
            f"{', '.join(given)}: --levels tunes the sidecar the model has and fits nothing (calibrate "
            "first without --levels, then tune)"
        )
    if args.plan_lag and args.planning != "async":
        raise ValueError("--plan-lag is for --planning async")
    return LevelsOptions(
        budgets=args.budgets,
        weights=args.weights,
        errors=args.errors,
        chunks=args.chunks,
        margin=args.margin,
        threads=args.threads or LEVELS_THREADS,
        planning=planning_of(args),
        validate=args.validate,
        validate_chunks=args.validate_chunks,
        merge=tuple(args.merge),
        write=not args.dry_run,
    )


def run_levels(args: argparse.Namespace) -> int:
    if args.replot is not None:
        if args.plot is None:
            raise ValueError("--replot: name the PNG to draw with --plot")
        doc = json.loads(args.replot.read_text(encoding="utf-8"))
        for png in plot_record(doc, args.plot, args.margin):
            note(f"plot written: {png}")
        return 0
    options = levels_options(args)
    # a built-in model's own sidecar is made on first use; any other must exist
    model = resolve_model(args, sidecar=args.output is None)
    sidecar = args.output or default_sidecar_path(model)
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"no sidecar {sidecar} to tune: calibrate it first (`pyspice calibrate -m {model}`), then "
            "run --levels"
        )
    # with --json the record is standard output, and the tables go to standard error
    result = tune_levels(model, sidecar, options, say=note, out=sys.stderr if args.json else sys.stdout)
    if args.plot is not None:
        for png in plot_result(result, args.plot, options.margin):
            note(f"plot written: {png}")
    if args.json:
        json.dump(result.doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if result.written is None:
        note("--dry-run: nothing written")
    return 0
