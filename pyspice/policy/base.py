"""The data a policy sees and returns (docs/design.md section 6)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pyspice.policy.context import PolicyContext

# Actions per (token, selected expert). The values are the C API's
# (spice_action in native/include/spice.h); a native test checks they agree.
ACTION_DEVICE = 0  # exact, expert resident in the device tier
ACTION_HOST = 1  # exact, on the host weights
ACTION_SURROGATE = 2  # lossy: low-rank surrogate
ACTION_DROP = 3  # lossy: contributes nothing (ablations, negative controls)

# Residency of an expert on the device tier (spice_residency in spice.h).
RESIDENCY_ABSENT = 0
RESIDENCY_QUEUED = 1  # copy waiting for the bus
RESIDENCY_COPYING = 2  # copy in flight
RESIDENCY_RESIDENT = 3


ACTION_NAMES = {
    ACTION_DEVICE: "device",
    ACTION_HOST: "host",
    ACTION_SURROGATE: "surrogate",
    ACTION_DROP: "drop",
}


_UNSET: Any = object()
_N_ARRAYS = 7  # HookCall's arrays, by index: hidden, probs, ids, weights, shared, residency, next_logits


class HookInputError(RuntimeError):
    """A policy read a HookCall input it did not declare (`reads_probs`, `reads_shared`):
    the graph did not hand it to the hook, so there is nothing to read."""


class HookCall:
    """One MoE layer's routed-expert work, as a policy sees it.

    hidden  [n_tokens, n_embd]          MoE input hidden states
    probs   [n_tokens, n_expert]        router probabilities
    ids     [n_tokens, n_expert_used]   selected experts
    weights [n_tokens, n_expert_used]   their gate weights
    shared  [n_tokens, n_embd] or None  shared-expert output before its gate
            (None: the architecture has no shared expert)
    residency [n_layers, max_expert] or None  RESIDENCY_* of every expert on the
            device tier when the call began (None: no device tier)
    next_logits [n_tokens, n_expert of the next MoE layer] or None  that layer's
            router logits on `hidden`, computed in llama.cpp's graph (on the GPU
            where the model runs there): a one-layer look-ahead at the cost of a
            few floats per token. None where there is no next MoE layer, under
            asynchronous planning, and in the simulator

    Under the engine, `probs`, `shared` and `next_logits` exist only for a policy
    that declares it reads them (`reads_probs`, `reads_shared`,
    `reads_next_logits` = True; see Policy): the
    graph hands the hook one packed input per layer, and on a GPU build each
    extra input is copied to the host at every layer. Reading one that was not
    declared raises HookInputError.

    Under the engine the arrays can be read only during `Policy.decide`: reading
    one afterwards raises RuntimeError. Each is read-only, filled on first
    access in a call (a policy pays only for what it reads), and owned by
    Python, not by the graph: an array taken during a call stays memory-safe
    after the call and after `Llama.close()`, but its contents are unspecified
    then (a later call of the same layer refills it). A policy that keeps data
    must copy it. The simulator and tests pass plain arrays, readable any time.
    """

    __slots__ = ("_arrays", "_fetch", "_live", "layer", "n_expert", "n_expert_used", "n_tokens")

    def __init__(
        self,
        layer: int,
        hidden: npt.NDArray[np.float32],
        probs: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int32],
        weights: npt.NDArray[np.float32],
        shared: npt.NDArray[np.float32] | None = None,
        residency: npt.NDArray[np.int8] | None = None,
        next_logits: npt.NDArray[np.float32] | None = None,
    ) -> None:
        self.layer = layer
        self.n_tokens = int(ids.shape[0])
        self.n_expert_used = int(ids.shape[1])
        self.n_expert = int(probs.shape[1])
        self._arrays: list[Any] = [hidden, probs, ids, weights, shared, residency, next_logits]
        self._fetch: Callable[[int], Any] = self._arrays.__getitem__  # every array is set already
        self._live = True  # plain arrays: readable at any time

    @classmethod
    def lazy(
        cls, layer: int, n_tokens: int, n_expert: int, n_expert_used: int, fetch: Callable[[int], Any]
    ) -> HookCall:
        """A call whose arrays come from fetch(i) (0 hidden, 1 probs, 2 ids, 3 weights, 4 shared,
        5 residency, 6 next_logits) on first access."""
        call = cls.__new__(cls)
        call.layer = layer
        call.n_tokens = n_tokens
        call.n_expert = n_expert
        call.n_expert_used = n_expert_used
        call._arrays = [_UNSET] * _N_ARRAYS
        call._fetch = fetch
        call._live = False  # readable only between open() and close()
        return call

    def open(self) -> None:
        """Start a call of a lazy HookCall: its arrays are refetched on first access."""
        self._arrays = [_UNSET] * _N_ARRAYS
        self._live = True

    def close(self) -> None:
        """End the call: reading an array raises until the next open()."""
        self._live = False

    def _get(self, i: int) -> Any:
        if not self._live:
            raise RuntimeError(
                f"HookCall of layer {self.layer} read after Policy.decide returned: its arrays are "
                "valid only during the call; copy what you keep (np.array(call.hidden))"
            )
        value = self._arrays[i]
        if value is _UNSET:
            value = self._arrays[i] = self._fetch(i)
        return value

    @property
    def hidden(self) -> npt.NDArray[np.float32]:
        return self._get(0)  # type: ignore[no-any-return]

    @property
    def probs(self) -> npt.NDArray[np.float32]:
        return self._get(1)  # type: ignore[no-any-return]

    @property
    def ids(self) -> npt.NDArray[np.int32]:
        return self._get(2)  # type: ignore[no-any-return]

    @property
    def weights(self) -> npt.NDArray[np.float32]:
        return self._get(3)  # type: ignore[no-any-return]

    @property
    def shared(self) -> npt.NDArray[np.float32] | None:
        return self._get(4)  # type: ignore[no-any-return]

    @property
    def residency(self) -> npt.NDArray[np.int8] | None:
        return self._get(5)  # type: ignore[no-any-return]

    @property
    def next_logits(self) -> npt.NDArray[np.float32] | None:
        return self._get(6)  # type: ignore[no-any-return]


@dataclass
class Plan:
    """What to do with one hook call.

    `actions` is [n_tokens, n_expert_used] of ACTION_* values, or None for the
    default: activations of resident experts on the device, the rest on the
    host (both exact). A device action on an absent expert fetches it on
    demand; one that cannot get a slot runs on the host. `fetch` are this layer's
    experts to copy now (demand); `prefetch` and `evict` are (layer, expert)
    pairs for the low-priority queue and for experts that may leave.

    `evict_from` lists MoE layers a prefetch may take room from, most evictable
    first: when a prefetch does not fit the budget, the engine evicts, from the
    first of the layers listed before the prefetch's own that has one, the least
    recently selected resident expert -- never one this call runs on the device
    nor one named in `prefetch` (a resident expert listed there is kept, not
    copied) -- and tries again; a prefetch that still finds no room is dropped,
    with the prefetches after it. So a policy names where victims may come from
    and in what order, and the engine, which sees every call, applies recency.

    `resume_layer` (-1: ask again at the next call) lets a policy decide the calls
    up to a later MoE layer in advance: the engine may then answer the following
    one-token (decode) calls with the default plan without calling `decide`, until
    the call of `resume_layer` (a call of more tokens always asks). A permission,
    not a promise: an engine may still call, so `decide` must give the same
    answer there.

    `rule` (None: keep it) replaces the per-activation rule the engine plans the
    calls no policy decides by -- from the next call on when the policy runs on the
    hook's thread, from the call that applies the plan when it plans asynchronously.
    Return the same Rule object to keep it: the engine installs a rule only when it
    is a different object.
    """

    actions: npt.ArrayLike | None = None
    fetch: Sequence[int] = ()
    prefetch: Sequence[tuple[int, int]] = field(default_factory=tuple)
    evict: Sequence[tuple[int, int]] = field(default_factory=tuple)
    evict_from: Sequence[int] = ()
    resume_layer: int = -1
    rule: object | None = None  # a pyspice.policy.Rule (rule.py builds on this module)


class Policy(Protocol):
    """A decision-maker for hook calls.

    name      what `--policy` accepts, and what stats records call it
    lossless  never substitutes nor drops: the engine loads the sidecar's
              surrogates only for a policy that is not lossless
    attach    called with the PolicyContext each time the policy is enabled,
              before its first call
    decide    the plan for one hook call

    Optional attributes (False when absent): `reads_probs`, `reads_shared` and
    `reads_next_logits` declare that decide reads HookCall.probs /
    HookCall.shared / HookCall.next_logits; only then does the hook receive
    them (policy_reads, policy_reads_next_logits).

    Subclass PolicyBase for the defaults (lossless, nothing to attach). An
    object with only `name` and `decide` is accepted too (a user's policy
    written against the minimal interface): `is_lossless` and `attach_policy`
    give it the same defaults.
    """

    @property
    def name(self) -> str: ...

    @property
    def lossless(self) -> bool: ...

    def attach(self, ctx: PolicyContext) -> None: ...

    def decide(self, call: HookCall) -> Plan: ...


class PolicyBase:
    """The defaults of the Policy protocol: lossless, nothing to learn at attach, and
    no optional inputs read (reads_probs, reads_shared, reads_next_logits)."""

    name = "policy"
    reads_probs: bool = False
    reads_shared: bool = False
    reads_next_logits: bool = False

    @property
    def lossless(self) -> bool:
        return True

    def attach(self, ctx: PolicyContext) -> None:
        pass

    def decide(self, call: HookCall) -> Plan:
        return Plan()


def is_lossless(policy: object) -> bool:
    """`policy.lossless`, True for an object that does not say (the minimal interface)."""
    return bool(getattr(policy, "lossless", True))


def surrogate_limit(policy: object) -> float | None:
    """`policy.surrogate_limit`: the held-out surrogate error above which a lossy policy
    never substitutes, so the engine loads only the surrogates within it; None (also for
    an object that does not say): every surrogate the sidecar has."""
    limit = getattr(policy, "surrogate_limit", None)
    return None if limit is None else float(limit)


def preloads_tier(policy: object) -> bool:
    """`policy.preloads_tier`, read once the policy is attached: whether the tier starts
    filled, in layer order as far as the budget goes (spice_runtime_preload, as `exact`
    starts), rather than empty; False for an object that does not say."""
    return bool(getattr(policy, "preloads_tier", False))


SLOT_PRECISIONS = ("exact", "4bit", "5bit")


def slot_precision(policy: object) -> str:
    """`policy.slot_precision`: what the device tier's slots hold while it runs, "exact"
    (also for an object that does not say), "4bit" or "5bit" (lossy low-precision copies
    of the experts, libspice's SPICE_SLOT_4BIT/_5BIT), which a lossless policy may not ask
    for."""
    value = str(getattr(policy, "slot_precision", "exact"))
    name = getattr(policy, "name", type(policy).__name__)
    if value not in SLOT_PRECISIONS:
        choices = ", ".join(SLOT_PRECISIONS)
        raise ValueError(f"policy {name!r}: slot_precision {value!r} is not one of {choices}")
    if value != "exact" and is_lossless(policy):
        raise ValueError(
            f"policy {name!r} says it is lossless but asks for {value} slots, which are lossy: "
            "a lossless policy keeps exact slots (or make its `lossless` False)"
        )
    return value


def policy_reads(policy: object) -> tuple[bool, bool]:
    """(probs, shared): whether `policy` reads HookCall.probs and HookCall.shared, by its
    `reads_probs` / `reads_shared` attributes (False for one that does not say)."""
    return bool(getattr(policy, "reads_probs", False)), bool(getattr(policy, "reads_shared", False))


def policy_reads_next_logits(policy: object) -> bool:
    """Whether `policy` reads HookCall.next_logits (its `reads_next_logits`; False when
    it does not say)."""
    return bool(getattr(policy, "reads_next_logits", False))


def attach_policy(policy: object, ctx: PolicyContext) -> None:
    """`policy.attach(ctx)` where the policy defines it (the minimal interface does not)."""
    attach = getattr(policy, "attach", None)
    if attach is not None:
        attach(ctx)
