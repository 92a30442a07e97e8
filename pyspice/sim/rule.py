"""The per-activation rule's twin: the plan libspice's spice_store_rule_plan
(native/src/spice-store-rule.c) writes for a call no policy decides, on the
simulated tier, step for step (tests/native/test_rule_twin.py compares the
two on random calls). A policy that is only a rule (pyspice.policy.rule) runs
under the simulator through this, as it runs under the engine through C.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
    Plan,
)
from pyspice.policy.rule import (
    KEEP_DECAYED,
    KEEP_LAYER_LRU,
    KEEP_LRU,
    KEEP_NONE,
    MISS_COST,
    MISS_FETCH,
    Rule,
    choose_fetches,
    host_per_activation,
)
from pyspice.sim.tier import SimTier

Key = tuple[int, int]


@dataclass
class RuleState:
    """An installed rule and what it keeps between calls (spice_store_rule)."""

    rule: Rule
    n_layers: int
    capacity: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    calls: int = 0
    uses: dict[int, npt.NDArray[np.float64]] = field(default_factory=dict)  # KEEP_DECAYED: per layer
    routers_q: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]] = field(default_factory=dict)

    def router(self, layer: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
        """Layer's router as the rule keeps it (int16 rows and their scales), made once."""
        if layer not in self.routers_q:
            weights = self.rule.routers[layer] if self.rule.routers is not None else None
            if weights is None:
                return None
            self.routers_q[layer] = quantize_rows(weights, ROUTER_Q_LIMIT)
        return self.routers_q[layer]

    def note_uses(self, layer: int, n_expert: int, selected: set[int]) -> None:
        """KEEP_DECAYED: the layer's use counts decay once per call, then each expert
        the call selects counts one more (spice_store_rule.uses)."""
        counts = self.uses.setdefault(layer, np.zeros(n_expert, np.float64))
        counts *= self.rule.decay
        counts[sorted(selected)] += 1.0

    def __post_init__(self) -> None:
        self.capacity = list(self.rule.capacity) if self.rule.capacity is not None else [0] * self.n_layers
        self.misses = [0] * self.n_layers


def _copy_us(tier: SimTier, layer: int) -> float:
    return tier.latency_us + tier.expert_bytes[layer] / (tier.bandwidth_gbps * 1e3)


def _evictable(tier: SimTier, layer: int, expert: int) -> bool:
    return tier.state(layer, expert) in (RESIDENCY_RESIDENT, RESIDENCY_QUEUED)


def _fit_layer(
    tier: SimTier, state: RuleState, layer: int, incoming: int, keep: set[int], chosen: list[Key]
) -> None:
    """Layer `layer`'s held experts over its capacity, least recently selected first."""
    taken = set(chosen)
    held = sum(
        1
        for e in range(tier.n_expert[layer])
        if tier.state(layer, e) != RESIDENCY_ABSENT and (layer, e) not in taken
    )
    over = held + incoming - state.capacity[layer]
    while over > 0:
        victim = -1
        for e in range(tier.n_expert[layer]):
            if e in keep or (layer, e) in taken or not _evictable(tier, layer, e):
                continue
            if victim < 0 or tier.last_use.get((layer, e), 0) < tier.last_use.get((layer, victim), 0):
                victim = e
        if victim < 0:
            return
        chosen.append((layer, victim))
        taken.add((layer, victim))
        over -= 1


def _fit_pool(
    tier: SimTier, state: RuleState, layer: int, selected: set[int], need: int, chosen: list[Key]
) -> None:
    """One pooled cache until `need` bytes fit: least recently selected out first, or
    (KEEP_DECAYED) the lowest decayed use count; ties to the lower (layer, expert)."""
    if state.rule.keep == KEEP_DECAYED:

        def rank(key: Key) -> float:
            counts = state.uses.get(key[0])
            return float(counts[key[1]]) if counts is not None else 0.0
    else:

        def rank(key: Key) -> float:
            return tier.last_use.get(key, 0)

    used = tier.used_bytes
    if used + need <= tier.budget_bytes:
        return
    # nothing changes a rank or a state while victims are chosen, so one ordering of the
    # held experts (rank, then (layer, expert)) gives them in turn: the pass over every
    # expert of the model per victim that this replaces cost a real model's 1664 experts
    # 10 ms per call
    taken = set(chosen)
    candidates = sorted(
        (
            key
            for key in set(tier.resident) | set(tier.copies)
            if not (key[0] == layer and key[1] in selected) and key not in taken and _evictable(tier, *key)
        ),
        key=lambda key: (rank(key), key),
    )
    for victim in candidates:
        if used + need <= tier.budget_bytes:
            return
        chosen.append(victim)
        used -= tier.slot_bytes


