"""The HookCall a policy reads, made from libspice's spice_policy_call: cached per layer
and buffers, so that a decode step pays for no new objects, and its fields copied into
memory Python owns on first access."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyspice.policy.base import HookCall, HookInputError, Policy
from pyspice.runtime.handle import RuntimeHandle

_MAX_CACHED_CALLS = 512  # HookCalls kept by _hook_call (a model has at most a few hundred layers)
# ... of calls of at most this many tokens: decode steps, which the cache is for. A prompt
# batch's buffers (its hidden rows: 295 KB a layer for 128 tokens of smolmoe-b) kept per
# layer were 8.7 MiB of an edge-mode SPICE row's peak RSS, to save an allocation per layer
# per prompt batch, against that layer's compute over the whole batch
_MAX_CACHED_ROWS = 8

# why a HookCall field is missing (HookCalls._field)
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


class HookCalls(RuntimeHandle):
    """The HookCalls of a Runtime's hook calls, and the cache that keeps them."""

    _policy: Policy | None  # the policy the hook calls (hook.py), named by a missing field's error

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        n = self._n
        # HookCalls by the bytes of the call's head (layer, sizes, array addresses, strides):
        # the graph reuses its buffers from one decode step to the next, so each layer's
        # call finds the views it had the step before and pays for no new objects
        self._calls: dict[bytes, HookCall] = {}
        self._call_head = int(n.ffi.offsetof("spice_policy_call", "actions"))
        self._buffer = n.ffi.buffer
        # HookCall fields (1 probs, 4 shared) the policy did not declare: reading one raises
        self._unrequested: frozenset[int] = frozenset()

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
