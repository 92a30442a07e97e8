"""The simulator on the window a memory-limited bench run replayed, with disk terms
given by hand: each lossless row's simulated TPOT, hit rate and bytes read per token
beside the measured TPOT.

`pyspice sim fit` prints predictions only with the terms it has just fitted; this
prices the records' rows with any terms (a fit's, one term set to 0), to tell a term
that explains the runs from one that absorbed a noisy row (docs/results/edge-mode.md).

    python tools/sim-replayed-window.py RECORD[:N,...] -m MODEL --trace TRACE \\
        --probe PROBE [--history-predictor NPZ] [--terms '{"disk_read_scale": 0.8}'] \\
        [--rows exact,lru,spice]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

from pyspice.engine.replay import replayed_workload
from pyspice.policy.rows import parse_row
from pyspice.sim.fit_disk import budget_bytes, disk_pricing, select_disk_runs
from pyspice.sim.hardware import load_profile
from pyspice.sim.rank import tier_context
from pyspice.sim.report import simulate_row
from pyspice.sim.simulator import Simulator
from pyspice.sim.targets import source_target
from pyspice.sim.workload import repeated
from pyspice.units import whole_tier_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="bench --memory-limit --json files, or FILE:N[,N]")
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True, help="the trace the runs replayed")
    p.add_argument("--probe", type=Path, required=True, help="`pyspice probe`'s profile of the model")
    p.add_argument("--history-predictor", type=Path, help="SPICE's routing-history predictor")
    p.add_argument("--terms", default="{}", help="disk terms as JSON; an absent one takes its default")
    p.add_argument("--rows", default="exact,lru,spice", help="lossless rows to price")
    args = p.parse_args()
    runs = [run for run in select_disk_runs(args.records) if run.replayed is not None]
    if not runs:
        raise SystemExit("no run in the records replayed a trace")
    window = runs[0].replayed
    assert window is not None
    if any(run.replayed != window or run.passes != runs[0].passes for run in runs):
        raise SystemExit("the runs replayed different windows: price them apart")
    once = replayed_workload(args.trace, source_target(args.model), window)
    workload = repeated(once, runs[0].passes) if runs[0].passes > 1 else once
    pricing, _ = disk_pricing(
        args.model, workload, args.probe, load_profile("disk"), history=args.history_predictor
    )
    costs = pricing.with_terms(json.loads(args.terms))
    routed = whole_tier_bytes(costs.expert_bytes, workload.n_expert)
    head = ("run", "budget", "row", "measured", "simulated", "error", "hit", "MiB/tok")
    print("{:<32} {:>6} {:<6} {:>9} {:>9} {:>7} {:>6} {:>8}".format(*head))
    for run in runs:
        sim = Simulator(
            workload,
            costs,
            budget_bytes(run.budget, routed),
            router=pricing.router,
            profile=pricing.policy_profile,
            context_extra={**tier_context(costs), **pricing.context_extra},
        )
        for name in args.rows.split(","):
            with contextlib.redirect_stderr(io.StringIO()):
                _, result = simulate_row({True: sim}, parse_row(name), None)
            got = run.measured_ms.get(name)
            error = f"{result.tpot_ms / got - 1:+7.1%}" if got else "      -"
            mib = (result.disk_read_bytes_per_token or 0.0) / 2**20
            print(
                f"{Path(run.source).name:<32} {run.budget:>6} {name:<6} {got or 0:9.1f} "
                f"{result.tpot_ms:9.1f} {error} {result.hit_rate:6.3f} {mib:8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
