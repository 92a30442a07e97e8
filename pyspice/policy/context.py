"""What a policy may know about the model and the machine before the first call.

The engine (and the simulator) hand a `PolicyContext` to a policy's
`attach(ctx)` whenever it is (re)enabled: layer geometry, expert sizes, the
device budget, the target model's routers (for look-ahead policies) and the
measured cost profile. Plain data only; nothing native.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pyspice.policy.profile import CostProfile
from pyspice.units import slot_bytes as slot_bytes_of

F32 = npt.NDArray[np.float32]

RouterLoader = Callable[[int], "npt.NDArray[np.float32] | None"]


def _no_router(layer: int) -> npt.NDArray[np.float32] | None:
    return None


ErrorLoader = Callable[[int], "npt.NDArray[np.float32] | None"]


def _no_errors(layer: int) -> npt.NDArray[np.float32] | None:
    return None


class RoutePredictor(Protocol):
    """Predicted router logits of the next MoE layers from one layer's input: the
    sidecar's draft predictor (pyspice.policy.predictor.DraftPredictor) or the
    cross-layer router baseline (pyspice.policy.spice.lookahead.RouterLookahead)."""

    # hidden: the layer's input row(s); the ids-reading HistoryLookahead takes the call's ids
    def rollout_logits(self, layer: int, hidden: npt.NDArray[Any], depth: int) -> list[tuple[int, F32]]: ...


@runtime_checkable
class AffinePredictor(RoutePredictor, Protocol):
    """A RoutePredictor whose rollout to `depth` layers is one affine map of the input:
    logits = G h (+ offset). Both shipped predictors are; a rollout is then one product."""

    def affine_map(self, layer: int, depth: int) -> tuple[list[int], F32, F32 | None]:
        """(layers reached, G [len(layers) * n_expert, n_embd], offset or None)."""
        ...


@dataclass(frozen=True)
class PolicyContext:
    n_layers: int
    n_expert: tuple[int, ...]  # per layer; 0 for layers without routed experts
    n_expert_used: int  # top-k
    expert_bytes: tuple[int, ...]  # bytes of one expert, per layer
    budget_bytes: int | None  # device tier size; None: no device tier
    # router(layer) -> [n_expert, n_embd] weights of that layer's router (float32), or None
    router: RouterLoader = field(default=_no_router, compare=False)
    # the machine's cost profile (measured by `pyspice probe`, or simulated), if any
    profile: CostProfile | None = field(default=None, compare=False)
    # the sidecar's draft predictor, if the model has a sidecar
    predictor: RoutePredictor | None = field(default=None, compare=False)
    # surrogate_error(layer) -> held-out relative error per expert (inf: none), when loaded
    surrogate_error: ErrorLoader = field(default=_no_errors, compare=False)
    surrogates_loaded: bool = False
    reserved_bytes: int = 0  # device bytes held besides experts (surrogate matrices)
    # False on edge mode's disk tier: a host action on an absent expert reads it from
    # the file first (as long as a fetch), so fetching it is never worse
    host_weights_in_memory: bool = True
    # the tier's (GB/s, us per copy) where no profile says better (set for the disk tier)
    tier_bus: tuple[float, float] | None = None

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(il for il, n in enumerate(self.n_expert) if n > 0)

    @property
    def max_expert(self) -> int:
        return max(self.n_expert, default=0)

    @property
    def slot_bytes(self) -> int:
        """A device slot's bytes: the largest expert's. Every expert held takes that much
        of the budget, whatever its own size (spice_store_create)."""
        return slot_bytes_of(self.expert_bytes, self.n_expert)

    def rule_routers(self) -> tuple[F32 | None, ...] | None:
        """Every layer's router as a Rule's `routers` takes them (None for a dense layer
        or one the model lacks), read now so no hook call pays for opening the model
        file; None when no layer has one."""
        routers = tuple(self.router(il) if n > 0 else None for il, n in enumerate(self.n_expert))
        return routers if any(r is not None for r in routers) else None

    def next_moe_layer(self, layer: int) -> int | None:
        for il in range(layer + 1, self.n_layers):
            if self.n_expert[il] > 0:
                return il
        return None

    def bytes_vector(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.expert_bytes, dtype=np.int64)
