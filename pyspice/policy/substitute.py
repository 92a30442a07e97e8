"""LOSSY substitute policies, for measuring what surrogates cost in quality.

`SubstitutePolicy(resident, mode)` runs the experts in `resident` exactly
and replaces every other activation:

| mode        | the activation becomes                                     |
|-------------|------------------------------------------------------------|
| `surrogate` | its LoRE surrogate: alpha * shared(h) + B A h               |
| `shared`    | the shared expert's output alone (alpha = 1, no B A)        |
| `drop`      | nothing                                                     |

`shared` is executed as a rank-0 surrogate with alpha = 1 for every expert
(`SharedExpertOnly`), so it goes through the same executor as `surrogate`
and differs from it only by the low-rank term. On an architecture without a
shared expert it contributes nothing, like `drop`. What to load for a mode is
`SubstitutePolicy.surrogate_source(sidecar, n_embd)`:

    policy = SubstitutePolicy(resident, "shared")
    source = policy.surrogate_source(sidecar, n_embd)
    if source is not None:
        llm.set_surrogates(source)
    llm.set_policy(policy)

These are evaluation tools (`pyspice eval surrogate`), not product policies,
and are not registered under a `--policy` name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import ACTION_DEVICE, ACTION_DROP, ACTION_SURROGATE, HookCall, Plan, PolicyBase

Mode = Literal["surrogate", "shared", "drop"]
MODES: tuple[Mode, ...] = ("surrogate", "shared", "drop")


class SharedExpertOnly:
    """A sidecar-like source of rank-0 surrogates with alpha = 1 for every
    expert: "the shared expert instead of the routed one"."""

    def __init__(self, n_embd: int) -> None:
        self.n_embd = n_embd
        self._a = np.zeros((0, n_embd), dtype=np.float32)
        self._b = np.zeros((n_embd, 0), dtype=np.float32)

    def surrogate(
        self, layer: int, expert: int
    ) -> tuple[float, npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        return 1.0, self._a, self._b


class SubstitutePolicy(PolicyBase):
    """Experts in `resident` ((layer, expert) pairs) run exactly (device
    actions: resident on a device tier once fetched, on the host without
    one); every other activation is replaced as `mode` says. In `surrogate`
    mode, `available` (when given) lists the (layer, expert) pairs that have
    a surrogate: the others run exactly instead of failing the plan."""

    def __init__(
        self,
        resident: Iterable[tuple[int, int]],
        mode: Mode = "surrogate",
        available: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"substitute mode {mode!r}: choose one of {', '.join(MODES)}")
        self.mode: Mode = mode
        self.name = f"substitute-{mode} (lossy)"
        self.resident = frozenset((int(il), int(e)) for il, e in resident)
        self.available = None if available is None else frozenset((int(il), int(e)) for il, e in available)
        self._exact: dict[int, npt.NDArray[np.bool_]] = {}

    @property
    def lossless(self) -> bool:
        return False  # every mode replaces the non-resident experts

    def surrogate_source(self, sidecar: Any, n_embd: int) -> Any:
        """What `Llama.set_surrogates` needs for this mode: the sidecar
        (`surrogate`), rank-0 shared-expert stand-ins (`shared`), or None
        (`drop` needs nothing)."""
        if self.mode == "surrogate":
            if sidecar is None:
                raise ValueError("substitute mode 'surrogate' needs a sidecar (pyspice calibrate -m MODEL)")
            return sidecar
        if self.mode == "shared":
            return SharedExpertOnly(n_embd)
        return None

    def _exact_mask(self, layer: int, n_expert: int) -> npt.NDArray[np.bool_]:
        """Per expert of a layer: runs exactly (resident, or no surrogate to use)."""
        mask = self._exact.get(layer)
        if mask is None or mask.shape[0] != n_expert:
            mask = np.zeros(n_expert, dtype=np.bool_)
            for e in range(n_expert):
                key = (layer, e)
                mask[e] = key in self.resident or (
                    self.mode == "surrogate" and self.available is not None and key not in self.available
                )
            self._exact[layer] = mask
        return mask

    def decide(self, call: HookCall) -> Plan:
        exact = self._exact_mask(call.layer, call.n_expert)[call.ids]
        substitute = ACTION_DROP if self.mode == "drop" else ACTION_SURROGATE
        return Plan(actions=np.where(exact, ACTION_DEVICE, substitute).astype(np.int32))
