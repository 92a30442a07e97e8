#!/usr/bin/env python3
"""`make run`: the main job until the default model lands.

Makes (once, cached) a small random-weight qwen2moe model and generates from
it through the MoE hook with the exact policy. The words are nonsense (the
weights are random); what it shows is the whole path working: patched
llama.cpp -> hook -> libspice -> exact experts, with the stats record.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pyspice.models.synth import synthesize
from pyspice.paths import models_dir


def main() -> int:
    model = models_dir() / "synth-qwen2moe-tiny-Q8_0.gguf"
    if not model.is_file():
        print(f"main job: making a synthetic qwen2moe model at {model}", file=sys.stderr)
        synthesize("qwen2moe", "tiny", model, quant="Q8_0", progress=True)
    prompt = "The experts of a mixture-of-experts model"
    cmd = [
        sys.executable,
        "-m",
        "pyspice",
        "generate",
        "-m",
        str(model),
        "-p",
        prompt,
        "-n",
        "32",
        "--temp",
        "0",
        "-c",
        "512",
        "--json",
    ]
    print("main job: " + " ".join(cmd[2:]), file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        return result.returncode
    doc = json.loads(result.stdout)
    stats = doc["stats"]
    print(f"{prompt}{doc['text']}")
    print(
        f"\n[{len(doc['tokens'])} tokens | policy exact | {stats['hook_calls']} hook calls, "
        f"{stats['activations']} expert activations | TPOT {stats['tpot_ms']:.2f} ms | "
        f"prefill {stats['prefill_tps']:.0f} tok/s | random weights: the text is noise]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
