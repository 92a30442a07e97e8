"""Read a MoE model's router weights from its GGUF (for look-ahead policies).

The file is opened (memory-mapped) on the first request only; a router is
dequantized to float32 [n_expert, n_embd] once and cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt


class RouterReader:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._reader: Any = None
        self._tensors: dict[str, Any] = {}
        self._cache: dict[int, npt.NDArray[np.float32] | None] = {}

    def __call__(self, layer: int) -> npt.NDArray[np.float32] | None:
        if layer not in self._cache:
            self._cache[layer] = self._load(layer)
        return self._cache[layer]

    def _load(self, layer: int) -> npt.NDArray[np.float32] | None:
        if self._reader is None:
            self._reader = gguf.GGUFReader(self.path)
            self._tensors = {t.name: t for t in self._reader.tensors}
        tensor = self._tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
        if tensor is None:
            return None
        n_expert, n_embd = int(tensor.shape[1]), int(tensor.shape[0])  # ggml order: ne0 = n_embd
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.ascontiguousarray(np.asarray(data, dtype=np.float32).reshape(n_expert, n_embd))
