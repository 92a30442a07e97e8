"""`pyspice bench`: policies side by side on one model, in one run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pyspice.cli import bench_limited, numbers
from pyspice.cli.common import add_context_args, add_model_args, add_sidecar_arg, open_model, resolve_model
from pyspice.cli.help_levels import advanced, brief
from pyspice.engine.config import gpu_present
from pyspice.engine.decode_trace import finish_decode_trace, greedy_next, start_decode_trace
from pyspice.formats.model_info import read_header
from pyspice.formats.profile import profile_path
from pyspice.measure.bench import (
    DEFAULT_PROMPT,
    BenchConfig,
    baseline_label,
    check_in_process_rows,
    fit_prompt,
    format_table,
    plot,
    run_bench,
    stderr_progress,
)
from pyspice.measure.device_bytes import llama_buffer_report
from pyspice.measure.upstream_rows import UPSTREAM_ROWS, UpstreamRow, plan_row
from pyspice.policy.rows import PolicyRow, rows_argument
from pyspice.runtime.ops import device_memory
from pyspice.units import format_bytes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="compare policies side by side (table, --json, --plot)", description=__doc__
    )
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    rows = p.add_argument(
        "--policies",
        metavar="ROWS",
        type=rows_argument(UPSTREAM_ROWS),
        default="stock,exact,exact-py",
        help="comma-separated rows NAME[@key=value,...]; llama.cpp rows (plain llama_cpp.Llama, upstream's "
        "defaults, weight repacking on): 'upstream' (-ngl 99 on a GPU: every weight there), "
        "'upstream-ncmoe' (-ngl 99 --n-cpu-moe N, N the smallest whose GPU experts fit the "
        "slots of the --device-budget tier) and 'upstream-cpu-exps' (-ngl 99 -ot exps=CPU), the "
        "last two GPU only (skipped, with the reason, elsewhere); NAME@sync, NAME@async, NAME@detK "
        "(short for NAME@plan=...) run a SPICE policy planning synchronously, asynchronously, or "
        "deterministically K layers late; NAME@ram=BUDGET gives a --memory-limit row a RAM budget "
        "of its own",
    )
    brief(
        rows,
        "comma-separated rows NAME[@key=value,...] (default stock,exact,exact-py); llama.cpp's own: "
        "upstream, upstream-ncmoe, upstream-cpu-exps",
    )
    advanced(
        p.add_argument(
            "--baseline", default=None, help="row the ratios divide by (default: the first of --policies)"
        )
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "-p", "--prompt", help=f"prompt text (default: a {len(DEFAULT_PROMPT.split())}-word passage)"
    )
    group.add_argument("-f", "--file", "--text", dest="file", help="read the prompt from a file")
    advanced(
        p.add_argument(
            "--prompt-tokens",
            type=numbers.integer(0, hint="0 takes the prompt as given"),
            default=128,
            help="repeat or cut the prompt to exactly this many tokens (default 128; 0 = as given)",
        )
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=numbers.TOKENS,
        default=32,
        metavar="N",
        help="tokens to decode per run (default 32)",
    )
    p.add_argument(
        "--repeat",
        type=numbers.integer(1, hint="runs per policy"),
        default=3,
        help="runs per policy (default 3)",
    )
    p.add_argument("--json", action="store_true", help="print {policies: {NAME: stats + tokens}} as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw the comparison into this PNG")
    advanced(
        p.add_argument(
            "--trace",
            metavar="DIR",
            default=None,
            help="after the timed runs, decode once more (untimed) with the first policy and record every "
            "decode step's MoE inputs and routing into this trace directory (pyspice sim)",
        )
    )
    advanced(
        p.add_argument(
            "--replay-routing",
            metavar="TRACE",
            type=Path,
            default=None,
            help="timing only: every hooked row uses the expert ids of this recorded trace (bench "
            "--trace, python -m pyspice.measure.record trace) instead of the router's, so hit rates and "
            "TPOT of a random-weight model show real locality; outputs are not compared; a trace of "
            "another geometry is mapped (said once); --trace then records the replayed ids",
        )
    )
    advanced(
        p.add_argument(
            "--memory-limit",
            type=bench_limited.parse_memory_limit,
            default=None,
            metavar="BYTES|rule",
            help="run every row in its own process and memory cgroup with this limit (2GiB, 512MiB), the "
            "model dropped from the page cache before each; a row may set its own budgets "
            "(exact@ram=50%%, lru@ram=2GiB,plan=sync); cold and warm "
            "start, bytes read per token, cgroup peak, peak RSS, OOM kills (needs root and cgroup v1 or v2). "
            "'rule': the cgroup peak of exact@ram=1%% (run first, as the rows run) plus half the "
            "routed-expert bytes, printed",
        )
    )
    p.set_defaults(func=run)


def _record_trace(llm: Any, out: str, policies: list[str], prompt: tuple[int, ...], n_predict: int) -> None:
    """`policies`: the names of the pyspice rows; the trace records under the first."""
    name = policies[0] if policies else "exact"
    recorder = start_decode_trace(llm, out, "exact" if name == "stock" else name)
    llm.reset()
    # replaying: the trace records the replayed ids, as the rows ran
    llm.spice_engine.replay_prompt()
    llm.eval(list(prompt))
    llm.spice_engine.replay_decode(len(prompt))
    tokens = [greedy_next(llm)]
    for _ in range(n_predict - 1):
        llm.eval([tokens[-1]])
        tokens.append(greedy_next(llm))
    trace = finish_decode_trace(recorder, prompt_tokens=len(prompt), tokens=tokens)
    print(f"bench: trace of {trace.n_tokens} decode steps written to {out}", file=sys.stderr)


def plan_upstream_rows(llm: Any, model: Path, policies: tuple[PolicyRow, ...]) -> dict[str, UpstreamRow]:
    """How each llama.cpp row among `policies` loads here, or why it cannot."""
    wanted = [p.name for p in policies if p.name in UPSTREAM_ROWS]
    if not wanted:
        return {}
    gpu = gpu_present()
    # what the pyspice rows' tier holds on the device: its slots (the budget in slots as large
    # as the largest expert), which is what upstream-ncmoe's GPU experts must match
    tier = llm.spice_engine.runtime.slot_pool_bytes() if llm.spice_device is not None else None
    tensors = read_header(model).tensors
    return {
        name: plan_row(
            name,
            tensors,
            gpu=gpu,
            budget_bytes=tier,
            device_free=device_memory(0)[0] if gpu else None,
            cpu_n_gpu_layers=int(llm.model_params.n_gpu_layers),
        )
        for name in wanted
    }


def pick_baseline(policies: tuple[str, ...], upstream: dict[str, UpstreamRow], chosen: str | None) -> str:
    """--baseline, or the first row that runs here (`policies`: the rows' labels); a
    baseline that cannot run is an error."""
    skipped = {name: row.skip for name, row in upstream.items() if row.skip is not None}
    if chosen is not None:
        if chosen in skipped:
            raise ValueError(f"baseline {chosen!r} cannot run here ({skipped[chosen]}); name another")
        return chosen
    runs = [p for p in policies if p not in skipped]
    if not runs:
        raise ValueError(f"no row of --policies can run here: {'; '.join(skipped.values())}")
    return runs[0]


def row_record(row: UpstreamRow) -> dict[str, Any]:
    """A llama.cpp row's placement for --json."""
    return {
        "label": row.label,
        "n_gpu_layers": row.n_gpu_layers,
        "overrides": [f"{pattern}={buft}" for pattern, buft in row.overrides],
        "expert_device_bytes": row.expert_device_bytes,
        "skipped": row.skip,
        **row.extra,
    }


def describe_row(row: UpstreamRow) -> str:
    """What a llama.cpp row ran, as llama.cpp's own flags say it."""
    if not row.n_gpu_layers:
        return f"bench: {row.label}: llama.cpp with upstream's defaults, every weight on the CPU"
    flags = f"-ngl {row.n_gpu_layers}"
    if "n_cpu_moe" in row.extra:
        flags += (
            f" --n-cpu-moe {row.extra['n_cpu_moe']} (the experts of {row.extra['gpu_expert_layers']} of "
            f"{row.extra['expert_layers']} MoE layers on the GPU: {format_bytes(row.expert_device_bytes)}, "
            f"for the {format_bytes(row.extra['matched_bytes'])} of the pyspice rows' device tier)"
        )
    elif row.overrides:
        flags += "".join(f" -ot {pattern}={buft}" for pattern, buft in row.overrides)
    return f"bench: {row.label}: llama.cpp {flags}"


def run(args: argparse.Namespace) -> int:
    if args.memory_limit is not None:
        return bench_limited.run(args)
    rows: tuple[PolicyRow, ...] = tuple(args.policies)
    check_in_process_rows(rows)
    labels = tuple(row.label for row in rows)
    chosen = baseline_label(args.baseline) if args.baseline is not None else None
    if chosen is not None and chosen not in labels:
        raise ValueError(f"baseline {args.baseline!r} is not among --policies {','.join(labels)}")
    if args.n_predict < 1 or args.repeat < 1:
        raise ValueError("-n and --repeat must be at least 1")
    prompt = Path(args.file).read_text(encoding="utf-8") if args.file else (args.prompt or DEFAULT_PROMPT)
    # open as the first policy that is not the reference, so that what it needs
    # (a device tier, the model's sidecar) is found before any run starts
    hooked = [row.name for row in rows if row.name not in UPSTREAM_ROWS]
    first = next((name for name in hooked if name != "stock"), "stock")
    model = resolve_model(args, role="benchmark")  # with no -m, the model in the targets' routing regime
    with llama_buffer_report() as model_buffers:
        llm = open_model(args, first)
    prompt_tokens = fit_prompt(llm.tokenize(prompt.encode("utf-8"), add_bos=True), args.prompt_tokens)
    if len(prompt_tokens) + args.n_predict > args.ctx_size:
        raise ValueError(
            f"prompt ({len(prompt_tokens)} tokens) + -n {args.n_predict} exceed -c {args.ctx_size}"
        )
    upstream = plan_upstream_rows(llm, model, rows)
    baseline = pick_baseline(labels, upstream, chosen)
    replay = llm.spice_engine.replay
    cfg = BenchConfig(
        rows,
        prompt_tokens,
        args.n_predict,
        args.repeat,
        upstream=upstream,
        replaying=replay is not None,
        model_buffers=model_buffers,
    )
    stderr_progress(
        f"{resolve_model(args).name}: {len(prompt_tokens)} prompt tokens, {args.n_predict} decoded, "
        f"{args.repeat} repeats, {llm.n_threads} threads"
    )
    results = run_bench(llm, cfg, stderr_progress)
    if args.trace:
        _record_trace(llm, args.trace, hooked, prompt_tokens, args.n_predict)
    llm.close()
    if args.json:
        doc = {
            "model": str(resolve_model(args)),
            "prompt_tokens": len(prompt_tokens),
            "n_predict": args.n_predict,
            "repeat": args.repeat,
            "threads": llm.n_threads,
            "replay_routing": str(replay.source) if replay is not None else None,
            # where the replayed decode started, so the simulator replays the run's window
            "replay_decode_start": replay.decode_start_after(len(prompt_tokens))
            if replay is not None
            else None,
            # what the simulator needs to replay the run: the tier as sized, the probe the policies read
            "tier": dataclasses.asdict(llm.spice_device) if llm.spice_device is not None else None,
            "cost_profile": str(probe) if (probe := profile_path(model)).is_file() else None,
            "policies": {name: res.record() for name, res in results.items()},
            "llama_cpp_rows": {name: row_record(row) for name, row in upstream.items()},
        }
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_table(results, baseline))
        for row in upstream.values():
            if row.skip is None:
                print(describe_row(row))
    if args.plot:
        title = f"{resolve_model(args).name}: {len(prompt_tokens)}-token prompt, {args.n_predict} decoded"
        plot(results, baseline, args.plot, title)
        print(f"bench: plot written to {args.plot}", file=sys.stderr)
    if tiers := (llm.spice_device.describe() if llm.spice_device is not None else None):
        print(f"bench: {tiers}", file=sys.stderr)
    invalid = [name for name, res in results.items() if res.stats.get("policy_fallbacks")]
    for name in invalid:
        print(
            f"bench: {name} had policy fallbacks (a policy raised or returned invalid plans): "
            "this run is INVALID",
            file=sys.stderr,
        )
    return 1 if invalid else 0
