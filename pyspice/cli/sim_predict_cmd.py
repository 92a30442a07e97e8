"""`pyspice sim --predict`: the simulator against recorded bench runs.

    pyspice sim --predict RECORD[:LINE] --profile PROFILE.json --target ... [--trace OWN] [--replay-trace T]

replays each run on a profile (one `pyspice sim fit` wrote, pyspice.cli.sim_fit_cmd)
and prints every row's predicted TPOT, over its run's stock, beside the measured
one (pyspice.sim.predict). Fit on one run of a machine, predict its others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pyspice.cli.common import note
from pyspice.engine.replay import replayed_workload
from pyspice.formats.routers import RouterReader
from pyspice.sim.hardware import load_profile
from pyspice.sim.predict import format_predictions, own_workload, predict_run
from pyspice.sim.records import RecordedRun, select_runs
from pyspice.sim.targets import TargetModel, load_target, source_target
from pyspice.sim.workload import ReplayWindow, Workload


def add_target_layers_arg(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument(
        "--target-layers",
        type=int,
        metavar="N",
        help="the target's first N layers only, as `pyspice models synth --layers N` builds it "
        "(the recorded GPU runs' model: 8)",
    )


def target_of(spec: str | None, layers: int | None, runs: list[RecordedRun]) -> TargetModel:
    if spec is not None:
        return load_target(spec, layers)
    models = {run.model for run in runs}
    here = [Path(m) for m in models if m and Path(m).is_file()]
    if len(models) == 1 and here:
        return source_target(here[0])
    raise ValueError(
        f"the runs' model ({', '.join(sorted(models)) or 'unnamed'}) is not here to size: give --target "
        "NAME:QUANT (and --target-layers N for a model synthesised with --layers N)"
    )


def workload_for(
    run: RecordedRun,
    target: TargetModel,
    *,
    own_trace: Path | None,
    replay_trace: Path | None,
) -> tuple[Workload | None, str]:
    """The routing a run's hook saw, or None and why it is not at hand."""
    row = next((r for r in run.rows.values() if r.hooked), None)
    prompt_hooked = row.prompt_hooked if row is not None else False
    if run.replay_routing:
        path = replay_trace or Path(run.replay_routing)
        if not path.exists():
            return None, (
                f"it replayed {run.replay_routing}, which is not here: "
                "give --replay-trace (the trace it replayed)"
            )
        window = ReplayWindow(run.prompt_tokens, run.n_predict, run.replay_decode_start)
        return replayed_workload(path, target, window, prompt_hooked=prompt_hooked), f"replayed {path}"
    if own_trace is None:
        return None, (
            "the model's own routing decided and the record keeps no ids: give --trace, a trace of that "
            "model's routing (`python -m pyspice.measure.record trace MODEL DIR`)"
        )
    return own_workload(own_trace, run, target, prompt_hooked), f"own routing from {own_trace}"


def run_predict(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.profile.split(",") if n.strip()]
    if len(names) != 1:
        raise ValueError("--predict takes one --profile (e.g. one `pyspice sim fit` wrote)")
    profile = load_profile(names[0])
    runs = select_runs(args.predict)
    target = target_of(args.target, args.target_layers, runs)
    model = Path(args.model or args.model_pos) if (args.model or args.model_pos) else None
    router = RouterReader(model) if model is not None else None
    preds = []
    for run in runs:
        workload, why = workload_for(run, target, own_trace=args.trace, replay_trace=args.replay_trace)
        if workload is None:
            note(f"{run.source}: not predicted: {why}")
            continue
        preds.extend(predict_run(run, workload, profile, target, router))
    if args.json:
        json.dump(
            {"simulated": True, "profile": profile.name, "rows": [p.record() for p in preds]}, sys.stdout
        )
        sys.stdout.write("\n")
    else:
        print(format_predictions(preds))
    return 0
