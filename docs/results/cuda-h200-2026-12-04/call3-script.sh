#!/usr/bin/env bash
# Device call 3 of 2026-12-04 as it ran: the setup (wheels, site, build facts, the step
# function, PY and BENCH) was lines 1-58 of scripts/gpu-check.sh at 4da12dd, with
# GPU_CHECK_SECONDS defaulting to 300; then these steps.
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
