"""`pyspice trace import`: read a real model's routing recording into an ids-only trace.

Formats (told by each file's first line, or --format):

  csv-ids     one prompt per file: `Layer ID,Batch Number,Token,Activated Expert IDs`
              rows, expert ids without weights (the moe-beyond recording of
              DeepSeek-V2-Lite-Chat); the token text is not imported
  vllm-jsonl  a {"type": "meta", ...} line, then {"type": "route", "token_idx",
              "layer", "topk_ids", "topk_weights"} lines; a token_idx not above
              its layer's last one starts a new sequence

A folder stands for the recording files in it; files are read in natural order
(prompt_2 before prompt_10), each file at least one sequence. The model's expert
count comes from the recording's meta line, --shape or --n-expert; layers and
top-k from the rows. Batches in which every token chose the same experts at
every layer (a logger's warm-up rows) are dropped and counted. A bad row stops
the import with its file and line, and nothing is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyspice.cli.common import note
from pyspice.cli.numbers import integer
from pyspice.formats.importers import FORMATS, ImportOptions, ModelShape, import_recording
from pyspice.models.synth import SHAPES
from pyspice.sim.targets import TARGET_SHAPES


def model_shape(name: str) -> ModelShape:
    """A published model's geometry from the shapes pyspice builds its models from."""
    dims = SHAPES[name]
    return ModelShape(
        name=name,
        n_layers=dims.n_layer,
        moe_layers=tuple(range(dims.n_dense_lead, dims.n_layer)),
        n_expert=dims.n_expert,
        top_k=dims.n_expert_used,
        n_embd=dims.n_embd,
    )


def register(actions: Any) -> None:
    p = actions.add_parser(
        "import",
        help="read a model's routing recording into an ids-only trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", type=Path, metavar="FILE", help="recording files, or folders of them")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="TRACE",
        help="the trace folder to create (must not exist)",
    )
    p.add_argument("--format", choices=FORMATS, help="the recording's format (default: told by each file)")
    p.add_argument(
        "--shape",
        choices=sorted(TARGET_SHAPES),
        help="the recorded model's published shape: its layers, experts and top-k, checked against the "
        "rows (deepseek-v2-lite: 27 layers, MoE layers 1..26, 64 experts, top-6)",
    )
    p.add_argument(
        "--n-expert",
        type=integer(1, hint="the model's routed experts per layer"),
        metavar="N",
        help="the model's experts per MoE layer, when neither the recording nor --shape says",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model name the trace records (default: the recording's, the shape's, or the folder's)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = ImportOptions(
        format=args.format,
        shape=model_shape(args.shape) if args.shape else None,
        n_expert=args.n_expert,
        model_name=args.model_name,
    )
    summary = import_recording(args.inputs, args.output, options)
    if summary.dropped_batches:
        note(
            f"dropped {summary.dropped_batches} dummy batches ({summary.dropped_tokens} tokens): every "
            "token in each routed to the same experts at every layer, as a logger's warm-up rows do"
        )
    print(summary.line())
    return 0
