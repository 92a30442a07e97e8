#!/usr/bin/env python3
"""A `pyspice` command (bench, sim, eval) with one SPICE level's constants replaced,
for A/B runs of a constant before it is changed in pyspice/policy/spice/config.py.

    scripts/with-spice-config.py plan_every=1,rule_next=0 -- bench -m smolmoe-b \\
        --policies spice:exact@sync,spice:exact@async --device-budget 25% -n 32 -t 1

The fields are SpiceConfig's (booleans as 0/1); `--level` picks the level (default
spice:exact). Everything after `--` is the pyspice command line, unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from pyspice.cli.main import main as pyspice_main
from pyspice.policy.spice import config


def parse_fields(text: str) -> dict[str, object]:
    """`a=1,b=0.4` as SpiceConfig values of each field's type."""
    hints = typing.get_type_hints(config.SpiceConfig)
    out: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in hints or name == "name":
            known = ", ".join(f for f in hints if f != "name")
            raise SystemExit(f"with-spice-config: {item!r} is not FIELD=VALUE of SpiceConfig ({known})")
        kind = hints[name]
        if typing.get_origin(kind) is typing.Literal:  # e.g. miss_mode
            choices = typing.get_args(kind)
            if value not in choices:
                raise SystemExit(f"with-spice-config: {name} is one of {choices}, not {value!r}")
            out[name] = value
        else:
            out[name] = value not in ("0", "false", "False") if kind is bool else kind(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fields", help="FIELD=VALUE[,FIELD=VALUE...] of SpiceConfig")
    ap.add_argument("--level", default="spice:exact", choices=sorted(config.QUALITY_LEVELS))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then a pyspice command line")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    shipped = config.QUALITY_LEVELS[args.level]
    config.QUALITY_LEVELS[args.level] = dataclasses.replace(shipped, **parse_fields(args.fields))
    print(f"with-spice-config: {args.level} with {args.fields}", file=sys.stderr)
    return pyspice_main(command)


if __name__ == "__main__":
    sys.exit(main())
