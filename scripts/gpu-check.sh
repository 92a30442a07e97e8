#!/usr/bin/env bash
# The GPU check: what a lent GPU machine measures in ONE device call (under 8 minutes),
# after scripts/gpu-check-prepare.sh here:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=560)
# Rehearse it first on this machine's CPU build, where the device tier is emulated:
#   GPU_CHECK_REHEARSE=1 GPU_CHECK_MODEL=path/to/model.gguf bash scripts/gpu-check.sh
# (the same steps with -t 2, short runs and, without GPU_CHECK_MODEL, a 4-layer model;
# results under $OUT, default /tmp/gpu-check-rehearsal).
#
# Steps, most valuable first; each has its own timeout and writes under $OUT as it goes,
# so a call cut short still returns what finished:
#   1. a DeepSeek-V2-Lite-shaped Q4_K_M model built there (it cannot travel): full depth
#      (26 MoE layers) when it builds within its step, else 8 layers (said in the log)
#   2. the CUDA tests (logits with the device's rows in use) into verify.txt
#   3. decode at 25% and 50% of the routed-expert bytes, routing replayed: at full depth
#      from the imported real recording (.gpu/real-routing, DeepSeek-V2-Lite-Chat's routing),
#      with SPICE predicting from a routing-history predictor fitted on other prompts of it
#      (.gpu/history.npz); on the 8-layer fallback from our smolmoe-b trace, mapped, and no
#      spice row. Rows: upstream (-ngl 99), upstream-ncmoe, upstream-cpu-exps, exact, static,
#      lru, spice, auto. Upstream's own expert cache (--moe-cache-mib) is not a row: our pin
#      predates it and its baseline binary is not built here.
#   4. prefill: 512-token prompts at 50%, stock, exact and upstream
#   5. a hardware profile fitted from the 25% run (`pyspice sim fit`), and the simulator's
#      prediction of every row of both runs beside the measured one (`pyspice sim --predict`)
#   6. the executor microbenchmark (pool vs per-expert graphs), if time is left
# Files back: gpu-check.log (everything, tables included), verify.txt, bench-decode.json,
# bench-prefill.json, fitted-profile.json, predict.txt, exec.json
set -u
REHEARSE=${GPU_CHECK_REHEARSE:-0}
if [ "$REHEARSE" = 1 ]; then
    O=${OUT:-/tmp/gpu-check-rehearsal}
else
    O=${OUT:?OUT is unset: this script runs on the device machine (see its header)}
fi
mkdir -p "$O"
LOG=$O/gpu-check.log
T0=$(date +%s)
DEADLINE=${GPU_CHECK_SECONDS:-480}
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
# step NAME LIMIT CMD...: run with a timeout (cut to what is left of the deadline; skipped
# under 20 s), output into the log as it goes
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - ($(date +%s) - T0)))
    if [ "$left" -lt 20 ]; then
        say "== $name: skipped, ${left}s left of the ${DEADLINE}s deadline"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    say "== $name: exit ${PIPESTATUS[0]}"
}

if [ "$REHEARSE" = 1 ]; then
    # this checkout's venv and CPU build; the device tier is emulated
    cd "$(dirname "$0")/.."
    PY=.venv/bin/python
    THREADS=2
    RUN="-n 8 --prompt-tokens 16 --repeat 1"
    PREFILL_TOKENS=64
    FULL_LIMIT=1800
    [ -d .gpu ] || mkdir .gpu
else
    # ---- setup: carried wheels and libraries, cuBLAS from torch's nvidia-cublas ----
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl >>"$LOG" 2>&1 || { say "wheels did not install"; exit 1; }
    tar -C /tmp/site -xJf .gpu/site.tar.xz || { say "no .gpu/site.tar.xz: run scripts/gpu-check-prepare.sh first"; exit 1; }
    # pyspice-build.json as install-native.py writes it, with this machine's paths
    python3 - <<'PYEOF' || { say "could not write pyspice-build.json"; exit 1; }
import json, os, pathlib
site = pathlib.Path("/tmp/site")
info = {"source_dir": os.getcwd(), "build_dir": str(site), "bin_dir": str(site / "bin"),
        "upstream_dir": str(site / "upstream"), "lib_dir": str(site / "llama_cpp" / "lib")}
