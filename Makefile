# One entry point per job. `make run` and `make test` are all a new machine needs.
#
#   make run        build everything, then run the main job (see README)
#   make test       build everything, then run the test suite (what CI runs)
#   make build      venv + patched llama.cpp + libspice, installed into the venv
#   make lint       ruff + mypy
#   make results-check   docs/results holds what its pages cite, and nothing else
#   make bench      pyspice bench on the largest synthetic model that is comfortable here
#   make cuda-check      compile the CUDA variant (build/cuda), cuBLAS from PyPI if missing
#   make check-patches   prove patches/series applies to a clean upstream tree
#   make patches-export  regenerate patches/ from commits in build/upstream/llama.cpp

PYTHON     ?= python3
VENV       ?= .venv
BUILD_DIR  ?= build/cmake
CMAKE_ARGS ?=
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)

PY    := $(VENV)/bin/python
CMAKE := $(VENV)/bin/cmake


.PHONY: all venv upstream build pristine test test-unit test-native lint format bench run \
        check-patches patches-export cuda-check results-check clean distclean

all: build

# ---- environment -----------------------------------------------------------

$(VENV)/.pyspice-venv: pyproject.toml upstream.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "cmake>=3.21" ninja
	@# llama-cpp-python from the verified pinned sdist, WITHOUT its native build:
	@# our patched libraries are installed into its lib/ folder by `make build`.
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
	    $(PY) -m pip install --quiet "$$($(PY) scripts/upstream.py sdist-path)"
	$(PY) -m pip install --quiet -e ".[dev,serve]"
	touch $@

venv: $(VENV)/.pyspice-venv

# ---- native build ----------------------------------------------------------

upstream: venv
	$(PY) scripts/upstream.py prepare

build: upstream
	$(CMAKE) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release --log-level=WARNING -Wno-dev $(CMAKE_ARGS)
	$(CMAKE) --build $(BUILD_DIR) -j $(JOBS)
	$(PY) scripts/install-native.py --build-dir $(BUILD_DIR)

# unpatched llama + ggml with the same flags: the reference for the test that
# proves the patch changes nothing when no hook is registered
PRISTINE_DIR ?= build/pristine

pristine: venv
	$(PY) scripts/upstream.py prepare --pristine
	$(CMAKE) -S . -B $(PRISTINE_DIR) -DCMAKE_BUILD_TYPE=Release -DPYSPICE_PRISTINE=ON \
	    -DPYSPICE_UPSTREAM_DIR=$(CURDIR)/build/upstream/llama.cpp-pristine --log-level=WARNING -Wno-dev
	$(CMAKE) --build $(PRISTINE_DIR) -j $(JOBS) --target llama

check-patches: venv
	$(PY) scripts/upstream.py check

# The CUDA variant in its own build tree, for sm_$(CUDA_ARCHITECTURES) (Hopper by
# default). cuBLAS comes from the nvidia-cublas wheel when the toolkit lacks it;
# FlashAttention kernels are left out (the hook does not need them, and they
# are most of the build), VMM too (no driver library on a build-only machine).
# The CPU kernels target a portable x86-64-v3 baseline (AVX2/FMA/F16C), not this
# machine's: these libraries are built here to run on the GPU machine.
# On a GPU machine: `make build CMAKE_ARGS="-DGGML_CUDA=ON"` installs CUDA libs.
CUDA_BUILD_DIR     ?= build/cuda
CUDA_ARCHITECTURES ?= 90
CUDA_CMAKE_ARGS    ?= -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES) \
                      -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON \
                      -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON \
                      -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON

cuda-check: upstream
	mkdir -p build/cuda-deps
	$(PY) scripts/cuda-deps.py --dest build/cuda-deps > build/cuda-deps/cmake-args
	$(CMAKE) -S . -B $(CUDA_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release --log-level=WARNING -Wno-dev \
	    $(CUDA_CMAKE_ARGS) $$(cat build/cuda-deps/cmake-args)
	$(CMAKE) --build $(CUDA_BUILD_DIR) -j $(JOBS)
	@echo "cuda-check: CUDA build compiled in $(CUDA_BUILD_DIR)"

patches-export:
	$(PYTHON) scripts/upstream.py export

# ---- jobs ------------------------------------------------------------------

# The main job: chat with the default model (smolmoe, built on first use) while a
# policy places its experts on a device tier of RUN_BUDGET; on a CPU-only build
# that device is emulated and labelled so. Type a question; /stats, /quit.
RUN_BUDGET ?= 50%
RUN_POLICY ?= spice
RUN_ARGS   ?= -n 256 --repeat-penalty 1.3 -t $(JOBS)

run: build
	$(PY) -m pyspice chat --device-budget $(RUN_BUDGET) --policy $(RUN_POLICY) $(RUN_ARGS)

test: build pristine results-check
	$(PY) -m pytest tests

# docs/results holds what its pages cite and nothing else (scripts/results-check.py)
results-check:
	$(PYTHON) scripts/results-check.py

test-unit: venv
	$(PY) -m pytest tests/unit

test-native: build pristine
	$(PY) -m pytest tests/native

lint: venv
	$(VENV)/bin/ruff check pyspice tests scripts tools
	$(VENV)/bin/ruff format --check pyspice tests scripts tools
	$(VENV)/bin/mypy pyspice

format: venv
	$(VENV)/bin/ruff format pyspice tests scripts tools
	$(VENV)/bin/ruff check --fix pyspice tests scripts tools

# The largest synthetic model comfortable on 2 cores / 24 GiB: DeepSeek-V2-Lite
# shapes, 8 layers, Q4_K_M (about 2 GB). Run once with the reference's tiled
# matmul off and once with upstream's default (on); ratios are within a run.
BENCH_MODEL ?= build/models/dsv2lite-8L-Q4_K_M.gguf
BENCH_ARGS  ?= --policies stock,exact,exact-py,upstream -n 32 --repeat 5 -t $(JOBS)

$(BENCH_MODEL):
	$(PY) -m pyspice models synth --arch deepseek2 --shape deepseek-v2-lite --layers 8 --quant Q4_K_M -o $@

bench: build $(BENCH_MODEL)
	GGML_CPU_TILED_MM=0 $(PY) -m pyspice bench -m $(BENCH_MODEL) $(BENCH_ARGS) --plot build/bench-reference.png
	$(PY) -m pyspice bench -m $(BENCH_MODEL) $(BENCH_ARGS) --plot build/bench-upstream-defaults.png

clean:
	rm -rf $(BUILD_DIR)

distclean:
	rm -rf build $(VENV)
