"""`pyspice eval`: measure model quality. `ppl` is perplexity as llama-perplexity computes it;
`predictor` and `surrogate` measure a calibration sidecar on held-out text."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.calibrate.capture import CaptureConfig, capture
from pyspice.calibrate.evaluate import evaluate_predictor, evaluate_surrogates
from pyspice.calibrate.lore_fit import open_gguf
from pyspice.cli import numbers
from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    add_sidecar_arg,
    add_text_arg,
    model_path,
    note,
    read_text_or_corpus,
    resolve_model,
    run_config,
)
from pyspice.cli.help_levels import advanced, brief
from pyspice.engine.config import RunConfig
from pyspice.formats.sidecar import Sidecar, TruncatedSurrogates, default_sidecar_path
from pyspice.measure.perplexity import perplexity, top1_agreement
from pyspice.models.synth import tensor_types
from pyspice.paths import cache_dir
from pyspice.policy.substitute import SubstitutePolicy

_PPL_CTX = 512  # llama-perplexity's usual context; results are only comparable at equal context


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="measure model quality (perplexity)", description=__doc__)
    esub = p.add_subparsers(dest="eval_command", metavar="ACTION")
    esub.required = True
    ppl = esub.add_parser(
        "ppl",
        help="perplexity of a GGUF on a text file",
        description="Perplexity as llama-perplexity computes it: chunks of -c tokens (default 512), each "
        "scored on its second half. Any GGUF; MoE models run through the chosen --policy, dense ones "
        "through llama.cpp unchanged. With no model, the quality default smolmoe (built on first use); "
        "with no -f, the held-out part of a built-in model's own corpus (smolmoe's for other models). "
        "--policies compares several "
        "policies in one run (e.g. the lossy SPICE levels against spice:exact), --token-by-token "
        "scores as decoding runs (one token per hook call), which is where lossy levels act.",
    )
    add_model_args(ppl)
    add_text_arg(ppl, "text to score (default: the held-out split of the model's corpus)")
    add_context_args(ppl)
    for action in ppl._actions:  # same flag as everywhere, another default: llama-perplexity's 512
        if action.dest == "ctx_size":
            action.default = _PPL_CTX
            action.help = f"tokens per chunk (default {_PPL_CTX})"
    advanced(
        ppl.add_argument(
            "--reference",
            metavar="MODEL",
            help="also score this model (e.g. the dense original) and report greedy next-token agreement",
        )
    )
    ppl.add_argument(
        "--chunks", type=numbers.CHUNKS, default=None, metavar="N", help="score only the first N chunks"
    )
    ppl.add_argument(
        "--token-by-token",
        action="store_true",
        help="evaluate one token per decode call (-b 1 -ub 1), as generation does",
    )
    policies = ppl.add_argument(
        "--policies",
        default=None,
        metavar="NAMES",
        help="comma-separated policies scored one after another on the same model; the first is "
        "the baseline of the relative change and of top-1 agreement, the share of scored positions "
        "whose greedy next token is the same (e.g. spice:exact,spice:balanced,spice:fast)",
    )
    brief(
        policies,
        "comma-separated policies scored one after another, the first the baseline "
        "(e.g. spice:exact,spice:balanced,spice:fast)",
    )
    add_sidecar_arg(ppl)
    ppl.add_argument("--json", action="store_true", help='print {"ppl", "tokens", ...} as one JSON document')
    ppl.set_defaults(func=run_ppl)
    _register_sidecar_evals(esub)


def _add_sidecar_eval_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--sidecar",
        type=Path,
        default=None,
        help="the model's sidecar (default: <model>.spice.gguf next to the model)",
    )
    add_text_arg(
        p, "held-out text (default: the held-out split of the model's corpus, smolmoe's if not built in)"
    )
    p.add_argument("--tokens", type=int, default=4096, help="cap on evaluated tokens (default 4096)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document")


def _register_sidecar_evals(esub: Any) -> None:
    pred = esub.add_parser(
        "predictor",
        help="recall of the draft predictor vs the cross-layer router baseline",
        description="Top-K recall at depth 1..H (predicting exactly K experts) of the cross-layer "
        "baseline (router of layer l+d on layer l's MoE input) and of the draft rollout, plus the "
        "draft's recall by confidence bin, on held-out text.",
    )
    _add_sidecar_eval_args(pred)
    pred.add_argument("--depth", type=int, default=3, help="deepest look-ahead H (default 3)")
    pred.set_defaults(func=run_predictor_eval)
    sur = esub.add_parser(
        "surrogate",
        help="surrogate error per expert, and perplexity with non-resident experts substituted",
        description="Relative error of each expert's surrogate (truncated to each --ranks), of the shared "
        "expert alone and of dropping it, on held-out tokens; then perplexity when every expert "
        "outside a resident set (the --resident share of each layer's most used experts in "
        "calibration) is replaced by its surrogate, by the shared expert alone, or dropped, next to "
        "exact execution.",
    )
    _add_sidecar_eval_args(sur)
    sur.add_argument("--ranks", default="1,2,4,8", help="surrogate ranks to report (default 1,2,4,8)")
    sur.add_argument(
        "--resident",
        type=float,
        default=0.5,
        help="share of each layer's experts kept exact in the perplexity runs (default 0.5)",
    )
    sur.add_argument(
        "-c", "--ctx-size", type=int, default=_PPL_CTX, help=f"perplexity context (default {_PPL_CTX})"
    )
    sur.add_argument(
        "--chunks", type=numbers.CHUNKS, default=8, help="perplexity chunks to score (default 8)"
    )
    sur.add_argument("--no-ppl", action="store_true", help="errors only, no perplexity runs")
    sur.set_defaults(func=run_surrogate_eval)


def _eval_inputs(args: argparse.Namespace) -> tuple[Path, Any, str]:
    # the default model's own sidecar is made on first use unless another is given
    model = model_path(args.model or args.model_pos, sidecar=args.sidecar is None, role="benchmark")
    sidecar_path = args.sidecar or default_sidecar_path(model)
    sidecar = Sidecar.load(sidecar_path, model)
    return model, sidecar, read_text_or_corpus(args.file, "heldout", model)


def _capture_eval_trace(args: argparse.Namespace, model: Path, text: str, tmp: Path) -> Any:
    return capture(
        model,
        text,
        tmp / "trace",
        CaptureConfig(tokens=args.tokens, threads=args.threads),
        progress=not args.json,
    )


def run_predictor_eval(args: argparse.Namespace) -> int:

    model, sidecar, text = _eval_inputs(args)
    with tempfile.TemporaryDirectory(prefix="eval-", dir=cache_dir()) as tmp:
        trace = _capture_eval_trace(args, model, text, Path(tmp))
        predictor = sidecar.predictor()
        result = evaluate_predictor(trace, predictor, max(1, args.depth))
    if args.json:
        json.dump(result.to_json(), sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"top-{trace.meta.n_expert_used} recall on {trace.n_tokens} held-out tokens")
    print("depth  baseline  draft  predictions")
    for d, b, r, n in zip(
        result.depths, result.baseline_recall, result.draft_recall, result.pairs, strict=True
    ):
        print(f"{d:5d}  {b:8.3f}  {r:5.3f}  {n:11d}")
    print("draft recall by confidence quintile (confidence = probability mass of the predicted top-K):")
    for d, ranges, recs in zip(result.depths, result.bins, result.bin_recall, strict=True):
        cells = [f"[{lo:.3f},{hi:.3f}] {r:.3f}" for (lo, hi), r in zip(ranges, recs, strict=True)]
        print(f"depth {d}: " + "  ".join(cells))
    return 0


def run_surrogate_eval(args: argparse.Namespace) -> int:

    try:
        ranks = sorted({int(r) for r in str(args.ranks).split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--ranks takes comma-separated integers, not {args.ranks!r}") from None
    if not 0.0 <= args.resident <= 1.0:
        raise ValueError("--resident is a share between 0 and 1")
    model, sidecar, text = _eval_inputs(args)
    with tempfile.TemporaryDirectory(prefix="eval-", dir=cache_dir()) as tmp:
        trace = _capture_eval_trace(args, model, text, Path(tmp))
        errors = evaluate_surrogates(trace, open_gguf(model), sidecar, ranks)
    doc: dict[str, Any] = {"tokens": trace.n_tokens, "error": errors.means()}
    doc["error_per_layer"] = {
        str(il): {"surrogate": dict(zip(map(str, ranks), row, strict=True)), "shared_alone": sh, "drop": dr}
        for il, row, sh, dr in zip(errors.layers, errors.surrogate, errors.shared, errors.drop, strict=True)
    }
    if not args.no_ppl:
        doc["ppl"] = _substitute_ppl(args, model, sidecar, text, ranks)
    if args.json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return 0
    m = doc["error"]
    print(f"relative error of an expert's output on {trace.n_tokens} held-out tokens (mean over experts)")
    print("layer  " + "  ".join(f"r{r:<5}" for r in ranks) + "  shared  drop")
    for il, row, sh, dr in zip(errors.layers, errors.surrogate, errors.shared, errors.drop, strict=True):
        print(f"{il:5d}  " + "  ".join(f"{v:6.3f}" for v in row) + f"  {sh:6.3f}  {dr:4.2f}")
    print(
        " mean  "
        + "  ".join(f"{v:6.3f}" for v in m["surrogate"])
        + f"  {m['shared_alone']:6.3f}  {m['drop']:4.2f}"
    )
    if "ppl" in doc:
        p = doc["ppl"]
        print(
            f"perplexity, {p['resident_share']:.0%} of each layer's experts resident, the rest substituted "
            f"({p['tokens']} scored tokens):"
        )
        for name, value in p["results"].items():
            print(f"  {name:14s} {value:.4f}")
    return 0


def _substitute_ppl(
    args: argparse.Namespace, model: Path, sidecar: Any, text: str, ranks: list[int]
) -> dict[str, Any]:
    layers = sidecar.moe_layers
    resident: set[tuple[int, int]] = set()
    for il in layers:
        counts = sidecar.expert_counts(il)
        n_expert = sidecar.data.n_expert
        keep = round(args.resident * n_expert)
        order = np.argsort(-counts, kind="stable") if counts is not None else np.arange(n_expert)
        resident |= {(il, int(e)) for e in order[:keep]}
    config = RunConfig(
        model=model,
        policy="exact",
        threads=args.threads,
        n_gpu_layers=0,
        n_ctx=args.ctx_size,
        n_batch=args.ctx_size,
        n_ubatch=args.ctx_size,
    )
    llm = _load(config)
    results: dict[str, float] = {}
    scored = 0

    def run(name: str) -> None:
        nonlocal scored
        r = perplexity(llm, text, args.ctx_size, max_chunks=args.chunks)
        results[name] = r.ppl
        scored = r.tokens
        if not args.json:
            print(f"pyspice: ppl {name}: {r.ppl:.4f}", file=sys.stderr, flush=True)

    try:
        run("exact")
        n_embd = sidecar.data.n_embd
        available = [
            (il, e) for il in layers for e in range(sidecar.data.n_expert) if sidecar.has_surrogate(il, e)
        ]
        for r in ranks:
            policy = SubstitutePolicy(resident, "surrogate", available)
            llm.set_surrogates(TruncatedSurrogates(sidecar, r))
            llm.set_policy(policy)
            run(f"surrogate r{r}")
        for mode in ("shared", "drop"):
            policy = SubstitutePolicy(resident, mode)  # type: ignore[arg-type]
            source = policy.surrogate_source(sidecar, n_embd)
            llm.clear_surrogates()
            if source is not None:
                llm.set_surrogates(source)
            llm.set_policy(policy)
            run("shared alone" if mode == "shared" else "drop")
    finally:
        llm.close()
    return {"resident_share": args.resident, "tokens": scored, "results": results}


def _is_moe(path: Path) -> bool:
    return any(name.endswith("ffn_gate_inp.weight") for name in tensor_types(path))


def _open(args: argparse.Namespace, path: Path, policy: str | None) -> Any:
    if not _is_moe(path):
        if policy not in (None, "stock"):
            raise ValueError(f"{path.name} has no MoE layers: only --policy stock applies to it")
        policy = "stock"
    if args.token_by_token:
        batch = ubatch = 1  # every hook call sees one token, as in decoding
    else:
        batch = max(args.batch_size, args.ctx_size)  # one chunk per decode, as llama-perplexity with -b >= -c
        ubatch = min(args.ubatch_size, batch)
    config = replace(run_config(args, policy, model=path), n_batch=batch, n_ubatch=ubatch)
    return _load(config)


def _load(config: RunConfig) -> Any:
    from pyspice.api import Llama  # lazy: native code loads here, not at CLI start-up

    return Llama.from_config(config, logits_all=True, note=note)


def _ppl_text(args: argparse.Namespace, model: Path) -> str:
    if args.file is None:
        note("no -f: scoring the held-out split of the model's corpus (smolmoe's for a model not built in)")
    return read_text_or_corpus(args.file, "heldout", model)


def run_ppl(args: argparse.Namespace) -> int:
    model = resolve_model(args)
    text = _ppl_text(args, model)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else [args.policy]
    if args.policies and args.reference:
        raise ValueError("--reference and --policies do not go together; run them separately")
    llm = _open(args, model, policies[0])
    reference = _open(args, model_path(args.reference), None) if args.reference else None
    rows: list[dict[str, Any]] = []
    first_argmax: Any = None

    def progress(done: int, total: int, ppl: float) -> None:
        print(f"[{llm.spice_policy} {done}/{total}] ppl {ppl:.4f}", file=sys.stderr, flush=True)

    try:
        for name in policies:
            if name is not None and name != llm.spice_policy:
                llm.set_policy(name)
            llm.spice_reset_stats()
            result = perplexity(
                llm,
                text,
                args.ctx_size,
                reference=reference,
                on_chunk=progress,
                max_chunks=args.chunks,
                keep_argmax=len(policies) > 1,
            )
            if result.argmax is not None:
                first_argmax = result.argmax if first_argmax is None else first_argmax
            stats = llm.spice_stats()
            activations = max(1, int(stats["activations"]))
            rows.append(
                {
                    "policy": llm.spice_policy,
                    "ppl": result.ppl,
                    "tokens": result.tokens,
                    "chunks": result.chunks,
                    "surrogate_rate": stats["misses"]["surrogate"] / activations,
                    # share of activations run as exact experts on the host (misses neither
                    # on the device nor substituted): what a lossy level exists to cut
                    "host_rate": stats["misses"]["host"] / activations,
                    "hit_rate": stats.get("hit_rate"),
                    "planning": llm.spice_engine.planning_label,
                    "policy_fallbacks": stats.get("policy_fallbacks", 0),
                    "top1_agreement": result.top1_agreement,
                    "reference_ppl": result.reference_ppl,
                    # greedy next token the same as under the first policy, position by position
                    "agreement_vs_first": (
                        top1_agreement(result.argmax, first_argmax)
                        if result.argmax is not None and first_argmax is not None
                        else None
                    ),
                }
            )
    finally:
        llm.close()
        if reference is not None:
            reference.close()
    if len({row["planning"] for row in rows}) > 1:
        how = ", ".join(f"{row['policy']} {row['planning']}" for row in rows)
        print(
            f"pyspice eval: the rows did not all plan the same way ({how}), so their host shares "
            "differ by that too; --planning sync or async plans every row alike",
            file=sys.stderr,
        )
    base, base_host = rows[0]["ppl"], rows[0]["host_rate"]
    for row in rows:
        row["change_vs_first"] = row["ppl"] / base - 1.0
        # the share of the first policy's host-executed activations this one does not run there
        row["host_cut_vs_first"] = 1.0 - row["host_rate"] / base_host if base_host > 0 else 0.0
    if args.json:
        doc = {"policies": rows} if len(rows) > 1 else {k: v for k, v in rows[0].items() if v is not None}
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    elif len(rows) == 1:
        r = rows[0]
        print(f"ppl {r['ppl']:.4f} over {r['tokens']} tokens ({r['chunks']} chunks of {args.ctx_size})")
        if r["top1_agreement"] is not None:
            print(f"reference ppl {r['reference_ppl']:.4f}; top-1 agreement {r['top1_agreement']:.4f}")
    else:
        print(
            f"{rows[0]['tokens']} tokens ({rows[0]['chunks']} chunks of {args.ctx_size})"
            + (", token by token" if args.token_by_token else "")
        )
        print(
            f"{'policy':<16} {'ppl':>10} {'vs first':>9} {'top-1 same':>10} {'surrogate':>10} {'hit':>6} "
            f"{'host':>6} {'host cut':>9} {'fallbacks':>9}"
        )
        for r in rows:
            hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
            print(
                f"{r['policy']:<16} {r['ppl']:>10.4f} {r['change_vs_first']:>+8.2%} "
                f"{r['agreement_vs_first']:>10.4f} {r['surrogate_rate']:>10.4f} {hit:>6} "
                f"{r['host_rate']:>6.3f} {r['host_cut_vs_first']:>+8.1%} {r['policy_fallbacks']:>9}"
            )
        print(
            "(top-1 same: share of scored positions whose greedy next token is the first policy's; host: "
            "share of activations run exactly on the host; host cut: how many fewer than the first's)"
        )
    return 0
