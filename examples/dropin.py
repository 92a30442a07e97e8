#!/usr/bin/env python3
"""A llama-cpp-python app on pyspice: the import changes, the calls do not.

    .venv/bin/python examples/dropin.py                       # the default model (smolmoe)
    .venv/bin/python examples/dropin.py model.gguf --policy lru --device-budget 25%

The pyspice options are keyword arguments of `Llama`: `policy`, `device_budget`
(emulated on a CPU-only build: `emulate_bandwidth` GB/s, `emulate_latency` us),
`sidecar`. `spice_stats()` returns the stats record.
"""

from __future__ import annotations

import argparse
import json
import sys

from pyspice import Llama  # was: from llama_cpp import Llama


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", help="GGUF path (default: smolmoe, built on first use)")
    parser.add_argument("--policy", default="exact", help="expert policy (default exact)")
    parser.add_argument("--device-budget", default=None, help="device tier: 2GiB, 512MiB or 25%%")
    parser.add_argument("-n", type=int, default=48, help="tokens per answer (default 48)")
    parser.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    args = parser.parse_args()
    if args.model is None:
        from pyspice.models.smolmoe_build import build_smolmoe

        args.model = str(build_smolmoe())

    llm = Llama(
        args.model,
        n_ctx=2048,
        n_threads=args.threads,
        verbose=False,
        policy=args.policy,  # pyspice's options, next to llama-cpp-python's
        device_budget=args.device_budget,
    )
    if llm.spice_device is not None:
        print(f"[{llm.spice_device.describe()}]", file=sys.stderr)

    print("tokenize:", llm.tokenize(b"Hello, world"))
    done = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
    print("completion:", repr(done["choices"][0]["text"]))

    print("chat (streamed): ", end="", flush=True)
    messages = [{"role": "user", "content": "What is a Mixture-of-Experts model?"}]
    for chunk in llm.create_chat_completion(
        messages=messages, max_tokens=args.n, temperature=0, repeat_penalty=1.3, stream=True
    ):
        print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
    print()

    stats = llm.spice_stats()
    stats.pop("layers")  # the same counters for each MoE layer
    print(json.dumps(stats, indent=1))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
