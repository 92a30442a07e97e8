"""Pythonic handles over libspice's C API (cffi, ABI mode).

The only module that touches the C API. The cffi declarations are derived
from the installed `spice.h`, so the two cannot drift apart. Arrays handed to
a Python policy are zero-copy numpy views, valid only during the call.

Failure rules (docs/design.md section 6): a policy's `Exception` or an invalid plan
runs that call exactly and is reported once; `KeyboardInterrupt` asks the
runtime to abort the running llama_decode and is re-raised by the API layer.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.build_info import BuildInfo, load_build_info
from pyspice.interrupts import SigintGuard
from pyspice.policy.base import HookCall, HookInputError, Plan, Policy, policy_reads, policy_reads_next_logits
from pyspice.policy.rule import Rule
from pyspice.stats import Counters

_COUNTER_FIELDS = (
    "hook_calls",
    "activations",
    "hits",
    "misses_fetched",
    "misses_host",
    "misses_surrogate",
    "dropped",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_cancelled",
    "bytes_h2d",
    "copy_ns",
    "stall_ns",
    "policy_ns",
    "policy_calls",
    "policy_fallbacks",
    "store_ns",
    "policy_quiet",
    "hook_ns",
    "gap_ns",
    "store_polls",
    "device_copies",
    "device_waits",
    "device_launches",
    "device_collects",
    "launch_ns",
    "collect_ns",
    "disk_read_bytes",
    "disk_reads",
    "scratch_reads",
    "scratch_ns",
    "async_posted",
    "async_skipped",
    "async_applied",
    "async_stale",
    "async_lag_calls",
    "async_wait_ns",
    "planner_ns",
    "exec_ns",
    "call_ns",
    "async_wakes",
    "rule_ns",
    "async_take_ns",
    "async_post_ns",
    "async_rows_by_hook",
)


# why a HookCall field is missing (Runtime._field)
_UNREQUESTED = {
    1: (
        "HookCall.probs: policy {name!r} did not declare that it reads the router probabilities, so the "
        "graph did not hand them to the hook; set `reads_probs = True` on the policy"
    ),
    4: (
        "HookCall.shared: policy {name!r} did not declare that it reads the shared-expert output, so the "
        "graph did not hand it to the hook; set `reads_shared = True` on the policy"
    ),
    6: (
        "HookCall.next_logits: policy {name!r} did not declare that it reads the next layer's router "
        "logits, so the graph did not compute them; set `reads_next_logits = True` on the policy"
    ),
}


class SpiceError(RuntimeError):
    """A libspice call failed; the message says why and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DecodeFailedError(SpiceError):
    """libspice stopped a decode because it could not go on exactly (the message
    says why: e.g. a read of the model file failed); nothing was generated from it."""


class IncompatibleModelError(SpiceError):
    """The model cannot be served by the hook (dense, or loaded with the wrong settings)."""


def cdef_from_header(text: str) -> str:
    """Turn spice.h into declarations cffi's ABI mode parses.

    Drops comments, preprocessor lines (keeping `#define NAME <int>`), the
    export macro and the C++ guards.
    """
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if re.fullmatch(r"#define\s+SPICE_\w+\s+-?\d+", stripped):
                lines.append(stripped)
            continue
        if stripped in ('extern "C" {', "}"):
            continue
        lines.append(line.replace("SPICE_API ", ""))
    return "\n".join(lines)


class _Native:
    """The loaded library and its cffi namespace (one per process is enough,
    but nothing forces that: each Runtime holds a reference)."""

    _lock = threading.Lock()
    _instance: _Native | None = None

    def __init__(self, info: BuildInfo) -> None:
        import cffi

        header = (info.lib_dir / "spice.h").read_text()
        self.ffi = cffi.FFI()
        self.ffi.cdef(cdef_from_header(header))
        self.lib: Any = self.ffi.dlopen(str(info.libspice))
        self.info = info

    @classmethod
    def get(cls) -> _Native:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Native(load_build_info())
            return cls._instance


def native() -> Any:
    """The cffi library object (for tests and diagnostics)."""
    return _Native.get().lib


EXECUTOR_AUTO = 0  # spice_executor: the device's default
EXECUTOR_POOL = 1  # the slot-pool graph, one mul_mat_id per matrix kind per call
EXECUTOR_LEGACY = 2  # CUDA: one small graph per device expert (A/B runs)
EXECUTORS = {"auto": EXECUTOR_AUTO, "pool": EXECUTOR_POOL, "legacy": EXECUTOR_LEGACY}
DEVICE_EMULATED = 0  # spice_device_kind
DEVICE_CUDA = 1
DEVICE_DISK = 2  # slots in RAM, copies read from the model file (edge mode)

