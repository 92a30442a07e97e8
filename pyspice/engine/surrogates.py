"""LoRE surrogates in the runtime: loading them, and cutting their rank to a budget share.

Surrogates are f16 host copies computed on the CPU (libspice has no device
path for them); their bytes are charged to the device budget so that a lossy
policy's experts and surrogates together stay within what the tier was given.
A lossy level loads only the surrogates within its error limit (the only ones
it may substitute): on the built-in models that is a few percent of them, and
loading all of them took 15-23% of the tier's expert slots for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pyspice.formats.sidecar import Sidecar, TruncatedSurrogates
from pyspice.runtime import Runtime, SpiceError, native

# Lossy policies get at most this share of the device budget for their
# surrogates (the rank is cut to fit); the rest stays for experts.
SURROGATE_BUDGET_SHARE = 0.25

F32 = npt.NDArray[np.float32]


class SurrogateSource(Protocol):
    """Anything that hands out (alpha, A [rank, n_embd], B [n_embd, rank]) per expert."""

    def surrogate(self, layer: int, expert: int) -> tuple[float, F32, F32] | None: ...


@dataclass(frozen=True)
class SurrogateSet:
    """The loaded LoRE surrogates: how many (layer, expert) pairs, and the budget bytes they take."""

    count: int
    device_bytes: int  # charged to the device budget (the f16 matrices themselves are in host memory)


def load_surrogates(runtime: Runtime, source: SurrogateSource) -> SurrogateSet:
    """Replace the runtime's surrogates by `source`'s. Over budget: nothing stays
    loaded and ValueError says by how much."""
    runtime.clear_surrogates()
    try:
        for info in runtime.layers():
            if not info.is_moe:
                continue
            for e in range(info.n_expert):
                entry = source.surrogate(info.il, e)
                if entry is None:
                    continue
                alpha, a, b = entry
                if np.shape(a)[-1:] != (info.n_embd,):
                    raise ValueError(
                        f"surrogate ({info.il}, {e}): A has shape {np.shape(a)}; this model needs "
                        f"[rank, {info.n_embd}] (a sidecar for another model?)"
                    )
                runtime.set_surrogate(info.il, e, float(alpha), a, b)
    except SpiceError as exc:
        runtime.clear_surrogates()
        if exc.status == native().SPICE_ERR_BUDGET:
            raise ValueError(
                f"the surrogates do not fit the device budget: {exc}; give a larger "
                "--device-budget or a lower rank"
            ) from exc
        raise
    except Exception:
        runtime.clear_surrogates()
        raise
    return loaded_surrogates(runtime)


def loaded_surrogates(runtime: Runtime) -> SurrogateSet:
    return SurrogateSet(count=runtime.n_surrogates(), device_bytes=runtime.surrogate_bytes())


class TrustedSurrogates:
    """The surrogates of `source` whose held-out error in `sidecar` is at most `limit`:
    the only ones a lossy level with that error limit may substitute, so the only ones
    worth device bytes (the others would take slots from experts for nothing)."""

    def __init__(self, source: SurrogateSource, sidecar: Sidecar, limit: float) -> None:
        self.source = source
        self.sidecar = sidecar
        self.limit = float(limit)

    def surrogate(self, layer: int, expert: int) -> tuple[float, F32, F32] | None:
        if not trusted(self.sidecar, layer, expert, self.limit):
            return None
        return self.source.surrogate(layer, expert)


def trusted(sidecar: Sidecar, layer: int, expert: int, limit: float | None) -> bool:
    """Whether (layer, expert)'s surrogate is within `limit` (None: any fitted one)."""
    if limit is None:
        return True
    s = sidecar.data.surrogates.get(layer)
    return s is not None and 0 <= expert < s.error.shape[0] and bool(s.error[expert] <= limit)


def budget_rank(sidecar: Sidecar, budget_bytes: int, limit: float | None = None) -> int | None:
    """The rank that keeps the sidecar's surrogates (those within error `limit`; None:
    all) within SURROGATE_BUDGET_SHARE of `budget_bytes`, or None when they fit as stored."""
    data = sidecar.data
    per_rank = 2 * data.n_embd * 2  # A row + B column, f16
    count = stored = 0
    for il, s in data.surrogates.items():
        for e in np.flatnonzero(s.rank > 0).tolist():
            if trusted(sidecar, il, e, limit):
                count += 1
                stored += int(s.rank[e]) * per_rank + 4  # and alpha
    if limit is None:
        stored = sidecar.surrogate_bytes()
    cap = SURROGATE_BUDGET_SHARE * budget_bytes
    if count == 0 or stored <= cap:
        return None
    return max(1, int(cap // (count * per_rank)))


def within_budget(
    sidecar: Sidecar, budget_bytes: int | None, limit: float | None = None
) -> tuple[SurrogateSource, int | None]:
    """The sidecar's surrogates within error `limit` (None: all of them) for a tier of
    `budget_bytes` (None: no tier), and the rank they were cut to (None: not cut)."""
    rank = budget_rank(sidecar, budget_bytes, limit) if budget_bytes is not None else None
    source: SurrogateSource = sidecar if rank is None else TruncatedSurrogates(sidecar, rank)
    if limit is not None:
        source = TrustedSurrogates(source, sidecar, limit)
    return source, rank


def surrogate_errors(sidecar: Sidecar, layer: int) -> F32 | None:
    """Held-out relative error of each of a layer's surrogates (inf where none is fitted)."""
    listed = sidecar.surrogate_error.get(layer)
    if listed is None:
        return None
    errors = np.nan_to_num(np.asarray(listed, dtype=np.float32), nan=np.inf)
    for e in range(errors.shape[0]):  # no surrogate: never a candidate
        if not sidecar.has_surrogate(layer, e):
            errors[e] = np.inf
    return errors
