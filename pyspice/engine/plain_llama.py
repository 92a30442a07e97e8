"""Tensor buffer-type overrides for llama.cpp models, through ctypes.

llama.cpp places weights by pattern (`-ot PATTERN=BUFT`, `--cpu-moe`,
`--n-cpu-moe N`: a NULL-terminated `llama_model_tensor_buft_override` list in
`llama_model_params`). The pinned llama-cpp-python declares that field as an
opaque pointer and its `Llama` takes no parameter for it, so the list is built
here: `override_array` from (pattern, buffer type) pairs, `buffer_type` finds
a buffer type by its ggml name as llama.cpp's `-ot` parser does (each
device's default buffer type: "CPU", "CUDA0", ...), and `PlainLlama` is plain
`llama_cpp.Llama` (the hook never registered) loaded with such a list.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp
import llama_cpp._ggml

from pyspice.engine.llama_log import llama_load_reasons


class TensorBuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def override_array(pairs: Sequence[tuple[bytes, int]]) -> ctypes.Array[TensorBuftOverride]:
    """The NULL-terminated override list of (pattern, buffer type address) pairs; the
    array keeps its pattern strings alive (hold it as long as a model loads with it)."""
    overrides = (TensorBuftOverride * (len(pairs) + 1))()
    for i, (pattern, buft) in enumerate(pairs):
        overrides[i].pattern = pattern
        overrides[i].buft = buft
    overrides[len(pairs)].pattern = None
    overrides[len(pairs)].buft = None
    return overrides


def _ggml() -> Any:
    lib = llama_cpp._ggml.libggml
    if not getattr(lib, "_pyspice_typed", False):
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
        lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_buft_name.restype = ctypes.c_char_p
        lib._pyspice_typed = True
    return lib


def buffer_types() -> dict[str, int]:
    """Each ggml device's default buffer type by name, as `-ot` knows them."""
    lib = _ggml()
    found: dict[str, int] = {}
    for i in range(int(lib.ggml_backend_dev_count())):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            found[lib.ggml_backend_buft_name(buft).decode()] = int(buft)
    return found


def buffer_type(name: str) -> int:
    """The address of the buffer type `-ot PATTERN=name` means; ValueError names the known ones."""
    known = buffer_types()
    if name not in known:
        raise ValueError(f"unknown buffer type {name!r}; this build has {', '.join(sorted(known))}")
    return known[name]


class PlainLlama(llama_cpp.Llama):
    """llama_cpp.Llama with tensor overrides: `tensor_overrides` are (pattern, buffer
    type name) pairs exactly as `-ot PATTERN=NAME` takes them (std::regex_search on
    each tensor's name, first match wins). Nothing of pyspice is attached."""

    def __init__(self, model_path: str, *, tensor_overrides: Sequence[tuple[str, str]] = (), **kwargs: Any):
        pairs = [(pattern.encode(), buffer_type(name)) for pattern, name in tensor_overrides]
        self._plain_overrides = override_array(pairs) if pairs else None
        self.tensor_overrides = tuple(tensor_overrides)
        with llama_load_reasons(model_path):
            super().__init__(model_path, **kwargs)

    # llama_cpp.Llama.__init__ assigns self.model_params and fills it before loading;
    # intercepting the assignment places the override list there (as pyspice.Llama does)
    @property
    def model_params(self) -> Any:
        return self._plain_model_params

    @model_params.setter
    def model_params(self, value: Any) -> None:
        if self._plain_overrides is not None:
            value.tensor_buft_overrides = ctypes.addressof(self._plain_overrides)
        self._plain_model_params = value
