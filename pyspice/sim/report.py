"""Runs of the simulator over profiles x budgets x policies, and their tables and plot
(paper Fig. 7: speedup over adapmoe; Table 2: fallback, bytes moved, bus use, TPOT)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspice.policy import make_policy, policy_spec
from pyspice.policy.registry import split_planning
from pyspice.sim.belady import BeladyOracle, belady
from pyspice.sim.hardware import HardwareProfile, budget_bytes, emulated_costs, policy_profile, target_costs
from pyspice.sim.planner import AsyncModel
from pyspice.sim.simulator import Simulator
from pyspice.sim.targets import TargetModel
from pyspice.sim.workload import Workload

SPEEDUP_BASE = "adapmoe"


@dataclass(frozen=True)
class SimConfig:
    profiles: tuple[HardwareProfile, ...]
    budgets: tuple[str, ...]
    policies: tuple[str, ...]
    target: TargetModel | None  # None: the source model itself (emulated profile)
    source_expert_bytes: tuple[int, ...]  # per layer, of the source model
    policy_us: dict[str, float] | None = None  # measured us per call, by policy
    # measured us per call by budget, then policy (bench runs of each budget); before policy_us
    policy_us_by_budget: dict[str, dict[str, float]] | None = None


def _check_policies(names: Sequence[str]) -> None:
    for row in names:
        spec = policy_spec(split_planning(row)[0])
        if spec.kind == "stock":
            raise ValueError("'stock' has no hook to simulate; 'exact' is the same work through the hook")


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
    rows: list[dict[str, Any]] = []
    for prof in cfg.profiles:
        if prof.emulated:
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
        routed = sum(b * n for b, n in zip(costs.expert_bytes, workload.n_expert, strict=True))
        for budget in cfg.budgets:
            nbytes = budget_bytes(budget, routed, target_routed)
            base = {"profile": prof.name, "budget": budget, "target": target_name, "simulated": True}
            note = _fit_note(prof, cfg.target, budget, target_routed)
            sim = Simulator(
                workload,
                costs,
                nbytes,
                router=router,
                profile=policy_profile(prof, costs),
                context_extra=context_extra,
            )
            for row in cfg.policies:
                if progress:
                    progress(f"{prof.name} {budget} {row}")
                name, how, lag = split_planning(row)  # NAME@async: the planner thread modelled
                spec = policy_spec(name)
                policy = make_policy(name)
                us = (cfg.policy_us_by_budget or {}).get(budget, {}).get(row)
                if us is None:
                    us = (cfg.policy_us or {}).get(row)
                if spec.kind != "python":
                    us = 0.0  # decided natively: no Python per call
                model = AsyncModel(max_lag=0, deterministic_lag=lag) if how == "async" else None
                result = sim.run(row, policy, policy_us=us, preload=name == "exact", asynchronous=model)
                rows.append({**base, **result.record(), **({"note": note} if note else {})})
            scale = costs.layer_scale
            n_tok = max(1, workload.decoded_tokens)
            # the bound over the bytes experts may use: those the tier keeps for surrogates are not
            reserved = int((context_extra or {}).get("reserved_bytes", 0))
            bounds = belady(workload, costs.expert_bytes, max(0, nbytes - reserved))
            first = bounds[0]
            if progress:
                progress(f"{prof.name} {budget} belady")
            oracle = sim.run("belady", BeladyOracle(workload), policy_us=0.0).record()
            rows.append(
                {
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
            )
    return rows


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
    header = (
        f"{'profile':<9} {'budget':>6} {'policy':<9} {'TPOT ms':>9} {'x adapmoe':>9} {'fallback':>8} "
        f"{'fetch/host':>13} {'MiB/tok':>8} {'bus use':>7} {'stall ms/tok':>12} {'pf used/issued':>14}"
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
        lines.append(
            f"{r['profile']:<9} {r['budget']:>6} {r['policy']:<9} {tpot} {sp} {r['fallback_rate']:8.1%} "
            f"{fh:>13} {r['bytes_per_token'] / 2**20:8.1f} {bus} {stall} {pf:>14}"
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
    lines += [f"note: {p} {b}: {n}" for p, b, n in notes]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Fig. 7 style: speedup over adapmoe per policy, grouped by profile and budget."""
    # lazy: matplotlib is optional, for --plot only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = _speedups(rows)
    groups = list(dict.fromkeys((r["profile"], r["budget"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4))
    width = 0.8 / max(1, len(policies))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stderr_progress(message: str) -> None:
    print(f"pyspice sim: {message}", file=sys.stderr, flush=True)
