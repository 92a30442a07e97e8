"""The data a policy sees and returns (DESIGN section 6)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

# Actions per (token, selected expert). The values are the C API's
# (spice_action in native/include/spice.h); a native test checks they agree.
ACTION_DEVICE = 0  # exact, expert resident in the device tier
ACTION_HOST = 1  # exact, on the host weights
ACTION_SURROGATE = 2  # lossy: low-rank surrogate
ACTION_DROP = 3  # lossy: contributes nothing (ablations, negative controls)

ACTION_NAMES = {
    ACTION_DEVICE: "device",
    ACTION_HOST: "host",
    ACTION_SURROGATE: "surrogate",
    ACTION_DROP: "drop",
}


@dataclass(slots=True)
class HookCall:
    """One MoE layer's routed-expert work, as a policy sees it.

    The arrays are read-only views into the running graph, valid only during
    `Policy.decide`; a policy that keeps data must copy it.
    """

    layer: int
    hidden: npt.NDArray[np.float32]  # [n_tokens, n_embd] MoE input
    probs: npt.NDArray[np.float32]  # [n_tokens, n_expert] router probabilities
    ids: npt.NDArray[np.int32]  # [n_tokens, n_expert_used] selected experts
    weights: npt.NDArray[np.float32]  # [n_tokens, n_expert_used] gate weights
    shared: npt.NDArray[np.float32] | None  # [n_tokens, n_embd] shared expert before its gate

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_expert_used(self) -> int:
        return int(self.ids.shape[1])

    @property
    def n_expert(self) -> int:
        return int(self.probs.shape[1])


@dataclass
class Plan:
    """What to do with one hook call.

    `actions` is [n_tokens, n_expert_used] of ACTION_* values, or None for
    "every activation exact on the device tier". `fetch` are this layer's
    experts to copy now (demand); `prefetch` and `evict` are (layer, expert)
    pairs for the low-priority queue and for experts that may leave.
    """

    actions: npt.ArrayLike | None = None
    fetch: Sequence[int] = ()
    prefetch: Sequence[tuple[int, int]] = field(default_factory=tuple)
    evict: Sequence[tuple[int, int]] = field(default_factory=tuple)


class Policy(Protocol):
    """A decision-maker for hook calls. `name` is what `--policy` accepts."""

    name: str

    def decide(self, call: HookCall) -> Plan: ...
