"""One rule for what a policy needs of the routing it runs on (registry.inputs_verdict):
`pyspice sim` refuses or notes by it, and `auto` leaves out anything that would not run
as itself."""

from __future__ import annotations

import pytest

from pyspice.policy import policy_spec
from pyspice.policy.registry import inputs_verdict

NOTHING = {"hidden_rows": False, "routers": False, "predictor": False}
EVERYTHING = {"hidden_rows": True, "routers": True, "predictor": True}


@pytest.mark.parametrize("name", ["exact", "static", "lru", "ondemand", "host"])
def test_ids_only_policies_run_as_themselves_on_anything(name: str) -> None:
    assert inputs_verdict(policy_spec(name), **NOTHING).runs_as_itself


def test_spice_needs_a_predictor_and_says_how_to_make_one() -> None:
    spec = policy_spec("spice")
    alone = inputs_verdict(spec, **NOTHING)
    assert alone.missing and "pyspice trace fit" in alone.missing and not alone.runs_as_itself
    assert inputs_verdict(spec, hidden_rows=False, routers=False, predictor=True).runs_as_itself


def test_adapmoe_falls_back_without_its_gate_inputs() -> None:
    spec = policy_spec("adapmoe")
    assert inputs_verdict(spec, **EVERYTHING).runs_as_itself
    for lacking in ("hidden_rows", "routers"):
        verdict = inputs_verdict(spec, **{**EVERYTHING, lacking: False})
        assert not verdict.missing and verdict.fallback == spec.without_hidden
        assert not verdict.runs_as_itself  # auto would rank another policy under its name
