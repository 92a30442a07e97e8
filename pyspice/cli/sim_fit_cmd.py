"""`pyspice sim fit`: a hardware profile's costs fitted to recorded bench runs.

    pyspice sim fit RECORD[:LINE]... -o PROFILE.json --target deepseek-v2-lite:Q4_K_M --target-layers 8
    pyspice sim fit RECORD... -m MODEL --trace SAMPLE [--probe P] [--budget 25%] \
        (-o PROFILE.json | --save-to-probe)

A device run's record holds the engine's counters per call and per layer, and
the fit reads the costs off them (pyspice.sim.fit). An edge-mode run (the disk
tier, `--ram-budget`) has no such counters: its disk terms are fitted to the
rows' measured TPOTs and hit rates by replaying the routing auto ranks on
(pyspice.sim.fit_disk), so that form needs the model and a routing trace.
`--save-to-probe` writes those terms into the machine's saved probe of the
model, where `--policy auto` on the disk tier reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from pyspice.cli.sim_predict_cmd import add_target_layers_arg, target_of
from pyspice.engine.replay import replayed_workload
from pyspice.formats.profile import load_profile as load_cost_profile
from pyspice.formats.profile import profile_path, save_profile
from pyspice.policy.spice.routing_history import RoutingHistory
from pyspice.sim.fit import FitTerm, fit_terms, fitted_profile
from pyspice.sim.fit_disk import (
    DISK_TERMS,
    DiskRun,
    disk_fit_terms,
    disk_pricing,
    fit_disk,
    fitted_disk_profile,
    format_disk_predictions,
    predict_disk,
    read_disk_runs,
    select_disk_runs,
)
from pyspice.sim.hardware import load_profile
from pyspice.sim.records import select_runs, split_record_spec
from pyspice.sim.targets import source_target
from pyspice.sim.workload import Workload, from_trace, repeated

FIT_COMMAND = "sim fit"  # one command name of two words: main() joins `sim fit` into it
GPU_BASE = "h200-vm16"  # the base a device fit keeps the values its records cannot show from
DISK_BASE = "disk"


def register_fit(sub: Any) -> None:
    p = sub.add_parser(
        FIT_COMMAND,
        help="fit a hardware profile's costs to recorded `bench --json` runs",
        description="Fit a hardware profile's costs to recorded `pyspice bench --json` runs, for "
        "`pyspice sim --profile` and `pyspice sim --predict`. A device run's costs are read off the "
        "engine's counters; an edge-mode run's disk terms (-m and --trace given) are fitted to its "
        "measured TPOTs and hit rates.",
    )
    p.add_argument(
        "records", nargs="+", metavar="RECORD[:LINE[,LINE]]", help="bench --json files (or lines of them)"
    )
    p.add_argument("-o", "--output", type=Path, help="the profile JSON to write")
    p.add_argument(
        "--target",
        help="the runs' model sizes, NAME:QUANT (default: the record's model file, where it is here)",
    )
    add_target_layers_arg(p)
    p.add_argument(
        "--base",
        help=f"profile whose values the records cannot show are kept (default {GPU_BASE}; "
        f"{DISK_BASE} for edge-mode runs)",
    )
    p.add_argument("--name", help="the new profile's name (default: the output file's stem)")
    edge = p.add_argument_group("edge-mode runs (the disk tier's terms)")
    edge.add_argument("-m", "--model", type=Path, help="the runs' GGUF model file")
    edge.add_argument(
        "--trace", type=Path, help="the routing to replay: auto's routing sample of the model, or a trace"
    )
    edge.add_argument(
        "--probe",
        type=Path,
        help="`pyspice probe`'s cost profile of the model (default: this machine's saved one, if any)",
    )
    edge.add_argument("--sidecar", type=Path, help="the model's sidecar, for SPICE's draft predictor")
    edge.add_argument(
        "--history-predictor",
        type=Path,
        metavar="NPZ",
        help="SPICE's routing-history predictor (`pyspice trace fit`; default: the one the records "
        "name, where it is here)",
    )
    edge.add_argument(
        "--budget",
        type=_budget_list,
        metavar="B[,B]",
        help="fit to the runs of these RAM budgets only (e.g. 12.5%%,25%%); the others are predicted",
    )
    edge.add_argument(
        "--save-to-probe",
        action="store_true",
        help="write the fitted terms into the probe (--probe, or this machine's saved probe of the model), "
        "where `--policy auto` on the disk tier reads them",
    )
    p.set_defaults(func=run_fit)


def run_fit(args: argparse.Namespace) -> int:
    edge = args.model is not None or args.trace is not None
    if edge:
        return _fit_edge(args)
    if args.output is None:
        raise ValueError("give -o PROFILE.json: where the fitted profile goes")
    if args.save_to_probe or args.budget or args.probe or args.sidecar or args.history_predictor:
        raise ValueError(
            "--probe, --sidecar, --history-predictor, --budget and --save-to-probe fit edge-mode runs: "
            "give -m and --trace"
        )
    edge_files = [spec for spec in args.records if read_disk_runs(split_record_spec(spec)[0])]
    if edge_files:
        raise ValueError(
            f"{edge_files[0]} holds edge-mode runs (a RAM budget): their disk terms are fitted to the "
            "rows' TPOTs, which needs -m MODEL and --trace SAMPLE (the routing auto ranked on)"
        )
    runs = select_runs(args.records)
    target = target_of(args.target, args.target_layers, runs)
    base = load_profile(args.base or GPU_BASE)
    name = args.name or args.output.stem
    terms = fit_terms(runs, target, base)
    _write(args.output, fitted_profile(runs, target, base, name, terms))
    print(f"fitted {len(runs)} run(s) of {target.name} on top of {base.name}:")
    _print_terms(terms, 24)
    print(f"profile written to {args.output}")
    return 0


def _fit_edge(args: argparse.Namespace) -> int:
    """The disk terms fitted to the RAM-budget runs of the records (module docstring)."""
    if args.model is None or args.trace is None:
        raise ValueError("an edge-mode fit needs both -m MODEL and --trace SAMPLE (the routing to replay)")
    if args.output is None and not args.save_to_probe:
        raise ValueError("give -o PROFILE.json, --save-to-probe, or both: where the fitted terms go")
    for path, what in ((args.model, "model"), (args.trace, "trace")):
        if not path.exists():
            raise ValueError(f"{path}: no such {what}")
    probe = args.probe
    if probe is None and profile_path(args.model).is_file():
        probe = profile_path(args.model)
    if args.save_to_probe and probe is None:
        raise ValueError(
            f"no saved probe of {args.model.name} on this machine to save the terms into: "
            f"run `pyspice probe -m {args.model}` first, or give --probe"
        )
    runs = select_disk_runs(args.records)
    fit_runs = [run for run in runs if args.budget is None or run.budget in args.budget]
    if not fit_runs:
        have = ", ".join(sorted({run.budget for run in runs})) or "none"
        wanted = f" of {','.join(args.budget)}" if args.budget else ""
        raise ValueError(f"no RAM-budget run{wanted} in the records (budgets there: {have})")
    base = load_profile(args.base or DISK_BASE)
    if not base.disk:
        raise ValueError(f"profile {base.name!r} is not a disk profile: the disk terms are edge mode's")
    history = _history_predictor(args.history_predictor, runs, args.sidecar is not None)
    workload = _routed(args.trace, args.model, runs)
    pricing, priced = disk_pricing(args.model, workload, probe, base, sidecar=args.sidecar, history=history)
    fit = fit_disk(pricing, fit_runs)
    disk = f"{priced['bus_gbps']:.3g} GB/s and {priced['bus_latency_us']:.3g} us per 64 KiB read"
    terms = disk_fit_terms(fit, fit_runs, f"the disk as probed ({disk}), routing {args.trace.name}")
    print(f"fitted the disk terms to {len(fit_runs)} run(s) ({fit.evaluations} simulations), on {base.name}:")
    _print_terms(terms, 20)
    print(format_disk_predictions(predict_disk(pricing, runs, fit.terms), {r.source for r in fit_runs}))
    if args.output is not None:
        name = args.name or args.output.stem
        _write(args.output, fitted_disk_profile(base, terms, fit_runs, name))
        print(f"profile written to {args.output}")
    if args.save_to_probe:
        assert probe is not None
        saved = load_cost_profile(probe)
        # every term as the fit priced it: one the records could not tell at its value without it
        terms_doc = {key: fit.terms.get(key, DISK_TERMS[key][2]) for key in DISK_TERMS}
        save_profile(dataclasses.replace(saved, disk_terms=terms_doc), probe)
        print(f"disk terms saved into the probe {probe}: `--policy auto` on the disk tier prices with them")
    return 0


def _budget_list(text: str) -> tuple[str, ...]:
    budgets = tuple(part.strip() for part in text.split(","))
    if not all(budgets):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of RAM budgets, e.g. 12.5%,25%")
    return budgets


def _history_predictor(given: Path | None, runs: list[DiskRun], sidecar: bool) -> Path | None:
    """SPICE's routing-history predictor: the one given, else the one the records say
    SPICE's rows read, where it is here (its rows priced without it would be another
    policy's)."""
    if given is not None:
        RoutingHistory.load(given)  # a missing or bad file fails before any simulation
        return given
    named = sorted({run.history_predictor for run in runs if run.history_predictor})
    if not named or sidecar:
        return None
    if len(named) > 1:
        raise ValueError(
            f"the runs' SPICE rows read different predictors ({', '.join(named)}): fit them apart"
        )
    path = Path(named[0])
    if not path.is_file():
        raise ValueError(f"the runs' SPICE rows read {path}, which is not here: give --history-predictor")
    print(f"SPICE is priced with the routing-history predictor the records name: {path}")
    return path


def _routed(trace: Path, model: Path, runs: list[DiskRun]) -> Workload:
    """The routing the runs' rows saw: the trace as a whole (auto's routing sample), or,
    for runs that replayed it (`bench --replay-routing`), the window of it bench replayed;
    as many times over as each row ran in its process, the cold run untimed (its slots
    and the policy's state carry into the warm runs the TPOT is of)."""
    windows = {(run.replayed, run.passes) for run in runs}
    if len(windows) > 1:
        raise ValueError(
            "the runs routed different windows of their traces (prompt and decode lengths, runs per "
            "row, or replayed and not): fit them apart"
        )
    ((window, passes),) = windows
    if window is None:
        once = from_trace(trace)
    else:
        for named in {run.routing for run in runs if run.routing}:
            if Path(named).exists() and Path(named).resolve() != trace.resolve():
                raise ValueError(f"the runs replayed {named}, not {trace}: give --trace {named}")
        once = replayed_workload(trace, source_target(model), window)
    return repeated(once, passes) if passes > 1 else once


def _print_terms(terms: list[FitTerm], width: int) -> None:
    for term in terms:
        print(f"  {term.key:<{width}} {term.value:10.3f}{'' if term.fitted else '  (kept)'}  {term.note}")


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
