"""`pyspice` entry point: one command, one subcommand per job.

Each subcommand module exposes `register(subparsers)`; only commands that
work are registered, so `--help` lists nothing that is not implemented.
Each command's `--help` shows its usual options and `--help-all` every one
(help_levels: options are marked advanced where they are defined).
Results go to standard output (one JSON document with --json); progress,
notes and logs go to standard error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pyspice import __version__
from pyspice.cli import (
    bench_cmd,
    cache_cmd,
    calibrate_cmd,
    chat_cmd,
    eval_cmd,
    generate_cmd,
    inspect_cmd,
    models_cmd,
    probe_cmd,
    serve_cmd,
    sim_cmd,
    trace_cmd,
)
from pyspice.cli.errors import add_verbose_arg, run_command
from pyspice.cli.help_levels import add_help_all, advanced
from pyspice.cli.sim_fit_cmd import FIT_COMMAND
from pyspice.cli.version import version_report


class _VersionAction(argparse.Action):
    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object
    ) -> None:
        super().__init__(
            option_strings, dest=dest, nargs=0, help="print versions, library path and patch series"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyspice",
        description=f"pyspice {__version__}: run Mixture-of-Experts models whose experts do not fit "
        "in GPU memory (SPICE on llama.cpp)",
        epilog="Each command's --help shows the options it is usually run with; its --help-all, every one.",
    )
    parser.add_argument("--version", action=_VersionAction)
    add_verbose_arg(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in (
        chat_cmd,
        generate_cmd,
        serve_cmd,
        inspect_cmd,
        bench_cmd,
        models_cmd,
        calibrate_cmd,
        eval_cmd,
        probe_cmd,
        sim_cmd,
        cache_cmd,
        trace_cmd,
    ):
        module.register(sub)
    for command in sub.choices.values():
        _add_verbose_everywhere(command)
    add_help_all(parser)
    return parser


def _add_verbose_everywhere(p: argparse.ArgumentParser) -> None:
    if not any("--verbose" in action.option_strings for action in p._actions):
        advanced(add_verbose_arg(p))  # `pyspice --help` shows it
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _add_verbose_everywhere(nested)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:2] == FIT_COMMAND.split():  # `pyspice sim fit ...`: its own parser, not sim's
        words = [FIT_COMMAND, *words[2:]]
    args = parser.parse_args(words)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
