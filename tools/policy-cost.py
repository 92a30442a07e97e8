"""Where a Python policy's time goes inside the graph, per hook call (default model: smolmoe).

Runs the prompt, then greedy decode steps, with each policy (runs interleaved,
medians reported); per decode hook call (prompt calls in their own column):
  C us        the policy time libspice measures around the callback (bench's `pol us/call`,
              which also averages in the prompt's calls)
  entry       C us minus the time inside Policy.decide: the cffi callback, the HookCall
              lookup and writing the plan (lookup and write also on their own)
  decide      the time inside Policy.decide
and, for SPICE policies, decide split into misses (the miss handler), look-ahead
(Algorithm 1; rollout is its predictor product) and planner (prefetch/evict),
other (the rest), and the share of decode calls that planned; then each policy's C us
less the first policy's, paired by repeat (the machine's drift cancels). The timers add a
microsecond or two each inside the graph, so C us here is above bench's; compare
policies within one run. `--set plan_every=1` etc. override SpiceConfig fields of
every SPICE policy; `spice:exact@plan_every=4,h_max=6` those of one entry.

    flock /tmp/pyspice-heavy.lock python tools/policy-cost.py \\
        --policies exact-py,spice:exact,spice:balanced --device-budget 25% -t 2 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import pyspice.policy.spice.policy as spice_module
from pyspice.cli.common import add_context_args, add_model_args, add_sidecar_arg, open_model
from pyspice.engine.decode_trace import greedy_next
from pyspice.policy import make_policy
from pyspice.policy.spice import SpiceConfig, SpicePolicy

PROMPT = (
    "The history of computing is a story of machines that grew smaller, faster and more capable, "
    "from rooms full of vacuum tubes to processors that fit in a pocket. Each generation"
)
PHASES = ("misses", "look-ahead", "planner")  # rollout: the part of look-ahead in the predictor


@dataclass
class Timers:
    ns: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[label] = self.ns.get(label, 0) + clock() - t0
                self.counts[label] = self.counts.get(label, 0) + 1

        return timed

    def clear(self) -> None:
        self.ns.clear()
        self.counts.clear()


def instrument(policy: Any, timers: Timers) -> Callable[[], None]:
    """Time the policy's decide (and a SPICE policy's phases); returns the undo."""
    setattr(policy, "decide", timers.wrap("decide", policy.decide))  # noqa: B010
    if not isinstance(policy, SpicePolicy):
        return lambda: None
    misses = policy.misses
    for method in ("decide_step", "decide"):  # decide_step: the plain-Python decode path
        if hasattr(misses, method):
            setattr(misses, method, timers.wrap("misses", getattr(misses, method)))
    setattr(policy.planner, "plan", timers.wrap("planner", policy.planner.plan))  # noqa: B010
    if hasattr(policy.predictor, "stacked_logits"):  # the rollout inside the look-ahead
        policy.predictor.stacked_logits = timers.wrap("rollout", policy.predictor.stacked_logits)  # type: ignore[attr-defined]
    original = getattr(spice_module, "look_ahead")  # noqa: B009
    setattr(spice_module, "look_ahead", timers.wrap("look-ahead", original))  # noqa: B010

    def undo() -> None:
        setattr(spice_module, "look_ahead", original)  # noqa: B010
        policy.predictor.__dict__.pop("stacked_logits", None)

    return undo


@dataclass
class Row:
    name: str
    c_us: list[float] = field(default_factory=list)
    prompt_us: list[float] = field(default_factory=list)
    decide_us: list[float] = field(default_factory=list)
    extra_us: dict[str, list[float]] = field(default_factory=dict)  # lookup, write, rollout
    phase_us: dict[str, list[float]] = field(default_factory=dict)
    planning: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)


def run_policy(
    llm: Any, row: Row, prompt: list[int], n_decode: int, overrides: dict[str, Any], timed: bool = True
) -> None:
    """One run of one policy: its numbers are appended to `row` (timed=False: C us, TPOT
    and hit rate only, without the timers' own cost)."""
    name, _, own = row.name.partition("@")
    policy = make_policy(name)
    overrides = {**overrides, **parse_overrides(own.split(",") if own else [])}
    if isinstance(policy, SpicePolicy) and overrides:
        policy = SpicePolicy(replace(policy.config, **overrides))
    if policy is None:
        raise ValueError(f"{name!r} is not a Python policy: nothing to measure")
    timers = Timers()
    llm.set_policy(policy)
    undo = instrument(policy, timers) if timed else lambda: None
    runtime = llm._spice_runtime
    for method, label in (("_hook_call", "lookup"), ("_write_plan", "write")):
        if timed and hasattr(runtime, method):  # the runtime's own steps of the entry
            setattr(runtime, method, timers.wrap(label, getattr(runtime, method)))
    try:
        llm.reset()
        llm.spice_reset_stats()
        llm.eval(prompt)
        row.prompt_us.append(float(llm.spice_stats()["policy_us_per_call"]))
        timers.clear()
        llm.spice_reset_stats()
        token = greedy_next(llm)
        for _ in range(n_decode):
            llm.eval([token])
            token = greedy_next(llm)
    finally:
        undo()
        for method in ("_hook_call", "_write_plan"):
            runtime.__dict__.pop(method, None)
    stats = llm.spice_stats()
    calls = max(1, int(stats["hook_calls"]))
    row.c_us.append(float(stats["policy_us_per_call"]))
    row.tpot_ms.append(float(stats["tpot_ms"]))
    row.hit_rate.append(float(stats.get("hit_rate", 0.0)))
    row.decide_us.append(timers.ns.get("decide", 0) / 1e3 / calls)
    for label in ("lookup", "write", "rollout"):
        row.extra_us.setdefault(label, []).append(timers.ns.get(label, 0) / 1e3 / calls)
    for phase in PHASES:
        row.phase_us.setdefault(phase, []).append(timers.ns.get(phase, 0) / 1e3 / calls)
    row.planning.append(timers.counts.get("planner", 0) / calls)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """FIELD=VALUE strings -> SpiceConfig overrides (ValueError names a bad one)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in {f.name for f in fields(SpiceConfig)} or not value:
            raise ValueError(f"{item!r}: expected FIELD=VALUE with a SpiceConfig field")
        kind = type(getattr(SpiceConfig("x"), key))
        overrides[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return overrides


def table(rows: list[Row]) -> str:
    med = statistics.median
    w = max(16, *(len(r.name) for r in rows))
    head = (
        f"{'policy':<{w}} {'C us':>7} {'entry':>7} {'lookup':>7} {'write':>7} {'decide':>7} "
        + " ".join(f"{p:>10}" for p in PHASES)
        + f" {'rollout':>7}"
        + f" {'other':>7} {'planning':>8} {'prompt us':>9} {'TPOT ms':>8} {'hit':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        c, d = med(r.c_us), med(r.decide_us)
        phases = [med(r.phase_us[p]) for p in PHASES]
        spice = any(phases)
        cells = " ".join(f"{v:>10.1f}" if spice else f"{'-':>10}" for v in phases)
        other = f"{d - sum(phases):>7.1f}" if spice else f"{'-':>7}"
        planning = f"{med(r.planning):>8.2f}" if spice else f"{'-':>8}"
        lines.append(
            f"{r.name:<{w}} {c:>7.1f} {c - d:>7.1f} {med(r.extra_us['lookup']):>7.1f} "
            f"{med(r.extra_us['write']):>7.1f} {d:>7.1f} {cells} {med(r.extra_us['rollout']):>7.1f} "
            f"{other} {planning} "
            f"{med(r.prompt_us):>9.1f} {med(r.tpot_ms):>8.2f} {med(r.hit_rate):>6.3f}"
        )
    # runs of one repeat ran side by side: their differences shed the machine's drift
    base = rows[0]
    for r in rows[1:]:
        diff = [a - b for a, b in zip(r.c_us, base.c_us, strict=True)]
        lines.append(
            f"{r.name:<{w}} C us - {base.name}'s, paired by repeat: median {med(diff):+.1f} "
            f"(min {min(diff):+.1f}, max {max(diff):+.1f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument(
        "--policies",
        default="exact-py,spice:exact",
        help="comma-separated Python policies (separated by ';' when one has @FIELD=VALUE,... overrides)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="decode steps per run (default 32)")
    p.add_argument(
        "--plain",
        action="store_true",
        help="no timers inside the policy: C us only (bench's figure, decode calls)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per policy; medians reported (default 3)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a SpiceConfig field of the SPICE policies (e.g. plan_every=1); repeatable",
    )
    args = p.parse_args(argv)
    if args.device_budget is None:
        args.device_budget = "25%"
    names = [n.strip() for n in args.policies.split(";" if "@" in args.policies else ",") if n.strip()]
    try:
        overrides = parse_overrides(args.set)
        for name in names:
            parse_overrides(name.partition("@")[2].split(",") if "@" in name else [])
    except ValueError as exc:
        p.error(str(exc))
    first = next((n for n in names if n != "exact-py"), names[0])
    llm = open_model(args, first.partition("@")[0])
    body = llm.tokenize(PROMPT.encode(), add_bos=True)
    prompt = (body[:1] + body[1:] * (args.prompt_tokens // max(1, len(body) - 1) + 1))[: args.prompt_tokens]
    rows = [Row(name) for name in names]
    # runs interleaved, so that a burst of other load on the machine hits every policy alike
    for r in range(args.repeat):
        for row in rows:
            print(f"policy-cost: run {r + 1}/{args.repeat}: {row.name}", file=sys.stderr)
            run_policy(llm, row, prompt, args.n_predict, overrides, timed=not args.plain)
    print(table(rows))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
