"""SubstitutePolicy: resident experts exact, every other activation replaced."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.policy import ACTION_DEVICE, ACTION_DROP, ACTION_SURROGATE, HookCall
from pyspice.policy.substitute import SharedExpertOnly, SubstitutePolicy


def call(layer: int, ids: list[list[int]], n_expert: int = 6) -> HookCall:
    ids_arr = np.array(ids, dtype=np.int32)
    n_tokens = ids_arr.shape[0]
    return HookCall(
        layer,
        hidden=np.zeros((n_tokens, 4), np.float32),
        probs=np.full((n_tokens, n_expert), 1.0 / n_expert, np.float32),
        ids=ids_arr,
        weights=np.full(ids_arr.shape, 0.5, np.float32),
    )


@pytest.mark.parametrize(
    "mode,substitute", [("surrogate", ACTION_SURROGATE), ("shared", ACTION_SURROGATE), ("drop", ACTION_DROP)]
)
def test_resident_exact_others_substituted(mode: str, substitute: int) -> None:
    policy = SubstitutePolicy({(1, 0), (1, 3), (2, 5)}, mode)  # type: ignore[arg-type]
    plan = policy.decide(call(1, [[0, 1], [3, 5], [2, 4]]))
    d, s = ACTION_DEVICE, substitute
    assert np.array_equal(np.asarray(plan.actions), [[d, s], [d, s], [s, s]])
    # resident sets are per layer: expert 5 is resident in layer 2 only
    plan = policy.decide(call(2, [[5, 0]]))
    assert np.array_equal(np.asarray(plan.actions), [[d, s]])
    assert np.asarray(plan.actions).dtype == np.int32
    assert "lossy" in policy.name


def test_missing_surrogates_run_exactly_when_listed() -> None:
    policy = SubstitutePolicy({(0, 0)}, "surrogate", available={(0, 1), (0, 2)})
    plan = policy.decide(call(0, [[0, 1], [2, 3]]))
    d, s = ACTION_DEVICE, ACTION_SURROGATE
    assert np.array_equal(np.asarray(plan.actions), [[d, s], [s, d]])


def test_surrogate_sources() -> None:
    sidecar = object()
    assert SubstitutePolicy((), "surrogate").surrogate_source(sidecar, 8) is sidecar
    assert SubstitutePolicy((), "drop").surrogate_source(sidecar, 8) is None
    shared = SubstitutePolicy((), "shared").surrogate_source(None, 8)
    assert isinstance(shared, SharedExpertOnly)
    alpha, a, b = shared.surrogate(3, 7)
    assert alpha == 1.0 and a.shape == (0, 8) and b.shape == (8, 0)
    with pytest.raises(ValueError, match="needs a sidecar"):
        SubstitutePolicy((), "surrogate").surrogate_source(None, 8)
    with pytest.raises(ValueError, match="choose one of"):
        SubstitutePolicy((), "exactish")  # type: ignore[arg-type]
