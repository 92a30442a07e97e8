"""Cost of the LoRE surrogate executor on a model (default: smolmoe).

Two measurements at a given rank (random matrices: the cost does not depend
on the values):
  kernel  spice_surrogate_apply over many rows on one thread: us per activation;
  decode  greedy decode steps with every activation a surrogate, minus the same
          steps with every activation dropped, per surrogate activation (the
          graph threads of the model, Python policy cost equal in both).
Also prints the exact host executor's decode time, and bytes per surrogate vs per expert.

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


def decode_times(llm: Llama, policies: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median seconds per single-token decode step under each policy. The
    policies take turns step by step on one context, so a slow spell of the
    machine hits them all alike."""
    llm.set_policy("exact")
    llm.reset()  # type: ignore[no-untyped-call]
    llm.eval(llm.tokenize(b"The quick brown fox", add_bos=True))
    times: dict[str, list[float]] = {name: [] for name in policies}
    token = 1
    for _ in range(rounds):
        for name, policy in policies.items():
            llm.set_policy(policy)
            t0 = time.perf_counter()
            llm.eval([token])
            times[name].append(time.perf_counter() - t0)
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=150, help="decode steps per policy (context 512 holds 3x)")
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
        n_ctx=1024,
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
        policies = {
            name: Everything(a)
            for name, a in (("host", ACTION_HOST), ("drop", ACTION_DROP), ("surrogate", ACTION_SURROGATE))
        }
        llm.set_policy(policies["surrogate"])
        llm.reset()  # type: ignore[no-untyped-call]
        llm.spice_reset_stats()
        llm.eval([1])
        per_step = llm.spice_stats()["activations"]
        med = decode_times(llm, policies, args.steps)
        extra = (med["surrogate"] - med["drop"]) / per_step * 1e6
        exact = (med["host"] - med["drop"]) / per_step * 1e6
        for name, sec in med.items():
            print(f"decode all-{name}: {sec * 1e3:.2f} ms per token")
        print(
            f"decode ({args.threads} threads): surrogate {extra:.2f} us per activation vs exact host "
            f"{exact:.2f} us per activation ({per_step} activations per token)"
        )
    finally:
        llm.close()


if __name__ == "__main__":
    main()
