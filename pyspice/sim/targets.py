"""Sizes of the models the simulator speaks for (`--target NAME:QUANT`).

Bytes come from the published shapes (pyspice.models.synth.SHAPES, the same
table the synthetic real-shape models are built from) and the quant's per-
tensor types as the pinned llama.cpp's llama-quantize assigns them for a
*_K_M mix (src/llama-quant.cpp): the base K type; ffn_down and attn_v one
step up (Q6_K) on the layers `use_more_bits` picks (the first and last
eighth, and every third layer between); output.weight Q6_K; router and norm
vectors F32; and a tensor whose rows are not a multiple of 256 falls back to a
32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Per-expert bytes are
exact under that rule; the rest of a layer is summed the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf

from pyspice.formats.model_info import read_header
from pyspice.formats.tensor_names import is_routed_expert
from pyspice.models.synth import shape_for, tensor_plan
from pyspice.units import whole_tier_bytes

_QK_K = 256
_BASE = {
    "Q4_K_M": "Q4_K",
    "Q5_K_M": "Q5_K",
    "Q4_K_S": "Q4_K",
    "Q5_K_S": "Q5_K",
    "Q6_K": "Q6_K",
    "Q8_0": "Q8_0",
}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
TARGET_SHAPES = {"qwen2-57b-a14b": "qwen2moe", "deepseek-v2-lite": "deepseek2"}


def _type_size(name: str) -> tuple[int, int]:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return int(block), int(size)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's choice of layers that get more bits in a *_K_M mix."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensor_type(name: str, ne0: int, layer: int | None, n_layer: int, quant: str) -> str:
    if quant not in _BASE:
        raise ValueError(f"unknown quant {quant!r} for a target; choose one of {', '.join(_BASE)}")
    mixed = quant.endswith("_M")
    if "ffn_gate_inp" in name or "norm" in name or name.endswith(".bias"):
        return "F32"
    if name == "output.weight" and quant != "Q8_0":
        kind = "Q6_K"
    elif mixed and layer is not None and ("ffn_down" in name or "attn_v" in name):
        kind = "Q6_K" if use_more_bits(layer, n_layer) else _BASE[quant]
    else:
        kind = _BASE[quant]
    if kind in _FALLBACK and ne0 % _QK_K != 0:
        kind = _FALLBACK[kind]
    return kind


def tensor_bytes(shape: tuple[int, ...], kind: str) -> int:
    block, size = _type_size(kind)
    ne0 = shape[-1]
    rows = math.prod(shape[:-1])
    return rows * (ne0 // block) * size


@dataclass(frozen=True)
class TargetModel:
    """What the simulator needs of a target: sizes per layer and per token."""

    name: str  # e.g. "qwen2-57b-a14b:Q5_K_M"
    n_layers: int
    moe_layers: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    expert_bytes: tuple[int, ...]  # per layer, one routed expert (0 for dense layers)
    layer_bytes: tuple[int, ...]  # per layer, weights read per token outside the routed experts
    head_bytes: int  # output projection, read once per token
    expert_params: int  # weights of one routed expert (for compute-bound batches)
    layer_params: tuple[int, ...]

    @property
    def routed_bytes(self) -> int:
        """A tier holding every routed expert (units.whole_tier_bytes): what 100% means."""
        return whole_tier_bytes(self.expert_bytes, [self.n_expert if b else 0 for b in self.expert_bytes])

    @property
    def resident_bytes(self) -> int:
        """Weights that stay on the device whatever the policy (all but routed experts)."""
        return sum(self.layer_bytes) + self.head_bytes


def load_target(spec: str, layers: int | None = None) -> TargetModel:
    """`qwen2-57b-a14b:Q5_K_M`, `deepseek-v2-lite:Q4_K_M`; `layers`: only the first N
    layers, as `pyspice models synth --layers N` builds them (its K_M mix is chosen
    for that depth, as llama-quantize chooses it for the file it quantizes)."""
    shape_name, _, quant = spec.partition(":")
    quant = quant.upper() or "Q4_K_M"
    arch = TARGET_SHAPES.get(shape_name)
    if arch is None:
        raise ValueError(
            f"unknown target {shape_name!r}; choose one of {', '.join(TARGET_SHAPES)} (as NAME:QUANT)"
        )
    if quant not in _BASE:
        raise ValueError(f"unknown quant {quant!r} for a target; choose one of {', '.join(_BASE)}")
    dims = shape_for(arch, shape_name, layers)
    n = dims.n_layer
    expert = [0] * n
    layer = [0] * n
    layer_params = [0] * n
    expert_params = 0
    head = 0
    for t in tensor_plan(arch, dims, dims.n_vocab or 32000):
        parts = t.name.split(".")
        il = int(parts[1]) if parts[0] == "blk" else None
        kind = tensor_type(t.name, t.shape[-1], il, n, quant)
        nbytes = tensor_bytes(t.shape, kind) if kind != "F32" else 4 * math.prod(t.shape)
        if il is None:
            if t.name == "output.weight":
                head = nbytes
            continue  # token_embd: one row per token is read, not the matrix
        if is_routed_expert(t.name):
            expert[il] += nbytes // t.shape[0]
            if il == min(i for i in range(n) if i >= dims.n_dense_lead):
                expert_params += math.prod(t.shape[1:])
        else:
            layer[il] += nbytes
            layer_params[il] += math.prod(t.shape)
    moe = tuple(il for il in range(n) if expert[il] > 0)
    depth = f"/{n}L" if layers is not None else ""
    return TargetModel(
        name=f"{shape_name}:{quant}{depth}",
        n_layers=n,
        moe_layers=moe,
        n_expert=dims.n_expert,
        n_expert_used=dims.n_expert_used,
        expert_bytes=tuple(expert),
        layer_bytes=tuple(layer),
        head_bytes=head,
        expert_params=expert_params,
        layer_params=tuple(layer_params),
    )


def source_target(path: Path) -> TargetModel:
    """The source model's own sizes as a target (`--target source`), read from its GGUF
    header: the same fields load_target computes from published shapes, here from the
    tensors the file holds, so `sim --target source --profile rtx4060` asks how the
    recorded model itself would run on that hardware."""
    header = read_header(path)
    arch = header.metadata.get("general.architecture")
    n_layers = header.metadata.get(f"{arch}.block_count")
    n_expert = header.metadata.get(f"{arch}.expert_count")
    n_used = header.metadata.get(f"{arch}.expert_used_count")
    if not isinstance(n_layers, int) or not isinstance(n_expert, int) or not isinstance(n_used, int):
        raise ValueError(
            f"{path}: no {arch}.block_count/expert_count/expert_used_count in its header, so it is "
            "no MoE model to simulate as --target source; pass a target NAME:QUANT instead"
        )
    expert = [0] * n_layers
    layer = [0] * n_layers
    layer_params = [0] * n_layers
    expert_params = 0
    head = embd = 0
    for t in header.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk":
            if t.name == "output.weight":
                head = t.nbytes
            elif t.name == "token_embd.weight":
                embd = t.nbytes
            continue
        il = int(parts[1])
        if is_routed_expert(t.name):
            expert[il] += t.nbytes // t.shape[-1]
        else:
            layer[il] += t.nbytes
            layer_params[il] += math.prod(t.shape)
    moe = tuple(il for il in range(n_layers) if expert[il] > 0)
    if not moe:
        raise ValueError(f"{path}: no routed expert tensors (blk.N.ffn_*_exps), nothing to simulate")
    for t in header.tensors:
        if t.name.startswith(f"blk.{moe[0]}.") and is_routed_expert(t.name):
            expert_params += math.prod(t.shape[:-1])
    return TargetModel(
        name=f"source:{path.name}",
        n_layers=n_layers,
        moe_layers=moe,
        n_expert=n_expert,
        n_expert_used=n_used,
        expert_bytes=tuple(expert),
        layer_bytes=tuple(layer),
        head_bytes=head or embd,  # a tied output projection reads the embedding matrix
        expert_params=expert_params,
        layer_params=tuple(layer_params),
    )
