"""`pyspice sim`: replay a recorded trace through policies on simulated hardware.

The source model (-m) gives the policies their routers and the trace its
geometry; a trace of routing alone (`pyspice trace import`) needs none, its
header carries layers, experts and k, and it runs every policy that reads
expert ids only (SPICE with --history-predictor, adapmoe without its gate);
--target gives the sizes to simulate (a 57B model on an RTX 4060),
--profile the hardware (shipped profiles, a JSON file, `emulated`: this
machine with its emulated device, from `pyspice probe`, or `disk`: edge mode
on this machine, the source model's experts read from its file into a RAM slot
pool of --ram-budget, the disk as `pyspice probe` measured it). Every figure is
simulated and labelled so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.cli.common import add_model_args, note, resolve_model
from pyspice.cli.help_levels import advanced
from pyspice.cli.numbers import budget_list, real
from pyspice.cli.sim_fit_cmd import register_fit
from pyspice.cli.sim_predict_cmd import add_target_layers_arg, run_predict
from pyspice.formats.profile import profile_path
from pyspice.formats.routers import RouterReader
from pyspice.formats.sidecar import Sidecar
from pyspice.formats.trace import TraceReader
from pyspice.policy.registry import SIM_ONLY_ROWS, UPSTREAM_MOECACHE, inputs_verdict
from pyspice.policy.rows import PolicyRow, parse_row, rows_argument
from pyspice.policy.spice.history_lookahead import HistoryLookahead
from pyspice.policy.spice.routing_history import RoutingHistory
from pyspice.sim.hardware import DISK, EMULATED, load_profile
from pyspice.sim.report import SimConfig, format_tables, plot, simulate_all, stderr_progress
from pyspice.sim.targets import TargetModel, load_target, source_target
from pyspice.sim.validate import compare, format_comparison, measured_policy_us, parse_compare
from pyspice.sim.workload import Workload, from_trace

DEFAULT_TARGET = "qwen2-57b-a14b:Q5_K_M"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sim", help="simulate policies on other hardware from a recorded trace", description=__doc__
    )
    add_model_args(p)
    advanced(
        p.add_argument("--sidecar", type=Path, help="the source model's sidecar (for policies that use one)")
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="trace directory (generate/bench --trace, or `pyspice trace import`); required",
    )
    advanced(
        p.add_argument(
            "--sequences",
            type=_sequence_range,
            metavar="FIRST-LAST",
            help="replay only these sequences of the trace (1-based, inclusive: an imported recording's "
            "prompts), e.g. the ones a --history-predictor was not fitted on",
        )
    )
    advanced(
        p.add_argument(
            "--history-predictor",
            type=Path,
            metavar="NPZ",
            help="SPICE predicts from expert ids with this routing-history predictor "
            "(`pyspice trace fit`); what SPICE needs on a trace of routing alone",
        )
    )
    p.add_argument(
        "--target",
        help="model sizes to simulate, NAME:QUANT (qwen2-57b-a14b, deepseek-v2-lite); "
        f"'source' = the source model's own sizes, on any profile (default {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--profile", default="rtx4060,a800", help="comma-separated hardware profiles (default rtx4060,a800)"
    )
    p.add_argument(
        "--device-budget",
        "--ram-budget",
        dest="device_budget",
        type=budget_list,
        metavar="SIZES",
        default="25%,50%",
        help="comma-separated budgets of the tier: device memory, or RAM for the disk profile "
        "(--ram-budget is the same option; default 25%%,50%%)",
    )
    p.add_argument(
        "--policies",
        metavar="ROWS",
        type=rows_argument(SIM_ONLY_ROWS, keys=("plan",)),
        default="host,static,ondemand,lru,adapmoe,exact",
        help="comma-separated rows, NAME or NAME@sync, NAME@async, NAME@detK (SPICE planning "
        "synchronously, asynchronously, deterministically K layers late), or "
        f"{UPSTREAM_MOECACHE} (upstream llama.cpp's GPU expert cache, simulated only); "
        "default host,static,ondemand,lru,adapmoe,exact",
    )
    advanced(
        p.add_argument(
            "--moe-cache-cpu-share",
            type=real(0.0, 1.0, "the share of the cache's misses run on the host, not uploaded"),
            default=0.0,
            metavar="F",
            help=f"{UPSTREAM_MOECACHE}: the share of its misses run on the host instead of uploaded, "
            "as upstream's --moe-cache-cpu-share (default 0)",
        )
    )
    advanced(
        p.add_argument(
            "--policy-us",
            default="",
            help="measured microseconds per call, ROW=US,... (default: time each decide() here and add "
            "the profile's cost of reaching Python)",
        )
    )
    advanced(
        p.add_argument(
            "--policy-us-from",
            type=Path,
            metavar="BENCH_JSON",
            help="take each policy's measured us per call from a `pyspice bench --json` document",
        )
    )
    advanced(
        p.add_argument(
            "--compare",
            default="",
            metavar="BUDGET=BENCH_JSON[+BENCH_JSON],...",
            help="validate: compare simulated TPOT with `pyspice bench --json` runs of the same budgets "
            "(repeats of several runs pool); without --policy-us-from, each policy's us per call is theirs",
        )
    )
    advanced(
        p.add_argument(
            "--probe",
            type=Path,
            help="cost profile (`pyspice probe`) for `emulated` and `disk` (default: the source model's "
            "saved one; `disk` falls back to profiles/disk.json without it)",
        )
    )
    advanced(
        p.add_argument(
            "--show-profiles",
            action="store_true",
            help="print every value of the --profile list with its source (measured, derived, ...) and exit",
        )
    )
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} as JSON')
    p.add_argument("--plot", metavar="PNG", help="draw speedup over adapmoe (paper Fig. 7 style)")
    advanced(
        p.add_argument(
            "--predict",
            action="append",
            metavar="RECORD[:LINE]",
            help="predict each row of these `bench --json` runs on --profile and print it beside the "
            "measured TPOT; --trace is then the model's own routing, for runs that did not replay one",
        )
    )
    advanced(
        p.add_argument(
            "--replay-trace",
            type=Path,
            metavar="DIR",
            help="with --predict: the trace the runs replayed, where the path they recorded is not here",
        )
    )
    advanced(add_target_layers_arg(p))
    p.set_defaults(func=run)
    register_fit(sub)


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _label(name: str) -> str:
    """A row named elsewhere (a bench record, --policy-us) as the rows label it: the
    same row however it was written; a name the grammar refuses stays as it is, and
    matches no row."""
    try:
        return parse_row(name).label
    except ValueError:
        return name.strip()


def _sequence_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST-LAST (e.g. 800-999)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: sequences count from 1, FIRST <= LAST")
    return lo, hi


def _ids_only_model(args: argparse.Namespace, profiles: tuple[str, ...]) -> None:
    """A trace of routing alone without -m: say what it cannot do before simulating."""
    if args.target == "source":
        raise ValueError(
            "a trace of routing alone has no model file to size: give --target NAME:QUANT "
            "(e.g. deepseek-v2-lite:Q4_K_M), or -m with the model it was recorded on"
        )
    local = [n for n in profiles if n in (EMULATED, DISK)]
    if local:
        raise ValueError(
            f"profile {local[0]!r} replays on this machine's copy of the model: give -m MODEL "
            "(or a hardware profile such as h200)"
        )
    if args.sidecar is not None:
        raise ValueError("--sidecar belongs to a model: give -m MODEL with it")


def _check_ids_only_policies(rows: list[PolicyRow], history: bool) -> None:
    """Refuse a policy that needs what a trace of routing alone lacks; say what falls back
    (registry.inputs_verdict, the rule auto's ranking follows too)."""
    for row in rows:
        if row.spec is None:  # a sim-only row (SIM_ONLY_ROWS): it reads the ids alone
            continue
        verdict = inputs_verdict(row.spec, hidden_rows=False, routers=False, predictor=history)
        if verdict.missing:
            raise ValueError(
                f"policy {row.name!r} cannot run on this trace of routing alone: {verdict.missing}"
            )
        if verdict.fallback:
            note(f"{row.name}: the trace has no hidden rows for its gate, so it {verdict.fallback}")


def _note_geometry(workload: Workload, target: TargetModel) -> None:
    """An imported trace replayed at another model's sizes: say so (the sizes still apply)."""
    ours = (len(workload.moe_layers), max(workload.n_expert), workload.n_expert_used)
    theirs = (len(target.moe_layers), target.n_expert, target.n_expert_used)
    if ours != theirs:
        note(
            f"the trace routes {ours[0]} MoE layers x {ours[1]} experts, top-{ours[2]}; {target.name} "
            f"has {theirs[0]} x {theirs[1]}, top-{theirs[2]}: its sizes are scaled to the trace's layers"
        )


def source_expert_bytes(model: Path, n_layers: int) -> tuple[int, ...]:
    """Bytes of one routed expert per layer of the trace's `n_layers`, from the GGUF's
    expert tensors (the source model's own sizes, pyspice.sim.targets.source_target)."""
    per = source_target(model).expert_bytes
    return tuple(per[il] if il < len(per) else 0 for il in range(n_layers))


def run(args: argparse.Namespace) -> int:
    if args.predict:
        return run_predict(args)
    if args.target is None:
        args.target = DEFAULT_TARGET
    if args.show_profiles:
        for name in _split(args.profile):
            if name != EMULATED:
                print("\n".join(load_profile(name).describe()))
        return 0
    if args.trace is None:
        raise ValueError("pyspice sim needs --trace DIR (a trace recorded with --trace)")
    names = _split(args.profile)
    ids_only = TraceReader(args.trace).meta.ids_only
    model: Path | None = None
    if ids_only and not (args.model or args.model_pos):
        _ids_only_model(args, names)
    else:
        model = resolve_model(args, role="benchmark")  # the model the trace was recorded on, by default
    if args.sidecar is not None and not args.sidecar.is_file():
        raise ValueError(f"sidecar {args.sidecar} does not exist")
    history: RoutingHistory | None = None
    if args.history_predictor is not None:
        history = RoutingHistory.load(args.history_predictor)  # a bad file fails before the trace loads
    if ids_only:
        _check_ids_only_policies(args.policies, history is not None)
    workload = from_trace(args.trace, args.sequences)
    if workload.decoded_tokens == 0:
        raise ValueError(f"{args.trace}: the trace has no decoded tokens to simulate")
    probe_file = args.probe
    if probe_file is not None and not probe_file.is_file():
        raise ValueError(f"cost profile {probe_file} does not exist")
    if (EMULATED in names or DISK in names) and probe_file is None:
        assert model is not None  # _ids_only_model refused these profiles without one
        probe_file = profile_path(model)
        if EMULATED in names and not probe_file.is_file():
            raise ValueError(f"no cost profile for {model.name}: run `pyspice probe -m {model}` first")
    profiles = tuple(load_profile(n, probe_file) for n in names)
    for prof in profiles:
        if prof.disk:
            note(
                f"profile {prof.name}: {prof.description}; disk {prof.values['bus_gbps'].label()} GB/s, "
                f"{prof.values['bus_latency_us'].label()} us per read"
            )
    # "source": the recorded model's own sizes, for hardware profiles as well as `emulated`
    if args.target == "source" and model:
        target = source_target(model)
    else:
        target = load_target(args.target, args.target_layers)
    if ids_only and target is not None:
        _note_geometry(workload, target)
    policy_us: dict[str, float] = {}
    if args.policy_us_from is not None:
        measured = json.loads(args.policy_us_from.read_text()).get("policies", {})
        policy_us.update({_label(name): float(rec["policy_us_per_call"]) for name, rec in measured.items()})
    for item in _split(args.policy_us):
        name, _, value = item.rpartition("=")  # the row's own keys hold '=' too
        policy_us[_label(name)] = float(value)
    # only the emulated and disk profiles, which need the model, read the source's sizes
    expert_bytes = source_expert_bytes(model, workload.n_layers) if model else (0,) * workload.n_layers
    policy_us_by_budget = None
    if args.compare and args.policy_us_from is None:
        policy_us_by_budget = measured_policy_us(parse_compare(args.compare))
    cfg = SimConfig(
        profiles,
        _split(args.device_budget),
        tuple(args.policies),
        target,
        expert_bytes,
        policy_us,
        policy_us_by_budget,
        model=model,
        moe_cache_cpu_share=args.moe_cache_cpu_share,
    )
    note(
        f"simulating {workload.decoded_tokens} decoded tokens of {args.trace} "
        f"({len(workload.moe_layers)} MoE layers x {max(workload.n_expert)} experts, "
        f"top-{workload.n_expert_used})"
        + (
            f" with the sizes of {target.name}"
            if target and any(not p.simulates_source for p in profiles)
            else ""
        )
    )
    # a trace without hidden rows gives a router nothing to read: gates stay off (adapmoe's note)
    router = RouterReader(model) if model is not None and not ids_only else None
    extra: dict[str, Any] = {}
    if args.sidecar is not None and model is not None:
        sidecar = Sidecar.load(args.sidecar, model)
        errors = sidecar.surrogate_error
        extra = {
            "predictor": sidecar.predictor(router),
            "surrogate_error": lambda il: np.asarray(errors[il], np.float32) if il in errors else None,
            "surrogates_loaded": bool(errors),
            "reserved_bytes": sidecar.surrogate_bytes() if errors else 0,
        }
        note(f"sidecar {args.sidecar}: draft predictor and {len(errors)} layers of surrogates")
    if history is not None:
        extra["predictor"] = HistoryLookahead(history, workload.moe_layers)
        note(f"SPICE predicts from expert ids with {args.history_predictor}")
    rows = simulate_all(workload, cfg, router=router, context_extra=extra, progress=stderr_progress)
    if args.plot:
        sized = target is not None and any(not p.simulates_source for p in profiles)
        title = target.name if sized and target else model.name if model else args.trace.name
        plot(rows, args.plot, f"{title}, trace {args.trace.name}")
        note(f"plot written to {args.plot}")
    doc: dict[str, Any] = {"rows": rows, "simulated": True}
    if args.compare:
        doc["validation"] = compare(rows, parse_compare(args.compare))
    if args.json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_tables(rows))
        if "validation" in doc:
            print()
            print(format_comparison(doc["validation"]))
    return 0
