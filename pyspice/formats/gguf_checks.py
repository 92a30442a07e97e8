"""Consistency rules for a GGUF's header, checked before llama.cpp sees the file.

llama.cpp trusts parts of a header it should not: an `expert_used_count` of 0
or above `expert_count` trips a GGML_ASSERT (SIGABRT, no message behind a
hidden log), and an expert tensor sized for another expert count loads and
runs wrong. Each rule is one function; `validate_header` runs them all, and
formats.model_info.read_header (the one entry point every command, the API
and inspect use to open a model) calls it. A rule raises ModelFileError naming
the file, the field and what a valid file holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pyspice.formats.gguf_header import ModelFileError

# GGML_MAX_DIMS in ggml.h: a tensor of more dimensions cannot be represented
MAX_DIMS = 4

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def offset(self) -> int: ...


def _int_field(meta: Mapping[str, Any], key: str) -> int | None:
    """An integer metadata field; None when absent or not a plain integer (a per-layer
    array, which some architectures use, is checked per layer by llama.cpp)."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def check_dimensions(path: Path, tensors: Sequence[_Tensor]) -> None:
    """1 to GGML_MAX_DIMS dimensions. (A zero dimension is legal: a rank-0 sidecar
    stores empty surrogate tensors.)"""
    for t in tensors:
        if not 1 <= len(t.shape) <= MAX_DIMS:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} has {len(t.shape)} dimensions (a GGUF tensor has 1 to "
                f"{MAX_DIMS}); re-download or rebuild the file"
            )


def check_alignment(path: Path, tensors: Sequence[_Tensor], alignment: int) -> None:
    """general.alignment is a power of two and every tensor offset a multiple of it
    (llama.cpp refuses the file otherwise, without saying why)."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ModelFileError(
            f"{path} is corrupt: general.alignment is {alignment}, not a power of two; "
            "re-download or rebuild the file"
        )
    for t in tensors:
        if t.offset % alignment:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} starts at offset {t.offset}, not a multiple of "
                f"the file's alignment {alignment}; re-download or rebuild the file"
            )


def check_moe_metadata(path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor]) -> None:
    """A MoE model's expert counts agree with each other and with its expert tensors:
    1 <= expert_used_count <= expert_count, and every ffn_*_exps tensor holds
    expert_count experts (its last ggml dimension)."""
    arch = str(meta.get("general.architecture", ""))
    experts = [t for t in tensors if _EXPERT_TENSOR.match(t.name)]
    n_expert = _int_field(meta, f"{arch}.expert_count")
    n_used = _int_field(meta, f"{arch}.expert_used_count")
    if not experts and not n_expert:
        return  # a dense model: nothing to check
    fix = "re-download the model, or rebuild it with `pyspice models`"
    if n_expert is None or n_expert < 1:
        raise ModelFileError(
            f"{path} is corrupt: it has expert tensors but {arch}.expert_count is "
            f"{meta.get(f'{arch}.expert_count', 'missing')}; {fix}"
        )
    if n_used is not None and not 1 <= n_used <= n_expert:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.expert_used_count is {n_used} but a model routes each token to "
            f"1 to expert_count ({n_expert}) experts; {fix}"
        )
    for t in experts:
        if t.shape[-1] != n_expert:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} holds {t.shape[-1]} experts but "
                f"{arch}.expert_count is {n_expert}; {fix}"
            )


def validate_header(path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor], alignment: int) -> None:
    """Every rule above, in the order a reader would want the first error."""
    check_dimensions(path, tensors)
    check_alignment(path, tensors, alignment)
    check_moe_metadata(path, meta, tensors)
