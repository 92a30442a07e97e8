"""`pyspice` entry point: one command, one subcommand per job.

Each subcommand module exposes `register(subparsers)`; only commands that
work are registered, so `--help` lists nothing that is not implemented.
Results go to standard output (one JSON document with --json); progress,
notes and logs go to standard error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pyspice import __version__
from pyspice.cli import bench_cmd, eval_cmd, generate_cmd, models_cmd, probe_cmd, sim_cmd
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
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in (generate_cmd, bench_cmd, models_cmd, eval_cmd, probe_cmd, sim_cmd):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except KeyboardInterrupt:
        print("pyspice: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"pyspice: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
