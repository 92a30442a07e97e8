"""`pyspice trace fit`: a routing-history predictor from a trace's expert ids.

Fits SPICE's ids-only predictor (pyspice.policy.spice.routing_history) on
the calibration sequences of a trace (by default its first 80%), saves it as
one .npz file, and prints its recall@k at each depth on the other sequences
beside the co-occurrence baseline (layer l's ids -> layer l+d's by a table of
P(f at l+d | e at l) counted on the same sequences). `pyspice sim
--history-predictor` runs SPICE with it, on a trace of routing alone too:
replay the held-out sequences (`--sequences`) for figures it was not fitted on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from pyspice.cli.common import note
from pyspice.cli.numbers import integer
from pyspice.outputs import check_output
from pyspice.policy.spice import history_predictor, routing_history
from pyspice.sim.regime import FIT_SHARE, Routing, read_routing


def register(actions: Any) -> None:
    p = actions.add_parser(
        "fit",
        help="fit SPICE's routing-history predictor on a trace's expert ids",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace directory, or a folder of traces")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="NPZ", help="where to save it")
    p.add_argument(
        "--fit-sequences",
        type=integer(1, hint="how many of the trace's first sequences to fit on"),
        metavar="N",
        help=f"fit on the first N sequences, test on the rest (default: the first {FIT_SHARE * 100:.0f}%%)",
    )
    p.add_argument("--depth", type=integer(1, 8), default=4, help="MoE layers ahead it predicts (default 4)")
    p.add_argument("--json", action="store_true", help="print the recall figures as JSON")
    p.set_defaults(func=run)


def _first_tokens(routing: Routing) -> npt.NDArray[np.bool_]:
    first = np.zeros(routing.n_tokens, dtype=bool)
    for start, _stop in routing.sequences:
        first[start] = True
    return first


def run(args: argparse.Namespace) -> int:
    check_output(args.output, [args.trace], "-o")
    routing = read_routing(args.trace)
    n_seq = len(routing.sequences)
    n_fit = args.fit_sequences if args.fit_sequences is not None else max(1, int(n_seq * FIT_SHARE))
    if n_fit >= n_seq:
        raise ValueError(
            f"{args.trace} has {n_seq} sequence(s): fitting on {n_fit} leaves none to test on; "
            "give --fit-sequences below that"
        )
    cut = routing.sequences[n_fit - 1][1]
    first = _first_tokens(routing)
    note(f"fitting on sequences 1-{n_fit} ({cut} tokens), testing on {n_fit + 1}-{n_seq}")
    with tqdm(desc="fit", unit="layer-depth", file=sys.stderr, mininterval=1.0) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        predictor = routing_history.fit(
            routing.ids[:cut], first[:cut], routing.n_expert, args.depth, progress=advance
        )
    predictor.save(args.output)
    test_ids, test_first = routing.ids[cut:], first[cut:]
    ours = routing_history.evaluate(predictor, test_ids, test_first)
    baseline = history_predictor.cooccurrence(
        routing.ids[:cut], first[:cut], routing.n_expert, predictor.max_depth
    )
    base = history_predictor.evaluate(baseline, test_ids, test_first)
    doc = {
        "trace": routing.name,
        "fit_sequences": [1, n_fit],
        "test_sequences": [n_fit + 1, n_seq],
        "recall": {d: round(r, 4) for d, r in ours.items()},
        "cooccurrence_recall": {d: round(r, 4) for d, r in base.items()},
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print("depth  recall@k  co-occurrence  gain")
        for d in ours:
            print(f"{d:5d}  {ours[d]:8.3f}  {base[d]:13.3f}  {ours[d] - base[d]:+.3f}")
    note(f"routing-history predictor written to {args.output}")
    return 0
