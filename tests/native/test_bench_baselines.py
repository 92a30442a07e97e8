"""The llama.cpp rows of `pyspice bench` (upstream, upstream-ncmoe, upstream-cpu-exps) and
its routing replay:

- the override list for a model and a budget: --n-cpu-moe's N and its patterns against a
  tiny deepseek2 GGUF's tensor names, and llama.cpp itself placing exactly those tensors
  on the CPU buffer type when loaded with them (std::regex agrees with Python's re);
- on this CPU-only build the GPU rows are accepted and skipped with their reason, in the
  table and in --json, every row reports its device bytes, and a skipped row cannot be
  the baseline;
- `--replay-routing` rows are timing only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyspice.engine.plain_llama import PlainLlama
from pyspice.formats.model_info import EXPERT_TENSOR, read_header
from pyspice.formats.trace import TraceReader
from pyspice.measure.device_bytes import llama_buffer_report
from pyspice.measure.upstream_rows import (
    CPU_EXPS_PATTERN,
    NO_GPU,
    UPSTREAM_NCMOE,
    expert_bytes_by_block,
    plan_row,
)

BENCH = [sys.executable, "-m", "pyspice", "bench", "-n", "4", "--repeat", "1", "--prompt-tokens", "16"]
BENCH += ["-t", "2", "--no-sidecar"]
OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to CPU")


def _cpu_side(tensors: list[str], overrides: tuple[tuple[str, str], ...]) -> set[str]:
    """The tensors llama.cpp moves to the CPU for these overrides (std::regex_search each)."""
    return {name for name in tensors if any(re.search(p, name) for p, _ in overrides)}


def test_the_ncmoe_override_list_for_a_model_and_budget(synth_model) -> None:  # type: ignore[no-untyped-def]
    tensors = read_header(synth_model("deepseek2", "tiny")).tensors
    by_block = expert_bytes_by_block(tensors)
    assert sorted(by_block) == [1, 2, 3]  # deepseek2: a dense first block, then MoE blocks
    names = [t.name for t in tensors]
    experts = {t.name for t in tensors if EXPERT_TENSOR.match(t.name)}
    for gpu_layers in range(len(by_block) + 1):
        budget = sum(by_block[il] for il in sorted(by_block)[len(by_block) - gpu_layers :])
        for slack in (0, by_block[1] - 1):  # the budget exactly, and just short of one more layer
            row = plan_row(UPSTREAM_NCMOE, tensors, gpu=True, budget_bytes=budget + slack)
            n = row.extra["n_cpu_moe"]
            assert row.label == f"upstream-ncmoe N={n}"
            assert row.extra["gpu_expert_layers"] == gpu_layers
            on_cpu = _cpu_side(names, row.overrides)
            assert on_cpu == {t for t in experts if int(t.split(".")[1]) < n}  # only routed experts
            on_gpu = sum(t.nbytes for t in tensors if t.name in experts - on_cpu)
            assert on_gpu == row.expert_device_bytes <= budget + slack
            if gpu_layers < len(by_block):  # one more expert layer would not fit
                assert on_gpu + by_block[sorted(by_block)[-gpu_layers - 1]] > budget + slack


def test_exps_matches_exactly_the_routed_experts(synth_model) -> None:  # type: ignore[no-untyped-def]
    for arch in ("deepseek2", "qwen2moe"):
        names = [t.name for t in read_header(synth_model(arch, "tiny")).tensors]
        experts = {n for n in names if EXPERT_TENSOR.match(n)}
        assert experts and _cpu_side(names, ((CPU_EXPS_PATTERN, "CPU"),)) == experts


def test_llama_cpp_places_the_tensors_the_patterns_name(synth_model) -> None:  # type: ignore[no-untyped-def]
    path = synth_model("deepseek2", "tiny", "Q8_0")
    tensors = read_header(path).tensors
    budget = expert_bytes_by_block(tensors)[3]  # the last expert layer on the GPU
    row = plan_row(UPSTREAM_NCMOE, tensors, gpu=True, budget_bytes=budget)
    assert row.extra["n_cpu_moe"] == 3
    with llama_buffer_report() as report:
        model = PlainLlama(str(path), tensor_overrides=row.overrides, n_ctx=64, verbose=False)
    model.close()
    placed = set(OVERRIDDEN.findall(report.text))
    assert placed == _cpu_side([t.name for t in tensors], row.overrides)
    assert len(placed) == 6  # gate, up and down of blocks 1 and 2
    assert report.buffers and report.device()["weights"] == 0  # a CPU-only build: nothing on a device


def test_the_gpu_rows_skip_here_with_their_reason(synth_model) -> None:  # type: ignore[no-untyped-def]
    model = synth_model("deepseek2", "tiny", "Q8_0")
    rows = "stock,exact,upstream,upstream-ncmoe,upstream-cpu-exps"
    run = [*BENCH, "-m", str(model), "--device-budget", "50%", "--policies", rows]
    out = subprocess.run([*run, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    policies = doc["policies"]
    assert policies["upstream-ncmoe"] == {"label": "upstream-ncmoe", "skipped": NO_GPU}
    assert policies["upstream-cpu-exps"]["skipped"] == NO_GPU
    assert doc["llama_cpp_rows"]["upstream-ncmoe"]["skipped"] == NO_GPU
    for name in ("stock", "exact", "upstream"):
        assert len(policies[name]["tokens"]) == 4 and "device_bytes" in policies[name]
    assert policies["upstream"]["tokens"] == policies["stock"]["tokens"]
    assert policies["upstream"]["device_bytes"]["total"] == 0  # every weight on the CPU here
    assert policies["stock"]["device_bytes"]["slots"] == 0  # the hook is off: no tier in use
    assert policies["exact"]["device_bytes"]["slots"] > 0  # the emulated tier's slots
    table = subprocess.run(run, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "upstream-ncmoe        skipped: needs a GPU" in table.stdout
    assert "dev MiB" in table.stdout


def test_a_skipped_row_is_no_baseline(synth_model) -> None:  # type: ignore[no-untyped-def]
    model = synth_model("deepseek2", "tiny", "Q8_0")
    run = [*BENCH, "-m", str(model), "--policies", "upstream-ncmoe,stock"]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "x stock" in out.stdout  # the first row that runs
    told = subprocess.run([*run, "--baseline", "upstream-ncmoe"], capture_output=True, text=True)
    assert told.returncode != 0 and "cannot run here" in told.stderr


@pytest.fixture(scope="module")
def trace(synth_model, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("replay") / "trace"
    qwen = synth_model("qwen2moe", "tiny", "Q8_0")
    done = subprocess.run(
        [*BENCH, "-m", str(qwen), "--policies", "exact", "--trace", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_replayed_rows_are_timing_only(synth_model, trace: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = synth_model("deepseek2", "tiny", "Q8_0")
    again = tmp_path / "replayed"
    run = [*BENCH, "-m", str(model), "--device-budget", "50%", "--policies", "stock,exact,lru,upstream"]
    replayed = [*run, "--replay-routing", str(trace)]
    out = subprocess.run([*replayed, "--trace", str(again), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "routing replay:" in out.stderr and "trace layer j mod 4" in out.stderr  # 4 layers onto 3
    doc = json.loads(out.stdout)
    assert doc["replay_routing"] == str(trace)
    policies = doc["policies"]
    assert policies["exact"]["timing_only"] and policies["lru"]["timing_only"]
    assert "timing_only" not in policies["stock"] and "timing_only" not in policies["upstream"]
    table = subprocess.run(replayed, capture_output=True, text=True)
    assert table.returncode == 0 and "timing only" in table.stdout
    # the trace recorded meanwhile holds the replayed ids: the first policy's decode steps
    recorded, _ = TraceReader(again).routing()
    source, _ = TraceReader(trace).routing()
    assert (recorded[:, 0] == source[: len(recorded), 0]).all()
