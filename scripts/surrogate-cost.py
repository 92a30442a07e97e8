"""Cost of the LoRE surrogate executor on a model (default: smolmoe).

Two measurements at a given rank (random matrices: the cost does not depend
on the values):
  kernel  spice_surrogate_apply over many rows on one thread: us per activation;
  decode  greedy decode steps with every activation a surrogate, minus the same
          steps with every activation dropped, per surrogate activation (the
          graph threads of the model, Python policy cost equal in both).
Also prints the exact policy's decode time, and bytes per surrogate vs per expert.

    flock /tmp/pyspice-heavy.lock python scripts/surrogate-cost.py [--rank 8] [-m MODEL]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.api import Llama
from pyspice.policy import ACTION_DROP, ACTION_HOST, ACTION_SURROGATE, HookCall, Plan
from pyspice.runtime import surrogate_apply


class Everything:
    def __init__(self, action: int) -> None:
        self.action = action
        self.name = f"all-{action}"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), self.action, np.int32))


class RandomSidecar:
    def __init__(self, n_embd: int, rank: int) -> None:
        rng = np.random.default_rng(0)
        self.a = (rng.standard_normal((rank, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
        self.b = (rng.standard_normal((n_embd, rank)) * 0.01).astype(np.float32)

    def surrogate(self, layer: int, expert: int) -> tuple[float, Any, Any]:
        return 0.5, self.a, self.b


def kernel_us(n_embd: int, rank: int, rows: int = 4096, repeat: int = 5) -> float:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rank, n_embd)).astype(np.float32)
    b = rng.standard_normal((n_embd, rank)).astype(np.float32)
    h = rng.standard_normal((rows, n_embd)).astype(np.float32)
    s = rng.standard_normal((rows, n_embd)).astype(np.float32)
    w = np.ones(rows, np.float32)
    out = np.zeros_like(h)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        surrogate_apply(a, b, 0.5, h, w, s, out=out, n_threads=1)
        best = min(best, time.perf_counter() - t0)
    return best / rows * 1e6


def decode_s(llm: Llama, policy: Any, steps: int) -> tuple[float, dict[str, Any]]:
    """Seconds per single-token decode step (median), and the stats."""
    llm.set_policy(policy)
    llm.reset()  # type: ignore[no-untyped-call]
    llm.eval(llm.tokenize(b"The quick brown fox", add_bos=True))
    llm.spice_reset_stats()
    times = []
    token = 1
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t0)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return statistics.median(times), llm.spice_stats()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args()
    if args.model is None:
        from pyspice.models.smolmoe_build import build_smolmoe

        path = build_smolmoe()
    else:
        path = Path(args.model)
    llm = Llama(
        str(path),
        policy="stock",
        n_ctx=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    try:
        layers = [info for info in llm.spice_layers() if info.is_moe]
        n_embd = layers[0].n_embd
        loaded = llm.set_surrogates(RandomSidecar(n_embd, args.rank))
        per_surrogate = loaded.device_bytes / loaded.count
        print(f"model {path.name}: n_embd {n_embd}, {len(layers)} MoE layers x {layers[0].n_expert} experts")
        print(
            f"bytes: expert {layers[0].bytes_per_expert}, surrogate rank {args.rank} {per_surrogate:.0f} "
            f"(f16; {per_surrogate / layers[0].bytes_per_expert:.1%} of an expert)"
        )
        print(f"kernel: {kernel_us(n_embd, args.rank):.2f} us per surrogate activation (1 thread, 4096 rows)")
        # interleaved rounds, best median per policy: other processes on the
        # machine slow single rounds, not all of them
        policies = {"host": ACTION_HOST, "drop": ACTION_DROP, "surrogate": ACTION_SURROGATE}
        results: dict[str, tuple[float, dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for name, action in policies.items():
                decode_s(llm, Everything(action), 2)  # warm-up
                got = decode_s(llm, Everything(action), args.steps)
                if name not in results or got[0] < results[name][0]:
                    results[name] = got
        per_step = results["surrogate"][1]["activations"] / args.steps
        extra = (results["surrogate"][0] - results["drop"][0]) / per_step * 1e6
        exact = (results["host"][0] - results["drop"][0]) / per_step * 1e6
        for name, (sec, _) in results.items():
            print(f"decode all-{name}: {sec * 1e3:.2f} ms per token")
        print(
            f"decode ({args.threads} threads): surrogate {extra:.2f} us per activation vs exact host "
            f"{exact:.2f} us per activation ({per_step:.0f} activations per token)"
        )
    finally:
        llm.close()


if __name__ == "__main__":
    main()
