"""Runtime's device tier: setting it (with its slots' low-precision copies, made or read
from a file), what it holds and how large, filling it, and the residency view policies
read."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pyspice.interrupts import SigintGuard
from pyspice.policy.base import HookCall
from pyspice.runtime.errors import SpiceError
from pyspice.runtime.handle import RuntimeHandle
from pyspice.runtime.store import StoreParams


class DeviceTier(RuntimeHandle):
    """The device tier a Runtime runs with (emulated on CPU-only builds), or none."""

    _calls: dict[bytes, HookCall]  # the HookCall cache (hook_calls.py): its views are into the tier

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        self._residency: tuple[Any, np.ndarray] | None = None

    def set_device(self, params: StoreParams | None) -> None:
        """Give the runtime a device tier (emulated on CPU-only builds), or remove it."""
        ffi, lib = self._n.ffi, self._n.lib
        cparams, _path = params.to_c(ffi) if params is not None else (ffi.NULL, None)
        status = lib.spice_runtime_set_store(self._rt, cparams)
        if status == lib.SPICE_ERR_BUDGET:  # smaller than one slot, or than the loaded surrogates
            raise SpiceError(status, self.last_error())
        self._check(status, "set_device")
        self._residency = None
        self._calls.clear()  # their residency views belong to the old tier

    def slot_expert_bytes(self) -> list[int]:
        """Bytes of one expert per layer as the device tier holds and copies it (its
        low-precision copies' where it has them; 0 for dense layers); [] without a tier."""
        lib = self._n.lib
        store = lib.spice_runtime_get_store(self._rt)
        if store == self._n.ffi.NULL:
            return []
        n_layers = lib.spice_runtime_n_layers(self._rt)
        return [int(lib.spice_store_expert_bytes(store, il)) for il in range(n_layers)]

    def slot_copies(self) -> tuple[int, float]:
        """(host bytes, seconds to make) of the low-precision expert copies the runtime
        holds for its slots; (0, 0.0) when it holds none."""
        ffi, lib = self._n.ffi, self._n.lib
        size, seconds = ffi.new("uint64_t *"), ffi.new("double *")
        self._check(lib.spice_runtime_slot_copies(self._rt, ffi.NULL, size, seconds), "slot_copies")
        return int(size[0]), float(seconds[0])

    def slot_copies_precision(self) -> int:
        """The precision (SLOT_*) of the copies the runtime holds; SLOT_EXACT for none."""
        ffi, lib = self._n.ffi, self._n.lib
        precision = ffi.new("int32_t *")
        self._check(lib.spice_runtime_slot_copies(self._rt, precision, ffi.NULL, ffi.NULL), "slot_copies")
        return int(precision[0])

    def slot_copies_size(self, precision: int) -> int:
        """Bytes of host memory the slots' copies of `precision` (SLOT_*) would take,
        without making them (0: none would be made)."""
        ffi, lib = self._n.ffi, self._n.lib
        size = ffi.new("uint64_t *")
        self._check(lib.spice_runtime_slot_copies_size(self._rt, precision, size), "slot_copies_size")
        return int(size[0])

    def slot_copies_progress(self) -> tuple[int, int]:
        """(bytes done, bytes in all) of the slot copies being made or read, else of the
        last ones; (0, 0) before any. Safe from another thread while set_device or
        load_slot_copies makes or reads them (its one use: a progress bar)."""
        ffi, lib = self._n.ffi, self._n.lib
        done, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        self._check(lib.spice_runtime_slot_copies_progress(self._rt, done, total), "slot_copies_progress")
        return int(done[0]), int(total[0])

    def load_slot_copies(self, precision: int, path: str | os.PathLike[str], model_key: str) -> None:
        """Read the slots' copies of `precision` (SLOT_*) from `path`, a file save_slot_copies
        wrote for this model under `model_key`, instead of making them; no device tier may be
        set. SpiceError (with the reason) where the file is missing or not for these copies."""
        lib = self._n.lib
        status = lib.spice_runtime_slot_copies_load(
            self._rt, precision, os.fsencode(path), model_key.encode()
        )
        if status != lib.SPICE_OK:
            raise SpiceError(status, self.last_error())

    def save_slot_copies(self, path: str | os.PathLike[str], model_key: str) -> None:
        """Write the slots' copies the runtime holds to `path` under `model_key` (whole or not
        at all). SpiceError where it holds none or the file cannot be written."""
        lib = self._n.lib
        status = lib.spice_runtime_slot_copies_save(self._rt, os.fsencode(path), model_key.encode())
        if status != lib.SPICE_OK:
            raise SpiceError(status, self.last_error())

    def device_is_real(self) -> bool:
        """Whether the device tier's slots are on a real (CUDA) device."""
        store = self._n.lib.spice_runtime_get_store(self._rt)
        return store != self._n.ffi.NULL and bool(self._n.lib.spice_store_is_real(store))

    def slot_pool_bytes(self) -> int:
        """Bytes of the device tier's slots: as many as the budget holds, each as large as
        the largest expert (what a tier allocates up front; a pooled layout adds its
        alignment and one zero slot); 0 without a tier."""
        lib = self._n.lib
        store = lib.spice_runtime_get_store(self._rt)
        if store == self._n.ffi.NULL:
            return 0
        return int(lib.spice_store_n_slots(store)) * int(lib.spice_store_slot_bytes(store))

    def read_slot(self, il: int, e: int, size: int) -> bytes:
        """The first `size` bytes (gate | up | down) of resident expert (il, e) as the
        device holds them: lets tests check that copies moved the right bytes."""
        ffi, lib = self._n.ffi, self._n.lib
        store = lib.spice_runtime_get_store(self._rt)
        buf = ffi.new("char[]", size)
        self._check(lib.spice_store_read_slot(store, il, e, buf, size), "read_slot")
        return bytes(ffi.buffer(buf, size))

    def preload(self) -> int:
        """Fill the device tier in layer order; returns how many experts it holds. Ctrl-C
        cuts its waits short (on a slow bus they can take minutes) and raises
        KeyboardInterrupt once it is back; the tier then holds what was asked for."""
        n = self._n.ffi.new("int32_t *")
        self.take_interrupt()  # stale: nothing was running
        with SigintGuard(self.request_abort) as guard:
            status = self._n.lib.spice_runtime_preload(self._rt, n)
        if self.take_interrupt() or guard.interrupted:
            raise KeyboardInterrupt
        self._check(status, "preload")
        return int(n[0])

    def residency(self) -> np.ndarray | None:
        """[n_layers, max_expert] RESIDENCY_* view of the device tier (None: no device tier).
        libspice updates the table in place and polls the device as each hook call
        begins, so the view a cached HookCall holds is current at every policy call."""
        ffi, lib = self._n.ffi, self._n.lib
        store = lib.spice_runtime_get_store(self._rt)
        if store == ffi.NULL:
            return None
        dims = ffi.new("int32_t[2]")
        ptr = lib.spice_store_states(store, dims, dims + 1)
        cached = self._residency
        if cached is not None and cached[0] == ptr:
            return cached[1]
        arr: np.ndarray = np.frombuffer(ffi.buffer(ptr, dims[0] * dims[1]), dtype=np.int8).reshape(
            dims[0], dims[1]
        )
        arr.flags.writeable = False
        self._residency = (ptr, arr)
        return arr

    def set_clock_step(self, step_ns: int) -> None:
        """Deterministic timing on an emulated tier: its clock leaves real time and moves
        `step_ns` per token of each hook call as it starts (0: real time again; a new
        tier starts there).
        Raises SpiceError without a tier or on a real device (spice_runtime_set_clock_step)."""
        status = self._n.lib.spice_runtime_set_clock_step(self._rt, max(0, int(step_ns)))
        self._check(status, "set_clock_step")
