"""Runtime's LoRE surrogates: loading one per expert (libspice keeps it on the device tier,
charged to its budget), unloading them all, and what they hold."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pyspice.runtime.errors import SpiceError
from pyspice.runtime.handle import RuntimeHandle


class Surrogates(RuntimeHandle):
    """The surrogates a Runtime's plans may run instead of an expert."""

    def set_surrogate(self, il: int, e: int, alpha: float, a: npt.ArrayLike, b: npt.ArrayLike) -> None:
        """Load the LoRE surrogate of (il, e): A [rank, n_embd], B [n_embd, rank]
        (rank 0: alpha times the shared expert alone). libspice keeps an f16
        copy on the device tier, charged to its budget."""
        ffi, lib = self._n.ffi, self._n.lib
        a32 = np.ascontiguousarray(a, dtype=np.float32)
        b32 = np.ascontiguousarray(b, dtype=np.float32)
        if a32.ndim != 2 or b32.ndim != 2 or b32.shape != (a32.shape[1], a32.shape[0]):
            raise ValueError(
                f"surrogate ({il}, {e}): A must be [rank, n_embd] and B [n_embd, rank]; "
                f"got {a32.shape} and {b32.shape}"
            )
        rank = int(a32.shape[0])
        status = lib.spice_runtime_set_surrogate(
            self._rt,
            il,
            e,
            float(alpha),
            rank,
            ffi.from_buffer("float[]", a32) if rank else ffi.NULL,
            ffi.from_buffer("float[]", b32) if rank else ffi.NULL,
        )
        if status != 0:
            raise SpiceError(status, self.last_error() or f"set_surrogate({il}, {e}) failed")

    def clear_surrogates(self) -> None:
        """Unload every surrogate and give their bytes back to the device budget."""
        self._check(self._n.lib.spice_runtime_clear_surrogates(self._rt), "clear_surrogates")

    def surrogate_bytes(self) -> int:
        """Device bytes the loaded surrogates hold."""
        return int(self._n.lib.spice_runtime_surrogate_bytes(self._rt))

    def n_surrogates(self) -> int:
        return int(self._n.lib.spice_runtime_n_surrogates(self._rt))
