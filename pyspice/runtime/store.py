"""Device tier settings (StoreParams, AsyncParams), the expert buffer type, and Store: the
device tier without a model, for tests and the differential tests against the simulator."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import Plan
from pyspice.policy.rule import Rule
from pyspice.runtime.constants import _COUNTER_FIELDS
from pyspice.runtime.errors import SpiceError
from pyspice.runtime.loader import _Native
from pyspice.runtime.plans import _policy_call, _rule_to_c
from pyspice.stats import Counters


class ExpertBufferType:
    """The ggml buffer type routed-expert tensors are loaded into: plain host
    memory, never repacked (pinned host memory on GPU builds). Keep it alive
    as long as any model loaded with it."""

    def __init__(self) -> None:
        self._n = _Native.get()
        out = self._n.ffi.new("spice_expert_buft **")
        status = self._n.lib.spice_expert_buft_create(out)
        if status != 0:
            raise SpiceError(status, "could not create the expert buffer type")
        self._handle: Any = out[0]

    @property
    def address(self) -> int:
        return int(self._n.ffi.cast("uintptr_t", self._n.lib.spice_expert_buft_get(self._handle)))

    @property
    def name(self) -> str:
        return str(self._n.ffi.string(self._n.lib.spice_expert_buft_name(self._handle)).decode())

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._n.lib.spice_expert_buft_free(handle)


@dataclass(frozen=True)
class AsyncParams:
    """Asynchronous planning (spice_async_params): the policy on libspice's planner
    thread, its plans applied at later hook calls.

    max_lag            free-running: plans older than this many hook calls (MoE
                       layers) when they could be applied are dropped and counted
    deterministic_lag  > 0: deterministic mode -- the plan of call c is applied
                       exactly at call c + deterministic_lag, the hook waiting for it
    with_probs         snapshots carry the router probabilities (HookCall.probs)
    with_shared        snapshots carry the shared-expert output (HookCall.shared)
    idle_poll          an idle planner polls a while before it parks (no wake-up
                       on the hook's thread in a steady decode): only where it
                       has a core of its own, else polling takes the graph's time
    """

    max_lag: int = 4
    deterministic_lag: int = 0
    with_probs: bool = False
    with_shared: bool = False
    idle_poll: bool = False

    def __post_init__(self) -> None:
        if self.max_lag < 1:
            raise ValueError(f"max_lag must be at least 1 hook call, got {self.max_lag}")
        if not 0 <= self.deterministic_lag <= 64:
            raise ValueError(
                "deterministic_lag must be 0 (free-running) or 1..64 hook calls, "
                f"got {self.deterministic_lag}"
            )

    def to_c(self, ffi: Any) -> Any:
        p = ffi.new("spice_async_params *")
        p.max_lag = self.max_lag
        p.deterministic = int(self.deterministic_lag > 0)
        p.lag = max(1, self.deterministic_lag)
        p.with_probs = int(self.with_probs)
        p.with_shexp = int(self.with_shared)
        p.idle_poll = int(self.idle_poll)
        return p


@functools.cache
def _c_store_defaults() -> Any:
    n = _Native.get()
    p = n.ffi.new("spice_store_params *")
    status = n.lib.spice_store_default_params(p)
    if status != 0:
        raise SpiceError(status, "spice_store_default_params failed")
    return p


def _c_default(name: str, kind: Callable[[Any], Any]) -> Any:
    """A StoreParams field's default, read from libspice when a StoreParams is made
    without it: one place states the defaults (spice.h), and importing this module
    still needs no built library."""
    return field(default_factory=lambda: kind(getattr(_c_store_defaults(), name)))


@dataclass(frozen=True)
class StoreParams:
    """Device tier settings (spice_store_params), with spice_store_default_params's
    defaults."""

    budget_bytes: int
    bandwidth_gbps: float = _c_default("bandwidth_gbps", float)
    latency_us: float = _c_default("latency_us", float)
    prefetch_queue_max: int = _c_default("prefetch_queue_max", int)
    # tests: time moves only through Store.advance
    manual_clock: bool = _c_default("manual_clock", bool)
    # DEVICE_CUDA: slots on a real GPU (CUDA builds)
    device_kind: int = _c_default("device_kind", int)
    device_index: int = _c_default("device_index", int)
    # DEVICE_DISK: the file experts are read from (NULL, C's default, is None)
    path: str | None = None
    # DEVICE_DISK: reader threads; tests only: reads after io_fault_after fail with EIO
    io_threads: int = _c_default("io_threads", int)
    io_fault_after: int = _c_default("io_fault_after", int)
    # spice_executor; EXECUTOR_POOL: the slot-pool graph (emulated: on the CPU)
    executor: int = _c_default("executor", int)
    # tests only: launches after this many fail (> 0), collects after -this (< 0)
    exec_fault_after: int = _c_default("exec_fault_after", int)
    # SLOT_4BIT/SLOT_5BIT: lossy low-precision slots (a runtime's tier only)
    slot_precision: int = _c_default("slot_precision", int)

    def to_c(self, ffi: Any) -> tuple[Any, Any]:
        """The C struct, and what must outlive the call it is passed to (the path:
        libspice copies what it keeps before that call returns)."""
        p = ffi.new("spice_store_params *")
        path = ffi.new("char[]", os.fsencode(self.path)) if self.path is not None else ffi.NULL
        p.path = path
        p.budget_bytes = self.budget_bytes
        p.bandwidth_gbps = self.bandwidth_gbps
        p.latency_us = self.latency_us
        p.prefetch_queue_max = self.prefetch_queue_max
        p.manual_clock = int(self.manual_clock)
        p.device_kind = self.device_kind
        p.device_index = self.device_index
        p.io_threads = self.io_threads
        p.io_fault_after = self.io_fault_after
        p.executor = self.executor
        p.exec_fault_after = self.exec_fault_after
        p.slot_precision = self.slot_precision
        return p, path


class Store:
    """A standalone expert store (no model): the device tier's slots, residency
    and copy engine, for tests and the differential tests against the simulator's twin."""

    def __init__(self, params: StoreParams, n_expert: list[int], expert_bytes: list[int]) -> None:
        self._n = _Native.get()
        ffi, lib = self._n.ffi, self._n.lib
        out = ffi.new("spice_store **")
        cparams, _path = params.to_c(ffi)
        status = lib.spice_store_create(
            cparams,
            len(n_expert),
            ffi.new("int32_t[]", n_expert),
            ffi.new("uint64_t[]", expert_bytes),
            out,
        )
        if status != 0:
            raise SpiceError(
                status, f"spice_store_create: {ffi.string(lib.spice_status_string(status)).decode()}"
            )
        self._s: Any = out[0]
        self._n_expert = list(n_expert)

    def __del__(self) -> None:
        s, self._s = getattr(self, "_s", None), None
        if s is not None:
            self._n.lib.spice_store_free(s)

    @property
    def n_slots(self) -> int:
        return int(self._n.lib.spice_store_n_slots(self._s))

    @property
    def n_free(self) -> int:
        return int(self._n.lib.spice_store_n_free(self._s))

    @property
    def used_bytes(self) -> int:
        return int(self._n.lib.spice_store_used_bytes(self._s))

    @property
    def budget_bytes(self) -> int:
        return int(self._n.lib.spice_store_budget_bytes(self._s))

    def request(self, il: int, e: int, demand: bool) -> int:
        """0 ok, 6 no free slot, 7 prefetch queue full (spice_status)."""
        return int(self._n.lib.spice_store_request(self._s, il, e, 1 if demand else 0))

    def evict(self, il: int, e: int) -> int:
        return int(self._n.lib.spice_store_evict(self._s, il, e))

    def reserve(self, nbytes: int) -> int:
        """Charge (or with a negative value release) non-expert bytes to the budget."""
        return int(self._n.lib.spice_store_reserve(self._s, nbytes))

    def pin(self, il: int, e: int) -> int:
        return int(self._n.lib.spice_store_pin(self._s, il, e))

    def unpin(self, il: int, e: int) -> int:
        return int(self._n.lib.spice_store_unpin(self._s, il, e))

    def state(self, il: int, e: int) -> int:
        """Residency as of the last poll and the store's own changes since."""
        return int(self._n.lib.spice_store_state(self._s, il, e))

    def read_slot(self, il: int, e: int, size: int) -> bytes | None:
        """The first `size` bytes of resident expert (il, e) as its slot holds them, or
        None when it is not resident (tests check copies moved the right bytes)."""
        ffi, lib = self._n.ffi, self._n.lib
        buf = ffi.new("char[]", size)
        if lib.spice_store_read_slot(self._s, il, e, buf, size) != 0:
            return None
        return bytes(ffi.buffer(buf, size))

    def poll(self) -> int:
        """One poll of the device: landed copies become resident, queued ones start."""
        return int(self._n.lib.spice_store_poll(self._s))

    def states(self) -> np.ndarray:
        """A copy of the residency table [n_layers, max_expert] (RESIDENCY_* values)."""
        ffi = self._n.ffi
        dims = ffi.new("int32_t[2]")
        ptr = self._n.lib.spice_store_states(self._s, dims, dims + 1)
        table = np.frombuffer(ffi.buffer(ptr, dims[0] * dims[1]), dtype=np.int8)
        return table.reshape(dims[0], dims[1]).copy()

    def begin_call(self, il: int, ids: npt.ArrayLike) -> np.ndarray:
        """A hook call of layer il selecting ids [n_tokens, n_used] begins: poll once,
        note the selection's recency; returns which activations were resident."""
        ffi = self._n.ffi
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        hit = np.zeros(arr.shape, dtype=np.uint8)
        status = self._n.lib.spice_store_begin_call(
            self._s,
            il,
            arr.shape[0],
            arr.shape[1],
            ffi.from_buffer("int32_t[]", arr),
            arr.shape[1] * 4,
            ffi.from_buffer("uint8_t[]", hit, require_writable=True),
        )
        if status != 0:
            raise SpiceError(status, f"spice_store_begin_call({il}) failed")
        return hit.astype(bool)

    def set_rule(self, rule: Rule | None) -> None:
        """Install the per-activation rule this store plans by (None: the default)."""
        ffi = self._n.ffi
        c_rule, keep = _rule_to_c(ffi, rule, self._n_expert) if rule is not None else (ffi.NULL, ())
        status = self._n.lib.spice_store_set_rule(self._s, c_rule)
        del keep  # copied by libspice
        if status != 0:
            raise SpiceError(status, "spice_store_set_rule: the rule was refused")

    def rule_plan(
        self, il: int, ids: npt.ArrayLike, weights: npt.ArrayLike, hidden: npt.ArrayLike | None = None
    ) -> Plan:
        """The installed rule's plan for a call of layer il (after begin_call), as a Plan."""
        ffi = self._n.ffi
        ids32 = np.ascontiguousarray(ids, dtype=np.int32)
        width, n_layers = max(self._n_expert), len(self._n_expert)
        pairs_all = 2 * n_layers * width
        call, keep = _policy_call(
            ffi, il, ids32, np.zeros(ids32.shape, np.int32), caps=(width, pairs_all, pairs_all, n_layers)
        )
        w32 = np.ascontiguousarray(weights, dtype=np.float32).reshape(ids32.shape)
        h32 = np.ascontiguousarray(
            hidden if hidden is not None else np.zeros((len(ids32), 1)), dtype=np.float32
        )
        call.n_expert = self._n_expert[il]
        call.weights, call.weights_nb1 = ffi.from_buffer("float[]", w32), ids32.shape[1] * 4
        call.inp, call.inp_nb1, call.n_embd = ffi.from_buffer("float[]", h32), h32.shape[1] * 4, h32.shape[1]
        status = self._n.lib.spice_store_rule_plan(self._s, call)
        if status != 0:
            raise SpiceError(status, f"spice_store_rule_plan({il}) failed")
        _, actions, fetch, prefetch, evict, evict_from = keep
        return Plan(
            actions=actions.reshape(ids32.shape).copy(),
            fetch=fetch[: call.n_fetch].tolist(),
            prefetch=[(int(a), int(b)) for a, b in prefetch[: call.n_prefetch].reshape(-1, 2)],
            evict=[(int(a), int(b)) for a, b in evict[: call.n_evict].reshape(-1, 2)],
            evict_from=evict_from[: call.n_evict_from].tolist(),
        )

    def apply_plan(
        self,
        il: int,
        ids: npt.ArrayLike,
        actions: npt.ArrayLike,
        *,
        fetch: Sequence[int] = (),
        prefetch: Sequence[tuple[int, int]] = (),
        evict: Sequence[tuple[int, int]] = (),
        evict_from: Sequence[int] = (),
    ) -> np.ndarray:
        """spice_store_apply_plan for one call; returns the actions as carried out
        (device actions of experts that got no slot become host actions)."""
        ffi = self._n.ffi
        call, keep = _policy_call(ffi, il, ids, actions, fetch, prefetch, evict, evict_from)
        status = self._n.lib.spice_store_apply_plan(self._s, call, ffi.NULL)
        if status != 0:
            raise SpiceError(status, f"spice_store_apply_plan({il}) failed")
        out: np.ndarray = keep[1].reshape(np.shape(ids)).copy()
        return out

    def ready_at(self, il: int, e: int) -> int:
        return int(self._n.lib.spice_store_ready_at(self._s, il, e))

    def wait(self, il: int, e: int) -> tuple[int, int]:
        """(status, stall ns)."""
        stall = self._n.ffi.new("uint64_t *")
        status = self._n.lib.spice_store_wait(self._s, il, e, stall)
        return int(status), int(stall[0])

    def now(self) -> int:
        return int(self._n.lib.spice_store_now(self._s))

    def advance(self, ns: int) -> None:
        if self._n.lib.spice_store_advance(self._s, ns) != 0:
            raise SpiceError(7, "advance needs a manual clock")

    def counters(self, il: int = -1) -> Counters:
        c = self._n.ffi.new("spice_counters *")
        self._n.lib.spice_store_get_counters(self._s, il, c)
        return Counters(**{name: int(getattr(c, name)) for name in _COUNTER_FIELDS})
