"""Runs of the simulator over profiles x budgets x policies, and their tables and plot
(paper Fig. 7: speedup over adapmoe; Table 2: fallback, bytes moved, bus use, TPOT)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspice.policy import make_policy
from pyspice.policy.base import slot_precision
from pyspice.policy.registry import SIM_ONLY_ROWS, UPSTREAM_MOECACHE, PolicySpec
from pyspice.policy.rows import PolicyRow
from pyspice.sim.belady import BeladyOracle, belady, read_bound
from pyspice.sim.costs import Costs
from pyspice.sim.hardware import (
    HardwareProfile,
    budget_bytes,
    disk_costs,
    emulated_costs,
    policy_profile,
    target_costs,
)
from pyspice.sim.planner import AsyncModel
from pyspice.sim.simulator import SimResult, Simulator
from pyspice.sim.targets import TargetModel
from pyspice.sim.upstream import NOT_CHECKED, check_moecache_profile, moecache_result
from pyspice.sim.workload import Workload
from pyspice.units import slot_bytes, whole_tier_bytes

SPEEDUP_BASE = "adapmoe"


@dataclass(frozen=True)
class SimConfig:
    profiles: tuple[HardwareProfile, ...]
    budgets: tuple[str, ...]
    policies: tuple[PolicyRow, ...]
    target: TargetModel | None  # None: the source model itself (emulated profile)
    source_expert_bytes: tuple[int, ...]  # per layer, of the source model
    policy_us: dict[str, float] | None = None  # measured us per call, by row label
    # measured us per call by budget, then policy (bench runs of each budget); before policy_us
    policy_us_by_budget: dict[str, dict[str, float]] | None = None
    model: Path | None = None  # the recorded model's file (the disk profile reads it)
    moe_cache_cpu_share: float = 0.0  # upstream-moecache: the share of misses run on the host


# PolicyContext fields that say surrogates are loaded: a lossless policy runs without
# them, as the engine runs it (Engine._sync_surrogates: they would only take room)
_SURROGATE_FIELDS = ("surrogate_error", "surrogates_loaded", "reserved_bytes")


def _spec(row: PolicyRow) -> PolicySpec:
    if row.spec is None:
        raise ValueError(f"row {row.label!r} is not a policy: the simulator runs policies only")
    return row.spec


def _check_policies(rows: Sequence[PolicyRow]) -> None:
    for row in rows:
        if row.spec is None and row.name in SIM_ONLY_ROWS:
            if row.planning is not None or row.ram is not None or row.device is not None:
                raise ValueError(f"row {row.label!r}: {row.name} takes no keys (it plans nothing of ours)")
            continue
        if _spec(row).kind == "stock":
            raise ValueError("'stock' has no hook to simulate; 'exact' is the same work through the hook")
        if _spec(row).kind == "auto":
            raise ValueError(
                "'auto' is the choice a run makes by simulating the lossless policies: "
                "simulate them instead (exact,static,lru,adapmoe,spice)"
            )
        if row.ram is not None or row.device is not None:
            # every row of a run shares the budgets of --device-budget, which key its tables
            raise ValueError(
                f"row {row.label!r}: the simulator's budgets are --device-budget/--ram-budget, "
                "the same for every row"
            )


def tier_context(costs: Costs) -> dict[str, Any]:
    """PolicyContext fields the tier itself sets, as Engine.policy_context says them:
    on the disk tier a host action reads its expert first, and the bus is the disk."""
    if costs.disk is None:
        return {}
    return {"host_weights_in_memory": False, "tier_bus": (costs.bus_gbps, costs.bus_latency_us)}


def simulate_row(
    sims: dict[bool, Simulator], row: PolicyRow, policy_us: float | None, *, native_us: float = 0.0
) -> tuple[Any, SimResult]:
    """One bench row through the simulator of its kind (`sims[lossless]`): the policy
    object and its result, named by the row's label. `policy_us`: a Python policy's
    measured deciding time per call (None: timed here); a native one decides in
    `native_us` (0 unless measured on the machine simulated). The row's budgets are
    the simulators' (sized by the caller)."""
    spec = _spec(row)
    policy = make_policy(row.name)
    sim = sims[spec.lossless]
    us = policy_us if spec.kind == "python" else native_us  # natively decided: no Python per call
    # a row that does not say plans where the engine would: asynchronously on the disk
    # tier (Planning.chosen), else synchronously, as the engine does where the decode
    # takes every core (a simulated target has no thread count)
    asynchronous = row.planning == "async" or (row.planning is None and sim.costs.disk is not None)
    model = AsyncModel(max_lag=0, deterministic_lag=row.plan_lag) if asynchronous else None
    return policy, sim.run(row.label, policy, policy_us=us, preload=row.name == "exact", asynchronous=model)


