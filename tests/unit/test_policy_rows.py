"""The row grammar of bench and sim, `NAME[@key=value,...]`, parsed once into a typed row."""

from __future__ import annotations

import pytest

from pyspice.policy.registry import policy_names, policy_spec
from pyspice.policy.rows import parse_row, parse_rows, split_rows
from pyspice.units import Budget


def test_a_plain_name_is_the_policy_as_it_is() -> None:
    row = parse_row("lru")
    assert row.spec is policy_spec("lru") and row.planning is None and row.ram is None
    assert row.label == "lru"


def test_keys_and_their_shorthands() -> None:
    row = parse_row("spice:exact@plan=det2,ram=2GiB")
    assert (row.planning, row.plan_lag, row.ram) == ("async", 2, Budget(bytes=2 << 30))
    assert row.label == "spice:exact@plan=det2,ram=2GiB"
    assert parse_row("spice@async") == parse_row("spice@plan=async")
    assert parse_row("exact@sync").planning == "sync"
    assert parse_row("lru@device=25%").device == Budget(share=0.25)


def test_a_list_keeps_each_rows_keys_with_it() -> None:
    assert split_rows("spice@plan=async,ram=2GiB,lru, exact@ram=50%") == [
        "spice@plan=async,ram=2GiB",
        "lru",
        "exact@ram=50%",
    ]
    rows = parse_rows("upstream,exact@ram=50%", others=("upstream",))
    assert rows[0].spec is None and rows[1].ram == Budget(share=0.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nosuch", "unknown policy 'nosuch'"),
        ("lru@speed=9", "not a key=value"),
        ("spice@plan=det99", "detK"),
        ("exact@ram=2GX", "ram: bad budget '2GX'"),
        ("lru@plan=async", "plans in the hook's call only"),
        ("exact@ram=1GiB,ram=2GiB", "ram is given twice"),
    ],
)
def test_bad_rows_name_the_row_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_row(text)


def test_every_spec_says_what_it_reads() -> None:
    for name in policy_names():
        spec = policy_spec(name)
        assert "ids" in spec.inputs
        assert (spec.make() is None) == (spec.kind in ("stock", "native")), name
        assert spec.reads_sidecar == ("hidden" in spec.inputs and spec.kind == "python"), name
