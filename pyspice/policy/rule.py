"""The per-activation rule a policy declares and the engine applies by itself
(spice_rule in native/include/spice.h; docs/design.md section 3a).

A policy that is fully described by a rule (the shipped baselines) is never
called per hook call: the engine plans every call from the rule, in C, and the
simulator from its twin (pyspice.sim.rule). Per activation, in order:

- resident                    -> `resident_action` (device, or host)
- a surrogate in `surrogate_set` and a gate weight below `surrogate_weight`
                              -> surrogate (lossy rules only)
- in flight                   -> wait (device) when `miss` is FETCH, or when its
                                 copy lands sooner than `host_us` (COST, or HOST
                                 with a cost table)
- absent                      -> host (HOST), a demand fetch (FETCH), or a fetch
                                 where that shortens the layer (COST, below)

The costs are weighed per expert of the call, for the n activations left to it
(a batch's tokens that picked it, less those substituted), host(n) being the
host's time per activation at n tokens (`host_points`, else `host_us`): a copy
in flight is waited for when its remaining time + n x device_us beats n x
host(n); COST fetches, of the absent misses, the most activations first, as
many as give the least layer time (`choose_fetches`: the bus copies them one
after another, the device runs each as it lands, the host the rest meanwhile),
where that beats all-host by `margin`. One copy is weighed against every token
of a batch that waits for it. Without `overlap` (the emulated device, whose work
is the host's time) waiting or fetching only adds a copy: every miss runs on
the host.

Room for demand fetches comes from `keep` (least recently selected out first,
pooled or per layer; or, DECAYED, the lowest use count decayed by `decay` at
every call of its layer: a frequency that forgets); a layer in `whole_layers` fetches
all its absent experts at its call and runs on the device; with
`prefetch_next` the next MoE layer's router, applied to the call's input,
names experts to prefetch (within that layer's capacity; only at the calls of
`next_layers` where given; with `next_room` taking room from the layers that
run again last first -- this call's, then the MoE layers before it, every MoE
layer with the next one last -- as a policy's Plan.evict_from would). The engine keeps the
routers in int16 with a scale per row and scales each input row to 15 bits
(half the bytes it would read per call in float32, and the same logits on
every build: pyspice.sim.rule.quantize_rows); a prefetch is a guess, and an
expert whose logit is that close to the top-k edge is as good a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import ACTION_DEVICE, ACTION_HOST
from pyspice.policy.context import PolicyContext

# spice_miss_rule
MISS_HOST = 0
MISS_FETCH = 1
MISS_COST = 2
# spice_keep_rule
KEEP_ALL = 0
KEEP_LRU = 1
KEEP_LAYER_LRU = 2
KEEP_NONE = 3
KEEP_DECAYED = 4
KEEP_RULES = (KEEP_ALL, KEEP_LRU, KEEP_LAYER_LRU, KEEP_NONE, KEEP_DECAYED)


@dataclass(frozen=True)
class Rule:
    resident_action: int = ACTION_DEVICE
    miss: int = MISS_HOST
    keep: int = KEEP_ALL
    host_us: float = 0.0  # cost table: host time per activation (0: unknown)
    device_us: float = 0.0  # device time per activation
    margin: float = 0.0  # COST: fetch only where that beats all-host by this share
    surrogate_weight: float = 0.0  # 0: no surrogates
    surrogate_set: npt.NDArray[np.bool_] | None = None  # [n_layers, max_expert]
    whole_layers: tuple[int, ...] = ()  # layers whose absent experts all come at their call
    capacity: tuple[int, ...] | None = None  # KEEP_LAYER_LRU: experts per layer
    resize_every: int = 0  # KEEP_LAYER_LRU: re-split capacities every this many calls (0: fixed)
    prefetch_next: bool = False
    next_layers: tuple[int, ...] | None = None  # the layers whose calls prefetch_next (None: every layer)
    next_room: bool = False  # prefetch_next may evict from the layers that run again last
    routers: tuple[npt.NDArray[np.float32] | None, ...] | None = None  # per layer [n_expert, n_embd]
    decay: float = 0.0  # KEEP_DECAYED: a call of a layer multiplies its use counts by this, in (0, 1]
    # host(n): (tokens, host µs per activation) ascending by tokens, linear between and flat
    # beyond (CostModel.host_points); () = host_us at any token count
    host_points: tuple[tuple[int, float], ...] = ()
    overlap: bool = False  # the device runs beside the host (a GPU), not on its time (emulated)

    def __post_init__(self) -> None:
        if self.resident_action not in (ACTION_DEVICE, ACTION_HOST):
            raise ValueError(f"rule: resident_action must be device or host, not {self.resident_action}")
        if self.miss not in (MISS_HOST, MISS_FETCH, MISS_COST):
            raise ValueError(f"rule: unknown miss rule {self.miss}")
        if self.keep not in KEEP_RULES:
            raise ValueError(f"rule: unknown keep rule {self.keep}")
        if self.keep == KEEP_LAYER_LRU and self.capacity is None:
            raise ValueError("rule: KEEP_LAYER_LRU needs a capacity per layer")
        if self.keep == KEEP_DECAYED and not 0.0 < self.decay <= 1.0:
            raise ValueError(f"rule: KEEP_DECAYED needs a decay in (0, 1], not {self.decay}")
        if self.prefetch_next and self.routers is None:
            raise ValueError("rule: prefetch_next needs the routers")
        if self.next_room and (not self.prefetch_next or self.keep == KEEP_LAYER_LRU):
            raise ValueError("rule: next_room needs prefetch_next (LAYER_LRU makes room by its capacities)")
        if not self.surrogate_weight >= 0 or self.resize_every < 0:
            raise ValueError("rule: surrogate_weight and resize_every must be non-negative")
        check_host_points(self.host_points)


MAX_HOST_POINTS = 16  # SPICE_RULE_MAX_HOST_POINTS


def check_host_points(points: tuple[tuple[int, float], ...]) -> None:
    """What libspice accepts as host(n)'s points (spice_rule.host_point_*)."""
    if len(points) > MAX_HOST_POINTS:
        raise ValueError(f"rule: at most {MAX_HOST_POINTS} host_points, not {len(points)}")
    last = 0
    for tokens, us in points:
        if int(tokens) <= last or not 0.0 < float(us) < float("inf"):
            raise ValueError(
                f"rule: host_points must be (tokens, µs per activation) pairs, tokens positive and "
                f"ascending, times finite and positive, not {points!r}"
            )
        last = int(tokens)