SLOT_EXACT = 0  # spice_slot_precision: slots hold the experts' own bytes
SLOT_4BIT = 1  # LOSSY: slots hold the experts re-quantized to about 4.5 bits (IQ4_NL...)
SLOT_5BIT = 2  # LOSSY: about 5.5 bits (Q5_0, else Q5_K); ~1.55x the experts of a Q8_0 model
SLOT_PRECISIONS = {"exact": SLOT_EXACT, "4bit": SLOT_4BIT, "5bit": SLOT_5BIT}


def device_count() -> int:
    """CUDA devices this libspice can use: 0 on a CPU-only build (answered from the
    build record, without loading libspice) or with no GPU."""
    if not load_build_info().cuda:
        return 0
    return int(_Native.get().lib.spice_device_count())


def device_memory(index: int = 0) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `index`."""
    n = _Native.get()
    free, total = n.ffi.new("uint64_t *"), n.ffi.new("uint64_t *")
    status = n.lib.spice_device_memory(index, free, total)
    if status != 0:
        raise SpiceError(status, f"no CUDA device {index} in this build")
    return int(free[0]), int(total[0])


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


@dataclass(frozen=True)
class StoreParams:
    """Device tier settings (spice_store_params)."""

    budget_bytes: int
    bandwidth_gbps: float = 16.0
    latency_us: float = 10.0
    prefetch_queue_max: int = 0  # 0: libspice's default (64)
    manual_clock: bool = False  # tests: time moves only through Store.advance
    device_kind: int = DEVICE_EMULATED  # DEVICE_CUDA: slots on a real GPU (CUDA builds)
    device_index: int = 0
    path: str | None = None  # DEVICE_DISK: the file experts are read from
    io_threads: int = 0  # DEVICE_DISK: reader threads (0: libspice's default, 4)
    io_fault_after: int = 0  # DEVICE_DISK, tests only: reads after this many fail with EIO
    executor: int = EXECUTOR_AUTO  # spice_executor; EXECUTOR_POOL: the slot-pool graph (emulated: CPU)
    exec_fault_after: int = 0  # tests only: launches after this many fail (> 0), collects after -this (< 0)
    slot_precision: int = SLOT_EXACT  # SLOT_4BIT/SLOT_5BIT: lossy low-precision slots (a runtime's tier only)

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


class Runtime:
    """libspice attached to one llama_context.

    Create it with the context's address (`llama_cpp.Llama._ctx.ctx`); then
    `enable_exact()` or `enable_policy(policy)`, and `disable()` to get
    upstream's graph back. `close()` (or garbage collection) frees it.
    """

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
        self._residency: tuple[Any, np.ndarray] | None = None
        # HookCalls by the bytes of the call's head (layer, sizes, array addresses, strides):
        # the graph reuses its buffers from one decode step to the next, so each layer's
        # call finds the views it had the step before and pays for no new objects
        self._calls: dict[bytes, HookCall] = {}
        self._call_head = int(n.ffi.offsetof("spice_policy_call", "actions"))
        self._buffer = n.ffi.buffer
        self._callback: Any = None
        self._policy: Policy | None = None
        self._policy_error: str | None = None
        self._interrupted = False
        self._warned_rejection = False
        self._rejections_seen = 0
        self._async = False
        # HookCall fields (1 probs, 4 shared) the policy did not declare: reading one raises
        self._unrequested: frozenset[int] = frozenset()
        self._rules: dict[int, tuple[Rule, Any, tuple[Any, ...]]] = {}  # see _plan_rule
        self._replay_ids: np.ndarray | None = None  # borrowed by libspice (set_routing_replay)

    # ---- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        if self._rt is not None:
            self._n.lib.spice_runtime_free(self._rt)
            self._rt = None
            self._callback = None
            self._calls.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down cffi
            self.close()

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            lib, ffi = self._n.lib, self._n.ffi
            detail = ffi.string(lib.spice_runtime_last_error(self._rt)).decode(errors="replace")
            name = ffi.string(lib.spice_status_string(status)).decode()
            raise SpiceError(status, f"{what}: {name}" + (f" ({detail})" if detail else ""))

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

    # ---- device tier ---------------------------------------------------------------

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

    # ---- surrogates ----------------------------------------------------------------

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

    # ---- routing replay ----------------------------------------------------------

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

    # ---- policies ------------------------------------------------------------------

    def set_rule(self, rule: Rule | None) -> None:
        """Install the per-activation rule the engine plans the calls no policy decides
        by (None: the default rule). Needs a device tier; a new tier starts with the
        default rule."""
        ffi = self._n.ffi
        layers = self.layers()
        n_expert = [info.n_expert if info.is_moe else 0 for info in layers]
        c_rule, keep = _rule_to_c(ffi, rule, n_expert) if rule is not None else (ffi.NULL, ())
        status = self._n.lib.spice_runtime_set_rule(self._rt, c_rule)
        del keep  # copied by libspice
        self._check(status, "set_rule")

    def enable_exact(self, max_tokens: int = 0) -> None:
        """Register the hook with libspice's built-in exact policy (no Python per layer)."""
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")  # a planner joined first
        self._policy = None
        self._callback = None
        self._check(
            self._n.lib.spice_runtime_enable(self._rt, self._n.ffi.NULL, self._n.ffi.NULL, max_tokens),
            "enable",
        )

    def enable_policy(
        self, policy: Policy, max_tokens: int = 0, asynchronous: AsyncParams | None = None
    ) -> None:
        """Register the hook with a Python policy called once per MoE layer: on the
        hook's thread, or with `asynchronous` on libspice's planner thread while the
        installed rule (set_rule) runs each call at once."""
        ffi = self._n.ffi
        # joins a planner thread first: it may be inside the old callback, which reads
        # self._policy and must outlive it
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")
        self._policy = policy
        # each policy gets its own one-time warnings
        self._policy_error = None
        self._warned_rejection = False
        self._async = asynchronous is not None
        self._calls.clear()  # a snapshot's arrays are not the graph's
        self._callback = ffi.callback(
            "int(spice_policy_call *, void *)", self._on_call, onerror=self._on_callback_error
        )
        lib = self._n.lib
        # the hook is handed only what the policy reads (each input is a copy per layer on a GPU)
        probs, shared = policy_reads(policy)
        if asynchronous is not None:
            probs, shared = probs or asynchronous.with_probs, shared or asynchronous.with_shared
        # the next layer's logits are the graph's, read where they are: on the hook's thread only
        # (a snapshot for the planner carries none, so an asynchronous policy reads None)
        nxt = policy_reads_next_logits(policy)
        self._unrequested = frozenset(i for i, wanted in ((1, probs), (4, shared), (6, nxt)) if not wanted)
        if asynchronous is None:
            flags = (
                (lib.SPICE_HOOK_WANT_PROBS if probs else 0)
                | (lib.SPICE_HOOK_WANT_SHEXP if shared else 0)
                | (lib.SPICE_HOOK_WANT_NEXT_LOGITS if nxt else 0)
            )
            status = lib.spice_runtime_enable_ex(self._rt, self._callback, ffi.NULL, max_tokens, flags)
            self._check(status, "enable")
        else:
            params = replace(asynchronous, with_probs=probs, with_shared=shared)
            status = lib.spice_runtime_enable_async(
                self._rt, self._callback, ffi.NULL, max_tokens, params.to_c(ffi)
            )
            self._check(status, "enable_async")

    def set_clock_step(self, step_ns: int) -> None:
        """Deterministic timing on an emulated tier: its clock leaves real time and moves
        `step_ns` per token of each hook call as it starts (0: real time again; a new
        tier starts there).
        Raises SpiceError without a tier or on a real device (spice_runtime_set_clock_step)."""
        status = self._n.lib.spice_runtime_set_clock_step(self._rt, max(0, int(step_ns)))
        self._check(status, "set_clock_step")

    def hook_flags(self) -> int:
        """SPICE_HOOK_WANT_* the hook is registered with (1 probs, 2 shared-expert output;
        libspice adds 2 while surrogates are loaded); 0 when it is not registered."""
        return int(self._n.lib.spice_runtime_hook_flags(self._rt))

    def sync_hook(self) -> None:
        """Between decodes: re-register the hook where the graph inputs the runtime needs
        changed (a plan installed a rule during the last decode; spice_runtime_sync_hook)."""
        self._n.lib.spice_runtime_sync_hook(self._rt)

    def is_async(self) -> bool:
        """Whether the policy plans on libspice's planner thread."""
        return bool(self._n.lib.spice_runtime_is_async(self._rt))

    def disable(self) -> None:
        """Unregister the hook: the context runs upstream's graph again."""
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")
        self._policy = None
        self._callback = None

    def keep_debug_log(self, keep: bool = True) -> None:
        """Let llama.cpp's debug log lines through to its log callback (a verbose model).
        By default the runtime drops them in C: ggml-cuda logs one per CUDA graph it
        replays, and llama-cpp-python's Python callback made each such launch take the
        GIL (spice_runtime_keep_debug_log in spice.h)."""
        self._check(self._n.lib.spice_runtime_keep_debug_log(self._rt, int(keep)), "keep_debug_log")

    def _hook_call(self, call: Any) -> HookCall:
        """The HookCall of this call, opened: one read of the call's head, then the cached
        HookCall of the same layer, sizes and buffers (its arrays are allocated on first
        access and kept), or a new one (kept only for calls of few tokens)."""
        head = self._buffer(call, self._call_head)[:]
        view = self._calls.get(head)
        if view is None:
            if len(self._calls) >= _MAX_CACHED_CALLS:  # prompt batches of many sizes
                self._calls.clear()
            # the fields are copied out of the struct: it lives only during this call
            fields = (
                (call.inp, call.n_embd, call.inp_nb1),
                (call.probs, call.n_expert, call.probs_nb1),
                (call.ids, call.n_expert_used, call.ids_nb1),
                (call.weights, call.n_expert_used, call.weights_nb1),
                (call.shexp, call.n_embd, call.shexp_nb1),
                (call.residency, int(call.res_width), int(call.res_layers)),
                (call.next_logits, int(call.n_expert_next), call.next_logits_nb1),
            )
            rows = int(call.n_tokens)
            owned: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(fields)
            view = HookCall.lazy(
                int(call.il),
                rows,
                int(call.n_expert),
                int(call.n_expert_used),
                lambda i: self._field(fields, rows, i, owned),
            )
            if rows <= _MAX_CACHED_ROWS:
                self._calls[head] = view
        view.open()
        return view

    def _field(
        self,
        fields: tuple[tuple[Any, int, int], ...],
        rows: int,
        i: int,
        owned: list[tuple[np.ndarray, np.ndarray] | None],
    ) -> np.ndarray | None:
        """Field i of a hook call (0 hidden, 1 probs, 2 ids, 3 weights, 4 shared,
        5 residency, 6 next_logits) as a read-only array in memory Python owns, refilled from the
        graph (or the store) at each first access in a call.

        Why a copy and not a view into the graph: a view outlives the buffers it
        points into when a policy keeps it (reading it after Llama.close() was a
        segfault), and a view made writable could change the routing in the graph.
        The memory is allocated once per cached HookCall and field, so a decode step
        pays one memmove of a few KiB per field read, and no new objects."""
        if i in self._unrequested:
            raise HookInputError(_UNREQUESTED[i].format(name=getattr(self._policy, "name", "?")))
        kept = owned[i]
        if i == 5:
            # the store's live table (synchronous) or the snapshot's copy (asynchronous)
            ptr, width, n_layers = fields[5]
            if ptr == self._n.ffi.NULL:
                return None
            if kept is None:
                table: np.ndarray = np.empty((n_layers, width), dtype=np.int8)
                frozen = table.view()
                frozen.flags.writeable = False
                kept = owned[i] = (table, frozen)
            self._n.ffi.memmove(kept[0], ptr, n_layers * width)
            return kept[1]
        ptr, cols, row_bytes = fields[i]
        if ptr == self._n.ffi.NULL:
            return None
        itemsize = 4  # float32 and int32 alike
        nbytes = (rows - 1) * row_bytes + cols * itemsize if rows > 0 else 0
        if kept is None:
            raw: np.ndarray = np.empty(max(nbytes, 1), dtype=np.uint8)
            dtype = np.int32 if i == 2 else np.float32
            strides = (row_bytes, itemsize) if rows > 0 else None
            arr: np.ndarray = np.ndarray((rows, cols), dtype=dtype, buffer=raw, strides=strides)
            arr.flags.writeable = False
            kept = owned[i] = (raw, arr)
        if nbytes:
            self._n.ffi.memmove(kept[0], ptr, nbytes)
        return kept[1]

    def _on_call(self, call: Any, _user_data: Any) -> int:
        """cffi callback on graph thread 0: find the views, ask the policy, write the plan."""
        try:
            policy = self._policy
            assert policy is not None
            view = self._hook_call(call)
            try:
                plan = policy.decide(view)
            finally:
                view.close()  # a HookCall read after decide raises
            self._write_plan(call, view, plan)
            return _POLICY_OK
        except KeyboardInterrupt:
            self._interrupted = True
            return _POLICY_ABORT
        except Exception as exc:  # a policy bug must never crash the host process
            if self._policy_error is None:
                self._policy_error = f"{type(exc).__name__}: {exc}"
                instead = (
                    "dropping its plan on the planner thread; the calls run by the policy's rule"
                    if self._async
                    else "running that call exactly"
                )
                print(
                    f"pyspice: policy {getattr(self._policy, 'name', '?')!r} raised {self._policy_error}; "
                    f"{instead} (warned once)",
                    file=sys.stderr,
                )
            return _POLICY_FAILED
        except BaseException:
            self._interrupted = True
            return _POLICY_ABORT

    def _on_callback_error(self, exc_type: Any, exc: Any, _tb: Any) -> int:
        """What cffi calls when an exception escapes `_on_call` itself (a Ctrl-C that
        lands before its try block runs): abort the decode instead of cffi's
        "Exception ignored" and decoding on."""
        self._interrupted = True
        return _POLICY_ABORT

    def _write_plan(self, call: Any, view: HookCall, plan: Plan) -> None:
        actions = plan.actions
        if actions is not None:
            n, used = view.n_tokens, view.n_expert_used
            # the common shapes first: a decode step's one row as a list (cffi converts and
            # range-checks each int in C), or an int32 array of the right shape
            if (
                isinstance(actions, list)
                and n == 1
                and len(actions) == 1
                and isinstance(actions[0], list)
                and len(actions[0]) == used
            ):
                try:
                    call.actions[0:used] = actions[0]
                except (TypeError, OverflowError):
                    _write_actions(self._n.ffi, call, actions, (n, used))
            elif (
                type(actions) is np.ndarray
                and actions.dtype == _INT32
                and actions.shape == (n, used)
                and actions.flags.c_contiguous
            ):
                self._n.ffi.memmove(call.actions, actions, actions.nbytes)
            else:
                _write_actions(self._n.ffi, call, actions, (n, used))
            call.n_actions = n * used
        # libspice zeroes the counts before each call, so empty lists cost nothing
        if plan.fetch:
            call.n_fetch = _copy_ints(self._n.ffi, call.fetch, call.cap_fetch, plan.fetch)
        if plan.prefetch:
            pairs = list(chain.from_iterable(plan.prefetch))
            call.n_prefetch = _copy_ints(self._n.ffi, call.prefetch, call.cap_prefetch, pairs)
        if plan.evict:
            pairs = list(chain.from_iterable(plan.evict))
            call.n_evict = _copy_ints(self._n.ffi, call.evict, call.cap_evict, pairs)
        if plan.evict_from:
            call.n_evict_from = _copy_ints(self._n.ffi, call.evict_from, call.cap_evict_from, plan.evict_from)
        if plan.resume_layer != -1:
            call.resume_il = plan.resume_layer
        if plan.rule is not None:
            if not isinstance(plan.rule, Rule):
                raise TypeError(f"plan.rule must be a pyspice.policy.Rule, got {type(plan.rule).__name__}")
            call.rule = self._plan_rule(plan.rule)

    def _plan_rule(self, rule: Rule) -> Any:
        """The spice_rule of a plan's Rule, converted once per Rule object and kept alive
        (with the arrays it points into) while cached: an asynchronous plan is applied
        calls after it was written, and the same object gives the same address, which
        libspice does not install again."""
        key = id(rule)
        hit = self._rules.get(key)
        if hit is not None and hit[0] is rule:
            return hit[1]
        if len(self._rules) >= _MAX_CACHED_RULES:  # more than any ring of plans holds
            self._rules.pop(next(iter(self._rules)))
        n_expert = [info.n_expert if info.is_moe else 0 for info in self.layers()]
        c_rule, keep = _rule_to_c(self._n.ffi, rule, n_expert)
        self._rules[key] = (rule, c_rule, keep)
        return c_rule

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

    def last_error(self) -> str:
        return str(
            self._n.ffi.string(self._n.lib.spice_runtime_last_error(self._rt)).decode(errors="replace")
        )

    def report_rejections(self) -> None:
        """Warn once when libspice rejected a plan (the message names the problem)."""
        n = int(self._n.lib.spice_runtime_plan_rejections(self._rt))
        if n > self._rejections_seen and not self._warned_rejection and self._policy_error is None:
            print(
                f"pyspice: a plan was rejected ({self.last_error()}); ran that call exactly (warned once)",
                file=sys.stderr,
            )
            self._warned_rejection = True
        self._rejections_seen = n

    # ---- counters -------------------------------------------------------------------

    def counters(self, il: int = -1) -> Counters:
        c = self._n.ffi.new("spice_counters *")
        self._check(self._n.lib.spice_runtime_get_counters(self._rt, il, c), "get_counters")
        return Counters(**{name: int(getattr(c, name)) for name in _COUNTER_FIELDS})

    def reset_counters(self) -> None:
        self._n.lib.spice_runtime_reset_counters(self._rt)


