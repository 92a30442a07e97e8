#!/usr/bin/env bash
# The GPU check a lent H200 session runs in ONE device call (under 8 minutes),
# after scripts/gpu-check-prepare.sh here:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=560)
# Every step has its own timeout and writes under $OUT as it goes, so a call
# cut short still returns what finished. What comes back (8 files at most):
#   gpu-check.log     every step's output, the tables included
#   exec.json         executor microbenchmark: pool vs legacy, 1/2/4/6 experts, 1 and 8 tokens
#   exec-nographs.json  the same with GGML_CUDA_DISABLE_GRAPHS=1 (does capture matter?)
#   sched.txt         the hooked layers' split inputs (GGML_SCHED_DEBUG=2), stock vs hook
#   bench-decode.json decode bench on a real-shape DeepSeek-V2-Lite: pool vs legacy at 25%, pool at 50%;
#                     then spice:exact sync, async and det1 at plan_every 4 and 1 (25%)
#   bench-prefill.json  512-token prompts: upstream's path above 32 tokens vs every batch through the hook;
#                     then a 32-token prompt (a chat turn, through the hook) at 25%
#   trace.tar         the decode trace (a folder, tarred), for `pyspice sim --profile h200` back here
#   verify.txt        the CUDA row-by-row checks (tests/native/test_cuda_device.py)
set -u
O=${OUT:?OUT is unset: this script runs on the device machine (see its header)}
LOG=$O/gpu-check.log
T0=$(date +%s)
DEADLINE=${GPU_CHECK_SECONDS:-330} # the whole script: 8 minutes, so a call of 560 s returns everything
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
# step NAME LIMIT CMD...: run with a timeout (cut to what is left of the deadline; skipped
# under 20 s), output into the log as it goes. Steps run most valuable first.
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

# ---- setup: carried wheels and libraries, cuBLAS from torch's nvidia-cublas ----
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    >>"$LOG" 2>&1 || { say "wheels did not install"; exit 1; }
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
BENCH="$PY -m pyspice bench -ngl 99 -t 15"
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
