#!/usr/bin/env bash
# Device call 2 of 2026-12-04 as it ran: the setup (wheels, site, build facts, the step
# function, PY and BENCH) was lines 1-58 of scripts/gpu-check.sh at 4da12dd, with
# GPU_CHECK_SECONDS defaulting to 330; then these steps.
M=/tmp/dsv2lite-8L-Q4_K_M.gguf
step synth-8 120 $PY -m pyspice models synth --arch deepseek2 --shape deepseek-v2-lite --layers 8 --quant Q4_K_M -o $M >/dev/null
[ -s $M ] || { say "no model"; exit 1; }
R="--replay-routing .gpu/routing-trace"
W="$PY scripts/with-spice-config.py"
# A: the model's own routing (no replay), so the lookahead predicts what runs
step A-own-25 70 $BENCH -m $M -n 48 --repeat 3 --device-budget 25% --policies stock,exact,lru,adapmoe,spice:exact,upstream-ncmoe --json 2>&1 | grep -E '^\{"' >"$O/a-own-25.json"
step A-own-50 70 $BENCH -m $M -n 48 --repeat 3 --device-budget 50% --policies stock,exact,lru,spice:exact,upstream-ncmoe --json 2>&1 | grep -E '^\{"' >"$O/a-own-50.json"
# B: replayed routing; spice:exact from exact's preloaded tier, with and without prefetch copies
step B-preload 60 $W preload=1 -- bench -ngl 99 -t 15 -m $M -n 48 --repeat 3 --device-budget 25% $R --policies stock,exact,spice:exact --json 2>&1 | grep -E '^\{"' >"$O/b-replay.json"
step B-noprefetch 60 $W preload=1,prefetch=0 -- bench -ngl 99 -t 15 -m $M -n 48 --repeat 3 --device-budget 25% $R --policies stock,exact,spice:exact --json 2>&1 | grep -E '^\{"' >>"$O/b-replay.json"
# C: own routing, preloaded spice sync / async / det1
step C-modes 70 $W preload=1 -- bench -ngl 99 -t 15 -m $M -n 48 --repeat 3 --device-budget 25% --policies stock,exact,spice:exact@sync,spice:exact@async,spice:exact@det1 --json 2>&1 | grep -E '^\{"' >"$O/c-modes.json"
# D: the host-only and simple baselines
step D-base 60 $BENCH -m $M -n 48 --repeat 3 --device-budget 25% $R --policies stock,host,static,ondemand,exact --json 2>&1 | grep -E '^\{"' >"$O/d-base.json"
say done
