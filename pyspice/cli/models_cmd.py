"""`pyspice models`: make models. `synth` writes random-weight MoE GGUFs for tests and timing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    from pyspice.models.synth import ARCHS, SHAPES

    p = sub.add_parser("models", help="make models (synthetic MoE fixtures)", description=__doc__)
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
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


def run_synth(args: argparse.Namespace) -> int:
    from pyspice.models.synth import synthesize

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
