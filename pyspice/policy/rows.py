"""The one grammar of bench and sim rows: `NAME[@key=value,...]`.

    lru                         a policy as it is
    spice:exact@plan=async      planned on the planner thread (free-running)
    spice@plan=det2             deterministic asynchronous planning, 2 layers late
    exact@ram=50%               edge mode: the row's own RAM budget
    lru@device=2GiB,plan=sync   the row's own device budget

Keys: `plan` (sync, async or detK with K = 1..64), `ram` and `device` (budgets:
2GiB, 512MiB, 25%). `NAME@sync`, `NAME@async` and `NAME@detK` are short for
`NAME@plan=...`. In a comma-separated list of rows a piece holding `=` belongs to
the row before it (policy names never hold one), so `spice@plan=async,ram=2GiB,lru`
is two rows. Every consumer takes the parsed `PolicyRow`; nothing re-reads the text.

A row's label (what tables and JSON name it by) writes the plan short, first:
`spice:exact@async`, `lru@det2,ram=25%`, as bench and sim rows were always written
and recorded, so a recorded name parses back to the row that ran it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from pyspice.policy.registry import PolicySpec, policy_spec
from pyspice.units import Budget, parse_budget

Planning = Literal["sync", "async"]
ROW_KEYS = ("plan", "ram", "device")
MAX_PLAN_LAG = 64
GRAMMAR = "NAME[@key=value,...] with keys plan (sync, async, detK), ram and device (budgets: 2GiB, 25%)"


@dataclass(frozen=True)
class PolicyRow:
    """One row: a shipped policy (spec) or another row the command knows (spec None:
    `upstream` and its placements), with what the row sets for itself."""

    name: str
    spec: PolicySpec | None = None
    planning: Planning | None = None  # None: as the command plans
    plan_lag: int = 0  # deterministic asynchronous planning: layers late (0: free-running)
    ram: Budget | None = None
    device: Budget | None = None
    ram_text: str = ""  # the budgets as written, for labels that read as the user wrote them
    device_text: str = ""

    @property
    def plan(self) -> str | None:
        """Where the row plans as the grammar writes it: sync, async, detK (None: as the command plans)."""
        if self.planning is None:
            return None
        return f"det{self.plan_lag}" if self.plan_lag else self.planning

    @property
    def label(self) -> str:
        """The row in canonical form (what tables and JSON name it by); it parses back to
        the same row. The plan comes short and first: a shorthand after a comma would
        start a row of its own in a list (split_rows)."""
        keys = []
        if self.plan is not None:
            keys.append(self.plan)
        if self.ram is not None:
            keys.append(f"ram={self.ram_text}")
        if self.device is not None:
            keys.append(f"device={self.device_text}")
        return self.name + ("@" + ",".join(keys) if keys else "")


def _planning(row: str, value: str) -> tuple[Planning, int]:
    if value in ("sync", "async"):
        return ("sync" if value == "sync" else "async"), 0
    if value.startswith("det") and value[3:].isdigit() and 1 <= int(value[3:]) <= MAX_PLAN_LAG:
        return "async", int(value[3:])
    raise ValueError(f"row {row!r}: plan is sync, async or detK (K = 1..{MAX_PLAN_LAG} layers of lag)")


def parse_row(text: str, others: Iterable[str] = ()) -> PolicyRow:
    """One row of the grammar; `others`: the names besides the policies this command
    accepts (their rows carry no spec). An unknown name, key or bad value is a
    ValueError naming the row and what is allowed."""
    row = text.strip()
    name, _, rest = (part.strip() for part in row.partition("@"))
    known_others = tuple(others)
    spec = None
    if name not in known_others:
        try:
            spec = policy_spec(name)
        except ValueError as exc:  # the policy list, and the command's other rows
            also = f", or {', '.join(known_others)}" if known_others else ""
            raise ValueError(f"row {row!r}: {exc}{also}") from None
    values: dict[str, str] = {}
    for item in (p.strip() for p in rest.split(",")) if rest else ():
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq and (key in ("sync", "async") or key.startswith("det")):
            key, value = "plan", key
        elif key not in ROW_KEYS or not value:
            raise ValueError(f"row {row!r}: {item!r} is not a key=value of the row grammar, {GRAMMAR}")
        if key in values:
            raise ValueError(f"row {row!r}: {key} is given twice")
        values[key] = value
    planning, lag = _planning(row, values["plan"]) if "plan" in values else (None, 0)
    if planning == "async" and spec is not None and not spec.asynchronous:
        raise ValueError(f"row {row!r}: {name} plans in the hook's call only: no plan=async or detK")
    budgets: dict[str, Budget] = {}
    for key in ("ram", "device"):
        if key in values:
            try:
                budgets[key] = parse_budget(values[key])
            except ValueError as exc:
                raise ValueError(f"row {row!r}: {key}: {exc}") from None
    return PolicyRow(name, spec, planning, lag, budgets.get("ram"), budgets.get("device"),
                     values.get("ram", ""), values.get("device", ""))  # fmt: skip


def split_rows(text: str) -> list[str]:
    """A comma-separated list of rows, each row's own `key=value` pieces kept with it."""
    rows: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and "@" not in piece and rows:
            rows[-1] += "," + piece
        else:
            rows.append(piece)
    return rows


def parse_rows(text: str, others: Iterable[str] = ()) -> list[PolicyRow]:
    """Every row of a comma-separated list (`--policies`), parsed; at least one, and no
    row twice (results are keyed by label: a second would overwrite the first)."""
    names = tuple(others)
    rows = [parse_row(r, names) for r in split_rows(text)]
    if not rows:
        raise ValueError(f"--policies needs at least one row, {GRAMMAR}")
    seen: set[str] = set()
    for row in rows:
        if row.label in seen:
            raise ValueError(f"--policies names row {row.label!r} twice")
        seen.add(row.label)
    return rows


def rows_argument(
    others: Iterable[str] = (), *, keys: Iterable[str] = ROW_KEYS
) -> Callable[[str], list[PolicyRow]]:
    """An argparse `type=` for `--policies`: the rows, parsed while the arguments are, so
    a bad row is a usage error before any model loads. `keys`: those the command's rows
    may set (sim's budgets are its own options, for every row)."""
    names, allowed = tuple(others), tuple(keys)

    def parse(text: str) -> list[PolicyRow]:
        try:
            rows = parse_rows(text, names)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        for row in rows:
            set_by_row = (("plan", row.planning), ("ram", row.ram), ("device", row.device))
            given = [k for k, v in set_by_row if v is not None]
            refused = [k for k in given if k not in allowed]
            if refused:
                raise argparse.ArgumentTypeError(
                    f"row {row.label!r}: this command's rows take no {refused[0]}= "
                    f"(keys here: {', '.join(allowed) or 'none'})"
                )
        return rows

    parse.__name__ = "rows"  # argparse names the type in a message it words itself
    return parse
