"""Two levels of help: `--help` shows the options a new user runs with, `--help-all` every one.

An option is marked where it is defined: `advanced(p.add_argument(...))` hides it from
`--help` (it is still accepted), `brief(p.add_argument(...), "short text")` gives a basic
option a shorter text for `--help` and keeps the full one for `--help-all`.
`add_help_all` then gives every parser of the command line its `--help-all`, once,
after all of them are registered.
"""

from __future__ import annotations

import argparse
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

A = TypeVar("A", bound=argparse.Action)

_ADVANCED: weakref.WeakSet[argparse.Action] = weakref.WeakSet()
_BRIEF: weakref.WeakKeyDictionary[argparse.Action, str] = weakref.WeakKeyDictionary()


def advanced(action: A) -> A:
    """Leave `action` out of `--help`; `--help-all` and the parser still take it."""
    _ADVANCED.add(action)
    return action


def brief(action: A, text: str) -> A:
    """Show `text` for `action` in `--help`; `--help-all` shows its full help."""
    _BRIEF[action] = text
    return action


class _HelpAllAction(argparse.Action):
    """Print the parser's help with every option, the full text of each, and exit."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object
    ) -> None:
        super().__init__(
            option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help="show every option and exit"
        )
        self.full_help: dict[argparse.Action, str | None] = {}

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        shown = {action: action.help for action in self.full_help}
        epilog = parser.epilog
        try:
            for action, text in self.full_help.items():
                action.help = text
            parser.epilog = None
            parser.print_help()
        finally:
            for action, text in shown.items():
                action.help = text
            parser.epilog = epilog
        parser.exit()


class _ShownGroupsUsage(argparse.HelpFormatter):
    """The usage line leaves out mutually exclusive groups whose options are all hidden
    (argparse before 3.12 fails on them when the usage line wraps)."""

    def add_usage(
        self,
        usage: str | None,
        actions: Iterable[argparse.Action],
        groups: Iterable[argparse._MutuallyExclusiveGroup],
        prefix: str | None = None,
    ) -> None:
        shown = [g for g in groups if any(a.help is not argparse.SUPPRESS for a in g._group_actions)]
        super().add_usage(usage, actions, shown, prefix)


_FORMATTERS: dict[type[argparse.HelpFormatter], type[argparse.HelpFormatter]] = {}


def _formatter(cls: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """`cls` with the usage line of _ShownGroupsUsage."""
    if issubclass(cls, _ShownGroupsUsage):
        return cls
    if cls not in _FORMATTERS:
        _FORMATTERS[cls] = type(f"Shown{cls.__name__}", (_ShownGroupsUsage, cls), {})
    return _FORMATTERS[cls]


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                yield from _parsers(nested)


def add_help_all(parser: argparse.ArgumentParser) -> None:
    """`--help-all` on `parser` and on every parser under it; their advanced options
    leave `--help`, whose epilog then says how many there are and where they are."""
    for p in _parsers(parser):
        if any("--help-all" in action.option_strings for action in p._actions):
            continue
        if isinstance(p.formatter_class, type) and issubclass(p.formatter_class, argparse.HelpFormatter):
            p.formatter_class = _formatter(p.formatter_class)
        help_all = p.add_argument("--help-all", action=_HelpAllAction)
        assert isinstance(help_all, _HelpAllAction)
        hidden = 0
        for action in p._actions:
            if action in _ADVANCED and action.help is not argparse.SUPPRESS:
                help_all.full_help[action] = action.help
                action.help = argparse.SUPPRESS
                hidden += 1
            elif action in _BRIEF:
                help_all.full_help[action] = action.help
                action.help = _BRIEF[action]
        if hidden:
            note = f"{hidden} more option{'s' if hidden > 1 else ''}: {p.prog} --help-all"
            p.epilog = f"{p.epilog} {note}" if p.epilog else note
