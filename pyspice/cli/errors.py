"""Failures as one line a person can act on: the one mapping every subcommand shares.

A command raises; `run_command` prints `pyspice: error: <what is wrong and
what to do>` on standard error and returns a non-zero exit status. The
traceback appears only with `--verbose`.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Callable

from pyspice.formats.model_info import ModelFileError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def explain(exc: BaseException) -> tuple[str, int]:
    """(message, exit status) for a failure."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(exc, ModelFileError | FileNotFoundError | IsADirectoryError | PermissionError):
        return str(exc), EXIT_ERROR
    if isinstance(exc, MemoryError):
        return (
            "out of memory: try a smaller --ctx-size or --device-budget, or a smaller quant of the model",
            EXIT_ERROR,
        )
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"address in use ({exc.strerror}): pick another --port", EXIT_ERROR
    message = str(exc)
    if isinstance(exc, ValueError) and message.startswith("Failed to load model from file"):
        path = message.split(":", 1)[-1].strip()
        return (
            f"llama.cpp could not load {path}: a corrupt file, or an architecture or quant type this "
            "llama.cpp does not support (`pyspice inspect -m MODEL` reads its header)",
            EXIT_ERROR,
        )
    if isinstance(exc, ValueError | RuntimeError) and message:
        return message, EXIT_ERROR
    return (
        f"unexpected {type(exc).__name__}: {message or 'no message'} "
        "(run again with --verbose for the traceback)",
        EXIT_ERROR,
    )


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(args)
    except BrokenPipeError:
        # the reader went away (`| head`): nothing left to say to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except (Exception, KeyboardInterrupt) as exc:
        if getattr(args, "verbose", False):
            traceback.print_exception(exc)
        message, status = explain(exc)
        prefix = "pyspice: " if status == EXIT_INTERRUPTED else "pyspice: error: "
        print(prefix + " ".join(message.split()), file=sys.stderr)
        return status


def add_verbose_arg(p: argparse.ArgumentParser, *, top_level: bool = False) -> argparse.Action:
    """`--verbose` before or after the subcommand; the subcommand's copy must not
    overwrite the top-level one, hence SUPPRESS as its default."""
    return p.add_argument(
        "--verbose",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="on errors, print the full traceback",
    )
