"""Runtime: libspice attached to one llama_context, and the hook callback that hands a
Python policy each MoE layer's HookCall and writes its plan back."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.interrupts import SigintGuard
from pyspice.policy.base import HookCall, HookInputError, Plan, Policy, policy_reads, policy_reads_next_logits
from pyspice.policy.rule import Rule
from pyspice.runtime.constants import _COUNTER_FIELDS
from pyspice.runtime.errors import IncompatibleModelError, SpiceError
from pyspice.runtime.loader import _Native
from pyspice.runtime.plans import _copy_ints, _rule_to_c, _write_actions
from pyspice.runtime.store import AsyncParams, StoreParams
from pyspice.stats import Counters

_INT32 = np.dtype(np.int32)
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

    # Failure rules (docs/design.md section 6): a policy's `Exception` or an invalid plan
    # runs that call exactly and is reported once; `KeyboardInterrupt` asks the
    # runtime to abort the running llama_decode and is re-raised by the API layer.
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
