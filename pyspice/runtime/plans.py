"""Plans and rules into libspice's structs: a policy's actions and ids written into a hook
call, standalone spice_policy_calls and spice_rules, and spice_plan_check."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.policy.rule import Rule
from pyspice.runtime.loader import _Native

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


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