def _resize(tier: SimTier, state: RuleState) -> None:
    moe = [il for il in range(tier.n_layers) if tier.n_expert[il]]
    total = sum((state.misses[il] + 1) * _copy_us(tier, il) for il in moe)
    for il in moe:
        share = tier.budget_bytes * ((state.misses[il] + 1) * _copy_us(tier, il)) / total
        n = min(share // tier.slot_bytes, tier.n_expert[il])
        state.capacity[il] = int(n) if n > 1 else 1
        state.misses[il] = 0


def _next_moe_layer(tier: SimTier, layer: int) -> int | None:
    return next((il for il in range(layer + 1, tier.n_layers) if tier.n_expert[il]), None)


_F32_MAX = np.float32(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # FLT_MIN
_ROUND = np.float32(12582912.0)  # 1.5 x 2^23: adding and taking it away rounds to nearest even
ROUTER_Q_LIMIT = 32767.0  # SPICE_ROUTER_Q_LIMIT, spice-store-rule.c
HIDDEN_Q_LIMIT = 16383.0  # SPICE_HIDDEN_Q_LIMIT


def quantize_rows(x: npt.ArrayLike, limit: float) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Each row to integers as libspice's quantize_row does, operation for operation in
    float32: scale = max |x| / limit over the finite values, q = x * (1 / scale)
    rounded to nearest even and clamped to +-limit, not finite as 0 (a row whose
    scale is subnormal, all 0). The rule keeps routers in int16 (ROUTER_Q_LIMIT)
    and scales each hidden row to 15 bits (HIDDEN_Q_LIMIT), so a logit is an exact
    integer sum times the two scales, the same in C and here."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    lim = np.float32(limit)
    a = np.abs(x)
    finite = a <= _F32_MAX
    amax = np.max(np.where(finite, a, np.float32(0)), axis=1, initial=np.float32(0))
    d = (amax / lim).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d >= _F32_TINY)  # a subnormal scale: all zeros
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.where(finite, x * inv[:, None], np.float32(0)).astype(np.float32)
        v = np.where(v < lim, v, lim)
        v = np.where(v > -lim, v, -lim)
        q = ((v + _ROUND) - _ROUND).astype(np.int64)
    return q, d


def router_logits(
    router_q: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]], hidden: npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """[tokens, experts] logits of a router as the rule keeps it
    (quantize_rows(router, ROUTER_Q_LIMIT))."""
    q, scale = router_q
    hq, h_scale = quantize_rows(hidden, HIDDEN_Q_LIMIT)
    dots = (hq @ q.T).astype(np.float64)
    return dots * scale.astype(np.float64)[None, :] * h_scale.astype(np.float64)[:, None]


def _predict(
    router_q: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]], hidden: npt.NDArray[np.float32], k: int
) -> set[int]:
    """Top-k experts per row of the next layer's router logits, ties to the lower id."""
    logits = router_logits(router_q, hidden)
    picked: set[int] = set()
    ids = np.arange(logits.shape[1])
    for row in logits:
        order = np.lexsort((ids, -row))
        picked.update(int(e) for e in order[:k])
    return picked


def _host_total(rule: Rule, n: int) -> float:
    return host_per_activation(rule, n) * n


def _device_total(rule: Rule, n: int) -> float:
    return rule.device_us * n


def _fixed_action(rule: Rule, whole: bool, state: int, has_surrogate: bool, weight: np.float32) -> int | None:
    """An activation's action when no cost decides it, else None (its expert's)."""
    if whole:
        return ACTION_DEVICE
    if state == RESIDENCY_RESIDENT:
        return rule.resident_action
    if rule.surrogate_weight > 0 and has_surrogate and weight < np.float32(rule.surrogate_weight):
        return ACTION_SURROGATE
    return ACTION_HOST if rule.resident_action == ACTION_HOST else None


def _in_flight_action(tier: SimTier, rule: Rule, layer: int, expert: int, n: int) -> int:
    if rule.miss == MISS_FETCH:
        return ACTION_DEVICE  # wait for it
    if rule.host_us <= 0 or not rule.overlap:
        return ACTION_HOST  # without overlap: the wait, then the device's work, the host's too
    ready = tier.ready_at(layer, expert)
    remaining_us = (ready - tier.now_ns) / 1e3 if ready > tier.now_ns else 0.0
    return ACTION_DEVICE if remaining_us + _device_total(rule, n) < _host_total(rule, n) else ACTION_HOST


def _miss_actions(
    tier: SimTier, rule: Rule, layer: int, count: dict[int, int], left: dict[int, int]
) -> dict[int, int]:
    """miss_actions in spice-store-rule.c: the action of each expert's activations left
    to the cost (`left`; `count`: all of the call's activations per expert)."""
    act: dict[int, int] = {}
    misses: list[int] = []
    for e in sorted(left):
        if tier.state(layer, e) != RESIDENCY_ABSENT:
            act[e] = _in_flight_action(tier, rule, layer, e, left[e])
        elif rule.miss == MISS_COST and rule.overlap:
            misses.append(e)
        else:
            act[e] = ACTION_DEVICE if rule.miss == MISS_FETCH else ACTION_HOST
    if misses:
        misses.sort(key=lambda e: -left[e])  # stable: ties to the lower id
        device_due = 0.0
        for e in sorted(count):
            st = tier.state(layer, e)
            if st == RESIDENCY_ABSENT:
                continue
            due = (
                rule.resident_action == ACTION_DEVICE
                if st == RESIDENCY_RESIDENT
                else act.get(e) == ACTION_DEVICE
            )
            if due:
                device_due += _device_total(rule, count[e])
        started = any(c.started for c in tier.copies.values())
        j = choose_fetches(
            _copy_us(tier, layer),
            [_host_total(rule, left[e]) for e in misses],
            [_device_total(rule, left[e]) for e in misses],
            device_due,
            _copy_us(tier, layer) if started else 0.0,
            rule.margin,
            rule.overlap,
        )
        for i, e in enumerate(misses):
            act[e] = ACTION_DEVICE if i < j else ACTION_HOST
    return act


