#!/usr/bin/env bash
# Prepare scripts/gpu-check.sh here, on the build machine, before a lent GPU
# session spends device time: the CUDA variant (make cuda-check: sm_90,
# cuBLAS from the nvidia-cublas wheel), compressed with the pure-Python
# llama_cpp package into .gpu/site.tar.xz (the libraries alone are over the
# 64 MiB a device call carries), the wheels the device lacks (cffi,
# pycparser, gguf, diskcache) for its Python 3.12 in .gpu/whl, and the routing
# the decode bench replays (random-weight models route at random):
#   .gpu/real-routing   the imported real recording (DeepSeek-V2-Lite-Chat's
#                       routing, prompts 901-1000 of the moe-beyond recording,
#                       read from $PYSPICE_ROUTING_RECORDING, default
#                       ~/.cache/pyspice/routing/moe-beyond-4dca2ea; skipped
#                       when absent), for a full-depth model
#   .gpu/history.npz    SPICE's routing-history predictor, fitted on prompts
#                       1-900 of it (`pyspice trace fit`)
#   .gpu/routing-trace  smolmoe-b's routing (built offline if missing), mapped
#                       onto a shallower model
#
#   scripts/gpu-check-prepare.sh              # then, with the device tool:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=560)
#   scripts/gpu-check-prepare.sh --routing    # the routing alone (a rehearsal here)
#
# A first CUDA build takes long on 2 cores (ggml-cuda's kernels); later ones
# rebuild libspice only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude

# ---- the routing the decode bench replays ----
routing() {
    rm -rf .gpu/real-routing .gpu/history.npz .gpu/routing-trace
    local rec=${PYSPICE_ROUTING_RECORDING:-$HOME/.cache/pyspice/routing/moe-beyond-4dca2ea}
    if [ -d "$rec" ]; then
        local fit=() replay=() i
        for i in $(seq 1 1000); do
            [ -f "$rec/prompt_${i}_data.csv" ] || continue # the recording lacks prompt 317
            if [ "$i" -le 900 ]; then fit+=("$rec/prompt_${i}_data.csv"); else replay+=("$rec/prompt_${i}_data.csv"); fi
        done
        local work
        work=$(mktemp -d)
        $PY -m pyspice trace import "${replay[@]}" -o .gpu/real-routing --shape deepseek-v2-lite
        $PY -m pyspice trace import "${fit[@]}" -o "$work/fit" --shape deepseek-v2-lite
        # fitted on the first 80% of prompts 1-900, its recall printed on the rest; the
        # replayed prompts (901-1000) are seen by neither
        $PY -m pyspice trace fit "$work/fit" -o .gpu/history.npz
        rm -rf "$work"
    else
        echo "gpu-check-prepare: no routing recording at $rec: the check replays smolmoe-b's routing only"
    fi
    local model
    model=$($PY -c 'from pyspice.models.default import default_model; print(default_model("smolmoe-b", sidecar=False, note=lambda m: None))')
    $PY -m pyspice.measure.record trace "$model" .gpu/routing-trace --prompt-tokens 128 -n 48 -t "$(nproc)"
}
if [ "${1:-}" = --routing ]; then
    routing
    du -sh .gpu/*
    exit 0
fi

make cuda-check
rm -rf .gpu && mkdir -p .gpu/whl .gpu/stage/llama_cpp .gpu/stage/bin

# llama_cpp: pure Python (installed without its native build), with the CUDA libraries in lib/
site=$($PY -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')
cp -r "$site"/. .gpu/stage/llama_cpp/
rm -rf .gpu/stage/llama_cpp/lib/* && find .gpu/stage/llama_cpp -name __pycache__ -prune -exec rm -rf {} +
cp -P build/cuda/bin/lib*.so* .gpu/stage/llama_cpp/lib/
cp native/include/spice.h .gpu/stage/llama_cpp/lib/
cp build/cuda/bin/spice-exec-bench build/cuda/bin/llama-quantize .gpu/stage/bin/ 2>/dev/null ||
    cp build/cuda/bin/spice-exec-bench .gpu/stage/bin/
cp build/cuda/bin/spice-planner-bench .gpu/stage/bin/ 2>/dev/null ||
    echo "gpu-check-prepare: no build/cuda/bin/spice-planner-bench (an older cuda build): step 1b will be skipped"
# what synth needs of the upstream tree (vocabularies), and the build's facts for
# pyspice-build.json, whose paths gpu-check.sh fills in there
mkdir -p .gpu/stage/upstream/models
for v in $($PY -c 'from pyspice.models.synth import SHAPES; print(" ".join(sorted({s.vocab for s in SHAPES.values()})))'); do
    cp build/upstream/llama.cpp/models/ggml-vocab-$v.gguf .gpu/stage/upstream/models/
done
$PY - <<'PYEOF'
import hashlib, json, pathlib
series = [l.strip() for l in pathlib.Path("patches/series").read_text().splitlines() if l.strip() and not l.startswith("#")]
lib = pathlib.Path("build/cuda/bin/libllama.so").resolve()
facts = {"patch_series": series, "libllama_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
         "cuda": True, "build_type": "Release"}
pathlib.Path(".gpu/stage/build-facts.json").write_text(json.dumps(facts, indent=2) + "\n")
PYEOF
tar -C .gpu/stage -cJf .gpu/site.tar.xz . && rm -rf .gpu/stage

$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl cffi pycparser gguf==0.19.0 diskcache
routing
du -sh .gpu
echo "gpu-check-prepare: ready; carry .gpu and run scripts/gpu-check.sh (under 8 minutes)"
