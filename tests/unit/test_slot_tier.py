"""When a lossy level's 4-bit slot copies are refused for memory (slot_tier)."""

from __future__ import annotations

from pyspice.engine.slot_tier import copies_estimate_s, copies_refusal


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


def test_the_models_own_experts_are_not_room_for_copies() -> None:
    # a mapped model's pages count as available; the host needs them, so they are set aside
    assert copies_refusal("4bit", 400 << 20, 1 << 30, experts=400 << 20) is None
    said = copies_refusal("4bit", 400 << 20, 1 << 30, experts=600 << 20)
    assert said is not None and "600.00 MiB of it the model's routed experts" in said


def test_the_copies_time_is_estimated_from_their_size_and_the_cores() -> None:
    assert copies_estimate_s("4bit", 4 << 20, 2) == 1.0  # 2 MiB per core per second
    assert copies_estimate_s("4bit", 4 << 20, 0) == 2.0  # at least one core
    assert copies_estimate_s("5bit", 4 << 20, 2) < 0.1  # Q5_0 searches no scales


def test_the_slot_cache_is_where_the_environment_says(tmp_path) -> None:
    from pyspice.engine.slot_cache import SlotCache

    assert SlotCache.from_environment({"PYSPICE_SLOT_CACHE": "off"}) is None
    assert SlotCache.from_environment({"PYSPICE_SLOT_CACHE": " OFF "}) is None
    assert SlotCache.from_environment({"PYSPICE_SLOT_CACHE": str(tmp_path)}) == SlotCache(tmp_path)
    default = SlotCache.from_environment({})
    assert default is not None and default.directory.name == "slot-copies"


def test_kept_copies_are_one_file_per_model_file_and_precision(tmp_path) -> None:
    from pyspice.engine.slot_cache import SlotCache

    cache = SlotCache(tmp_path / "slots")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "m.gguf").write_bytes(b"x")
    a, b = cache.for_model(tmp_path / "a" / "m.gguf"), cache.for_model(tmp_path / "b" / "m.gguf")
    assert a is not None and b is not None
    assert a.path("4bit").name.startswith("m-") and a.path("4bit").name.endswith(".4bit-slots.gguf")
    assert a.path("4bit") != a.path("5bit")
    assert a.path("4bit") != b.path("4bit")  # two models of one name elsewhere do not meet
    assert cache.for_model(tmp_path / "missing.gguf") is None  # no file: nothing to key copies by
