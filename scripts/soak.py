"""Soak: many decode tokens per policy, over several generations, with the process's RSS
sampled (issue 22). Per policy family, one model instance: generations of
--tokens-per-gen greedy tokens each (prompt, then one token per step, the context
reset between generations) until --tokens are done; after each generation a row:
TPOT (ms per decode token), RSS, and RSS growth since the end of the first
generation (the warm-up: allocations that happen once). The last column is what the
issue bounds (under 1% after warm-up). Not a test: numbers for the note.

    flock /tmp/pyspice-heavy.lock python scripts/soak.py -m smolmoe --tokens 10000 \\
        --policies exact,lru,spice:exact --device-budget 25% -t 2
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

from pyspice.cli.common import add_context_args, add_model_args, add_sidecar_arg, open_model
from pyspice.measure.bench import greedy_next

PROMPT = (
    "The history of computing is a story of machines that grew smaller, faster and more capable, "
    "from rooms full of vacuum tubes to processors that fit in a pocket. Each generation"
)


def rss_mib() -> float:
    """Resident set size now (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / (1 << 20)


def one_generation(llm: Any, n_tokens: int) -> float:
    """Greedy decode of n_tokens after the prompt; seconds per decode token."""
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    start = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([greedy_next(llm)])
    return (time.perf_counter() - start) / n_tokens


Row = tuple[str, int, float, float, float]  # policy, tokens so far, TPOT ms, RSS MiB, growth %


def soak(llm: Any, policy: str, total: int, per_gen: int, out: Any) -> list[Row]:
    llm.set_policy(policy)
    rows = []
    warm: float | None = None
    done = 0
    gen = 0
    while done < total:
        n = min(per_gen, total - done)
        tpot = one_generation(llm, n)
        done += n
        gen += 1
        rss = rss_mib()
        warm = rss if warm is None else warm
        growth = 100.0 * (rss - warm) / warm
        rows.append((policy, done, tpot * 1e3, rss, growth))
        line = f"{policy:<14} {gen:>4} {done:>7} {tpot * 1e3:>9.3f} {rss:>9.1f} {growth:>+8.2f}%"
        print(line, file=out, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument("--policies", default="exact,lru", help="comma-separated policies (default exact,lru)")
    p.add_argument("--tokens", type=int, default=10000, help="decode tokens per policy (default 10000)")
    p.add_argument(
        "--tokens-per-gen", type=int, default=1000, help="decode tokens per generation (default 1000)"
    )
    args = p.parse_args(argv)
    if args.tokens_per_gen + 64 > args.ctx_size:
        p.error(f"--tokens-per-gen {args.tokens_per_gen} and the prompt do not fit -c {args.ctx_size}")
    policies = [x for x in args.policies.split(",") if x]
    llm = open_model(args, policies[0])
    print(f"{'policy':<14} {'gen':>4} {'tokens':>7} {'TPOT ms':>9} {'RSS MiB':>9} {'growth':>9}")
    summary = []
    try:
        for policy in policies:
            rows = soak(llm, policy, args.tokens, args.tokens_per_gen, sys.stdout)
            first, last = rows[0], rows[-1]
            summary.append((policy, last[1], first[2], last[2], first[3], last[3], last[4]))
    finally:
        llm.close()
    print()
    head = ("policy", "tokens", "TPOT first", "TPOT last", "RSS warm", "RSS end", "growth")
    print("{:<14} {:>7} {:>11} {:>10} {:>9} {:>9} {:>8}".format(*head))
    for policy, n, t0, t1, r0, r1, g in summary:
        print(f"{policy:<14} {n:>7} {t0:>9.3f}ms {t1:>8.3f}ms {r0:>8.1f}M {r1:>8.1f}M {g:>+7.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
