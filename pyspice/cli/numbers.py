"""argparse types for numeric flags: each flag's range is one rule, checked while
parsing, so a bad value is one line naming the flag, the value and what is
allowed (`argument --chunks: 0 is not allowed: at least 1 ...`) before any
model loads. Settings that the API takes too are checked again, by the same
kind of rule, in pyspice.engine.checks."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from pyspice.units import parse_budget


def integer(minimum: int, maximum: int | None = None, hint: str = "") -> Callable[[str], int]:
    """An integer in [minimum, maximum]; `hint` says what the flag means at its edge."""

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            allowed = f"at least {minimum}" if maximum is None else f"{minimum} to {maximum}"
            raise argparse.ArgumentTypeError(
                f"{value} is not allowed: {allowed}" + (f" ({hint})" if hint else "")
            )
        return value

    return parse


def real(minimum: float, maximum: float | None = None, hint: str = "") -> Callable[[str], float]:
    """A finite number in [minimum, maximum]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
            allowed = f"at least {minimum:g}" if maximum is None else f"{minimum:g} to {maximum:g}"
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: {allowed}" + (f" ({hint})" if hint else "")
            )
        return value

    return parse


def positive_real(hint: str = "") -> Callable[[str], float]:
    """A finite number above 0."""

    def parse(text: str) -> float:
        value = real(0.0, hint=hint)(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: above 0" + (f" ({hint})" if hint else "")
            )
        return value

    return parse


def byte_size(hint: str = "") -> Callable[[str], int]:
    """A byte count: 123456 or with a unit (2GiB, 512MiB, 1.5GB); no share (%)."""

    def parse(text: str) -> int:
        if text.strip().endswith("%"):
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: bytes with a unit (2GiB, 512MiB), not a share"
                + (f" ({hint})" if hint else "")
            )
        try:
            budget = parse_budget(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size: bytes with a unit (2GiB, 512MiB, 1.5GB) or a plain count"
            ) from None
        assert budget.bytes is not None
        return budget.bytes

    return parse


def budget_text(text: str) -> str:
    """A tier budget (2GiB, 512MiB, 25%), checked while parsing and kept as written: the
    engine sizes it once the model's expert bytes are known (RunConfig.resolve)."""
    try:
        parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def budget_list(text: str) -> str:
    """A comma-separated list of budgets (`pyspice sim`), each checked while parsing."""
    for item in (x for x in text.split(",") if x.strip()):
        budget_text(item)
    return text


PORT = integer(0, 65535, "0 picks a free port")
THREADS = integer(1, hint="leave -t out to use every core")
TOKENS = integer(1, hint="tokens to generate")
CHUNKS = integer(1, hint="leave --chunks out to score them all")
