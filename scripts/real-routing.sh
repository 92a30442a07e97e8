#!/usr/bin/env bash
# The routing regime table of docs/results/real-routing.md: record ten greedy
# 100-token decodes of each benchmark model (smolmoe, smolmoe-b, the 4-layer
# random-weight DeepSeek-V2-Lite slice), then put them beside every imported
# real trace given on the command line in one `pyspice trace stats` run.
#
#   bash scripts/real-routing.sh ~/.cache/pyspice/traces/deepseek-v2-lite-moe-beyond
#
# Writes docs/results/real-routing.json and .png; the recorded traces stay in
# ~/.cache/pyspice/traces/regime/ (a rerun reuses them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/pyspice
OUT=${REGIME_TRACES:-$HOME/.cache/pyspice/traces/regime}
mkdir -p "$OUT"

PROMPTS=(
    "The history of the printing press begins"
    "Write a short story about a lighthouse keeper."
    "Explain how a refrigerator keeps food cold."
    "List five ways to save water at home."
    "What is the difference between a virus and a bacterium?"
    "Describe the rules of chess for a beginner."
    "Summarise the plot of a detective novel you like."
    "How do bees make honey?"
    "Give advice to someone starting their first job."
    "Why is the sky blue during the day and red at sunset?"
)

record() {  # record NAME MODEL_ARGS...
    local name=$1
    shift
    local i=0
    for prompt in "${PROMPTS[@]}"; do
        i=$((i + 1))
        local dir="$OUT/$name/p$i"
        if [ ! -f "$dir/meta.json" ]; then
            rm -rf "$dir"
            # bench decodes greedily for exactly -n tokens (generate would stop at an
            # end-of-text token), then records one more decode into the trace
            "$PY" bench "$@" -p "$prompt" --prompt-tokens 0 -n 100 --repeat 1 --policies exact \
                --trace "$dir" > /dev/null
        fi
    done
}

SYNTH="$OUT/dsv2lite-4L-Q4_K_M.gguf"
if [ ! -f "$SYNTH" ]; then
    "$PY" models synth --arch deepseek2 --shape deepseek-v2-lite --layers 4 --quant Q4_K_M -o "$SYNTH"
fi

record smolmoe -m smolmoe
record smolmoe-b -m smolmoe-b
record dsv2lite-synth-4L -m "$SYNTH"

"$PY" trace stats "$OUT/smolmoe" "$OUT/smolmoe-b" "$OUT/dsv2lite-synth-4L" "$@" \
    --json --plot docs/results/real-routing.png > docs/results/real-routing.json
"$PY" trace stats "$OUT/smolmoe" "$OUT/smolmoe-b" "$OUT/dsv2lite-synth-4L" "$@"
