"""`pyspice calibrate`: fit the draft predictor and LoRE surrogates of a MoE model; write its sidecar.

Runs the model on a text (default: the calibration split of the built-in
model's corpus; for any other model smolmoe's, CPython's pydoc_data.topics),
records every MoE layer's inputs, routing and shared-expert output through
the hook, fits per layer a transition to the next MoE layer's input and per
expert a low-rank surrogate, and writes `<model>.spice.gguf`.
Safe to interrupt: run the same command again to continue.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyspice.calibrate.run import format_summary, run_calibration, summary_doc
from pyspice.cli import numbers
from pyspice.cli.common import add_model_args, add_text_arg, note, resolve_model
from pyspice.cli.help_levels import advanced


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the draft predictor and surrogates; write the sidecar", description=__doc__
    )
    add_model_args(p)
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="sidecar path (default: <model>.spice.gguf)"
    )
    add_text_arg(p, "calibration text (default: the calibration split of the model's corpus, else smolmoe's)")
    advanced(p.add_argument("--rank", type=int, default=8, help="LoRE surrogate rank per expert (default 8)"))
    advanced(
        p.add_argument(
            "--draft-rank", type=int, default=128, help="rank of each draft transition (default 128)"
        )
    )
    p.add_argument("--tokens", type=int, default=8192, help="cap on calibration tokens (default 8192)")
    advanced(
        p.add_argument(
            "--expert-tokens",
            type=int,
            default=2048,
            help="cap on training tokens per expert for its surrogate (default 2048)",
        )
    )
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per evaluated chunk (default 512)")
    p.add_argument("-t", "--threads", type=numbers.THREADS, default=None, help="threads (default: all cores)")
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
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
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
