#!/usr/bin/env python3
"""Tune the lossy SPICE levels' surrogate thresholds on the CALIBRATION text.

`spice:balanced` may cost at most +1% perplexity over exact and `spice:fast` at
most +5% (token by token, as decoding runs). Their two thresholds — the gate
weight under which a miss may be substituted and the surrogate's held-out
fit error under which it is trusted — are chosen here on the calibration
split of the model's corpus (the text the sidecar was fitted on; -m smolmoe-b
tunes on smolmoe-b's mix),
never on the held-out text the levels are then judged on
(`pyspice eval ppl --token-by-token --policies spice:exact,spice:balanced,spice:fast`).

For every device budget and every (weight, error) pair of the grid this prints
the perplexity change against spice:exact and the share of activations
substituted; then, per level, the pair with the most substitution whose change
stays under `--margin` x the level's bound at every budget (a margin, because
held-out text is not calibration text).

    .venv/bin/python scripts/tune-quality-levels.py --budgets 25%,50% --chunks 3
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

BOUNDS = {"spice:balanced": 0.01, "spice:fast": 0.05}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="GGUF or built-in name (default: smolmoe)")
    parser.add_argument("--sidecar", type=Path, default=None, help="default: the one beside the model")
    parser.add_argument("--budgets", default="25%,50%")
    parser.add_argument("--weights", default="0.04,0.05,0.06,0.07", help="gate-weight thresholds to try")
    parser.add_argument("--errors", default="0.5,0.6,0.7,0.8", help="fit-error thresholds to try")
    parser.add_argument("--chunks", type=int, default=3, help="512-token chunks scored per run")
    parser.add_argument("--margin", type=float, default=0.6, help="use at most this share of each bound")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()

    from pyspice.api import Llama
    from pyspice.engine import RunConfig
    from pyspice.formats.sidecar import default_sidecar_path
    from pyspice.measure.perplexity import perplexity
    from pyspice.models.builtin import builtin_of
    from pyspice.models.default import default_model
    from pyspice.models.smolmoe_build import MODEL_NAMES
    from pyspice.models.smolmoe_recipe import RECIPE_NAME, corpus_part
    from pyspice.policy.spice import SpicePolicy, spice_config

    def say(message: str) -> None:
        print(f"pyspice: {message}", file=sys.stderr)

    # a built-in model by name (smolmoe, smolmoe-b) is tuned on ITS calibration split; a
    # GGUF path on that of the built-in model it is a build of, else smolmoe's
    if args.model is None or args.model in MODEL_NAMES:
        model = default_model(args.model or RECIPE_NAME, note=say)
    else:
        model = Path(args.model)
    sidecar = args.sidecar or default_sidecar_path(model)
    corpus = builtin_of(model) or RECIPE_NAME
    say(f"tuning on the calibration split of {corpus}'s corpus")
    text = corpus_part("calibration", corpus).text
    grid = list(itertools.product(floats(args.weights), floats(args.errors)))
    # (budget, weight, error) -> (ppl change vs exact, surrogate rate)
    results: dict[tuple[str, float, float], tuple[float, float]] = {}
    for budget in [b.strip() for b in args.budgets.split(",") if b.strip()]:
        config = RunConfig(
            model=model,
            policy="exact",
            device_budget=budget,
            sidecar=sidecar,
            threads=args.threads,
            n_gpu_layers=0,
            n_ctx=512,
            n_batch=1,
            n_ubatch=1,
        )
        llm = Llama.from_config(config, logits_all=True, note=say)
        try:
            llm.set_policy("spice:exact")
            exact = perplexity(llm, text, 512, max_chunks=args.chunks).ppl
            print(f"{budget}: spice:exact ppl {exact:.4f}", file=sys.stderr, flush=True)
            for weight, error in grid:
                config = dataclasses.replace(
                    spice_config("spice:fast"),
                    name=f"tune@{weight},{error}",
                    surrogate_max_weight=weight,
                    surrogate_max_error=error,
                )
                llm.set_policy(SpicePolicy(config))
                llm.spice_reset_stats()
                ppl = perplexity(llm, text, 512, max_chunks=args.chunks).ppl
                stats = llm.spice_stats()
                rate = stats["misses"]["surrogate"] / max(1, stats["activations"])
                results[(budget, weight, error)] = (ppl / exact - 1.0, rate)
                print(
                    f"{budget}: weight < {weight:g}, error <= {error:g}: ppl {ppl:.4f} "
                    f"({ppl / exact - 1.0:+.2%}), surrogate rate {rate:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            llm.close()

    budgets = sorted({b for b, _, _ in results})
    print(
        f"calibration text, token by token, {args.chunks} chunks of 512; "
        "change vs spice:exact / surrogate rate"
    )
    print(f"{'weight':>7} {'error':>6} " + " ".join(f"{b:>20}" for b in budgets))
    for weight, error in grid:
        cells = [
            f"{results[(b, weight, error)][0]:+8.2%} / {results[(b, weight, error)][1]:.4f}" for b in budgets
        ]
        print(f"{weight:>7g} {error:>6g} " + " ".join(f"{c:>20}" for c in cells))
    for level, bound in BOUNDS.items():
        ok = [
            (min(results[(b, w, e)][1] for b in budgets), w, e)
            for w, e in grid
            if all(results[(b, w, e)][0] <= args.margin * bound for b in budgets)
        ]
        if ok:
            rate, w, e = max(ok)
            print(
                f"{level}: surrogate_max_weight={w:g}, surrogate_max_error={e:g} "
                f"(lowest surrogate rate {rate:.4f})"
            )
        else:
            print(f"{level}: no pair of the grid stays under {args.margin:g} x {bound:.0%} at every budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
