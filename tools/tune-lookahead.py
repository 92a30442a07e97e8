#!/usr/bin/env python3
"""Sweep SPICE's look-ahead constants (plan_every x prefetch_share) on a model's CALIBRATION text.

`SpiceConfig.plan_every` (how often a decode step plans its prefetches) and
`SpiceConfig.prefetch_share` (how much of each predicted top-K is prefetched)
are constants in pyspice/policy/spice/config.py. This runs `spice:exact` with
each pair of the grid, without editing the shipped file: for each run the
`spice:exact` entry of config.QUALITY_LEVELS is replaced (and restored after),
so the policy goes through the engine exactly as the shipped one does,
synchronously or on the planner thread (a policy object given to set_policy
always plans synchronously).

The text: windows of the calibration split of the model's corpus
(corpus_part("calibration", ...), the text the sidecar is fitted on; the
sidecar's predictor is fitted on its first 8192 tokens, the windows start far
beyond them), never the held-out split. Each window: PROMPT tokens in one batch,
then N tokens fed one per call (teacher-forced, so every setting decodes the
same tokens); the stats are reset after the prompt, so every figure is the
decode steps'.

The share acts through n_prefetch = ceil(share x top-k): on a top-4 model 0.8
and 1.0 are the same policy. `sim` replays the same windows, recorded as traces,
through the simulator on target shapes, charging the hook thread what `bench`
measured (docs/results/planning.md has a run and its reading).

    # engine (emulated device): decode hit rate, MiB moved, host activations, hook us
    flock /tmp/pyspice-heavy.lock nice -n 10 python tools/tune-lookahead.py bench -m smolmoe-b \\
        --budgets 25%,50% --modes sync,det1,async --plan-every 1,2,4 --shares 0.25,0.4,0.6,1.0 \\
        --json bench.json
    # the same windows as traces, replayed by the simulator on target shapes
    python tools/tune-lookahead.py traces -m smolmoe-b --out traces/
    python tools/tune-lookahead.py sim -m smolmoe-b --traces traces/ --bench bench.json --charge pooled \\
        --profiles h200,rtx4060 --targets qwen2-57b-a14b:Q5_K_M,deepseek-v2-lite:Q4_K_M --json sim.json
    python tools/tune-lookahead.py report --bench bench.json --sim sim.json --plot grid.png
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEVEL = "spice:exact"


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def say(message: str) -> None:
    print(f"tune-lookahead: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def spice_exact_with(plan_every: int, prefetch_share: float) -> Iterator[None]:
    """`spice:exact` as if config.py said these two constants, for the duration."""
    from pyspice.policy.spice import config

    shipped = config.QUALITY_LEVELS[LEVEL]
    config.QUALITY_LEVELS[LEVEL] = dataclasses.replace(
        shipped, plan_every=plan_every, prefetch_share=prefetch_share
    )
    try:
        yield
    finally:
        config.QUALITY_LEVELS[LEVEL] = shipped


def model_and_corpus(name: str | None) -> tuple[Path, str]:
    from pyspice.models.builtin import builtin_of
    from pyspice.models.default import default_model
    from pyspice.models.smolmoe_build import MODEL_NAMES

    if name is None or name in MODEL_NAMES:
        model = default_model(name or "smolmoe-b", note=say)
    else:
        model = Path(name)
    corpus = builtin_of(model)
    if corpus is None:
        raise SystemExit(f"{model}: not a build of a built-in model, so it has no calibration split here")
    return model, corpus


def windows(corpus: str, starts: list[float], chars: int = 12000) -> list[tuple[float, str]]:
    """Text windows of the corpus's CALIBRATION split, each starting at the first line
    after `start` x its length (the sidecar fits on the first 8192 tokens: start far
    beyond them)."""
    from pyspice.models.smolmoe_recipe import corpus_part

    text = corpus_part("calibration", corpus).text
    out = []
    for f in starts:
        i = text.index("\n", int(f * len(text))) + 1
        out.append((f, text[i : i + chars]))
    return out


def stat_row(stats: dict[str, Any]) -> dict[str, Any]:
    """The decode steps' figures of one run (stats reset after the prompt)."""
    n = max(1, int(stats["activations"]))
    planning = stats.get("planning", {})
    misses = stats["misses"]
    return {
        "hit_rate": float(stats["hit_rate"]),
        "mib_per_token": float(stats["bytes_per_token"]) / 2**20,
        "stall_ms_per_token": float(stats["stall_ms_per_token"]),
        "fetched": int(misses["fetched"]),
        "host": int(misses["host"]),
        "host_share": int(misses["host"]) / n,
        "activations": int(stats["activations"]),
        "prefetch_issued": int(stats["prefetch_issued"]),
        "prefetch_used": int(stats["prefetch_used"]),
        "hook_us": float(stats["policy_us_per_call"]),
        "quiet_share": float(stats["policy_quiet_share"]),
        "tpot_ms": float(stats["tpot_ms"]),
        "lag": float(planning.get("lag_layers", 0.0)),
        "applied": int(planning.get("applied", 0)),
        "stale": int(planning.get("stale", 0)),
        "planner_us_per_plan": float(planning.get("planner_us_per_plan", 0.0)),
        "fallbacks": int(stats.get("policy_fallbacks", 0)),
    }


