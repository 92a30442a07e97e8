"""`pyspice inspect`: what a GGUF holds for expert offloading, from its header alone.

Architecture, layers, experts, top-k, shared experts, bytes per routed
expert by quant type, expert vs non-expert bytes, and what a device budget
holds (experts, and the llama.cpp `--n-cpu-moe N` split it corresponds to).
No tensor data is read and no native code is loaded: instant on any size.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyspice.cli.common import add_model_args, resolve_model
from pyspice.cli.numbers import budget_text
from pyspice.formats.model_info import (
    DEFAULT_BUDGETS,
    format_ram_fits,
    format_summary,
    inspect_model,
    summary_record,
)
from pyspice.units import parse_budget


def register(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "inspect", help="show a model's experts, sizes and what a device budget holds"
    )
    p.description = __doc__
    add_model_args(p)
    p.add_argument(
        "--device-budget",
        action="append",
        type=budget_text,
        default=None,
        help="budget(s) to size: 2GiB, 512MiB or 25%% (repeatable; default: "
        + ", ".join(DEFAULT_BUDGETS).replace("%", "%%")
        + ")",
    )
    p.add_argument(
        "--ram-budget",
        action="append",
        type=budget_text,
        default=None,
        help="edge-mode RAM budget(s) to size (2GiB or 50%%; repeatable): what stays in RAM and on disk",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    summary = inspect_model(resolve_model(args, sidecar=False))  # header only: no sidecar needed
    budgets = [parse_budget(b) for b in (args.device_budget or DEFAULT_BUDGETS)]
    fits = [summary.fit(b) for b in budgets] if summary.is_moe else []
    ram_fits = [summary.fit(parse_budget(b)) for b in args.ram_budget or []] if summary.is_moe else []
    if args.json:
        record = summary_record(summary, fits)
        record["ram_budgets"] = [vars(f) for f in ram_fits]
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_summary(summary, fits))
        if ram_fits:
            print(format_ram_fits(summary, ram_fits))
    return 0