def rule_plan(
    tier: SimTier,
    state: RuleState,
    layer: int,
    ids: npt.NDArray[np.int32],
    weights: npt.NDArray[np.float32],
    hidden: npt.NDArray[np.float32] | None = None,
) -> tuple[npt.NDArray[np.int32], Plan]:
    """The rule's actions and lists for a call of `layer` (after begin_call)."""
    rule = state.rule
    n_expert = tier.n_expert[layer]
    whole = layer in rule.whole_layers
    actions = np.full(ids.shape, ACTION_HOST, dtype=np.int32)
    selected: set[int] = set()
    incoming: set[int] = set()
    absent_selected = 0
    surrogates = rule.surrogate_set if rule.surrogate_weight > 0 else None
    count: dict[int, int] = {}
    left: dict[int, int] = {}  # activations per expert no fixed action took
    open_actions: list[tuple[int, int, int]] = []
    for (t, k), e_raw in np.ndenumerate(ids):
        e = int(e_raw)
        if not 0 <= e < n_expert:
            continue  # dropped by the runtime before anything acts
        st = tier.state(layer, e)
        if e not in selected:
            selected.add(e)
            absent_selected += st == RESIDENCY_ABSENT
        count[e] = count.get(e, 0) + 1
        has = surrogates is not None and bool(surrogates[layer, e])
        a = _fixed_action(rule, whole, st, has, np.float32(weights[t, k]))
        if a is None:
            left[e] = left.get(e, 0) + 1
            open_actions.append((t, k, e))
        else:
            actions[t, k] = a
    act = _miss_actions(tier, rule, layer, count, left) if left else {}
    for t, k, e in open_actions:
        actions[t, k] = act[e]
    incoming = {
        e
        for e in selected
        if tier.state(layer, e) == RESIDENCY_ABSENT and (whole or (e in left and act[e] == ACTION_DEVICE))
    }
    fetch = [e for e in range(n_expert) if tier.state(layer, e) == RESIDENCY_ABSENT] if whole else []
    evict: list[Key] = []
    if rule.keep == KEEP_NONE:
        evict = [
            (il, e)
            for il in range(tier.n_layers)
            for e in range(tier.n_expert[il])
            if not (il == layer and e in selected) and _evictable(tier, il, e)
        ]
    elif rule.keep in (KEEP_LRU, KEEP_DECAYED):
        if rule.keep == KEEP_DECAYED:
            state.note_uses(layer, n_expert, selected)
        _fit_pool(tier, state, layer, selected, len(incoming) * tier.slot_bytes, evict)
    elif rule.keep == KEEP_LAYER_LRU:
        state.calls += 1
        if rule.resize_every > 0 and state.calls % rule.resize_every == 0:
            _resize(tier, state)
        state.misses[layer] += absent_selected
        _fit_layer(tier, state, layer, len(incoming), selected, evict)
    prefetch: list[Key] = []
    evict_from: list[int] = []
    at_layer = rule.next_layers is None or layer in rule.next_layers
    nxt = _next_moe_layer(tier, layer) if rule.prefetch_next and at_layer else None
    router = state.router(nxt) if nxt is not None else None
    if nxt is not None and router is not None and hidden is not None:
        predicted = _predict(router, hidden, min(ids.shape[1], tier.n_expert[nxt]))
        limit = state.capacity[nxt] if rule.keep == KEEP_LAYER_LRU else tier.n_expert[nxt]
        wanted = [e for e in sorted(predicted) if tier.state(nxt, e) == RESIDENCY_ABSENT][:limit]
        if wanted and rule.keep == KEEP_LAYER_LRU:
            _fit_layer(tier, state, nxt, len(wanted), predicted, evict)
        prefetch = [(nxt, e) for e in wanted]
        if wanted and rule.next_room:
            evict_from = _past_layers(tier, layer)
    return actions, Plan(actions=actions, fetch=fetch, prefetch=prefetch, evict=evict, evict_from=evict_from)


def _past_layers(tier: SimTier, layer: int) -> list[int]:
    """next_room's evict_from: `layer`, then the MoE layers before it (wrapping), every
    MoE layer (room_from_past_layers in spice-store-rule.c)."""
    order = [il for il in range(layer, -1, -1) if tier.n_expert[il] > 0]
    order += [il for il in range(tier.n_layers - 1, layer, -1) if tier.n_expert[il] > 0]
    return order
