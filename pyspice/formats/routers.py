"""Read a MoE model's router weights from its GGUF (for look-ahead policies).

The header is read once, on the first request (pyspice's own parser: gguf's
GGUFReader builds a numpy object per metadata string and keeps them, ~130 MiB
for a 49k-token vocabulary, which edge mode's memory limit cannot spare); a
router's bytes are then read from the file, dequantized to float32
[n_expert, n_embd] once and cached.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from pyspice.formats.model_info import TensorInfo, read_header


class RouterReader:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._data_offset = 0
        self._tensors: dict[str, TensorInfo] | None = None
        self._cache: dict[int, npt.NDArray[np.float32] | None] = {}

    def release(self) -> None:
        """Forget the routers read so far (a later request reads them again)."""
        self._cache.clear()

    def __call__(self, layer: int) -> npt.NDArray[np.float32] | None:
        if layer not in self._cache:
            self._cache[layer] = self._load(layer)
        return self._cache[layer]

    def _load(self, layer: int) -> npt.NDArray[np.float32] | None:
        if self._tensors is None:
            header = read_header(self.path)
            self._data_offset = header.data_offset
            self._tensors = {t.name: t for t in header.tensors}
        tensor = self._tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
        if tensor is None:
            return None
        n_embd, n_expert = int(tensor.shape[0]), int(tensor.shape[1])  # ggml order: ne0 = n_embd
        with self.path.open("rb") as fh:
            fh.seek(self._data_offset + tensor.offset)
            raw = np.frombuffer(fh.read(tensor.nbytes), dtype=np.uint8).reshape(n_expert, -1)
        data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[tensor.type_name])
        return np.ascontiguousarray(np.asarray(data, dtype=np.float32).reshape(n_expert, n_embd))