def planning_of(mode: str) -> Any:
    """sync, async or detK, as bench rows write it after '@' (measure.bench.split_row)."""
    from pyspice.measure.bench import split_row

    try:
        return split_row(f"{LEVEL}@{mode}")[1]
    except ValueError as err:
        raise SystemExit(f"mode {mode!r}: {err}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from pyspice.api import Llama
    from pyspice.engine import RunConfig
    from pyspice.formats.sidecar import default_sidecar_path

    model, corpus = model_and_corpus(args.model)
    sidecar = args.sidecar or default_sidecar_path(model)
    texts = windows(corpus, floats(args.windows))
    say(f"{model.name}: {len(texts)} windows of the CALIBRATION split of {corpus}'s corpus")
    grid = list(itertools.product(ints(args.plan_every), floats(args.shares)))
    rows: list[dict[str, Any]] = []
    started = datetime.datetime.now()
    for budget in names(args.budgets):
        config = RunConfig(
            model=model,
            policy="exact",
            device_budget=budget,
            sidecar=sidecar,
            threads=args.threads,
            n_gpu_layers=0,
            n_ctx=args.prompt + args.n + 16,
        )
        llm = Llama.from_config(config, note=say)
        try:
            token_windows = []
            for start, text in texts:
                tokens = list(llm.tokenize(text.encode("utf-8"), add_bos=True))[: args.prompt + args.n]
                if len(tokens) < args.prompt + args.n:
                    raise SystemExit(f"window at {start}: {len(tokens)} tokens, fewer than needed")
                token_windows.append((start, tokens))
            for rep in range(args.repeat):
                # every repeat in another order, so drift on a shared machine spreads over the grid
                cells = list(itertools.product(names(args.modes), grid))
                if rep % 2:
                    cells.reverse()
                for mode, (every, share) in cells:
                    for start, tokens in token_windows:
                        llm.spice_engine.planning = planning_of(mode)
                        with spice_exact_with(every, share):
                            llm.set_policy(LEVEL)
                        llm.reset()
                        llm.spice_reset_stats()
                        llm.eval(tokens[: args.prompt])
                        llm.spice_reset_stats()
                        t0 = time.perf_counter()
                        for t in tokens[args.prompt :]:
                            llm.eval([t])
                        wall = time.perf_counter() - t0
                        row = {
                            "budget": budget,
                            "mode": mode,
                            "plan_every": every,
                            "prefetch_share": share,
                            "window": start,
                            "repeat": rep,
                            **stat_row(llm.spice_stats()),
                        }
                        rows.append(row)
                        say(
                            f"{budget} {mode:5} plan_every {every} share {share:g} window {start:g} r{rep}: "
                            f"hit {row['hit_rate']:.3f}, {row['mib_per_token']:.2f} MiB/tok, host "
                            f"{row['host_share']:.3f}, hook {row['hook_us']:.1f} us, lag {row['lag']:.2f}, "
                            f"stale {row['stale']} ({wall:.1f} s)"
                        )
        finally:
            llm.close()
    doc = {
        "model": model.name,
        "corpus": corpus,
        "text": f"calibration split, windows at {args.windows} of it, {args.prompt} prompt tokens in one "
        f"batch + {args.n} teacher-forced, decode steps only",
        "threads": args.threads,
        "started": started.isoformat(timespec="seconds"),
        "minutes": (datetime.datetime.now() - started).total_seconds() / 60,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    say(f"wrote {args.json} ({doc['minutes']:.1f} min)")
    return 0


def cmd_traces(args: argparse.Namespace) -> int:
    from pyspice.measure.record import record_bench_trace

    model, corpus = model_and_corpus(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for start, text in windows(corpus, floats(args.windows)):
        where = out / f"calib-{start:g}"
        record_bench_trace(
            model, where, prompt_tokens=args.prompt, n_predict=args.n, threads=args.threads, text=text
        )
        say(f"recorded {where}")
    return 0


def sim_us(
    bench: dict[str, Any] | None, budget: str, mode: str, every: int, share: float, pooled: bool
) -> float | None:
    """The hook thread's measured us per decode call of this cell (median over windows and
    repeats of the bench run); `pooled`: over every budget and prefetch share of this mode
    and plan_every (the share adds no Python to speak of, and single cells on a shared
    machine are noisy); None: let the simulator time decide() itself."""
    if bench is None:
        return None
    got = [
        r["hook_us"]
        for r in bench["rows"]
        if r["mode"] == mode
        and r["plan_every"] == every
        and (pooled or (r["budget"] == budget and abs(r["prefetch_share"] - share) < 1e-9))
    ]
    return statistics.median(got) if got else None


def cmd_sim(args: argparse.Namespace) -> int:
    from pyspice.cli.sim_cmd import source_expert_bytes
    from pyspice.formats.routers import RouterReader
    from pyspice.formats.sidecar import Sidecar, default_sidecar_path
    from pyspice.policy.spice import SpicePolicy, spice_config
    from pyspice.sim.hardware import budget_bytes, emulated_costs, load_profile, policy_profile, target_costs
    from pyspice.sim.planner import AsyncModel
    from pyspice.sim.simulator import Simulator
    from pyspice.sim.targets import load_target
    from pyspice.sim.workload import from_trace
    from pyspice.units import whole_tier_bytes

    model, _corpus = model_and_corpus(args.model)
    sidecar = Sidecar.load(args.sidecar or default_sidecar_path(model), model)
    router = RouterReader(model)
    extra = {"predictor": sidecar.predictor(router)}  # lossless: no surrogates held (as the engine)
    bench = json.loads(Path(args.bench).read_text()) if args.bench else None
    grid = list(itertools.product(ints(args.plan_every), floats(args.shares)))
    rows: list[dict[str, Any]] = []
    traces = sorted(p for p in Path(args.traces).iterdir() if p.is_dir())
    for trace in traces:
        workload = from_trace(trace)
        pairs = [(p, t) for p in names(args.profiles) if p != "emulated" for t in names(args.targets)]
        if "emulated" in names(args.profiles):  # this machine, the source model's own sizes
            pairs.append(("emulated", "source"))
        for pname, tname in pairs:
            if pname == "emulated":
                prof, target = load_profile(pname, Path(args.probe) if args.probe else None), None
                costs = emulated_costs(prof, workload, source_expert_bytes(model, workload.n_layers))
            else:
                prof, target = load_profile(pname), load_target(tname)
                costs = target_costs(prof, target, workload)
            routed = whole_tier_bytes(costs.expert_bytes, workload.n_expert)  # 100%, as in `pyspice sim`
            for budget in names(args.budgets):
                nbytes = budget_bytes(budget, routed, target.routed_bytes if target else None)
                sim = Simulator(
                    workload,
                    costs,
                    nbytes,
                    router=router,
                    profile=policy_profile(prof, costs),
                    context_extra=extra,
                )
                for mode, (every, share), charge in itertools.product(
                    names(args.modes), grid, names(args.charge)
                ):
                    cfg = dataclasses.replace(spice_config(LEVEL), plan_every=every, prefetch_share=share)
                    # measured: the hook thread's us per call from the bench run (this machine, in
                    # the graph; pooled: over shares and budgets); timed: decide() timed here +
                    # the profile's cost of reaching Python (sync), 0 on the hook thread (async:
                    # the planner's time only delays plans)
                    us = None
                    if charge in ("measured", "pooled"):
                        us = sim_us(bench, budget, mode, every, share, pooled=charge == "pooled")
                        if us is None:
                            continue
                    model_ = AsyncModel(max_lag=0) if mode == "async" else None
                    result = sim.run(f"{LEVEL}@{mode}", SpicePolicy(cfg), policy_us=us, asynchronous=model_)
                    rec = result.record()
                    row = {
                        "trace": trace.name,
                        "profile": pname,
                        "target": tname,
                        "budget": budget,
                        "mode": mode,
                        "plan_every": every,
                        "prefetch_share": share,
                        "charge": charge,
                        "tpot_ms": rec["tpot_ms"],
                        "hit_rate": rec["hit_rate"],
                        "mib_per_token": rec["bytes_per_token"] / 2**20,
                        "stall_ms_per_token": rec["stall_ms_per_token"],
                        "policy_us_per_call": rec["policy_us_per_call"],
                        "lag": float(result.plan_lag_layers),
                        "stale": result.plans_stale,
                        "skipped": result.plans_skipped,
                    }
                    rows.append(row)
                    say(
                        f"{trace.name} {pname} {tname} {budget} {mode} pe {every} ps {share:g} {charge}: "
                        f"TPOT {row['tpot_ms']:.2f} ms, hit {row['hit_rate']:.3f}, "
                        f"{row['mib_per_token']:.1f} MiB/tok, us {row['policy_us_per_call']:.1f}, "
                        f"lag {row['lag']:.2f}, stale {row['stale']}"
                    )
    doc = {
        "model": model.name,
        "simulated": True,
        "traces": [t.name for t in traces],
        "bench": args.bench,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows) if rows else float("nan")


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


BENCH_KEY = ("budget", "mode", "plan_every", "prefetch_share")
SIM_KEY = ("profile", "target", "budget", "mode", "charge", "plan_every", "prefetch_share")


def cells(
    rows: list[dict[str, Any]], key: tuple[str, ...]
) -> list[tuple[tuple[Any, ...], list[dict[str, Any]]]]:
    """The rows grouped by the fields of `key`, in sorted order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    return sorted(groups.items())


def bench_table(doc: dict[str, Any]) -> list[str]:
    """Per (budget, mode, plan_every, share): the deterministic figures averaged over the
    windows (and repeats), hook us and TPOT as medians."""
    out = [
        "| budget | mode | plan_every | prefetch_share | decode hit | MiB/tok | host share | stall ms/tok "
        "| pf used/issued | hook us/call | lag | stale | TPOT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (b, m, e, s), cell in cells(doc["rows"], BENCH_KEY):
        used, issued = sum(r["prefetch_used"] for r in cell), sum(r["prefetch_issued"] for r in cell)
        out.append(
            f"| {b} | {m} | {e} | {s:g} | {_mean(cell, 'hit_rate'):.3f} | {_mean(cell, 'mib_per_token'):.2f} "
            f"| {_mean(cell, 'host_share'):.3f} | {_mean(cell, 'stall_ms_per_token'):.3f} "
            f"| {used / max(1, issued):.2f} | {_med(cell, 'hook_us'):.1f} "
            f"| {_mean(cell, 'lag'):.2f} | {sum(r['stale'] for r in cell)} | {_med(cell, 'tpot_ms'):.2f} |"
        )
    return out


def sim_table(doc: dict[str, Any]) -> list[str]:
    out = [
        "| profile | target | budget | mode | us charged | plan_every | prefetch_share | TPOT ms | hit "
        "| MiB/tok | stall ms/tok | us/call | lag | stale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (p, t, b, m, c, e, s), cell in cells(doc["rows"], SIM_KEY):
        out.append(
            f"| {p} | {t.split(':')[0]} | {b} | {m} | {c} | {e} | {s:g} | {_mean(cell, 'tpot_ms'):.2f} "
            f"| {_mean(cell, 'hit_rate'):.3f} | {_mean(cell, 'mib_per_token'):.1f} "
            f"| {_mean(cell, 'stall_ms_per_token'):.2f} | {_mean(cell, 'policy_us_per_call'):.1f} "
            f"| {_mean(cell, 'lag'):.2f} | {sum(r['stale'] for r in cell)} |"
        )
    return out


def plot(bench: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bench["rows"]
    budgets = sorted({r["budget"] for r in rows})
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (m != "sync", m))
    fig, axes = plt.subplots(2, len(budgets), figsize=(5.5 * len(budgets), 7.5), squeeze=False)
    for j, budget in enumerate(budgets):
        for mode in modes:
            for every in sorted({r["plan_every"] for r in rows}):
                cell = [r for r in rows if (r["budget"], r["mode"], r["plan_every"]) == (budget, mode, every)]
                shares = sorted({r["prefetch_share"] for r in cell})
                if not shares:
                    continue
                hit = [_mean([r for r in cell if r["prefetch_share"] == s], "hit_rate") for s in shares]
                mib = [_mean([r for r in cell if r["prefetch_share"] == s], "mib_per_token") for s in shares]
                style = "-" if mode == "sync" else "--"
                axes[0][j].plot(shares, hit, style, marker="o", label=f"{mode}, plan_every {every}")
                axes[1][j].plot(shares, mib, style, marker="o", label=f"{mode}, plan_every {every}")
        axes[0][j].set_title(f"{bench['model']}, {budget} budget, calibration text", fontsize=9)
        axes[0][j].set_ylabel("decode hit rate")
        axes[1][j].set_ylabel("MiB moved per decoded token")
        for ax in axes[:, j]:
            ax.set_xlabel("prefetch_share")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_report(args: argparse.Namespace) -> int:
    if args.bench:
        doc = json.loads(Path(args.bench).read_text())
        print(f"## engine: {doc['model']}, {doc['text']}, -t {doc['threads']}")
        print("\n".join(bench_table(doc)))
        if args.plot:
            plot(doc, Path(args.plot))
    if args.sim:
        doc = json.loads(Path(args.sim).read_text())
        print(f"\n## simulated: traces {', '.join(doc['traces'])} (mean over them)")
        print("\n".join(sim_table(doc)))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-m", "--model", default="smolmoe-b", help="built-in model name or its GGUF")
        p.add_argument("--windows", default="0.3,0.7", help="window starts, as shares of the split")
        p.add_argument("--prompt", type=int, default=128, help="prompt tokens (one batch)")
        p.add_argument("-n", type=int, default=256, help="teacher-forced decode tokens per window")
        p.add_argument("-t", "--threads", type=int, default=1)

    b = sub.add_parser("bench", help="the grid on the engine (emulated device)")
    common(b)
    b.add_argument("--sidecar", type=Path, default=None)
    b.add_argument("--budgets", default="25%,50%")
    b.add_argument("--modes", default="sync,det1,async", help="sync, async (free-running), detK")
    b.add_argument("--plan-every", default="1,2,4")
    b.add_argument("--shares", default="0.25,0.4,0.6,1.0")
    b.add_argument("--repeat", type=int, default=1)
    b.add_argument("--json", required=True)
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("traces", help="record the same windows as traces for the simulator")
    common(t)
    t.add_argument("--out", required=True)
    t.set_defaults(func=cmd_traces)

    s = sub.add_parser("sim", help="the grid in the simulator, on target shapes")
    s.add_argument("-m", "--model", default="smolmoe-b")
    s.add_argument("--sidecar", type=Path, default=None)
    s.add_argument("--traces", required=True, help="a folder of traces (the `traces` command's)")
    s.add_argument("--bench", default=None, help="the bench JSON whose hook us/call to charge ('measured')")
    s.add_argument(
        "--charge",
        default="pooled",
        help="measured (bench's us/call of the cell), pooled (of the mode and plan_every), timed (sim's)",
    )
    s.add_argument("--profiles", default="h200,rtx4060", help="shipped profiles; `emulated`: this machine")
    s.add_argument("--probe", default=None, help="the cost profile (`pyspice probe`) of `emulated`")
    s.add_argument("--targets", default="qwen2-57b-a14b:Q5_K_M,deepseek-v2-lite:Q4_K_M")
    s.add_argument("--budgets", default="25%,50%")
    s.add_argument("--modes", default="sync,async")
    s.add_argument("--plan-every", default="1,2,4")
    s.add_argument("--shares", default="0.25,0.4,0.6,1.0")
    s.add_argument("--json", required=True)
    s.set_defaults(func=cmd_sim)

    r = sub.add_parser("report", help="tables (markdown) and a plot from the JSONs")
    r.add_argument("--bench", default=None)
    r.add_argument("--sim", default=None)
    r.add_argument("--plot", default=None)
    r.set_defaults(func=cmd_report)

    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
