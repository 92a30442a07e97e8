#!/usr/bin/env bash
# Device call 2 of the third lease (2026-12-04, session 46): the setup (wheels, site,
# build facts, the step function, PY and BENCH) is scripts/gpu-check.sh up to its BENCH=
# line, with GPU_CHECK_SECONDS=300; then these steps. Run as
#   { sed -n '1,/^BENCH=/p' scripts/gpu-check.sh; cat <this file>; } >.gpu/gc2.sh
#   run(command="GPU_CHECK_SECONDS=300 bash .gpu/gc2.sh", carry=[".gpu"], timeout_s=340)
M=/tmp/dsv2lite-8L-Q4_K_M.gguf
step synth-8 120 $PY -m pyspice models synth --arch deepseek2 --shape deepseek-v2-lite --layers 8 --quant Q4_K_M -o $M >/dev/null
[ -s $M ] || { say "no model"; exit 1; }
J() { grep -E '^\{"' ; }
# T: the tolerance tests with the copier thread on (the default from this call on), and
# the device's rows against the host's on a 15-token prompt (the batched kernel)
step tolerance 60 $PY -m pytest -q -s -p no:cacheprovider tests/native/test_cuda_device.py \
    tests/native/test_pool_executor.py >"$O/verify.txt"
SPICE_CUDA_VERIFY=1 step rows-pool 40 $PY -m pyspice generate -m $M -ngl 99 -n 8 \
    -p "one two three four five six seven eight nine ten eleven twelve thirteen fourteen" \
    --temp 0 --policy exact --device-budget 50% 2>&1 | grep -E "SPICE_CUDA_VERIFY|==" >>"$O/verify.txt"
# A: copies inline (0) against the copier (default), the copying rows, own routing, both budgets
for budget in 50% 25%; do
    for copier in 0 1; do
        SPICE_CUDA_COPY_THREAD=$copier step "A-$budget-copy$copier" 45 $BENCH -m $M -n 48 --repeat 5 \
            --device-budget $budget --policies stock,exact,lru,adapmoe,spice:exact --json 2>&1 | J >>"$O/a-copier.json"
    done
done
# B: is the device launch slow for asynchronous spice:exact because 15 spinning decode
# threads and a polling planner fill the 16 cores? -t 14 and 13 against A's -t 15
for t in 14 13; do
    step "B-t$t" 45 $PY -m pyspice bench -ngl 99 -t $t -m $M -n 48 --repeat 5 --device-budget 50% \
        --policies stock,exact,spice:exact@sync,spice:exact@async --json 2>&1 | J >>"$O/b-threads.json"
done
# C: planning at every layer against every fourth, own routing, 25% (issue 19's hit and
# hook-thread targets; the replayed routing of gpu-check step 8 makes predictions worthless)
for every in 4 1; do
    step "C-every$every" 45 $PY scripts/with-spice-config.py plan_every=$every,plan_every_async=$every -- \
        bench -ngl 99 -t 15 -m $M -n 48 --repeat 3 --device-budget 25% \
        --policies stock,spice:exact@sync,spice:exact@async,spice:exact@det1 --json 2>&1 | J >>"$O/c-every.json"
done
say done
