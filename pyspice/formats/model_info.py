"""What a GGUF holds, read from its header alone (`pyspice inspect`).

The header (metadata and tensor directory) sits at the start of the file;
tensor data is never touched, so inspecting a 40 GB model costs the same as a
tiny one (formats.gguf_header reads it, summarizing long arrays). Pure
Python: no native code is loaded.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from pyspice.formats.gguf_checks import VOCAB_KEYS, check_container, validate_header
from pyspice.formats.gguf_header import ArraySummary, parse_header, tensor_nbytes

# ModelFileError is re-exported: it is the error callers of read_header catch
from pyspice.formats.gguf_header import ModelFileError as ModelFileError

# EXPERT_TENSOR is re-exported: callers that read a header match its names with it
from pyspice.formats.tensor_names import EXPERT_TENSOR as EXPERT_TENSOR
from pyspice.formats.tensor_names import SHARED_EXPERT_TENSOR
from pyspice.units import Budget, format_bytes, whole_tier_bytes
from pyspice.units import slot_bytes as slot_bytes_of

# arrays longer than this are summarized (tokenizer vocabularies), not decoded
_MAX_ARRAY_ITEMS = 64


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the contiguous dimension
    type_name: str
    nbytes: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    data_offset: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


def read_header(path: Path | str) -> GGUFHeader:
    """Metadata and tensor directory of a GGUF, without reading tensor data."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    file_size = path.stat().st_size
    if file_size < 24:
        raise ModelFileError(f"{path} is not a GGUF model (only {file_size} bytes)")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return header_from_buffer(buf, path, file_size)


def header_from_buffer(buf: Any, path: Path, file_size: int) -> GGUFHeader:
    """read_header on bytes already in memory (`path` names them in errors): every
    check, no file access. The fuzz harness (fuzz/fuzz_gguf_header.py) enters here;
    its contract is that nothing but ModelFileError comes out."""
    if len(buf) < 24:
        raise ModelFileError(f"{path} is not a GGUF model (only {len(buf)} bytes)")
    # the vocabulary whole (its checks need every token), summarized again after them
    header = parse_header(buf, path, max_array_items=_MAX_ARRAY_ITEMS, keep=VOCAB_KEYS)
    metadata: dict[str, Any] = {kv.key: kv.value for kv in header.metadata}
    raw: list[tuple[str, tuple[int, ...], str, int]] = []
    for t in header.tensors:
        try:
            type_name = gguf.GGMLQuantizationType(t.type_id).name
        except ValueError:
            raise ModelFileError(f"{path} is corrupt: tensor {t.name} has unknown type {t.type_id}") from None
        raw.append((t.name, t.shape, type_name, t.offset))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool):
        raise ModelFileError(f"{path} is corrupt: general.alignment is {alignment!r}, not an integer")
    # what ggml's GGUF reader refuses, then the consistency llama.cpp assumes (expert
    # counts above all), before any size is computed
    check_container(path, header)
    validate_header(path, metadata, header.tensors, alignment, header.end)
    for kv in header.metadata:
        if kv.key in VOCAB_KEYS and isinstance(kv.value, list) and len(kv.value) > _MAX_ARRAY_ITEMS:
            assert kv.sub_type is not None
            metadata[kv.key] = ArraySummary(kv.sub_type.name.lower(), len(kv.value))
    data_offset = (header.end + alignment - 1) // alignment * alignment
    tensors = [TensorInfo(n, s, t, tensor_nbytes(t, s), o) for n, s, t, o in raw]
    end = max((data_offset + t.offset + t.nbytes for t in tensors), default=data_offset)
    if end > file_size:
        raise ModelFileError(
            f"{path} is truncated: its tensors need {end} bytes but the file has {file_size} "
            "(an interrupted download or copy? fetch or rebuild it)"
        )
    return GGUFHeader(path, header.version, file_size, data_offset, metadata, tensors)


# ---- what the model means for expert offloading ------------------------------------------


@dataclass(frozen=True)
class ExpertGroup:
    """MoE layers whose experts have the same quant types and size."""

    layers: tuple[int, ...]
    types: tuple[str, str, str]  # gate, up, down
    bytes_per_expert: int

    def layer_range(self) -> str:
        runs: list[str] = []
        start = prev = self.layers[0]
        for il in (*self.layers[1:], None):
            if il is not None and il == prev + 1:
                prev = il
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if il is not None:
                start = prev = il
        return ("layer " if len(self.layers) == 1 else "layers ") + ",".join(runs)


@dataclass(frozen=True)
class BudgetFit:
    """What a device budget holds."""

    budget: str
    budget_bytes: int
    holds: int  # experts: one slot each, as large as the largest expert
    experts: int
    n_cpu_moe: int  # llama.cpp --n-cpu-moe N: whole layers 0..N-1 keep experts on the host
    resident_layers: int
    resident_bytes: int


