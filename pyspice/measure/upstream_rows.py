"""The llama.cpp rows of `pyspice bench`: the model as a user would run it without pyspice.

Plain `llama_cpp.Llama` (the hook never registered), placed as llama.cpp's own
flags place it:

- `upstream`: `-ngl 99`, every weight on the GPU where it fits (on a CPU-only
  build: upstream's defaults on the CPU, weight repacking on);
- `upstream-ncmoe`: `-ngl 99 --n-cpu-moe N`, the routed experts of the first N
  blocks on the CPU and the rest on the GPU, N the smallest (so the most
  expert layers on the GPU) whose GPU experts fit the bytes the pyspice rows'
  device tier holds (its slots): the same device bytes for experts;
- `upstream-cpu-exps`: `-ngl 99 -ot exps=CPU`, every routed expert on the CPU.

The override patterns are llama.cpp's (common/common.h, LLM_FFN_EXPS_REGEX and
llm_ffn_block_regex); `plan_row` decides each row from the model's tensor
directory and the budget, without loading anything, and says why a row cannot
run here (a CPU-only build has no GPU to split experts against).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyspice.formats.model_info import TensorInfo

# the rows' names live in the registry; bench's modules take them from here too
from pyspice.policy.registry import ALL_LAYERS_NGL as ALL_LAYERS_NGL
from pyspice.policy.registry import UPSTREAM as UPSTREAM
from pyspice.policy.registry import UPSTREAM_CPU_EXPS as UPSTREAM_CPU_EXPS
from pyspice.policy.registry import UPSTREAM_NCMOE as UPSTREAM_NCMOE
from pyspice.policy.registry import UPSTREAM_ROWS as UPSTREAM_ROWS
from pyspice.units import format_bytes

# llama.cpp's LLM_FFN_EXPS_REGEX: what --cpu-moe and --n-cpu-moe move to the CPU
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# what `-ot exps=CPU` matches (std::regex_search: anywhere in the name)
CPU_EXPS_PATTERN = "exps"
# all weights on the GPU only when they leave this share of its free memory for
# llama.cpp's KV cache and compute buffers (pyspice.engine.device's margin)
FIT_MARGIN = 0.9
_BLOCK = re.compile(r"^blk\.(\d+)\.")
NO_GPU = (
    "needs a GPU, and this build sees none (a CPU-only build, or no CUDA device): there is no "
    "split of the experts between GPU and CPU to measure here"
)


def block_regex(il: int) -> str:
    """llama.cpp's llm_ffn_block_regex(il, LLM_FFN_EXPS_REGEX)."""
    return rf"blk\.{il}{EXPS_REGEX}"


def ncmoe_overrides(n: int) -> tuple[tuple[str, str], ...]:
    """`--n-cpu-moe n` as (pattern, buffer type) pairs: blocks 0..n-1's experts on the CPU."""
    return tuple((block_regex(il), "CPU") for il in range(n))


def expert_bytes_by_block(tensors: Iterable[TensorInfo]) -> dict[int, int]:
    """Routed-expert bytes (what EXPS_REGEX matches) of each block that has any."""
    out: dict[int, int] = {}
    for t in tensors:
        m = _BLOCK.match(t.name)
        if m is not None and re.search(EXPS_REGEX, t.name):
            il = int(m.group(1))
            out[il] = out.get(il, 0) + t.nbytes
    return out


def n_cpu_moe(by_block: dict[int, int], budget_bytes: int) -> int:
    """The smallest N for `--n-cpu-moe N` whose GPU experts (those of blocks N and up)
    fit `budget_bytes`: as many expert layers on the GPU as the budget holds."""
    if not by_block:
        return 0
    on_gpu = 0
    n = max(by_block) + 1  # every expert block on the CPU
    for il in sorted(by_block, reverse=True):
        if on_gpu + by_block[il] > budget_bytes:
            break
        on_gpu += by_block[il]
        n = il
    # dense blocks below the first expert block change nothing: every expert on the GPU is N = 0
    return n if any(il < n for il in by_block) else 0


@dataclass(frozen=True)
class UpstreamRow:
    """How one llama.cpp row loads, or why it does not run here."""

    name: str
    label: str  # the table's name for it (N of --n-cpu-moe included)
    n_gpu_layers: int = 0
    overrides: tuple[tuple[str, str], ...] = ()  # (pattern, buffer type), as -ot takes them
    expert_device_bytes: int = 0  # routed-expert bytes it places on the GPU (from the header)
    skip: str | None = None  # why it cannot run here
    extra: dict[str, Any] = field(default_factory=dict)  # for --json (n_cpu_moe, ...)


def plan_row(
    name: str,
    tensors: list[TensorInfo],
    *,
    gpu: bool,
    budget_bytes: int | None,
    device_free: int | None = None,
    cpu_n_gpu_layers: int = 0,
) -> UpstreamRow:
    """Row `name` of UPSTREAM_ROWS for a model of `tensors`: `gpu` whether a CUDA device
    is there, `budget_bytes` the pyspice rows' device budget (None: none), `device_free`
    the device's free bytes now (for whether everything fits)."""
    by_block = expert_bytes_by_block(tensors)
    experts = sum(by_block.values())
    if name == UPSTREAM:
        if not gpu:
            return UpstreamRow(UPSTREAM, "upstream", n_gpu_layers=cpu_n_gpu_layers)
        weights = sum(t.nbytes for t in tensors)
        label = "upstream -ngl 99"
        if device_free is not None and weights > FIT_MARGIN * device_free:
            return UpstreamRow(
                UPSTREAM,
                label,
                skip=f"all weights on the GPU do not fit: {format_bytes(weights)} of weights, "
                f"{format_bytes(device_free)} free on CUDA device 0",
            )
        return UpstreamRow(UPSTREAM, label, ALL_LAYERS_NGL, expert_device_bytes=experts)
    if name == UPSTREAM_CPU_EXPS:
        label = "upstream -ot exps=CPU"
        if not gpu:
            return UpstreamRow(name, label, skip=NO_GPU)
        return UpstreamRow(name, label, ALL_LAYERS_NGL, ((CPU_EXPS_PATTERN, "CPU"),))
    if name == UPSTREAM_NCMOE:
        if not gpu:
            return UpstreamRow(name, "upstream-ncmoe", skip=NO_GPU)
        if budget_bytes is None:
            return UpstreamRow(
                name,
                "upstream-ncmoe",
                skip="no device budget to match: give --device-budget (the pyspice rows' budget)",
            )
        n = n_cpu_moe(by_block, budget_bytes)
        on_gpu = sum(b for il, b in by_block.items() if il >= n)
        layers = sum(1 for il in by_block if il >= n)
        return UpstreamRow(
            name,
            f"upstream-ncmoe N={n}",
            ALL_LAYERS_NGL,
            ncmoe_overrides(n),
            expert_device_bytes=on_gpu,
            extra={
                "n_cpu_moe": n,
                "gpu_expert_layers": layers,
                "expert_layers": len(by_block),
                "matched_bytes": budget_bytes,
            },
        )
    raise ValueError(f"{name!r} is not a llama.cpp row ({', '.join(UPSTREAM_ROWS)})")
