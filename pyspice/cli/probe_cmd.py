"""`pyspice probe`: measure and save this machine's cost profile for a model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    add_sidecar_arg,
    note,
    open_model,
    resolve_model,
)
from pyspice.engine.config import gpu_present
from pyspice.engine.device import DEFAULT_EMULATED_GBPS, DEFAULT_EMULATED_LATENCY_US
from pyspice.engine.probe import measure_profile
from pyspice.formats.profile import profile_path, save_profile


def register(sub: Any) -> None:
    p = sub.add_parser("probe", help="measure this machine's cost profile for a model", description=__doc__)
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument("--batch-sizes", default="1,8,32", help="tokens per micro-batch to time (default 1,8,32)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median; default 5)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sizes = tuple(int(x) for x in args.batch_sizes.split(",") if x.strip())
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes needs positive integers")
    llm = open_model(args, "exact")
    path = resolve_model(args)
    profile = measure_profile(
        llm,
        path,
        bus_gbps=args.emulate_bandwidth or DEFAULT_EMULATED_GBPS,
        bus_latency_us=args.emulate_latency
        if args.emulate_latency is not None
        else DEFAULT_EMULATED_LATENCY_US,
        batch_sizes=sizes,
        repeats=args.repeat,
        progress=lambda m: print(f"probe: {m}", file=sys.stderr, flush=True),
        real_device=args.emulate_bandwidth is None and args.emulate_latency is None and gpu_present(),
    )
    llm.close()
    saved = save_profile(profile, profile_path(path))
    note(f"cost profile written to {saved}")
    if args.json:
        json.dump(profile.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(
            f"bus ({profile.bus_source}): {profile.bus_gbps:g} GB/s, {profile.bus_latency_us:g} us per copy"
        )
        print(f"device ({profile.device_source}): {profile.device_expert_us:.1f} us per expert activation")
        if profile.disk_gbps is not None:
            print(
                f"disk (the model file, O_DIRECT, 4 readers; edge mode's --ram-budget tier): "
                f"{profile.disk_gbps:.2f} GB/s, {profile.disk_latency_us:.0f} us per 64 KiB read"
            )
        for b in profile.batches:
            print(
                f"batch {b.tokens:>4}: {b.expert_us:8.1f} us per expert activation, "
                f"{b.rest_us_per_layer:8.1f} us per token per layer for the rest"
            )
        print(saved)
    return 0
