#!/usr/bin/env python3
"""`make run`: the main job until `pyspice chat` lands.

Builds the default model (smolmoe, a real qwen2moe made from SmolLM2-135M-
Instruct; cached after the first time) and asks it a question in its own chat
format, through the MoE hook with the exact policy, then prints the stats.
"""

from __future__ import annotations

import json
import subprocess
import sys

QUESTION = "What is Python?"
# SmolLM2's ChatML template (the GGUF carries it; `pyspice chat` will apply it itself)
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def main() -> int:
    cmd = [
        sys.executable,
        "-m",
        "pyspice",
        "generate",
        "-p",
        PROMPT,
        "-n",
        "64",
        "--temp",
        "0",
        "--repeat-penalty",
        "1.3",
        "-c",
        "1024",
        "--json",
    ]
    print("main job: pyspice generate (default model, exact policy) ...", file=sys.stderr)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        return result.returncode
    doc = json.loads(result.stdout)
    stats = doc["stats"]
    answer = doc["text"].split("<|im_end|>")[0].strip()
    print(f"user: {QUESTION}\nsmolmoe: {answer}")
    print(
        f"\n[{len(doc['tokens'])} tokens | policy exact | {stats['hook_calls']} hook calls, "
        f"{stats['activations']} expert activations | TPOT {stats['tpot_ms']:.2f} ms | "
        f"prefill {stats['prefill_tps']:.0f} tok/s]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
