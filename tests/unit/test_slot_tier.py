"""When a lossy level's 4-bit slot copies are refused for memory (slot_tier)."""

from __future__ import annotations

from pyspice.engine.slot_tier import copies_refusal


def test_copies_fit_in_most_of_the_memory_available() -> None:
    assert copies_refusal("4bit", 800 << 20, 1 << 30) is None
    assert copies_refusal("4bit", 1, None) is None  # nothing known: nothing to refuse on


def test_copies_beyond_that_are_refused_with_both_sizes() -> None:
    said = copies_refusal("4bit", 900 << 20, 1 << 30)
    assert (
        said is not None
        and "4bit slots need 900.00 MiB" in said
        and "1.00 GiB" in said
        and "exact slots" in said
    )