def choose_fetches(
    copy_us: float,
    host_us: list[float],
    device_us: list[float],
    device_due: float,
    bus_ahead_us: float,
    margin: float,
    overlap: bool,
) -> int:
    """How many of a call's absent misses -- host_us and device_us: each one's time for all
    its activations there, the most activations first -- are fetched rather than run on
    the host: the count with the least layer time, and only if it beats all-host by
    `margin` (paper section 4.3). The bus copies them one after another behind
    `bus_ahead_us`, the device runs each as it lands after `device_due`, and the host
    runs the rest meanwhile. Without `overlap` the device's work is the host's time too,
    so a fetch only adds its copy: none. The rule's choice in libspice
    (spice-store-rule.c) is this, step for step."""
    if not overlap:
        return 0
    host_left = 0.0
    for h in host_us:  # in order, as C adds them (sum() compensates from Python 3.12 on)
        host_left += h
    all_host = max(host_left, device_due)
    best_j, best_t = 0, all_host
    device = device_due  # when the device finishes the fetched ones
    for j in range(1, len(host_us) + 1):
        host_left -= host_us[j - 1]
        device = max(device, bus_ahead_us + copy_us * j) + device_us[j - 1]
        t = max(host_left, device)
        if t < best_t:
            best_j, best_t = j, t
    return best_j if best_j and best_t <= all_host * (1.0 - margin) else 0


def per_activation(points: tuple[tuple[int, float], ...], n_tokens: int) -> float:
    """One activation's time where one expert runs n_tokens tokens, from (tokens, µs per
    activation) points ascending by tokens (at least one): linear between them, flat
    beyond either end. CostModel.host_us and the rule's host(n) -- here and in
    spice-store-rule.c's host_per_activation, the same arithmetic -- are this."""
    if n_tokens <= points[0][0]:
        return points[0][1]
    i = 1
    while i < len(points) and points[i][0] < n_tokens:
        i += 1
    if i == len(points):
        return points[-1][1]
    (t0, c0), (t1, c1) = points[i - 1], points[i]
    return c0 + (c1 - c0) * (n_tokens - t0) / (t1 - t0)


def host_per_activation(rule: Rule, n_tokens: int) -> float:
    """host(n) of the rule: its points interpolated, or host_us without them."""
    return per_activation(rule.host_points, n_tokens) if rule.host_points else rule.host_us


DEFAULT_RULE = Rule()  # resident on the device, misses on the host, keep everything


@runtime_checkable
class RulePolicy(Protocol):
    """A policy that is its rule: attached once, then never called per hook call."""

    @property
    def name(self) -> str: ...

    @property
    def lossless(self) -> bool: ...

    def attach(self, ctx: PolicyContext) -> None: ...

    def rule(self) -> Rule: ...


class RulePolicyBase:
    """Defaults of a RulePolicy: lossless, nothing to learn at attach, the default rule."""

    name = "rule"

    @property
    def lossless(self) -> bool:
        return True

    def attach(self, ctx: PolicyContext) -> None:
        pass

    def rule(self) -> Rule:
        return DEFAULT_RULE


def declared_rule(policy: object) -> Rule | None:
    """The rule of a policy that is only a rule (no per-call `decide`), else None."""
    if hasattr(policy, "decide") or not callable(getattr(policy, "rule", None)):
        return None
    rule = policy.rule()  # type: ignore[attr-defined]
    if not isinstance(rule, Rule):
        raise TypeError(
            f"policy {getattr(policy, 'name', policy)!r}: rule() must return a pyspice.policy.Rule"
        )
    return rule