_INT32 = np.dtype(np.int32)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# spice_policy_fn return values (SPICE_POLICY_* in spice.h; test_cffi_declarations checks them):
# module constants because the callback runs on the hook's thread 0 per call
_POLICY_OK, _POLICY_FAILED, _POLICY_ABORT = 0, 1, 2
_MAX_CACHED_RULES = 80  # above the deepest plan ring (deterministic lag 64 + 2)
_MAX_CACHED_CALLS = 512  # HookCalls kept by _hook_call (a model has at most a few hundred layers)
# ... of calls of at most this many tokens: decode steps, which the cache is for. A prompt
# batch's buffers (its hidden rows: 295 KB a layer for 128 tokens of smolmoe-b) kept per
# layer were 8.7 MiB of an edge-mode SPICE row's peak RSS, to save an allocation per layer
# per prompt batch, against that layer's compute over the whole batch
_MAX_CACHED_ROWS = 8


def _write_actions(ffi: Any, call: Any, actions: Any, want: tuple[int, int]) -> None:
    """Any array-like of action integers shaped [n_tokens, n_expert_used]."""
    arr = np.asarray(actions)
    if arr.shape != want:
        raise ValueError(f"plan.actions has shape {arr.shape}; layer {call.il} needs {want}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"plan.actions must be integers, got {arr.dtype}")
    # range-checked before the cast: int32 wraps silently (2**32 + 3 would become 3, DROP);
    # inside int32, libspice's plan check names any value that is not an action
    if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
        bad = int(arr.max()) if int(arr.max()) > _INT32_MAX else int(arr.min())
        raise ValueError(f"plan.actions holds {bad}, not an action value (ACTION_DEVICE..ACTION_DROP)")
    flat = np.ascontiguousarray(arr, dtype=np.int32).ravel()
    ffi.memmove(call.actions, flat, flat.nbytes)


def _copy_ints(ffi: Any, dst: Any, cap: int, values: Any) -> int:
    """Write plan ids into a libspice buffer. cffi's slice assignment converts and
    range-checks each int in C: for the few dozen ids of a decode step this is
    several times cheaper than building numpy arrays (measured in-graph). An
    int32 array.array (a policy's precomputed list) is copied in one move."""
    if type(values) is array and values.typecode == "i" and values.itemsize == 4:
        n = len(values)  # int32 already: one copy
        ffi.memmove(dst, values, 4 * min(n, cap))
        return n
    vals = values if isinstance(values, list) else list(values)
    n = len(vals)
    if n > cap:
        vals = vals[:cap]
    try:
        try:
            dst[0 : len(vals)] = vals
        except TypeError:  # numpy integers and other int-likes
            dst[0 : len(vals)] = [int(v) for v in vals]
    except OverflowError:  # cffi range-checks each value: nothing was wrapped
        raise ValueError(f"plan ids must fit in int32, got {max(vals, key=lambda v: abs(int(v)))}") from None
    return n  # libspice rejects a count above cap by name


def _policy_call(
    ffi: Any,
    il: int,
    ids: npt.ArrayLike,
    actions: npt.ArrayLike,
    fetch: Sequence[int] = (),
    prefetch: Sequence[tuple[int, int]] = (),
    evict: Sequence[tuple[int, int]] = (),
    evict_from: Sequence[int] = (),
    resume_layer: int = -1,
    caps: tuple[int, int, int, int] | None = None,
) -> tuple[Any, tuple[np.ndarray, ...]]:
    """A spice_policy_call holding a plan, for libspice's standalone plan functions;
    the arrays it points into are returned too (keep them alive while it is used):
    ids, actions, fetch, prefetch, evict, evict_from. With `caps`, the four lists are
    empty buffers of those capacities, for libspice to write a plan into."""
    ids32 = np.ascontiguousarray(ids, dtype=np.int32)
    acts = np.ascontiguousarray(actions, dtype=np.int64)
    if acts.shape != ids32.shape:
        raise ValueError(f"actions shape {acts.shape} differs from ids shape {ids32.shape}")
    acts32 = np.ascontiguousarray(np.clip(acts, -(2**31), 2**31 - 1), dtype=np.int32).ravel()
    lists = (
        [np.zeros(max(1, cap), np.int32) for cap in caps]
        if caps is not None
        else [
            np.ascontiguousarray(np.asarray(list(v), dtype=np.int32).ravel())
            for v in (fetch, [x for p in prefetch for x in p], [x for p in evict for x in p], evict_from)
        ]
    )
    call = ffi.new("spice_policy_call *")
    call.il = il
    call.n_tokens, call.n_expert_used = ids32.shape
    call.ids = ffi.from_buffer("int32_t[]", ids32)
    call.ids_nb1 = ids32.shape[1] * 4
    call.actions = ffi.from_buffer("int32_t[]", acts32, require_writable=True)
    call.n_actions = call.cap_actions = acts32.size
    bufs = [ffi.from_buffer("int32_t[]", a, require_writable=True) if a.size else ffi.NULL for a in lists]
    call.fetch, call.prefetch, call.evict, call.evict_from = bufs
    counts = (0, 0, 0, 0) if caps is not None else tuple(a.size for a in lists)
    call.n_fetch, call.n_prefetch, call.n_evict, call.n_evict_from = counts
    call.cap_fetch, call.cap_prefetch, call.cap_evict, call.cap_evict_from = (a.size for a in lists)
    call.resume_il = resume_layer
    return call, (ids32, acts32, *lists)


def _rule_to_c(ffi: Any, rule: Rule, n_expert: Sequence[int]) -> tuple[Any, tuple[Any, ...]]:
    """A spice_rule for libspice and the buffers it points into (keep them alive
    until libspice has copied them)."""
    n_layers, width = len(n_expert), max(n_expert, default=0)
    c = ffi.new("spice_rule *")
    c.resident_action, c.miss, c.keep = rule.resident_action, rule.miss, rule.keep
    c.host_us, c.device_us, c.margin = rule.host_us, rule.device_us, rule.margin
    c.surrogate_weight = rule.surrogate_weight
    c.resize_every = rule.resize_every
    c.decay = rule.decay
    c.overlap = 1 if rule.overlap else 0
    keep: list[Any] = [c]
    if rule.host_points:
        tokens = np.ascontiguousarray([t for t, _ in rule.host_points], dtype=np.int32)
        per_act = np.ascontiguousarray([us for _, us in rule.host_points], dtype=np.float64)
        keep += [tokens, per_act]
        c.n_host_points = len(rule.host_points)
        c.host_point_tokens = ffi.from_buffer("int32_t[]", tokens)
        c.host_point_us = ffi.from_buffer("double[]", per_act)
    if rule.surrogate_set is not None:
        table = np.zeros((n_layers, width), np.uint8)
        given = np.asarray(rule.surrogate_set, dtype=np.uint8)
        table[: given.shape[0], : given.shape[1]] = given[:n_layers, :width]
        keep.append(table)
        c.surrogate_set = ffi.from_buffer("uint8_t[]", table)
    if rule.whole_layers:
        layers = np.zeros(n_layers, np.uint8)
        layers[list(rule.whole_layers)] = 1
        keep.append(layers)
        c.whole_layers = ffi.from_buffer("uint8_t[]", layers)
    if rule.capacity is not None:
        capacity = np.ascontiguousarray(rule.capacity, dtype=np.int32)
        if capacity.shape != (n_layers,):
            raise ValueError(f"rule.capacity has {capacity.size} entries; the model has {n_layers} layers")
        keep.append(capacity)
        c.capacity = ffi.from_buffer("int32_t[]", capacity)
    if rule.prefetch_next and rule.routers is not None:
        routers = ffi.new("float *[]", n_layers)
        n_embd = 0
        for il, router in enumerate(rule.routers[:n_layers]):
            if router is None or not n_expert[il]:
                continue
            arr = np.ascontiguousarray(router, dtype=np.float32)
            if arr.ndim != 2 or arr.shape[0] != n_expert[il] or (n_embd and arr.shape[1] != n_embd):
                raise ValueError(
                    f"rule.routers[{il}] has shape {arr.shape}; layer {il} has {n_expert[il]} experts"
                )
            n_embd = arr.shape[1]
            keep.append(arr)
            routers[il] = ffi.from_buffer("float[]", arr)
        keep.append(routers)
        if rule.next_layers is not None:
            at = np.zeros(n_layers, np.uint8)
            at[[il for il in rule.next_layers if 0 <= il < n_layers]] = 1
            keep.append(at)
            c.next_layers = ffi.from_buffer("uint8_t[]", at)
        c.next_room = 1 if rule.next_room and n_embd else 0
        c.prefetch_next = 1 if n_embd else 0
        c.routers = ffi.cast("const float * const *", routers)
        c.n_embd = n_embd
    return c, tuple(keep)


def plan_check(
    n_expert: Sequence[int],
    has_surrogate: npt.ArrayLike | None,
    il: int,
    ids: npt.ArrayLike,
    actions: npt.ArrayLike,
    *,
    fetch: Sequence[int] = (),
    prefetch: Sequence[tuple[int, int]] = (),
    evict: Sequence[tuple[int, int]] = (),
    evict_from: Sequence[int] = (),
    resume_layer: int = -1,
    caps: tuple[int, int, int, int] | None = None,
) -> str | None:
    """spice_plan_check on a plan for a model with n_expert[il] routed experts per layer
    (0: dense) and surrogates where has_surrogate [n_layers, max_expert] is true (None:
    none loaded). Returns None when valid, else libspice's message. `caps` overrides the
    list capacities (fetch, prefetch, evict, evict_from); by default the runtime's."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    width = max(n_expert, default=0)
    call, keep = _policy_call(ffi, il, ids, actions, fetch, prefetch, evict, evict_from, resume_layer)
    pairs_all = 2 * len(n_expert) * width
    call.cap_fetch, call.cap_prefetch, call.cap_evict, call.cap_evict_from = caps or (
        width,
        pairs_all,
        pairs_all,
        len(n_expert),
    )
    experts = np.ascontiguousarray(n_expert, dtype=np.int32)
    lim = ffi.new("spice_plan_limits *")
    lim.n_layers = len(n_expert)
    lim.n_expert = ffi.from_buffer("int32_t[]", experts)
    lim.max_expert = width
    mask = None
    if has_surrogate is not None:
        mask = np.ascontiguousarray(has_surrogate, dtype=np.uint8)
        lim.has_surrogate = ffi.from_buffer("uint8_t[]", mask)
    err = ffi.new("char[]", 512)
    status = lib.spice_plan_check(lim, call, err, 512)
    del keep, mask
    return None if status == 0 else ffi.string(err).decode(errors="replace")


def add_outcomes(actions: npt.ArrayLike, hit: npt.ArrayLike) -> Counters:
    """spice_counters_add_outcomes: each activation's outcome, from its action and
    whether its expert was resident as the call began."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    acts = np.ascontiguousarray(actions, dtype=np.int32).ravel()
    hits = np.ascontiguousarray(hit, dtype=np.uint8).ravel()
    if acts.shape != hits.shape:
        raise ValueError(f"{acts.size} actions but {hits.size} hit flags")
    c = ffi.new("spice_counters *")
    lib.spice_counters_add_outcomes(
        c, ffi.from_buffer("int32_t[]", acts), ffi.from_buffer("uint8_t[]", hits), acts.size
    )
    return Counters(**{name: int(getattr(c, name)) for name in _COUNTER_FIELDS})


def rule_router_logits(router: npt.ArrayLike, hidden: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The logits the rule's next-layer prefetch ranks when a call carries none from
    the graph (spice_rule_router_logits): router [n_expert, n_embd] in int16 and
    hidden rows [n, n_embd] in 15 bits, each row with its own scale. Returns
    [n, n_expert] float64."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    r = np.ascontiguousarray(router, dtype=np.float32)
    h = np.ascontiguousarray(np.atleast_2d(hidden), dtype=np.float32)
    if r.ndim != 2 or h.ndim != 2 or h.shape[1] != r.shape[1]:
        raise ValueError(f"shapes: router {r.shape}, hidden {h.shape}")
    out = np.zeros((h.shape[0], r.shape[0]), np.float64)
    status = lib.spice_rule_router_logits(
        r.shape[0],
        r.shape[1],
        ffi.from_buffer("float[]", r),
        h.shape[0],
        ffi.from_buffer("float[]", h),
        ffi.from_buffer("double[]", out, require_writable=True),
    )
    if status != 0:
        raise SpiceError(
            status, f"spice_rule_router_logits: {ffi.string(lib.spice_status_string(status)).decode()}"
        )
    return out


def surrogate_apply(
    a: npt.ArrayLike,
    b: npt.ArrayLike,
    alpha: float,
    hidden: npt.ArrayLike,
    weights: npt.ArrayLike,
    shared: npt.ArrayLike | None = None,
    out: npt.NDArray[np.float32] | None = None,
    n_threads: int = 1,
) -> npt.NDArray[np.float32]:
    """libspice's surrogate executor on plain arrays (spice_surrogate_apply):
    out[i] += weights[i] * (alpha * shared[i] + B @ (A @ hidden[i])), with A and
    B rounded to f16 as a loaded surrogate is and the work split as n_threads
    graph threads split it. Returns out (zeros when not given)."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    b32 = np.ascontiguousarray(b, dtype=np.float32)
    h = np.ascontiguousarray(hidden, dtype=np.float32)
    w = np.ascontiguousarray(weights, dtype=np.float32).ravel()
    rows, n_embd = h.shape
    rank = int(a32.shape[0])
    if a32.shape != (rank, n_embd) or b32.shape != (n_embd, rank) or w.shape != (rows,):
        raise ValueError(f"shapes: A {a32.shape}, B {b32.shape}, hidden {h.shape}, weights {w.shape}")
    sh = None if shared is None else np.ascontiguousarray(shared, dtype=np.float32)
    if sh is not None and sh.shape != h.shape:
        raise ValueError(f"shared has shape {sh.shape}; hidden has {h.shape}")
    result = np.zeros_like(h) if out is None else out
    if result.shape != h.shape or result.dtype != np.float32 or not result.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 array shaped like hidden")
    row_bytes = n_embd * 4
    status = lib.spice_surrogate_apply(
        n_embd,
        rank,
        float(alpha),
        ffi.from_buffer("float[]", a32) if rank else ffi.NULL,
        ffi.from_buffer("float[]", b32) if rank else ffi.NULL,
        rows,
        ffi.from_buffer("float[]", h),
        row_bytes,
        ffi.from_buffer("float[]", sh) if sh is not None else ffi.NULL,
        row_bytes,
        ffi.from_buffer("float[]", w),
        ffi.from_buffer("float[]", result, require_writable=True),
        row_bytes,
        n_threads,
    )
    if status != 0:
        raise SpiceError(
            status, f"spice_surrogate_apply: {ffi.string(lib.spice_status_string(status)).decode()}"
        )
    return result
