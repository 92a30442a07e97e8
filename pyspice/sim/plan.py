"""The engine's three plan rules, written once in Python, as libspice applies them.

- `validate_plan`: spice_plan_validate (native/src/spice-plan.c), after the
  marshalling pyspice.runtime does on the way there (Runtime._write_plan);
- `count_outcomes`: count_actions (native/src/spice-runtime.c);
- `begin_call` and `apply_plan`: the store's call snapshot and its one
  plan-application entry point with request_prefetches and
  evict_least_recent (spice_runtime_apply_store_plan in
  native/src/spice-runtime-store.c, becoming spice_store_begin_call /
  spice_store_apply_plan in spice-store-plan.c), on a `SimTier`.

The simulator applies every plan through them, the unit tests drive policies
through them (`PlanDriver`), and differential tests hold each to its C original,
so "the policy measured in simulation is the policy that ships" rests on one
copy of each rule. Timing stays with the caller: `apply_plan` calls back for
each copy the call waits for. Nothing here imports native code.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_DROP,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    HookCall,
    Plan,
)
from pyspice.policy.context import PolicyContext
from pyspice.policy.rule import Rule, declared_rule
from pyspice.sim.rule import RuleState, rule_plan
from pyspice.sim.tier import OK, PRIORITY_DEMAND, PRIORITY_PREFETCH, REFUSED_BUDGET, SimTier

Actions = npt.NDArray[np.int32]  # [n_tokens, n_expert_used] of ACTION_*
Ids = npt.NDArray[np.int32]  # [n_tokens, n_expert_used] selected experts
SurrogateTable = npt.NDArray[np.bool_]  # [n_layers, max_expert]: a surrogate is loaded there
Wait = Callable[[int], None]  # waits for one expert's copy of the call's layer

_N_ACTIONS = ACTION_DROP + 1  # SPICE_ACTION_COUNT_
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# ---- validation ------------------------------------------------------------------


class InvalidPlan(ValueError):
    """A plan the engine refuses (and runs the call exactly instead). The message
    names the first problem, worded as libspice words it."""


def surrogate_table(ctx: PolicyContext) -> SurrogateTable | None:
    """Which surrogates the context says are loaded: a finite held-out error
    (the context's "inf: none"). None when none are loaded, as for libspice
    without a sidecar."""
    if not ctx.surrogates_loaded:
        return None
    table = np.zeros((ctx.n_layers, ctx.max_expert), dtype=np.bool_)
    for il in ctx.moe_layers:
        errors = ctx.surrogate_error(il)
        if errors is not None:
            row = np.isfinite(np.asarray(errors, dtype=np.float64)[: ctx.max_expert])
            table[il, : row.size] = row
    return table


def validate_plan(
    plan: Plan,
    layer: int,
    ids: Ids,
    n_expert: Sequence[int],
    surrogates: SurrogateTable | None = None,
) -> Actions | None:
    """The plan's actions as int32 [n_tokens, n_expert_used] (None: the default plan)
    if the engine would accept `plan` for the call of `layer` selecting `ids`;
    raises InvalidPlan otherwise. `n_expert` is per layer, 0 for layers without
    routed experts; `surrogates` marks the loaded surrogates (None: none)."""
    # what Runtime._write_plan does before libspice sees the plan
    actions = None if plan.actions is None else _marshal_actions(plan.actions, layer, ids.shape)
    fetch = _marshal_ints(plan.fetch)
    prefetch = _marshal_ints(_flatten(plan.prefetch))
    evict = _marshal_ints(_flatten(plan.evict))
    evict_from = _marshal_ints(plan.evict_from)
    resume = _marshal_resume(plan.resume_layer)
    if plan.rule is not None and not isinstance(plan.rule, Rule):
        raise InvalidPlan(f"plan.rule must be a pyspice.policy.Rule, got {type(plan.rule).__name__}")
    # spice_plan_validate, check for check and in its order
    n_layers, max_expert = len(n_expert), max(n_expert, default=0)
    if actions is not None:
        _check_actions(actions, layer, ids, surrogates)
    _check_fetch(fetch, layer, n_expert[layer], max_expert)
    _check_evict_from(evict_from, layer, n_expert)
    _check_resume(resume, layer, n_expert)
    pair_cap = 2 * n_layers * max_expert  # ints: (layer, expert) pairs across all layers
    _check_pairs("prefetch", prefetch, n_expert, pair_cap)
    _check_pairs("evict", evict, n_expert, pair_cap)
    return actions


def _marshal_actions(actions: Any, layer: int, want: tuple[int, ...]) -> Actions:
    """_write_actions: any integer array-like of the call's shape, cast to int32."""
    arr = np.asarray(actions)
    if arr.shape != want:
        raise InvalidPlan(f"plan.actions has shape {arr.shape}; layer {layer} needs {want}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidPlan(f"plan.actions must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _flatten(pairs: Iterable[Any]) -> list[Any]:
    if not pairs:
        return []
    try:
        return list(chain.from_iterable(pairs))
    except TypeError as exc:
        raise InvalidPlan(f"plan pairs must be (layer, expert) tuples: {exc}") from None


def _marshal_ints(values: Iterable[Any]) -> list[int]:
    """_copy_ints: each value as a C int32 (int() of int-likes), the count kept whole."""
    if not values:
        return []
    try:
        ints = [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise InvalidPlan(f"plan ids must be integers: {exc}") from None
    if any(not _INT32_MIN <= v <= _INT32_MAX for v in ints):
        raise InvalidPlan("plan ids must fit in int32")
    return ints


def _marshal_resume(resume: Any) -> int:
    """spice_policy_call.resume_il is an int32 field: cffi takes integers only."""
    try:
        value = operator.index(resume)
    except TypeError:
        raise InvalidPlan(f"plan resume_layer must be an integer, got {type(resume).__name__}") from None
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise InvalidPlan("plan resume_layer must fit in int32")
    return value


def _check_actions(actions: Actions, layer: int, ids: Ids, surrogates: SurrogateTable | None) -> None:
    flat, picked = actions.ravel(), np.asarray(ids).ravel()
    if flat.size == 0 or (flat.min() >= 0 and flat.max() < ACTION_SURROGATE):
        return  # exact actions only: nothing more to look up
    used = actions.shape[1] if actions.ndim == 2 else 1
    unknown = (flat < 0) | (flat >= _N_ACTIONS)
    wants_surrogate = flat == ACTION_SURROGATE
    bad = unknown | (wants_surrogate & ~_has_surrogate(surrogates, layer, picked))
    if not bad.any():
        return
    i = int(np.argmax(bad))  # the first problem, as C's loop finds it
    t, k, a = i // used, i % used, int(flat[i])
    if unknown[i]:
        raise InvalidPlan(
            f"layer {layer}: plan action {i} (token {t}, slot {k}) is {a}, not a known action "
            "(0 device, 1 host, 2 surrogate, 3 drop)"
        )
    if surrogates is None or not surrogates.any():
        raise InvalidPlan(
            f"layer {layer}: plan action {i} asks for a surrogate, but no surrogates are loaded "
            "(calibrate the model and pass its sidecar)"
        )
    raise InvalidPlan(
        f"layer {layer}: plan action {i} (token {t}, slot {k}) asks for the surrogate of expert "
        f"{int(picked[i])}, which the loaded sidecar does not have"
    )


def _has_surrogate(surrogates: SurrogateTable | None, layer: int, experts: Ids) -> npt.NDArray[np.bool_]:
    """spice_runtime_surrogate(rt, layer, e) != NULL for each expert (out of the table: none)."""
    if surrogates is None or not 0 <= layer < surrogates.shape[0]:
        return np.zeros(experts.shape, dtype=np.bool_)
    inside = (experts >= 0) & (experts < surrogates.shape[1])
    found = np.zeros(experts.shape, dtype=np.bool_)
    found[inside] = surrogates[layer, experts[inside]]
    return found


def _check_fetch(fetch: list[int], layer: int, n_expert: int, cap: int) -> None:
    if len(fetch) > cap:
        raise InvalidPlan(f"layer {layer}: plan fetch list has {len(fetch)} entries; at most {cap} fit")
    for i, e in enumerate(fetch):
        if not 0 <= e < n_expert:
            raise InvalidPlan(f"layer {layer}: plan fetch[{i}] = {e} is not an expert id (0..{n_expert - 1})")


def _is_moe(n_expert: Sequence[int], il: int) -> bool:
    return 0 <= il < len(n_expert) and n_expert[il] > 0


def _check_evict_from(evict_from: list[int], layer: int, n_expert: Sequence[int]) -> None:
    cap = len(n_expert)
    if len(evict_from) > cap:
        raise InvalidPlan(f"layer {layer}: plan evict_from has {len(evict_from)} entries; at most {cap} fit")
    for i, il in enumerate(evict_from):
        if not _is_moe(n_expert, il):
            raise InvalidPlan(
                f"layer {layer}: plan evict_from[{i}] names layer {il}, which is not an MoE layer"
            )


def _check_resume(resume: int, layer: int, n_expert: Sequence[int]) -> None:
    if resume != -1 and not _is_moe(n_expert, resume):
        raise InvalidPlan(f"layer {layer}: plan resume_il = {resume} is neither -1 nor an MoE layer")


def _check_pairs(what: str, pairs: list[int], n_expert: Sequence[int], cap: int) -> None:
    """check_pairs: `pairs` are the flattened (layer, expert) ints."""
    if len(pairs) > cap:
        raise InvalidPlan(f"plan {what} has {len(pairs)} entries; at most {cap} fit")
    if len(pairs) % 2 != 0:
        raise InvalidPlan(f"plan {what} must be (layer, expert) pairs, got an odd count {len(pairs)}")
    for i in range(0, len(pairs), 2):
        il, e = pairs[i], pairs[i + 1]
        if not _is_moe(n_expert, il):
            raise InvalidPlan(f"plan {what}[{i // 2}] names layer {il}, which is not an MoE layer")
        if not 0 <= e < n_expert[il]:
            raise InvalidPlan(
                f"plan {what}[{i // 2}] names expert {e} of layer {il}, which has {n_expert[il]} experts"
            )


# ---- outcomes --------------------------------------------------------------------


@dataclass(frozen=True)
class Outcomes:
    """Activations by outcome, as the stats record counts them (docs/design.md section 11)."""

    hits: int = 0
    fetched: int = 0  # waited on a demand copy
    host: int = 0
    surrogate: int = 0
    dropped: int = 0

    @property
    def activations(self) -> int:
        return self.hits + self.misses

    @property
    def misses(self) -> int:
        """Every activation that was not a hit, whatever its outcome (stats.Counters.misses)."""
        return self.fetched + self.host + self.surrogate + self.dropped

    def __add__(self, other: Outcomes) -> Outcomes:
        return Outcomes(
            self.hits + other.hits,
            self.fetched + other.fetched,
            self.host + other.host,
            self.surrogate + other.surrogate,
            self.dropped + other.dropped,
        )


def count_outcomes(actions: npt.ArrayLike, hit: npt.ArrayLike) -> Outcomes:
    """count_actions: `hit` is whether each activation's expert was resident as the
    call began. Lossy actions are never hits; an exact one is a hit when its expert
    was resident, else a miss fetched (device) or run on the host (anything else)."""
    a, h = np.asarray(actions), np.asarray(hit, dtype=np.bool_)
    is_surrogate, is_dropped = a == ACTION_SURROGATE, a == ACTION_DROP
    hits = int(np.count_nonzero(h & ~(is_surrogate | is_dropped)))
    fetched = int(np.count_nonzero((a == ACTION_DEVICE) & ~h))
    surrogate, dropped = int(np.count_nonzero(is_surrogate)), int(np.count_nonzero(is_dropped))
    host = int(a.size) - hits - fetched - surrogate - dropped  # every other exact miss
    return Outcomes(hits, fetched, host, surrogate, dropped)


def default_actions(hit: npt.NDArray[np.bool_]) -> Actions:
    """The default plan, and every fallback: resident experts on the device, the rest on the host."""
    return np.where(hit, ACTION_DEVICE, ACTION_HOST).astype(np.int32)


# ---- application -----------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    actions: Actions  # the plan's, with device actions of experts that got no slot on the host
    waited: tuple[int, ...]  # the device experts the call waited for, in expert order


def wait_until_landed(tier: SimTier, layer: int) -> Wait:
    """A wait that costs nothing but the copy itself (spice_store_wait on the tier's
    clock): the clock moves to when the expert's copy lands, the wait is booked."""

    def wait(expert: int) -> None:
        tier.wait(layer, expert)

    return wait


def apply_plan(
    tier: SimTier, layer: int, ids: Ids, actions: Actions, plan: Plan, wait: Wait | None = None
) -> ApplyResult:
    """spice_runtime_apply_store_plan for a validated plan (`actions` from
    validate_plan or default_actions; `plan` gives the lists): pin the device
    experts the tier holds, evict, fetch, demand the device experts it lacks,
    prefetch, wait for every pinned device expert (`wait`, in expert order;
    default wait_until_landed), run the unpinned ones on the host, unpin."""
    n_expert = tier.n_expert[layer]
    # an id outside the layer names no slot (libspice drops those activations before this)
    need = sorted({e for e in ids[actions == ACTION_DEVICE].tolist() if 0 <= e < n_expert})
    # pinned first, so the plan's own evictions cannot take them away
    pinned = {e for e in need if tier.state(layer, e) != RESIDENCY_ABSENT and tier.pin(layer, e) == OK}
    # refused evictions (pinned, in flight) and refused requests (no room, queue full)
    # are not errors: the plan degrades to host execution
    for pl, pe in plan.evict:
        tier.evict(int(pl), int(pe))
    for e in plan.fetch:
        tier.request(layer, int(e), PRIORITY_DEMAND)
    for e in need:
        if e not in pinned and tier.request(layer, e, PRIORITY_DEMAND) == OK and tier.pin(layer, e) == OK:
            pinned.add(e)
    # prefetches queue behind the demand copies and use the bus while the call waits
    request_prefetches(tier, plan.prefetch, plan.evict_from)
    waited = tuple(e for e in need if e in pinned)
    do_wait = wait if wait is not None else wait_until_landed(tier, layer)
    for e in waited:
        do_wait(e)
    out = _to_host(ids, actions, [e for e in need if e not in pinned], n_expert)
    for e in waited:
        tier.unpin(layer, e)
    return ApplyResult(out, waited)


def request_prefetches(tier: SimTier, prefetch: Sequence[tuple[int, int]], evict_from: Sequence[int]) -> None:
    """The plan's prefetches in order. With `evict_from`, one that does not fit takes
    room from the layers listed before its own (the least recently selected resident
    expert of the first that has one, never pinned, never one the prefetch list
    names), and one that still finds no room drops the ones after it; without it a
    refused prefetch is skipped (its expert stays on the host)."""
    order = [int(il) for il in evict_from]
    if not order:
        for pl, pe in prefetch:
            tier.request(int(pl), int(pe), PRIORITY_PREFETCH)
        return
    rank: dict[int, int] = {}
    for i, il in enumerate(order):
        rank.setdefault(il, i)  # a layer listed twice counts where first listed
    kept = {(int(pl), int(pe)) for pl, pe in prefetch}
    next_from = 0  # the listed layers before it were found empty: they stay so this call
    for pl, pe in prefetch:
        il, e = int(pl), int(pe)
        status = tier.request(il, e, PRIORITY_PREFETCH)
        limit = rank.get(il, len(order))
        while status == REFUSED_BUDGET and next_from < limit:
            next_from = tier.evict_least_recent(order, next_from, limit, kept)
            if next_from < limit:
                status = tier.request(il, e, PRIORITY_PREFETCH)
        if status == REFUSED_BUDGET:
            return  # no room for it, nor for the prefetches after it


def _to_host(ids: Ids, actions: Actions, no_slot: Iterable[int], n_expert: int) -> Actions:
    """Device actions of experts that got no slot (or name none) become host actions."""
    out = actions.copy()
    for e in no_slot:
        out[(ids == e) & (out == ACTION_DEVICE)] = ACTION_HOST
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        out[(out == ACTION_DEVICE) & ((ids < 0) | (ids >= n_expert))] = ACTION_HOST
    return out


# ---- driving a policy ------------------------------------------------------------


def begin_call(tier: SimTier, layer: int, ids: Ids) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.bool_]]:
    """spice_store_begin_call: one poll (residency current as the call begins, copies
    in flight included), the selection noted for recency (evict_from), and which
    activations find their expert resident; with the residency a HookCall carries."""
    hit = tier.begin_call(layer, ids)
    return tier.states(), hit


@dataclass
class PlanDriver:
    """Drives a policy over hand-made calls the way the engine does, on `tier`: the
    call's residency as it begins, the selection noted for recency, the policy's
    plan validated (an invalid one raises: a test should see it) and applied, the
    outcomes counted. Copies take the tier's time; with zero latency and a huge
    bandwidth they land at once."""

    tier: SimTier
    policy: Any  # a Policy: decide(HookCall) -> Plan
    surrogates: SurrogateTable | None = None
    outcomes: Outcomes = field(default_factory=Outcomes)
    rule_state: RuleState | None = None  # a rule policy's, from its first call on

    def call(
        self,
        layer: int,
        ids: npt.ArrayLike,
        hidden: npt.NDArray[np.float32] | None = None,
        weights: npt.ArrayLike | None = None,
        n_embd: int = 8,
    ) -> Plan:
        """One hook call of `layer` selecting `ids` ([n_tokens, k], or one token's k)."""
        picked = np.atleast_2d(np.asarray(ids, dtype=np.int32))
        n_tokens, k = picked.shape
        n_expert = self.tier.n_expert[layer]
        residency, hit = begin_call(self.tier, layer, picked)
        hook = HookCall(
            layer,
            hidden if hidden is not None else np.zeros((n_tokens, n_embd), np.float32),
            np.full((n_tokens, n_expert), 1.0 / n_expert, np.float32),
            picked,
            np.asarray(weights, np.float32).reshape(picked.shape)
            if weights is not None
            else np.full(picked.shape, 1.0 / k, np.float32),
            None,
            residency,
        )
        rule = declared_rule(self.policy)
        if rule is not None:  # a policy that is its rule: the engine plans, nobody is called
            if self.rule_state is None:
                self.rule_state = RuleState(rule, self.tier.n_layers)
            w = np.asarray(hook.weights, np.float32)
            ruled, rule_made = rule_plan(self.tier, self.rule_state, layer, picked, w, hook.hidden)
            result = apply_plan(self.tier, layer, picked, ruled, rule_made)
            self.outcomes = self.outcomes + count_outcomes(result.actions, hit)
            return rule_made
        plan: Plan = self.policy.decide(hook)
        checked = validate_plan(plan, layer, picked, self.tier.n_expert, self.surrogates)
        actions = default_actions(hit) if checked is None else checked
        result = apply_plan(self.tier, layer, picked, actions, plan)
        self.outcomes = self.outcomes + count_outcomes(result.actions, hit)
        return plan

    # what the tests read

    @property
    def copied_bytes(self) -> int:
        return sum(k.bytes_h2d for k in self.tier.counters)

    @property
    def prefetch_used(self) -> int:
        return sum(k.prefetch_used for k in self.tier.counters)

    def resident(self, layer: int) -> set[int]:
        """The experts of `layer` the tier holds (resident or on their way)."""
        return {e for e in range(self.tier.n_expert[layer]) if self.tier.holds(layer, e)}


def instant_tier(n_expert: Sequence[int], expert_bytes: Sequence[int], budget_bytes: int) -> SimTier:
    """A tier whose copies land as they are issued (no latency, a bus too fast to
    take a nanosecond), for tests of what policies decide rather than of timing."""
    return SimTier(
        n_expert=tuple(n_expert),
        expert_bytes=tuple(expert_bytes),
        budget_bytes=budget_bytes,
        bandwidth_gbps=1e12,
        latency_us=0.0,
    )
