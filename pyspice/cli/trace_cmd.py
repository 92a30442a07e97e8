"""`pyspice trace`: routing traces as files (importing other runtimes' recordings,
their statistics). Each action lives in its own module exposing `register(actions)`;
this module only gathers them under one command.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pyspice.cli import trace_fit_cmd, trace_import_cmd, trace_stats_cmd

# the actions of `pyspice trace`, each a module with register(actions)
ACTIONS: tuple[ModuleType, ...] = (trace_import_cmd, trace_stats_cmd, trace_fit_cmd)


def register(sub: Any) -> None:
    if not ACTIONS:  # main.py registers only commands that work
        return
    p = sub.add_parser("trace", help="import routing recordings, and their statistics", description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for module in ACTIONS:
        module.register(actions)
