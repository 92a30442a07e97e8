"""The spice_runtime handle that every part of Runtime works through: created on one
llama_context and freed with it, its errors, what it reports (layers, counters), and the
abort and failure flags a decode leaves behind."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from pyspice.runtime.constants import _COUNTER_FIELDS
from pyspice.runtime.errors import IncompatibleModelError, SpiceError
from pyspice.runtime.loader import _Native
from pyspice.stats import Counters


@dataclass(frozen=True)
class LayerInfo:
    il: int
    is_moe: bool
    n_expert: int
    n_embd: int
    n_ff: int
    type_gate: int
    type_up: int
    type_down: int
    bytes_per_expert: int


class RuntimeHandle:
    """libspice attached to one llama_context: the base of Runtime's parts (hook.py puts
    them together). Each part that keeps state of its own sets it in its __init__ after
    this one's."""

    def __init__(self, ctx_address: int) -> None:
        n = _Native.get()
        self._n = n
        ffi, lib = n.ffi, n.lib
        out = ffi.new("spice_runtime **")
        err = ffi.new("char[]", 1024)
        status = lib.spice_runtime_create(ffi.cast("struct llama_context *", ctx_address), out, err, 1024)
        if status != 0:
            message = (
                ffi.string(err).decode(errors="replace")
                or ffi.string(lib.spice_status_string(status)).decode()
            )
            kind = (
                IncompatibleModelError
                if status in (lib.SPICE_ERR_UNSUPPORTED, lib.SPICE_ERR_INCOMPATIBLE)
                else SpiceError
            )
            raise kind(status, message)
        self._rt: Any = out[0]
        # a policy saw Ctrl-C (the hook sets it; take_interrupt reads and clears it)
        self._interrupted = False

    # ---- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        if self._rt is not None:
            self._n.lib.spice_runtime_free(self._rt)
            self._rt = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down cffi
            self.close()

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            lib, ffi = self._n.lib, self._n.ffi
            detail = ffi.string(lib.spice_runtime_last_error(self._rt)).decode(errors="replace")
            name = ffi.string(lib.spice_status_string(status)).decode()
            raise SpiceError(status, f"{what}: {name}" + (f" ({detail})" if detail else ""))

    def last_error(self) -> str:
        return str(
            self._n.ffi.string(self._n.lib.spice_runtime_last_error(self._rt)).decode(errors="replace")
        )

    # ---- description ------------------------------------------------------------

    def layers(self) -> list[LayerInfo]:
        ffi, lib = self._n.ffi, self._n.lib
        info = ffi.new("spice_layer_info *")
        result = []
        for il in range(lib.spice_runtime_n_layers(self._rt)):
            self._check(lib.spice_runtime_layer_info(self._rt, il, info), "layer_info")
            result.append(
                LayerInfo(
                    il=il,
                    is_moe=bool(info.is_moe),
                    n_expert=info.n_expert,
                    n_embd=info.n_embd,
                    n_ff=info.n_ff,
                    type_gate=info.type_gate,
                    type_up=info.type_up,
                    type_down=info.type_down,
                    bytes_per_expert=int(info.bytes_per_expert),
                )
            )
        return result

    # ---- after a decode -----------------------------------------------------------

    def request_abort(self) -> None:
        """Stop the running decode soon (any thread; spice_runtime_request_abort). Stays
        requested until take_interrupt."""
        self._n.lib.spice_runtime_request_abort(self._rt)

    def take_interrupt(self) -> bool:
        """True once if a policy saw Ctrl-C (or the runtime asked to abort) since the last check."""
        lib = self._n.lib
        hit = self._interrupted or bool(lib.spice_runtime_abort_requested(self._rt))
        self._interrupted = False
        lib.spice_runtime_clear_abort(self._rt)
        return hit

    def take_failure(self) -> str | None:
        """Why libspice itself stopped the last decode (a disk tier's read error, no
        memory for the executors), once; None when it did not."""
        lib = self._n.lib
        if not lib.spice_runtime_failed(self._rt):
            return None
        message = self.last_error()
        self._interrupted = False
        lib.spice_runtime_clear_abort(self._rt)
        return message

    # ---- counters -------------------------------------------------------------------

    def counters(self, il: int = -1) -> Counters:
        c = self._n.ffi.new("spice_counters *")
        self._check(self._n.lib.spice_runtime_get_counters(self._rt, il, c), "get_counters")
        return Counters(**{name: int(getattr(c, name)) for name in _COUNTER_FIELDS})

    def reset_counters(self) -> None:
        self._n.lib.spice_runtime_reset_counters(self._rt)
