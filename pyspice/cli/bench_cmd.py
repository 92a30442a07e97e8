"""`pyspice bench`: policies side by side on one model, in one run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyspice.calibrate.capture import finish_decode_trace, start_decode_trace
from pyspice.cli import bench_limited, numbers
from pyspice.cli.common import add_context_args, add_model_args, add_sidecar_arg, open_model, resolve_model
from pyspice.measure.bench import (
    DEFAULT_PROMPT,
    BenchConfig,
    fit_prompt,
    format_table,
    greedy_next,
    plot,
    run_bench,
    split_row,
    stderr_progress,
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="compare policies side by side (table, --json, --plot)", description=__doc__
    )
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument(
        "--policies",
        default="stock,exact,exact-py",
        help="comma-separated policy names; 'upstream' adds the model loaded by plain llama_cpp.Llama "
        "with upstream's defaults (weight repacking on); NAME@sync, NAME@async, NAME@detK run a "
        "SPICE policy planning synchronously, asynchronously, or deterministically K layers late",
    )
    p.add_argument(
        "--baseline", default=None, help="policy the ratios divide by (default: the first of --policies)"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "-p", "--prompt", help=f"prompt text (default: a {len(DEFAULT_PROMPT.split())}-word passage)"
    )
    group.add_argument("-f", "--file", "--text", dest="file", help="read the prompt from a file")
    p.add_argument(
        "--prompt-tokens",
        type=numbers.integer(0, hint="0 takes the prompt as given"),
        default=128,
        help="repeat or cut the prompt to exactly this many tokens (default 128; 0 = as given)",
    )
    p.add_argument(
        "-n", "--n-predict", type=numbers.TOKENS, default=32, help="tokens to decode per run (default 32)"
    )
    p.add_argument(
        "--repeat",
        type=numbers.integer(1, hint="runs per policy"),
        default=3,
        help="runs per policy (default 3)",
    )
    p.add_argument("--json", action="store_true", help="print {policies: {NAME: stats + tokens}} as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw the comparison into this PNG")
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="after the timed runs, decode once more (untimed) with the first policy and record every "
        "decode step's MoE inputs and routing into this trace directory (pyspice sim)",
    )
    p.add_argument(
        "--memory-limit",
        type=numbers.byte_size("the RAM every row may use"),
        default=None,
        metavar="BYTES",
        help="run every row in its own process and memory cgroup with this limit (2GiB, 512MiB), the "
        "model dropped from the page cache before each; rows NAME or NAME@ram=BUDGET; cold and warm "
        "start, bytes read per token, cgroup peak, peak RSS, OOM kills (needs root and cgroup v1 or v2)",
    )
    p.set_defaults(func=run)


def _record_trace(llm: Any, out: str, policies: list[str], prompt: tuple[int, ...], n_predict: int) -> None:
    # lazy: the capture module loads native code

    name = policies[0] if policies else "exact"
    recorder = start_decode_trace(llm, out, "exact" if name == "stock" else name)
    llm.reset()
    llm.eval(list(prompt))
    tokens = [greedy_next(llm)]
    for _ in range(n_predict - 1):
        llm.eval([tokens[-1]])
        tokens.append(greedy_next(llm))
    trace = finish_decode_trace(recorder, prompt_tokens=len(prompt), tokens=tokens)
    print(f"bench: trace of {trace.n_tokens} decode steps written to {out}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.memory_limit is not None:
        return bench_limited.run(args)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not policies:
        raise ValueError("--policies needs at least one policy name")
    baseline = args.baseline if args.baseline is not None else policies[0]
    if baseline not in policies:
        raise ValueError(f"baseline {baseline!r} is not among --policies {','.join(policies)}")
    if args.n_predict < 1 or args.repeat < 1:
        raise ValueError("-n and --repeat must be at least 1")
    prompt = Path(args.file).read_text(encoding="utf-8") if args.file else (args.prompt or DEFAULT_PROMPT)
    # open as the first policy that is not the reference, so that what it needs
    # (a device tier, the model's sidecar) is found before any run starts
    first = next((split_row(p)[0] for p in policies if p not in ("stock", "upstream")), "stock")
    resolve_model(args, role="benchmark")  # with no -m, the model in the targets' routing regime
    llm = open_model(args, first)
    prompt_tokens = fit_prompt(llm.tokenize(prompt.encode("utf-8"), add_bos=True), args.prompt_tokens)
    if len(prompt_tokens) + args.n_predict > args.ctx_size:
        raise ValueError(
            f"prompt ({len(prompt_tokens)} tokens) + -n {args.n_predict} exceed -c {args.ctx_size}"
        )
    cfg = BenchConfig(policies, prompt_tokens, args.n_predict, args.repeat)
    stderr_progress(
        f"{resolve_model(args).name}: {len(prompt_tokens)} prompt tokens, {args.n_predict} decoded, "
        f"{args.repeat} repeats, {llm.n_threads} threads"
    )
    results = run_bench(llm, cfg, stderr_progress)
    if args.trace:
        _record_trace(
            llm, args.trace, [p for p in policies if p != "upstream"], prompt_tokens, args.n_predict
        )
    llm.close()
    if args.json:
        doc = {
            "model": str(resolve_model(args)),
            "prompt_tokens": len(prompt_tokens),
            "n_predict": args.n_predict,
            "repeat": args.repeat,
            "threads": llm.n_threads,
            "policies": {name: res.record() for name, res in results.items()},
        }
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_table(results, baseline))
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