def simulate_all(
    workload: Workload,
    cfg: SimConfig,
    *,
    router: Any = None,
    context_extra: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (profile, budget, policy) plus a `belady` row per (profile, budget)."""
    _check_policies(cfg.policies)
    if any(row.name == UPSTREAM_MOECACHE for row in cfg.policies):
        for prof in cfg.profiles:  # before anything is simulated
            check_moecache_profile(prof)
    rows: list[dict[str, Any]] = []
    extra = dict(context_extra or {})
    for prof in cfg.profiles:
        if prof.disk:
            if cfg.model is None:
                raise ValueError(f"profile {prof.name!r} reads the recorded model's file: give the model")
            costs = disk_costs(prof, workload, cfg.model, cfg.source_expert_bytes)
            target_name = "source"
            target_routed = None
        elif prof.emulated:
            costs = emulated_costs(prof, workload, cfg.source_expert_bytes)
            target_name = "source"
            target_routed = None
        else:
            if cfg.target is None:
                raise ValueError(
                    f"profile {prof.name!r} needs a target (which model's sizes to simulate): "
                    "--target NAME:QUANT, or --target source for the recorded model's own"
                )
            costs = target_costs(prof, cfg.target, workload)
            target_name = cfg.target.name
            target_routed = cfg.target.routed_bytes
        routed = whole_tier_bytes(costs.expert_bytes, workload.n_expert)  # what 100% means
        tier_extra = {**extra, **tier_context(costs)}
        lossless_extra = {k: v for k, v in tier_extra.items() if k not in _SURROGATE_FIELDS}
        for budget in cfg.budgets:
            nbytes = budget_bytes(budget, routed, target_routed)
            base = {"profile": prof.name, "budget": budget, "target": target_name, "simulated": True}
            note = _fit_note(prof, cfg.target, budget, target_routed)
            sims = {
                lossless: Simulator(
                    workload,
                    costs,
                    nbytes,
                    router=router,
                    profile=policy_profile(prof, costs),
                    context_extra=lossless_extra if lossless else tier_extra,
                )
                for lossless in (True, False)
            }
            for row in cfg.policies:
                if progress:
                    progress(f"{prof.name} {budget} {row.label}")
                if row.name == UPSTREAM_MOECACHE:
                    rows.append({**base, **_moecache_row(workload, prof, cfg, nbytes, note)})
                    continue
                us = (cfg.policy_us_by_budget or {}).get(budget, {}).get(row.label)
                if us is None:
                    us = (cfg.policy_us or {}).get(row.label)
                policy, result = simulate_row(sims, row, us)
                row_note = note
                if slot_precision(policy) != "exact" and costs.disk is None:
                    # libspice picks the copies' types (spice-slot-copies.c); the simulator
                    # does not model them rather than keep a second copy of that choice
                    precision = slot_precision(policy)
                    unmodelled = f"{row.name}'s {precision} slots not modelled (charged at the model's bytes)"
                    row_note = f"{note}; {unmodelled}" if note else unmodelled
                rows.append({**base, **result.record(), **({"note": row_note} if row_note else {})})
            scale = costs.layer_scale
            n_tok = max(1, workload.decoded_tokens)
            # the bound is for lossless replacement, which holds no surrogates (the whole
            # budget is the experts'), as the lossless rows run
            bounds = belady(workload, costs.expert_bytes, nbytes)
            first = bounds[0]
            if progress:
                progress(f"{prof.name} {budget} belady")
            oracle = sims[True].run("belady", BeladyOracle(workload), policy_us=0.0).record()
            bound_row = {
                **base,
                **oracle,
                # the bound itself; tpot_ms and the traffic columns are the oracle's
                # (MIN eviction, demand fetches, no decision cost)
                "hit_rate": 1.0 - first.fallback_rate,
                "fallback_rate": first.fallback_rate,
                "misses": {"fetched": first.misses, "host": 0, "surrogate": 0},
                "bounds": [
                    {
                        "mode": b.mode,
                        "slots": b.slots,
                        "misses": b.misses,
                        "fallback_rate": b.fallback_rate,
                        "bytes_per_token": b.bytes_loaded / n_tok * scale,
                    }
                    for b in bounds
                ],
            }
            if costs.disk is not None:
                bound_row.update(_disk_bound(workload, costs, nbytes, n_tok, scale, bound_row["bounds"]))
            rows.append(bound_row)
    return rows


def _moecache_row(
    workload: Workload, prof: HardwareProfile, cfg: SimConfig, nbytes: int, note: str
) -> dict[str, Any]:
    """upstream-moecache's row (pyspice.sim.upstream), saying that nothing measured it."""
    assert cfg.target is not None  # a GPU profile's rows have one (simulate_all)
    got = moecache_result(workload, prof, cfg.target, nbytes, cfg.moe_cache_cpu_share)
    said = f"{UPSTREAM_MOECACHE}: {NOT_CHECKED}"
    if cfg.moe_cache_cpu_share:
        said += f" (CPU share of misses {cfg.moe_cache_cpu_share:g})"
    return {**got.record(), "note": f"{note}; {said}" if note else said}


def _disk_bound(
    workload: Workload, costs: Any, nbytes: int, n_tok: int, scale: float, bounds: list[dict[str, Any]]
) -> dict[str, Any]:
    """The belady row of a disk profile (belady.ReadBound): hits and misses are MIN with
    bypass (a call's experts need no slot: without one they are read into scratch), and
    its disk bytes per token are the least bytes of any schedule (min-cost flow), the
    bound a lossless policy's disk reads are held to."""
    assert costs.disk is not None
    slot = slot_bytes(costs.expert_bytes, workload.n_expert)
    slots = min(nbytes // slot, sum(workload.n_expert)) if slot else 0  # as libspice counts them
    b = read_bound(workload, costs.disk.reads.bytes_of, slots)
    per_expert = max((costs.disk.reads.of(il, 0)[0] for il in workload.moe_layers), default=0)
    bypass = {
        "mode": "MIN with bypass",
        "slots": b.slots,
        "misses": b.misses,
        "fallback_rate": b.fallback_rate,
        "bytes_per_token": b.min_bytes / n_tok * scale,
    }
    return {
        "hit_rate": 1.0 - b.fallback_rate,
        "fallback_rate": b.fallback_rate,
        "misses": {"fetched": b.misses, "host": 0, "surrogate": 0},
        "disk_read_bytes_per_token": b.bound_bytes / n_tok * scale,
        "disk_reads_per_token": b.bound_reads * per_expert / n_tok * scale,
        "disk_expert_reads_per_token": b.bound_reads / n_tok * scale,
        "read_bound": {
            "slots": b.slots,
            "min_misses": b.misses,
            "min_reads_per_token": b.reads / n_tok * scale,
            "min_bytes_per_token": b.min_bytes / n_tok * scale,
            "bound_reads_per_token": b.bound_reads / n_tok * scale,
            "bound_bytes_per_token": b.bound_bytes / n_tok * scale,
        },
        "bounds": [bypass, *bounds],
    }


def _fit_note(prof: HardwareProfile, target: TargetModel | None, budget: str, routed: int | None) -> str:
    """Say so when the budget plus the always-resident weights exceed the device's memory."""
    if target is None or routed is None or "device_memory_gib" not in prof.values:
        return ""
    need = budget_bytes(budget, routed, routed) + target.resident_bytes
    have = prof["device_memory_gib"] * 2**30
    if need <= have:
        return ""
    return f"needs {need / 2**30:.1f} GiB on a {have / 2**30:.0f} GiB device (simulated anyway)"


def _speedups(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    base = {
        (r["profile"], r["budget"]): r["tpot_ms"]
        for r in rows
        if r["policy"] == SPEEDUP_BASE and r["tpot_ms"]
    }
    out = {}
    for r in rows:
        b = base.get((r["profile"], r["budget"]))
        if b and r.get("tpot_ms"):
            out[(r["profile"], r["budget"], r["policy"])] = b / r["tpot_ms"]
    return out


def format_tables(rows: Sequence[dict[str, Any]]) -> str:
    """Table 2 style (fallback, MiB moved per token, bus utilisation, TPOT), with the
    Fig. 7 speedup over adapmoe as a column."""
    speed = _speedups(rows)
    bound = _read_bounds(rows)
    disk = bool(bound)
    header = (
        f"{'profile':<9} {'budget':>6} {'policy':<9} {'TPOT ms':>9} {'x adapmoe':>9} {'fallback':>8} "
        f"{'fetch/host':>13} {'MiB/tok':>8} {'bus use':>7} {'stall ms/tok':>12} {'pf used/issued':>14}"
        + (f" {'read MiB/tok':>12} {'x bound':>7}" if disk else "")
    )
    lines = ["(simulated)", header, "-" * len(header)]
    notes = []
    for r in rows:
        key = (r["profile"], r["budget"], r["policy"])
        tpot = f"{r['tpot_ms']:9.2f}" if r.get("tpot_ms") is not None else f"{'-':>9}"
        sp = f"{speed[key]:9.2f}" if key in speed else f"{'-':>9}"
        misses = r.get("misses", {})
        fh = f"{misses.get('fetched', 0)}/{misses.get('host', 0)}"
        bus = f"{r['bus_utilization']:7.0%}" if "bus_utilization" in r else f"{'-':>7}"
        stall = f"{r['stall_ms_per_token']:12.2f}" if "stall_ms_per_token" in r else f"{'-':>12}"
        pf = f"{r['prefetch_used']}/{r['prefetch_issued']}" if "prefetch_issued" in r else "-"
        read = ""
        if disk:
            got, b = r.get("disk_read_bytes_per_token"), bound.get((r["profile"], r["budget"]))
            read = f" {got / 2**20:12.2f}" if got is not None else f" {'-':>12}"
            read += f" {got / b:7.2f}" if got is not None and b else f" {'-':>7}"
        lines.append(
            f"{r['profile']:<9} {r['budget']:>6} {r['policy']:<9} {tpot} {sp} {r['fallback_rate']:8.1%} "
            f"{fh:>13} {r['bytes_per_token'] / 2**20:8.1f} {bus} {stall} {pf:>14}{read}"
        )
        if r.get("note") and (r["profile"], r["budget"], r["note"]) not in notes:
            notes.append((r["profile"], r["budget"], r["note"]))
        for b in r.get("bounds", [])[1:]:
            lines.append(
                f"{'':<9} {'':>6} {'  ' + b['mode']:<30} {b['fallback_rate']:8.1%} "
                f"{b['misses']:>13} {b['bytes_per_token'] / 2**20:8.1f}"
            )
    lines.append(
        "(fallback = misses / activations over decoded tokens; belady = MIN over equal slots, pooled: "
        "the fewest misses of any demand-loading replacement policy, with the TPOT of MIN eviction and "
        "demand fetches at no decision cost; MiB/tok = host-to-device bytes per decoded token)"
    )
    if disk:
        lines.append(
            "(disk profile: MiB/tok = bytes copied into RAM slots; read MiB/tok = bytes read from the model "
            "file, widened as O_DIRECT reads them, scratch reads of host actions included; belady's hits are "
            "MIN with bypass and its read MiB/tok the least bytes of any schedule (min-cost flow), a lower "
            "bound for every lossless policy; x bound = read MiB/tok over it)"
        )
    lines += [f"note: {p} {b}: {n}" for p, b, n in notes]
    return "\n".join(lines)


def _read_bounds(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(profile, budget) -> the belady row's bound on disk bytes per token (disk profiles)."""
    return {
        (r["profile"], r["budget"]): r["disk_read_bytes_per_token"]
        for r in rows
        if r["policy"] == "belady" and r.get("disk_read_bytes_per_token")
    }


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Fig. 7 style: speedup over adapmoe per policy, grouped by profile and budget; with
    disk profiles a second panel: bytes read from the file per token, against the bound."""
    # lazy: matplotlib is optional, for --plot only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = _speedups(rows)
    groups = list(dict.fromkeys((r["profile"], r["budget"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    bound = _read_bounds(rows)
    disk_groups = [g for g in groups if g in bound]
    panels = 2 if disk_groups else 1
    fig, axes = plt.subplots(1, panels, figsize=(panels * max(6.0, 1.6 * len(groups) + 2), 4), squeeze=False)
    width = 0.8 / max(1, len(policies))
    ax = axes[0][0]
    for i, name in enumerate(policies):
        xs = [g + i * width for g in range(len(groups))]
        ys = [speed.get((p, b, name), 0.0) for p, b in groups]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{p}\n{b}" for p, b in groups])
    ax.set_ylabel(f"speedup over {SPEEDUP_BASE} (TPOT ratio)")
    ax.set_title(f"{title} (simulated)")
    ax.legend(fontsize=8, ncol=min(4, len(policies)))
    if disk_groups:
        read = {
            (r["profile"], r["budget"], r["policy"]): r["disk_read_bytes_per_token"] / 2**20
            for r in rows
            if r.get("disk_read_bytes_per_token") is not None
        }
        ax = axes[0][1]
        for i, name in enumerate(policies):
            xs = [g + i * width for g in range(len(disk_groups))]
            ys = [read.get((p, b, name), 0.0) for p, b in disk_groups]
            ax.bar(xs, ys, width, label=name if name != "belady" else "bound (least bytes)")
        for g, key in enumerate(disk_groups):
            ax.plot(
                [g - width / 2, g + 0.8 - width / 2],
                [1.2 * bound[key] / 2**20] * 2,
                color="black",
                linewidth=1,
            )
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(disk_groups))])
        ax.set_xticklabels([f"{p}\n{b}" for p, b in disk_groups])
        ax.set_ylabel("MiB read from the model file per token")
        ax.set_title("disk reads (line: 1.2 x the bound) (simulated)")
        ax.set_ylim(0, 1.4 * max(read.values(), default=1.0))
        ax.legend(fontsize=7, ncol=min(3, len(policies)), loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stderr_progress(message: str) -> None:
    print(f"pyspice sim: {message}", file=sys.stderr, flush=True)