@dataclass
class ModelSummary:
    path: Path
    file_size: int
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_expert: int
    n_expert_used: int
    n_shared: int
    expert_ff: int
    moe_layers: list[int]
    expert_bytes_by_layer: dict[int, int]  # routed-expert bytes of each MoE layer (all experts)
    experts_by_layer: dict[int, int]
    groups: list[ExpertGroup]
    expert_bytes: int
    shared_expert_bytes: int
    non_expert_bytes: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # bytes by quant type, all tensors

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def n_routed_experts(self) -> int:
        return sum(self.experts_by_layer.values())

    def _sizes(self) -> tuple[list[int], list[int]]:
        """Per group of layers: bytes per expert, and experts in its layers."""
        experts = [sum(self.experts_by_layer.get(il, 0) for il in g.layers) for g in self.groups]
        return [g.bytes_per_expert for g in self.groups], experts

    @property
    def slot_bytes(self) -> int:
        """A tier slot's bytes: the largest expert (units.slot_bytes)."""
        return slot_bytes_of(*self._sizes())

    @property
    def whole_tier_bytes(self) -> int:
        """A tier holding every routed expert (units.whole_tier_bytes): what 100% means."""
        return whole_tier_bytes(*self._sizes())

    def fit(self, budget: Budget) -> BudgetFit:
        whole = self.whole_tier_bytes
        budget_bytes = budget.resolve(whole)
        experts = self.n_routed_experts
        holds = min(experts, budget_bytes * experts // whole) if whole else 0
        # llama.cpp's --n-cpu-moe N keeps the experts of layers 0..N-1 on the host: the
        # smallest N whose remaining layers fit is the split this budget corresponds to
        resident_bytes = 0
        n_cpu_moe = self.n_layers
        for il in reversed(range(self.n_layers)):
            layer_bytes = self.expert_bytes_by_layer.get(il, 0)
            if resident_bytes + layer_bytes > budget_bytes:
                break
            resident_bytes += layer_bytes
            n_cpu_moe = il
        resident_layers = sum(1 for il in self.moe_layers if il >= n_cpu_moe)
        return BudgetFit(
            budget=str(budget),
            budget_bytes=budget_bytes,
            holds=holds,
            experts=experts,
            n_cpu_moe=n_cpu_moe,
            resident_layers=resident_layers,
            resident_bytes=resident_bytes,
        )


def _meta_int(meta: dict[str, Any], key: str, default: int = 0) -> int:
    value = meta.get(key, default)
    if isinstance(value, list):  # per-layer arrays (some architectures): take the largest
        value = max((int(v) for v in value), default=default)
    return int(value) if isinstance(value, int | float) else default


def summarize(header: GGUFHeader) -> ModelSummary:
    meta = header.metadata
    arch = str(meta.get("general.architecture", "unknown"))
    n_layers = _meta_int(meta, f"{arch}.block_count")
    per_layer: dict[int, dict[str, TensorInfo]] = {}
    shared_layers: set[int] = set()
    expert_bytes = shared_bytes = other_bytes = 0
    by_type: dict[str, int] = {}
    for t in header.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        m = EXPERT_TENSOR.match(t.name)
        if m:
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
            expert_bytes += t.nbytes
            continue
        m = SHARED_EXPERT_TENSOR.match(t.name)
        if m:
            shared_layers.add(int(m.group(1)))
            shared_bytes += t.nbytes
        other_bytes += t.nbytes
    layer_bytes: dict[int, int] = {}
    layer_experts: dict[int, int] = {}
    groups: list[ExpertGroup] = []
    for il in sorted(per_layer):
        parts = per_layer[il]
        if set(parts) != {"gate", "up", "down"}:
            raise ModelFileError(f"{header.path}: layer {il} has only {sorted(parts)} expert tensors")
        n_exp = parts["gate"].shape[-1]
        layer_bytes[il] = sum(p.nbytes for p in parts.values())
        layer_experts[il] = n_exp
        types = (parts["gate"].type_name, parts["up"].type_name, parts["down"].type_name)
        per_expert = layer_bytes[il] // max(1, n_exp)
        same = [k for k, g in enumerate(groups) if g.types == types and g.bytes_per_expert == per_expert]
        if same:
            g = groups[same[0]]
            groups[same[0]] = ExpertGroup((*g.layers, il), types, per_expert)
        else:
            groups.append(ExpertGroup((il,), types, per_expert))
    n_shared = _meta_int(meta, f"{arch}.expert_shared_count")
    if n_shared == 0 and shared_layers:
        n_shared = 1  # qwen2moe: one shared expert per layer, sized by its own ff length
    return ModelSummary(
        path=header.path,
        file_size=header.file_size,
        architecture=arch,
        name=str(meta.get("general.name", header.path.stem)),
        n_layers=n_layers,
        n_embd=_meta_int(meta, f"{arch}.embedding_length"),
        n_expert=_meta_int(meta, f"{arch}.expert_count", max(layer_experts.values(), default=0)),
        n_expert_used=_meta_int(meta, f"{arch}.expert_used_count"),
        n_shared=n_shared,
        expert_ff=_meta_int(meta, f"{arch}.expert_feed_forward_length"),
        moe_layers=sorted(per_layer),
        expert_bytes_by_layer=layer_bytes,
        experts_by_layer=layer_experts,
        groups=groups,
        expert_bytes=expert_bytes,
        shared_expert_bytes=shared_bytes,
        non_expert_bytes=other_bytes,
        tensor_types=by_type,
    )


def inspect_model(path: Path | str) -> ModelSummary:
    return summarize(read_header(path))


DEFAULT_BUDGETS = ("10%", "25%", "50%")


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def format_summary(s: ModelSummary, fits: list[BudgetFit]) -> str:
    total = s.expert_bytes + s.non_expert_bytes
    lines = [
        f"model        {s.path.name} ({format_bytes(s.file_size)}): {s.name}",
        f"architecture {s.architecture}, {s.n_layers} layers, n_embd {s.n_embd}",
    ]
    if not s.is_moe:
        lines.append("experts      none: a dense model, nothing to offload (pyspice runs it with 'stock')")
        lines.append(f"weights      {format_bytes(total)}")
        return "\n".join(lines)
    dense = s.n_layers - len(s.moe_layers)
    lines += [
        f"MoE layers   {len(s.moe_layers)}" + (f" ({dense} dense)" if dense else ""),
        f"experts      {s.n_expert} routed per layer, top-{s.n_expert_used}, "
        f"{s.n_shared} shared" + (f", expert ff {s.expert_ff}" if s.expert_ff else ""),
        f"routed-expert bytes  {format_bytes(s.expert_bytes)} ({_share(s.expert_bytes, total)}) "
        f"in {s.n_routed_experts} experts",
        f"non-expert bytes     {format_bytes(s.non_expert_bytes)} ({_share(s.non_expert_bytes, total)})"
        + (
            f", of which shared experts {format_bytes(s.shared_expert_bytes)}"
            if s.shared_expert_bytes
            else ""
        ),
        "bytes per routed expert (gate/up/down quant types):",
    ]
    for g in s.groups:
        lines.append(f"  {'/'.join(g.types):<20} {g.layer_range():<14} {format_bytes(g.bytes_per_expert)}")
    if s.whole_tier_bytes > s.expert_bytes:  # experts differ in size: every slot is the largest's
        lines.append(
            f"  a device slot holds any expert: {format_bytes(s.slot_bytes)}, "
            f"so holding them all takes {format_bytes(s.whole_tier_bytes)} (what 100% means)"
        )
    lines.append("device budget (pooled over layers):")
    for f in fits:
        lines.append(
            f"  {f.budget:>10} = {format_bytes(f.budget_bytes):>11}: {f.holds} of {f.experts} experts; "
            f"llama.cpp --n-cpu-moe {f.n_cpu_moe} ({f.resident_layers} whole layers resident, "
            f"{format_bytes(f.resident_bytes)})"
        )
    return "\n".join(lines)


def format_ram_fits(s: ModelSummary, fits: list[BudgetFit]) -> str:
    """What edge mode's --ram-budget holds: the non-expert weights are read into RAM,
    the budget's share of experts lives in its slot pool, the rest stays in the file."""
    lines = [
        f"RAM budget (edge mode: non-expert weights {format_bytes(s.non_expert_bytes)} in RAM, "
        "routed experts read from the file into a slot pool):"
    ]
    for f in fits:
        left = s.expert_bytes * (f.experts - f.holds) // max(1, f.experts)  # of average size
        in_ram = s.non_expert_bytes + min(f.budget_bytes, s.whole_tier_bytes)
        lines.append(
            f"  {f.budget:>10} = {format_bytes(f.budget_bytes):>11}: {f.holds} of {f.experts} experts "
            f"resident; weights in RAM {format_bytes(in_ram)}"
            f" (plus runtime buffers), {format_bytes(left)} of experts stay on disk"
        )
    return "\n".join(lines)


def summary_record(s: ModelSummary, fits: list[BudgetFit]) -> dict[str, Any]:
    return {
        "path": str(s.path),
        "file_size": s.file_size,
        "architecture": s.architecture,
        "name": s.name,
        "n_layers": s.n_layers,
        "n_embd": s.n_embd,
        "moe_layers": s.moe_layers,
        "n_expert": s.n_expert,
        "n_expert_used": s.n_expert_used,
        "n_shared": s.n_shared,
        "expert_bytes": s.expert_bytes,
        "non_expert_bytes": s.non_expert_bytes,
        "shared_expert_bytes": s.shared_expert_bytes,
        "bytes_per_expert": [
            {"layers": list(g.layers), "types": list(g.types), "bytes": g.bytes_per_expert} for g in s.groups
        ],
        "bytes_by_type": s.tensor_types,
        "budgets": [vars(f) for f in fits],
    }
