"""Runtime's routing replay: every hook call uses given expert ids instead of the router's."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pyspice.runtime.errors import SpiceError
from pyspice.runtime.handle import RuntimeHandle


class RoutingReplay(RuntimeHandle):
    """A trace of expert ids a Runtime replays, token by token."""

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        self._replay_ids: np.ndarray | None = None  # borrowed by libspice (set_routing_replay)

    def set_routing_replay(self, ids: npt.ArrayLike | None) -> None:
        """Make every hook call use these expert ids instead of the router's:
        ids [n_tokens, n_layers, n_used] over all the model's layers (dense layers'
        rows ignored), each MoE row distinct experts of its layer; None stops
        replaying. libspice borrows the array: this handle keeps it alive. Tokens
        advance per hooked row, from token 0 (spice_runtime_set_routing_replay)."""
        ffi, lib = self._n.ffi, self._n.lib
        if ids is None:
            self._check(lib.spice_runtime_set_routing_replay(self._rt, ffi.NULL, 0, 0, 0), "routing replay")
            self._replay_ids = None
            return
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        if arr.ndim != 3:
            raise ValueError(f"routing replay ids must be [tokens, layers, experts], not {arr.shape}")
        status = lib.spice_runtime_set_routing_replay(
            self._rt, ffi.from_buffer("int32_t[]", arr), arr.shape[0], arr.shape[1], arr.shape[2]
        )
        if status != 0:
            raise SpiceError(status, self.last_error() or "routing replay refused")
        self._replay_ids = arr  # borrowed by libspice until cleared

    def routing_replay_position(self) -> int:
        """The trace token the next micro-batch starts at; -1 when not replaying."""
        return int(self._n.lib.spice_runtime_routing_replay_position(self._rt))

    def seek_routing_replay(self, token: int) -> None:
        """The next micro-batch starts at trace token `token` (modulo the trace's length)."""
        self._check(
            self._n.lib.spice_runtime_seek_routing_replay(self._rt, int(token)), "seek routing replay"
        )
