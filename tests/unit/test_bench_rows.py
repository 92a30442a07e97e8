"""The llama.cpp rows of `bench` without a model: --n-cpu-moe's N for a budget, the rows a
CPU-only build skips (and why), and device bytes from llama.cpp's buffer reports."""

from __future__ import annotations

import re

import pytest

from pyspice.formats.model_info import TensorInfo
from pyspice.measure.device_bytes import BufferReport, device_bytes, device_match_lines, parse_buffer_lines
from pyspice.measure.upstream_rows import (
    NO_GPU,
    UPSTREAM,
    UPSTREAM_CPU_EXPS,
    UPSTREAM_NCMOE,
    block_regex,
    n_cpu_moe,
    plan_row,
)

MiB = 2**20


def test_n_cpu_moe_puts_as_many_expert_layers_on_the_gpu_as_the_budget_holds() -> None:
    by_block = {1: 10, 2: 10, 3: 10}  # block 0 dense (deepseek2's first layer)
    assert n_cpu_moe(by_block, 0) == 4  # nothing fits: every expert block on the CPU
    assert n_cpu_moe(by_block, 9) == 4
    assert n_cpu_moe(by_block, 10) == 3  # llama.cpp keeps the first N blocks' experts on the CPU
    assert n_cpu_moe(by_block, 29) == 2
    assert n_cpu_moe(by_block, 30) == 0  # all of them: --n-cpu-moe 0
    assert n_cpu_moe({}, 100) == 0


def test_block_patterns_are_llama_cpps() -> None:
    # common/common.h: llm_ffn_block_regex(il, LLM_FFN_EXPS_REGEX)
    assert block_regex(12) == r"blk\.12\.ffn_(up|down|gate|gate_up)_(ch|)exps"
    assert re.search(block_regex(1), "blk.1.ffn_gate_exps.weight")
    assert not re.search(block_regex(1), "blk.11.ffn_gate_exps.weight")
    assert not re.search(block_regex(1), "blk.1.ffn_gate_shexp.weight")


def _tensors() -> list[TensorInfo]:
    out = [TensorInfo("token_embd.weight", (8, 8), "F32", 4 * MiB, 0)]
    for il in range(4):
        out.append(TensorInfo(f"blk.{il}.attn_q.weight", (8, 8), "F32", MiB, 0))
        if il > 0:
            for kind in ("gate", "up", "down"):
                out.append(TensorInfo(f"blk.{il}.ffn_{kind}_exps.weight", (8, 8, 8), "Q8_0", 2 * MiB, 0))
    return out


def test_a_cpu_only_build_skips_the_gpu_rows_with_the_reason() -> None:
    for name in (UPSTREAM_NCMOE, UPSTREAM_CPU_EXPS):
        row = plan_row(name, _tensors(), gpu=False, budget_bytes=12 * MiB)
        assert row.skip == NO_GPU
    up = plan_row(UPSTREAM, _tensors(), gpu=False, budget_bytes=None)
    assert up.skip is None and up.label == "upstream" and up.n_gpu_layers == 0 and not up.overrides


def test_the_gpu_rows_as_llama_cpp_would_run_them() -> None:
    tensors = _tensors()
    ncmoe = plan_row(UPSTREAM_NCMOE, tensors, gpu=True, budget_bytes=12 * MiB)  # two of 3 expert layers
    assert ncmoe.skip is None and ncmoe.label == "upstream-ncmoe N=2" and ncmoe.n_gpu_layers == 99
    assert [p for p, _ in ncmoe.overrides] == [block_regex(0), block_regex(1)]
    assert {b for _, b in ncmoe.overrides} == {"CPU"}
    assert ncmoe.expert_device_bytes == 12 * MiB
    extra = {"n_cpu_moe": 2, "gpu_expert_layers": 2, "expert_layers": 3, "matched_bytes": 12 * MiB}
    assert ncmoe.extra == extra
    cpu = plan_row(UPSTREAM_CPU_EXPS, tensors, gpu=True, budget_bytes=None)
    assert cpu.overrides == (("exps", "CPU"),) and cpu.n_gpu_layers == 99 and cpu.expert_device_bytes == 0
    up = plan_row(UPSTREAM, tensors, gpu=True, budget_bytes=None, device_free=10**12)
    assert up.skip is None and up.n_gpu_layers == 99 and up.expert_device_bytes == 18 * MiB


def test_gpu_rows_that_cannot_run_say_why() -> None:
    tensors = _tensors()
    no_budget = plan_row(UPSTREAM_NCMOE, tensors, gpu=True, budget_bytes=None)
    assert no_budget.skip is not None and "--device-budget" in no_budget.skip
    small = plan_row(UPSTREAM, tensors, gpu=True, budget_bytes=None, device_free=8 * MiB)
    assert small.skip is not None and "do not fit" in small.skip
    with pytest.raises(ValueError, match="not a llama"):
        plan_row("stock", tensors, gpu=True, budget_bytes=None)


LOG = """\
load_tensors: offloaded 5/5 layers to GPU
load_tensors:        CUDA0 model buffer size =   100.00 MiB
load_tensors:   CPU_Mapped model buffer size =    27.07 MiB
load_tensors:    CUDA_Host model buffer size =    50.00 MiB
llama_context:  CUDA_Host  output buffer size =     0.12 MiB
llama_kv_cache:        CUDA0 KV buffer size =     1.50 MiB
sched_reserve:        CUDA0 compute buffer size =    32.25 MiB
sched_reserve:    CUDA_Host compute buffer size =     2.00 MiB
"""


def test_device_bytes_from_llama_cpps_buffer_report() -> None:
    buffers = parse_buffer_lines(LOG)
    assert len(buffers) == 6  # the output buffer is not a model/KV/compute line
    d = device_bytes(BufferReport(buffers), slot_bytes=10 * MiB)
    assert d == {
        "weights": 100 * MiB,
        "kv": round(1.5 * MiB),
        "compute": round(32.25 * MiB),
        "slots": 10 * MiB,
        "total": 100 * MiB + round(1.5 * MiB) + round(32.25 * MiB) + 10 * MiB,
    }
    cpu = device_bytes(BufferReport(parse_buffer_lines(LOG.replace("CUDA0", "CPU"))))
    assert cpu["total"] == 0  # pinned host buffers and CPU ones are not device memory


def test_rows_at_the_same_device_bytes_are_named() -> None:
    rows = {
        "exact": {"total": 100, "slots": 40},
        "upstream-ncmoe": {"total": 103, "slots": 0},
        "upstream": {"total": 300, "slots": 0},
        "stock": {"total": 0, "slots": 0},
    }
    (line,) = device_match_lines(rows)
    assert line.startswith("device bytes vs upstream-ncmoe")
    assert "within 5%: exact (-3%)" in line and "not: upstream (+191%)" in line
    assert "none on the device: stock" in line
    assert device_match_lines({"stock": {"total": 0}}) == []


def test_a_memory_limited_bench_refuses_the_gpu_rows() -> None:
    from pyspice.cli.bench_limited import check_rows
    from pyspice.measure.upstream_rows import UPSTREAM_ROWS
    from pyspice.policy.rows import parse_rows

    check_rows(parse_rows("upstream,exact", UPSTREAM_ROWS))
    for row in (UPSTREAM_NCMOE, UPSTREAM_CPU_EXPS):
        with pytest.raises(ValueError, match="splits the experts between GPU and CPU"):
            check_rows(parse_rows(f"exact,{row}", UPSTREAM_ROWS))
