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
DEADLINE=${GPU_CHECK_SECONDS:-300} # the whole script: 8 minutes, so a call of 560 s returns everything
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
W="$PY scripts/with-spice-config.py"
J() { grep -E '^\{"' ; }
# F1: no cost profile (what bench gets before `pyspice probe`), own routing, 50%
step F1-noprofile-50 45 $BENCH -m $M -n 48 --repeat 5 --device-budget 50% --policies stock,exact,spice:exact --json 2>&1 | J >"$O/f1-noprofile.json"
# F2: the same host work while another process copies pinned host memory to the GPU flat out:
# does bus traffic slow the host's expert execution (shared memory bandwidth)?
cat >/tmp/bgcopy.py <<'PYEOF'
import os, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8).pin_memory(); y = torch.empty_like(x, device="cuda")
s = torch.cuda.Stream(); n = 0; t = time.time()
with torch.cuda.stream(s):
    while os.path.exists("/tmp/bgcopy.run"):
        y.copy_(x, non_blocking=True); s.synchronize(); n += 1
print(f"bgcopy: {n} GiB in {time.time() - t:.1f} s = {n * (1 << 30) / (time.time() - t) / 1e9:.1f} GB/s", flush=True)
PYEOF
touch /tmp/bgcopy.run; python3 /tmp/bgcopy.py >>"$LOG" 2>&1 & BG=$!; sleep 6
step F2-bgcopy-50 40 $BENCH -m $M -n 48 --repeat 5 --device-budget 50% --policies stock,exact --json 2>&1 | J >"$O/f2-bgcopy.json"
rm -f /tmp/bgcopy.run; sleep 3; kill $BG 2>/dev/null; wait $BG
# the cost profile a user measures once; later runs weigh copies with it
step probe 70 $PY -m pyspice probe -m $M -ngl 99 -t 15 --batch-sizes 1,8 --repeat 3
step F3-profile-50 50 $BENCH -m $M -n 48 --repeat 5 --device-budget 50% --policies stock,exact,lru,spice:exact --json 2>&1 | J >"$O/f3-profile-50.json"
step F4-profile-25 50 $BENCH -m $M -n 48 --repeat 5 --device-budget 25% --policies stock,exact,lru,spice:exact --json 2>&1 | J >"$O/f4-profile-25.json"
step F5-share03-50 40 $W prefetch_share=0.3 -- bench -ngl 99 -t 15 -m $M -n 48 --repeat 5 --device-budget 50% --policies stock,exact,spice:exact --json 2>&1 | J >"$O/f5-share.json"
GGML_CUDA_DISABLE_GRAPHS=1 step F6-nographs-50 40 $BENCH -m $M -n 48 --repeat 5 --device-budget 50% --policies stock,exact,spice:exact --json 2>&1 | J >"$O/f6-nographs.json"
say done
