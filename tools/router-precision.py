"""How much of the next layer's router top-k survives a narrower number format.

The rule's next-layer prefetch (adapmoe; pyspice.sim.rule.quantize_rows) keeps
routers in int16 and hidden rows in 15 bits. This measures why: for a recorded
trace (`pyspice generate ... --trace DIR`, which stores each MoE layer's input),
each layer's input against the next MoE layer's router, the mean and worst
per-layer overlap of each format's top-k with float64's. Not a test: the table
in docs/results/cpu-overhead.md.

    pyspice generate -m smolmoe-b -n 64 -t 2 --trace /tmp/tr \\
        -p "The history of the Roman empire spans many centuries, and its institutions"
    python tools/router-precision.py -m smolmoe-b --trace /tmp/tr
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def top_k(logits: F64, k: int) -> list[set[int]]:
    """Per row, the k largest, ties to the lower id (as the rule picks)."""
    ids = np.arange(logits.shape[1])
    return [set(np.lexsort((ids, -row))[:k].tolist()) for row in logits]


def overlap(a: list[set[int]], b: list[set[int]], k: int) -> float:
    return float(np.mean([len(x & y) / k for x, y in zip(a, b, strict=True)]))


def main() -> int:
    from pyspice.formats.routers import RouterReader
    from pyspice.models.default import default_model
    from pyspice.models.smolmoe_build import MODEL_NAMES
    from pyspice.sim.rule import HIDDEN_Q_LIMIT, ROUTER_Q_LIMIT, quantize_rows
    from pyspice.sim.workload import from_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True, help="GGUF or built-in name")
    parser.add_argument("--trace", type=Path, required=True, help="a trace with hidden rows")
    parser.add_argument("-k", type=int, default=None, help="top-k (default: the trace's experts per token)")
    args = parser.parse_args()

    def say(message: str) -> None:
        print(f"pyspice: {message}", file=sys.stderr)

    model = default_model(args.model, note=say) if args.model in MODEL_NAMES else Path(args.model)
    routers = RouterReader(model)
    work = from_trace(args.trace)
    moe = list(work.moe_layers)
    hidden: dict[int, list[npt.NDArray[np.float32]]] = {il: [] for il in moe}
    k = args.k
    for step in work.steps:
        for call in step.calls:
            if call.hidden is None:
                raise SystemExit(f"{args.trace}: the trace has no hidden rows")
            hidden[call.layer].append(np.asarray(call.hidden, np.float32))
            k = k or int(call.ids.shape[1])
    assert k is not None

    def rows(q: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]) -> F64:
        return q[0] * q[1][:, None].astype(np.float64)

    def bf16(r: npt.NDArray[np.float32]) -> F64:
        bits = r.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32).astype(np.float64)

    def blocks(r: npt.NDArray[np.float32], size: int) -> F64:
        n, d = r.shape
        return rows(quantize_rows(r.reshape(n * d // size, size), 127.0)).reshape(n, d)

    # (name, router format, hidden format)
    Fmt = Callable[[npt.NDArray[np.float32]], F64]
    plain: Fmt = lambda x: x.astype(np.float64)  # noqa: E731
    formats: list[tuple[str, Fmt, Fmt]] = [
        ("int8, scale per row | float32", lambda r: rows(quantize_rows(r, 127.0)), plain),
        ("int8, blocks of 32 | float32", lambda r: blocks(r, 32), plain),
        ("int12 | float32", lambda r: rows(quantize_rows(r, 2047.0)), plain),
        ("int14 | float32", lambda r: rows(quantize_rows(r, 8191.0)), plain),
        ("bf16 | float32", bf16, plain),
        ("float32 | int16", plain, lambda h: rows(quantize_rows(h, 32767.0))),
        (
            "int16 | 15 bits (the rule's)",
            lambda r: rows(quantize_rows(r, ROUTER_Q_LIMIT)),
            lambda h: rows(quantize_rows(h, HIDDEN_Q_LIMIT)),
        ),
    ]
    print(f"{model.name}, {args.trace}: top-{k} overlap with float64, per layer pair")
    print(f"{'router | input':34s} {'mean':>7s} {'worst':>7s}")
    for name, fw, fh in formats:
        scores = []
        for il, nxt in itertools.pairwise(moe):
            router = routers(nxt)
            if router is None or not hidden[il]:
                continue
            h = np.concatenate(hidden[il])
            r = np.asarray(router, np.float32)
            exact = top_k(h.astype(np.float64) @ r.astype(np.float64).T, k)
            scores.append(overlap(exact, top_k(fh(h) @ fw(r).T, k), k))
        print(f"{name:34s} {np.mean(scores):7.4f} {np.min(scores):7.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
