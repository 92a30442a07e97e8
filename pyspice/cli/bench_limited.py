"""`pyspice bench --memory-limit BYTES`: every row in its own process and memory cgroup
with that limit, the model's pages dropped from the page cache before each
(pyspice.measure.limited_bench), threads equal across rows.

Rows are --policies rows (pyspice.policy.rows): `upstream` (plain
llama_cpp.Llama, mmap on, as upstream users run it) or a pyspice policy,
optionally with budgets and planning of its own (`exact@ram=50%`,
`spice:exact@async,ram=2GiB`), passed to the row's RunConfig. A --ram-budget
given to the whole command reaches every pyspice row through the same
RunConfig; `upstream` never has one.

`--memory-limit rule` takes the limit edge mode is judged at
(pyspice.measure.memory_rule): the highest cgroup peak among floor rows, `exact`
and each row's policy at the smallest RAM budget, run first as the rows run (same
sidecar, prompt and threads) under no effective limit, plus half the
routed-expert bytes. Floor rows run in the same command because the peak moves
with what a row loads (a sidecar, SPICE's draft maps) and with what the page
cache already holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from pyspice.cli.common import note, resolve_model, run_config
from pyspice.cli.numbers import byte_size
from pyspice.engine.config import RunConfig
from pyspice.engine.replay import trace_decode_start
from pyspice.formats.model_info import inspect_model
from pyspice.formats.sidecar import default_sidecar_path
from pyspice.measure.bench import DEFAULT_PROMPT, baseline_label, fit_prompt, row_planning, stderr_progress
from pyspice.measure.isolated_row import UPSTREAM, RowSpec, config_fields
from pyspice.measure.limited_bench import RowOutcome, run_limited_bench, tokenize
from pyspice.measure.limited_report import format_limited_table, limited_document, limited_plot
from pyspice.measure.memlimit import system_layout
from pyspice.measure.memory_rule import (
    RULE,
    RuleLimit,
    floor_policies,
    floor_row_name,
    format_rss_bounds,
    over_limit_rows,
    rss_bounds,
    rule_limit,
    rule_warning,
)
from pyspice.measure.upstream_rows import UPSTREAM_CPU_EXPS, UPSTREAM_NCMOE
from pyspice.policy.rows import PolicyRow, parse_row
from pyspice.units import format_bytes

GPU_ROWS = (UPSTREAM_NCMOE, UPSTREAM_CPU_EXPS)


def check_rows(rows: list[PolicyRow]) -> None:
    """What a row in a process of its own cannot be: llama.cpp with a tier or a plan
    (upstream is plain llama.cpp from its mmap), or a row that splits the experts with
    a GPU; errors naming the fix, before any work."""
    for row in rows:
        if row.name == UPSTREAM and row.label != UPSTREAM:
            raise ValueError(
                f"row {row.label!r}: upstream is plain llama.cpp from its mmap, it has no budget or "
                "planning of its own; write 'upstream'"
            )
        if row.name in GPU_ROWS:
            raise ValueError(
                f"row {row.label!r} splits the experts between GPU and CPU; --memory-limit rows measure "
                "the host: leave it out (or run it without --memory-limit)"
            )


def parse_memory_limit(text: str) -> int | str:
    """--memory-limit: bytes with a unit (2GiB, 512MiB), or `rule`."""
    if text.strip().lower() == RULE:
        return RULE
    return byte_size("or 'rule': exact's minimum plus half the routed-expert bytes")(text)


def row_config(args: argparse.Namespace, row: PolicyRow, threads: int) -> RunConfig:
    """The row's RunConfig: the command's, with what the row sets for itself over it."""
    if row.name == UPSTREAM:  # plain llama.cpp from its mmap: no tier, no hook to replay routing
        args = argparse.Namespace(
            **{**vars(args), "ram_budget": None, "device_budget": None, "replay_routing": None}
        )
    policy = "stock" if row.name == UPSTREAM else row.name
    config = dataclasses.replace(run_config(args, policy), threads=threads)
    # as written: RunConfig resolves a budget's text itself, and records it as given
    if row.ram is not None:
        config = dataclasses.replace(config, ram_budget=row.ram_text)
    if row.device is not None:
        config = dataclasses.replace(config, device_budget=row.device_text)
    planning = row_planning(row)
    if planning is not None:  # the command's --max-plan-lag still holds
        planning = dataclasses.replace(planning, max_lag=config.planning.max_lag)
        config = dataclasses.replace(config, planning=planning)
    return config


def run(args: argparse.Namespace) -> int:
    rows: list[PolicyRow] = list(args.policies)
    check_rows(rows)
    labels = [r.label for r in rows]
    baseline = baseline_label(args.baseline) if args.baseline is not None else labels[0]
    if baseline not in labels:
        raise ValueError(f"baseline {args.baseline!r} is not among the rows of --policies {','.join(labels)}")
    if args.repeat < 2:
        raise ValueError("--memory-limit needs --repeat of at least 2 (the first run is the cold start)")
    if args.n_predict < 2:
        raise ValueError("--memory-limit needs -n of at least 2 (TPOT and bytes are per decoded token)")
    if args.trace:
        raise ValueError("--trace records in one process: leave it out with --memory-limit")
    if args.replay_routing is not None and any(row.name == UPSTREAM for row in rows):
        note(
            "--replay-routing: the pyspice rows replay the trace's routing; upstream is plain llama.cpp, "
            "which has no hook to replay it, so it routes by the model's own router (on a random-weight "
            "model, at random): compare it with the others as a different workload"
        )
    layout = system_layout()  # no cgroup here: fail before the model is touched
    model = resolve_model(args, role="benchmark")
    text = Path(args.file).read_text(encoding="utf-8") if args.file else (args.prompt or DEFAULT_PROMPT)
    prompt = fit_prompt(tokenize(model, text), args.prompt_tokens)
    if len(prompt) + args.n_predict > args.ctx_size:
        raise ValueError(f"prompt ({len(prompt)} tokens) + -n {args.n_predict} exceed -c {args.ctx_size}")
    threads = args.threads or max(1, os.cpu_count() or 1)

    def spec_of(row: PolicyRow) -> RowSpec:
        config = config_fields(row_config(args, row, threads))
        return RowSpec(row.label, row.name, config, list(prompt), args.n_predict, args.repeat)

    specs = [spec_of(row) for row in rows]
    sidecar = args.sidecar or default_sidecar_path(model)
    files = [model] + ([sidecar] if sidecar.is_file() else [])
    limit = args.memory_limit
    rule: RuleLimit | None = None
    budgets = [
        (row.label, row.name, None if row.name == UPSTREAM else spec.config.get("ram_budget"))
        for row, spec in zip(rows, specs, strict=True)
    ]
    if limit == RULE:
        # each policy at the smallest RAM budget, planning as the command does
        floors = [parse_row(floor_row_name(p)) for p in floor_policies([r.name for r in rows])]
        whole = inspect_model(model).whole_tier_bytes
        stderr_progress(
            "the limit by the rule: first "
            + ", ".join(f.label for f in floors)
            + ", the highest cgroup peak of which sets it"
        )

        def measure(spec: RowSpec, roomy: int) -> RowOutcome:
            return run_limited_bench([spec], layout, roomy, files, stderr_progress)[0]

        rule = rule_limit([spec_of(f) for f in floors], whole, measure)
        limit = rule.limit
        peaks = ", ".join(
            f"{floor_row_name(p)} {format_bytes(o.cgroup_peak or 0)}" for p, o in rule.floors.items()
        )
        stderr_progress(
            f"memory limit {format_bytes(limit)}: {floor_row_name(rule.highest)}'s cgroup peak "
            f"{format_bytes(rule.highest_outcome.cgroup_peak or 0)} + half of {format_bytes(whole)} "
            f"of routed experts (rounded up to a MiB); floor peaks: {peaks}"
        )
        for line in filter(None, [rule_warning(o) for o in rule.floors.values()]):
            stderr_progress(line)
        for line in over_limit_rows(rule, budgets):
            stderr_progress(line)
    stderr_progress(
        f"{model.name}: {len(prompt)} prompt tokens, {args.n_predict} decoded, 1 cold + {args.repeat - 1} "
        f"warm runs per row, {threads} threads, memory limit {format_bytes(limit)} "
        f"(cgroup v{layout.version} under {layout.parent})"
    )
    outcomes = run_limited_bench(specs, layout, limit, files, stderr_progress)
    rule_record: dict[str, Any] = {}
    if rule is not None:
        rule_record = rule.record()
        bounds = rss_bounds(budgets, outcomes, rule)
        rule_record["rss_bounds"] = bounds
        if bounds:
            stderr_progress(format_rss_bounds(bounds))
    if args.json:
        header = {
            "model": str(model),
            "memory_limit": limit,
            **({"memory_limit_rule": rule_record} if rule_record else {}),
            "cgroup_version": layout.version,
            "prompt_tokens": len(prompt),
            "n_predict": args.n_predict,
            "runs": args.repeat,
            "threads": threads,
            # the pyspice rows' routing (timing only); upstream routes by its own router
            "replay_routing": str(args.replay_routing) if args.replay_routing is not None else None,
            # where the replayed decode started, so the simulator replays the runs' window
            "replay_decode_start": (
                trace_decode_start(Path(args.replay_routing), len(prompt))
                if args.replay_routing is not None
                else None
            ),
            "history_predictor": str(args.history_predictor) if args.history_predictor is not None else None,
        }
        json.dump(limited_document(outcomes, baseline, header), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_limited_table(outcomes, baseline, limit, layout.version))
    if args.plot:
        title = (
            f"{model.name}: memory limit {format_bytes(limit)}, {len(prompt)}-token prompt, "
            f"{args.n_predict} decoded (warm runs)"
        )
        limited_plot(outcomes, baseline, args.plot, title)
        print(f"bench: plot written to {args.plot}", file=sys.stderr)
    failed = [o for o in outcomes if o.status in ("error", "crashed")]
    for o in failed:
        print(f"bench: row {o.spec.row} failed: {o.message}", file=sys.stderr)
    invalid = [o for o in outcomes if any(r.get("stats", {}).get("policy_fallbacks") for r in o.runs)]
    for o in invalid:
        print(f"bench: {o.spec.row} had policy fallbacks: this run is INVALID", file=sys.stderr)
    # an OOM-killed row is a measurement (the limit was too small for it), not a failure
    return 1 if failed or invalid else 0
