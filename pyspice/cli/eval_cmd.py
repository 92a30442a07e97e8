"""`pyspice eval`: measure model quality. `ppl` is perplexity as llama-perplexity computes it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    default_policy,
    open_model,
    resolve_model,
)

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
        "through llama.cpp unchanged. With no model, the default model smolmoe (built on first use).",
    )
    add_model_args(ppl)
    ppl.add_argument("-f", "--file", "--text", dest="file", type=Path, required=True, help="text to score")
    add_context_args(ppl)
    for action in ppl._actions:  # same flag as everywhere, another default: llama-perplexity's 512
        if action.dest == "ctx_size":
            action.default = _PPL_CTX
            action.help = f"tokens per chunk (default {_PPL_CTX})"
    ppl.add_argument(
        "--reference",
        metavar="MODEL",
        help="also score this model (e.g. the dense original) and report greedy next-token agreement",
    )
    ppl.add_argument("--json", action="store_true", help='print {"ppl", "tokens", ...} as one JSON document')
    ppl.set_defaults(func=run_ppl)


def _is_moe(path: Path) -> bool:
    from pyspice.models.synth import tensor_types

    return any(name.endswith("ffn_gate_inp.weight") for name in tensor_types(path))


def resolve_eval_model(name: str | None) -> Path:
    """A GGUF path, or the default model's name (built on first use)."""
    return resolve_model(argparse.Namespace(model=name, model_pos=None))


def _open(args: argparse.Namespace, path: Path, policy: str | None) -> Any:
    model_args = argparse.Namespace(**{**vars(args), "model": str(path), "model_pos": None})
    if not _is_moe(path):
        if policy not in (None, "stock"):
            raise ValueError(f"{path.name} has no MoE layers: only --policy stock applies to it")
        policy = "stock"
    elif policy is None:
        policy = default_policy(args)
    if args.batch_size < args.ctx_size:
        model_args.batch_size = args.ctx_size  # one chunk per decode, as llama-perplexity with -b >= -c
    model_args.ubatch_size = min(args.ubatch_size, model_args.batch_size)
    return open_model(model_args, policy, logits_all=True)


def run_ppl(args: argparse.Namespace) -> int:
    from pyspice.perplexity import perplexity

    text_path: Path = args.file
    if not text_path.is_file():
        raise FileNotFoundError(f"text file {text_path} does not exist")
    text = text_path.read_text(encoding="utf-8")
    model = resolve_eval_model(args.model or args.model_pos)
    llm = _open(args, model, args.policy)
    reference = _open(args, resolve_eval_model(args.reference), None) if args.reference else None

    def progress(done: int, total: int, ppl: float) -> None:
        print(f"[{done}/{total}] ppl {ppl:.4f}", file=sys.stderr, flush=True)

    try:
        result = perplexity(llm, text, args.ctx_size, reference=reference, on_chunk=progress)
    finally:
        llm.close()
        if reference is not None:
            reference.close()
    if args.json:
        doc: dict[str, Any] = {"ppl": result.ppl, "tokens": result.tokens, "chunks": result.chunks}
        if result.top1_agreement is not None:
            doc["reference_ppl"] = result.reference_ppl
            doc["top1_agreement"] = result.top1_agreement
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"ppl {result.ppl:.4f} over {result.tokens} tokens ({result.chunks} chunks of {args.ctx_size})")
        if result.top1_agreement is not None:
            print(f"reference ppl {result.reference_ppl:.4f}; top-1 agreement {result.top1_agreement:.4f}")
    return 0
