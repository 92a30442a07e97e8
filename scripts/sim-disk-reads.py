#!/usr/bin/env python3
"""What limits the bytes a policy reads on edge mode's disk tier, in `pyspice sim`'s
disk profile (docs/results/edge-mode-sim.md). Two studies over a recorded trace:

  lookahead  -- how much of the future a retention policy must know to read within a
                factor of Belady's MIN: MIN with bypass whose knowledge of the next
                uses is cut W tokens ahead (beyond that: ranked by recency, or with
                --decay by a decayed use count). Counts reads only, no timing.
  policies   -- spice:exact and variants of it (SpiceConfig fields, `spice:exact|KEY=V,...`),
                the baselines, and `keep|...`: a PROTOTYPE for this tier, not shipped,
                see KeepSpice. Simulated on the disk profile; reads, bytes against the
                bound, the share of prefetches used, stall and TPOT.

Tune on a calibration trace only (python -m pyspice.measure.record trace MODEL OUT -f
TEXT, TEXT from `pyspice models corpus MODEL --part calibration`); judge on others.

  python scripts/sim-disk-reads.py lookahead TRACE --slots 240,480 [--decay 0.97]
  python scripts/sim-disk-reads.py policies TRACE --probe PROFILE.json [-m MODEL] \\
      [--sidecar SIDECAR] --budgets 25%,50% --variants "lru;spice:exact;keep|decay=0.99,prefetch=0"
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.cli.common import model_path
from pyspice.cli.sim_cmd import source_expert_bytes
from pyspice.formats.routers import RouterReader
from pyspice.formats.sidecar import Sidecar, default_sidecar_path
from pyspice.policy import make_policy
from pyspice.policy.base import ACTION_DEVICE, RESIDENCY_ABSENT, RESIDENCY_RESIDENT, HookCall, Plan
from pyspice.policy.context import PolicyContext
from pyspice.policy.spice import SpicePolicy
from pyspice.policy.spice.config import SpiceConfig, spice_config
from pyspice.sim.belady import _requests, read_bound
from pyspice.sim.hardware import DISK, budget_bytes, disk_costs, load_profile, policy_profile
from pyspice.sim.simulator import Simulator
from pyspice.sim.workload import Workload, from_trace


def lookahead(wl: Workload, slots: int, window: int, decay: float | None) -> float:
    """Reads per decoded token of MIN with bypass that knows next uses `window` tokens ahead."""
    calls = _requests(wl)
    per_token = len(wl.moe_layers)
    uses: dict[tuple[int, int], list[int]] = {}
    for i, (_, keys) in enumerate(calls):
        for key, _ in keys:
            uses.setdefault(key, []).append(i)
    held: set[tuple[int, int]] = set()
    last: dict[tuple[int, int], int] = {}
    count: dict[tuple[int, int], float] = {}
    reads = 0
    for i, (decode, keys) in enumerate(calls):
        for key, _ in keys:
            if decode and key not in held:
                reads += 1
            held.add(key)
            if decay is not None:
                count[key] = count.get(key, 0.0) * decay ** ((i - last.get(key, i)) / per_token) + 1.0
            last[key] = i

        def rank(key: tuple[int, int], i: int = i) -> tuple[int, float]:
            u = uses[key]
            j = bisect.bisect_right(u, i)
            if j < len(u) and u[j] - i <= window * per_token:
                return (0, u[j])  # known: needed soonest first
            if decay is not None:
                return (1, -count[key] * decay ** ((i - last[key]) / per_token))
            return (1, -last[key])  # unknown: most recently used first

        if len(held) > slots:
            held = set(sorted(held, key=rank)[:slots])
    return reads / max(1, wl.decoded_tokens)


class KeepSpice(SpicePolicy):
    """PROTOTYPE for tiers whose host actions read (edge mode), not shipped: every miss is
    fetched into a slot (it is read anyway; SPICE reads it into scratch and drops it), room
    is made by evicting the resident experts with the lowest decayed use count (every call
    is seen: no calls answered in advance), and SPICE's own prefetches (without their
    evict_from) are kept or, with prefetch=False, dropped. Lossless: every action exact."""

    def __init__(self, config: SpiceConfig, decay: float, prefetch: bool) -> None:
        super().__init__(config)
        self.decay, self.use_prefetch = decay, prefetch

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self.count = np.zeros((ctx.n_layers, max(1, ctx.max_expert)))
        self.slots = max(0, (ctx.budget_bytes or 0) - ctx.reserved_bytes) // max(ctx.expert_bytes)
        self.resume = [-1] * ctx.n_layers

    def decide(self, call: HookCall) -> Plan:
        layer, used = call.layer, np.unique(call.ids)
        self.count[layer] *= self.decay  # once per call of the layer: per token when decoding
        self.count[layer, used] += 1.0
        base = super().decide(call)
        res = call.residency
        assert res is not None
        misses = [int(e) for e in used if res[layer, e] == RESIDENCY_ABSENT]
        prefetch = []
        if self.use_prefetch:
            prefetch = [
                (int(il), int(e))
                for il, e in base.prefetch
                if res[il, e] == RESIDENCY_ABSENT and not (il == layer and e in misses)
            ]
        cancel = [(int(il), int(e)) for il, e in base.evict]
        held = int(np.count_nonzero(res != RESIDENCY_ABSENT))
        free = self.slots - held + sum(1 for il, e in cancel if res[il, e] != RESIDENCY_ABSENT)
        keep = {(layer, int(e)) for e in used} | {(int(il), int(e)) for il, e in base.prefetch}
        cells = np.argwhere(res == RESIDENCY_RESIDENT)
        order = np.argsort(self.count[cells[:, 0], cells[:, 1]], kind="stable")
        victims = [(int(il), int(e)) for il, e in (cells[j] for j in order) if (int(il), int(e)) not in keep][
            : max(0, len(misses) + len(prefetch) - free)
        ]
        room = free + len(victims)
        actions = np.full(call.ids.shape, ACTION_DEVICE, np.int32)  # misses fetched, in-flight awaited
        return Plan(
            actions=actions,
            fetch=misses,
            prefetch=prefetch[: max(0, room - len(misses))],
            evict=cancel + victims,
        )


def make(variant: str) -> tuple[str, Any]:
    """`NAME` (a shipped policy), `spice:exact|KEY=V,...` (SpiceConfig fields) or
    `keep|decay=D,prefetch=0|1,KEY=V,...` (KeepSpice over such a config)."""
    name, _, settings = variant.partition("|")
    opts = dict(item.split("=", 1) for item in settings.split(",")) if settings else {}
    if not (name == "keep" or (name == "spice:exact" and opts)):
        return variant, make_policy(name)
    cfg = spice_config("spice:exact")
    fields = {f.name: f for f in dataclasses.fields(SpiceConfig)}
    over: dict[str, Any] = {}
    for key, value in opts.items():
        if key in fields and not (name == "keep" and key == "prefetch"):
            kind = type(getattr(cfg, key))
            over[key] = value == "1" if kind is bool else kind(value)
    cfg = dataclasses.replace(cfg, **over)
    if name == "keep":
        return variant, KeepSpice(cfg, float(opts.get("decay", "0.99")), opts.get("prefetch", "1") == "1")
    return variant, SpicePolicy(cfg)


def policies(args: argparse.Namespace) -> None:
    model = model_path(args.model or "smolmoe-b", sidecar=False)
    wl = from_trace(args.trace)
    prof = load_profile(DISK, args.probe)
    costs = disk_costs(prof, wl, model, source_expert_bytes(model, wl.n_layers))
    assert costs.disk is not None
    router = RouterReader(model)
    extra: dict[str, Any] = {
        "host_weights_in_memory": False,
        "tier_bus": (costs.bus_gbps, costs.bus_latency_us),
    }
    sidecar = args.sidecar or default_sidecar_path(model)
    if sidecar.is_file():
        extra["predictor"] = Sidecar.load(sidecar, model).predictor(router)
    routed = sum(b * n for b, n in zip(costs.expert_bytes, wl.n_expert, strict=True))
    n_tok = max(1, wl.decoded_tokens)
    for budget in args.budgets.split(","):
        nbytes = budget_bytes(budget, routed)
        slots = nbytes // max(costs.expert_bytes)
        bound = read_bound(wl, costs.disk.reads.bytes_of, slots)
        floor = bound.bound_bytes / n_tok
        print(
            f"== {budget}: {slots} slots; bound {floor / 2**20:.3f} MiB/tok; MIN with bypass "
            f"{bound.reads / n_tok:.1f} reads/tok, hit {1 - bound.fallback_rate:.3f}"
        )
        sim = Simulator(
            wl, costs, nbytes, router=router, profile=policy_profile(prof, costs), context_extra=extra
        )
        for variant in args.variants.split(";"):
            label, policy = make(variant)
            r = sim.run(label, policy, policy_us=0.0, preload=label == "exact")
            got = r.disk_read_bytes_per_token or 0.0
            print(
                f"{label:<48} {got / 2**20:6.3f} MiB/tok x{got / floor:5.2f}  reads/tok "
                f"{r.disk_expert_reads_per_token or 0:5.1f} (scratch {(r.scratch_reads or 0) / n_tok:5.1f}, "
                f"prefetched {r.prefetch_issued / n_tok:5.1f}, used {r.prefetch_used / n_tok:5.1f})  "
                f"hit {r.hit_rate:.3f}  stall {r.stall_ms_per_token:5.2f}  TPOT {r.tpot_ms:6.2f} ms",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    la = sub.add_parser("lookahead")
    la.add_argument("trace", type=Path)
    la.add_argument("--slots", default="240,480")
    la.add_argument(
        "--decay", type=float, default=None, help="rank the unknown by a use count decayed per token"
    )
    la.add_argument("--windows", default="0,1,2,4,8,16,64")
    po = sub.add_parser("policies")
    po.add_argument("trace", type=Path)
    po.add_argument(
        "--probe", type=Path, help="a `pyspice probe` cost profile of the model (default: disk.json)"
    )
    po.add_argument("-m", "--model", help="the traced model (default: smolmoe-b)")
    po.add_argument("--sidecar", type=Path)
    po.add_argument("--budgets", default="25%,50%")
    po.add_argument("--variants", default="lru;spice:exact;keep|decay=0.99,prefetch=0")
    args = p.parse_args(argv)
    if args.what == "policies":
        policies(args)
        return 0
    wl = from_trace(args.trace)
    for slots in map(int, args.slots.split(",")):
        bound = read_bound(wl, lambda il, e: 1, slots).reads / max(1, wl.decoded_tokens)
        cells = [f"MIN {bound:.1f} reads/tok"]
        for w in map(int, args.windows.split(",")):
            got = lookahead(wl, slots, w, args.decay)
            cells.append(f"W={w}: {got:.1f} ({got / bound:.2f}x)")
        print(f"{args.trace.name} {slots} slots: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