info.update(json.loads((site / "build-facts.json").read_text()))
(site / "llama_cpp" / "lib" / "pyspice-build.json").write_text(json.dumps(info, indent=2) + "\n")
PYEOF
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
    CUBLAS=$(python3 -c 'import nvidia.cublas as c, os; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null)
    export LD_LIBRARY_PATH=/tmp/site/llama_cpp/lib:${CUBLAS}:${LD_LIBRARY_PATH:-}
    export PATH=/tmp/site/bin:$PATH
    PY=python3
    THREADS=15
    RUN="-n 48 --repeat 3"
    PREFILL_TOKENS=512
    FULL_LIMIT=240
fi
BENCH="$PY -m pyspice bench -ngl 99 -t $THREADS"
step env 60 bash -c "nvidia-smi 2>/dev/null || echo 'no nvidia-smi: emulated device'; \
    lscpu | grep -E 'Model name|Thread|Core|Socket'; free -g | head -2; df -h /tmp | tail -1; $PY -m pyspice --version"

# ---- 1. the model ----
SYNTH="$PY -m pyspice models synth --arch deepseek2 --shape deepseek-v2-lite --quant Q4_K_M"
FULL=0
if [ -n "${GPU_CHECK_MODEL:-}" ]; then
    M=$GPU_CHECK_MODEL
    say "model given: $M"
elif [ "$REHEARSE" = 1 ]; then
    M=/tmp/gpu-check-dsv2lite-4L-Q4_K_M.gguf
    [ -s $M ] || step synth-4 600 $SYNTH --layers 4 -o $M
else
    M=/tmp/dsv2lite-Q4_K_M.gguf
    step synth-full $FULL_LIMIT $SYNTH -o $M
    if [ ! -s $M ]; then
        rm -f /tmp/.dsv2lite-Q4_K_M.gguf.* # a temporary the timeout left
        M=/tmp/dsv2lite-8L-Q4_K_M.gguf
        step synth-8 120 $SYNTH --layers 8 -o $M
    fi
fi
[ -s "$M" ] || { say "no model: stopping before the model steps"; exit 1; }
LAYERS=$($PY -c "import sys; from pyspice.formats.model_info import inspect_model as i; print(i(sys.argv[1]).n_layers)" "$M")
[ "$LAYERS" = 27 ] && FULL=1
say "model: $M, $LAYERS layers ($([ $FULL = 1 ] && echo 'full depth' || echo 'shallower than DeepSeek-V2-Lite'))"

# ---- 2. tolerance: the CUDA tests, logits with the device's rows in use ----
if [ "$REHEARSE" != 1 ]; then
    step tolerance 100 $PY -m pytest -q -s -p no:cacheprovider tests/native/test_cuda_device.py \
        tests/native/test_pool_executor.py >"$O/verify.txt"
fi

# ---- 3. decode with routing replayed ----
ROWS=upstream,upstream-ncmoe,upstream-cpu-exps,exact,static,lru
if [ $FULL = 1 ] && [ -e .gpu/real-routing/meta.json ]; then
    REPLAY="--replay-routing .gpu/real-routing"
    if [ -e .gpu/history.npz ]; then
        REPLAY="$REPLAY --history-predictor .gpu/history.npz"
        ROWS=$ROWS,spice
    fi
    say "routing: the imported real recording (.gpu/real-routing)"
elif [ -e .gpu/routing-trace/meta.json ]; then
    REPLAY="--replay-routing .gpu/routing-trace"
    say "routing: smolmoe-b's trace, mapped onto this model (the real recording needs 26 MoE layers)"
else
    REPLAY=""
    say "routing: the model's own random router (no trace carried)"
fi
# auto last: it probes the device and records its routing sample on first use (cached after)
ROWS=$ROWS,auto
for budget in 25% 50%; do
    step "decode-$budget" 150 $BENCH -m "$M" $RUN --device-budget $budget $REPLAY --policies stock,$ROWS --json
done 2>&1 | grep -E '^\{"' >"$O/bench-decode.json"

# ---- 4. prefill ----
step prefill 70 $BENCH -m "$M" -n 1 --prompt-tokens $PREFILL_TOKENS --repeat 2 --device-budget 50% \
    --policies stock,exact,upstream --json 2>&1 | grep -E '^\{"' >"$O/bench-prefill.json"

# ---- 5. the simulator: a profile fitted on the 25% run, every row of both runs predicted ----
if [ -s "$O/bench-decode.json" ]; then
    TARGET="--target deepseek-v2-lite:Q4_K_M --target-layers $LAYERS"
    step sim-fit 60 $PY -m pyspice sim fit "$O/bench-decode.json:1" -o "$O/fitted-profile.json" $TARGET
    if [ -s "$O/fitted-profile.json" ]; then
        routing=${REPLAY#--replay-routing }
        routing=${routing%% *}
        step sim-predict 90 bash -c "$PY -m pyspice sim --predict $O/bench-decode.json --profile $O/fitted-profile.json \
            $TARGET -m $M ${routing:+--trace $routing --replay-trace $routing} >$O/predict.txt; cat $O/predict.txt"
    fi
fi

# ---- 6. the executors alone, no model ----
if command -v spice-exec-bench >/dev/null; then
    step exec 60 spice-exec-bench --iters 1000 --json "$O/exec.json"
fi
say "done"
