"""The lossy levels' slot copies kept on disk (pyspice/engine/slot_cache.py,
native/src/spice-slot-cache.c): a later run reads the copies an earlier one made, to
the bit, and any file that is not those copies -- damaged, truncated, of another
model, precision or build -- is refused with its reason and the copies are made again."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from pyspice.engine import slot_tier
from pyspice.engine.slot_cache import SlotCache
from pyspice.runtime import SLOT_4BIT, SLOT_5BIT, SpiceError

from .golden import greedy_run, load
from .test_low_precision_slots import AllDevice4Bit

N_DECODE = 4


def _run_4bit(model: Path, cache: SlotCache, capsys: pytest.CaptureFixture[str]) -> tuple[np.ndarray, str]:
    llm = load(model)
    try:
        llm.spice_engine.slot_cache = cache
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        run = greedy_run(llm, AllDevice4Bit(), n_decode=N_DECODE)
        assert run.stats["misses"]["fetched"] > 0  # the copies were used
        return run.logits, capsys.readouterr().err
    finally:
        llm.close()


@pytest.fixture()
def model(synth_model, tmp_path: Path) -> Path:
    """A private copy of the tiny model: tests here rewrite it to make it another model."""
    path = tmp_path / "model.gguf"
    path.write_bytes(synth_model("qwen2moe", "tiny", "Q8_0").read_bytes())
    return path


def test_a_later_run_reads_the_copies_an_earlier_one_made(model: Path, tmp_path: Path, capsys) -> None:
    cache = SlotCache(tmp_path / "slots")
    made, said = _run_4bit(model, cache, capsys)
    kept = cache.for_model(model)
    assert kept is not None and kept.path("4bit").is_file()
    assert "made in" in said and f"copies kept in {kept.path('4bit')}" in said

    read, said = _run_4bit(model, cache, capsys)
    assert "read in" in said and "made in" not in said and "copies kept" not in said
    assert np.array_equal(read, made)

    # a GGUF that gguf-py reads: the copies' tensors and the keys that name them
    reader = GGUFReader(kept.path("4bit"))
    names = [t.name for t in reader.tensors]
    assert names and all(n.endswith(".slot") for n in names)
    assert "ffn_gate_exps" in " ".join(names)
    fields = reader.fields
    assert int(fields["spice.slot_copies.precision"].parts[-1][0]) == SLOT_4BIT
    assert "ggml" in bytes(fields["spice.slot_copies.quantizer"].parts[-1]).decode()


def test_a_damaged_file_is_refused_said_and_replaced(model: Path, tmp_path: Path, capsys) -> None:
    cache = SlotCache(tmp_path / "slots")
    made, _ = _run_4bit(model, cache, capsys)
    kept = cache.for_model(model)
    assert kept is not None
    path = kept.path("4bit")
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # truncated: a crash mid-copy, a full disk
    again, said = _run_4bit(model, cache, capsys)
    assert "the kept copies are not used" in said and "truncated" in said and "made in" in said
    assert np.array_equal(again, made)
    assert path.read_bytes() == whole  # made again, kept again

    path.write_bytes(b"not a gguf")
    _, said = _run_4bit(model, cache, capsys)
    assert "not a readable GGUF" in said and path.read_bytes() == whole


def test_copies_of_another_model_precision_or_state_are_refused(model: Path, tmp_path: Path, capsys) -> None:
    cache = SlotCache(tmp_path / "slots")
    _run_4bit(model, cache, capsys)
    kept = cache.for_model(model)
    assert kept is not None
    path, key = kept.path("4bit"), kept.model_key()
    llm = load(model)
    try:
        runtime = llm.spice_engine.runtime
        with pytest.raises(SpiceError, match="another model"):
            runtime.load_slot_copies(SLOT_4BIT, path, key + " but another")
        with pytest.raises(SpiceError, match="slot precision 1, not 2"):
            runtime.load_slot_copies(SLOT_5BIT, path, key)
        with pytest.raises(SpiceError, match="No such file"):
            runtime.load_slot_copies(SLOT_4BIT, tmp_path / "none.gguf", key)
        assert runtime.slot_copies() == (0, 0.0)  # a refused file leaves no copies behind
        runtime.load_slot_copies(SLOT_4BIT, path, key)
        assert runtime.slot_copies_precision() == SLOT_4BIT
        need = runtime.slot_copies_size(SLOT_4BIT)
        assert runtime.slot_copies_progress() == (need, need)  # every byte read counted
        llm.set_device("50%", 8.0, 5.0, manual_clock=True)
        with pytest.raises(SpiceError, match="remove the tier first"):
            runtime.load_slot_copies(SLOT_4BIT, path, key)
    finally:
        llm.close()

    # the model file rewritten in place is another model: its copies are made again
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))
    _, said = _run_4bit(model, cache, capsys)
    assert "another model" in said and "made in" in said


def test_copies_that_cannot_be_kept_cost_only_a_line(model: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    made, said = _run_4bit(model, SlotCache(blocker / "slots"), capsys)  # a folder under a file
    assert "the copies are not kept for the next run" in said and "made in" in said
    assert made.shape[0] > 0


def test_making_and_reading_copies_show_progress(model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Long work shows progress: a bar over the bytes libspice has made or read, polled
    from a thread while the one native call runs (shown here for copies that take well
    under the threshold a real model's exceed)."""
    monkeypatch.setattr(slot_tier, "ANNOUNCE_AFTER_S", -1.0)
    cache = SlotCache(tmp_path / "slots")
    _, said = _run_4bit(model, cache, capsys)
    assert "4bit slots: re-quantizing" in said and "100%" in said and "kept for later runs" in said
    _, said = _run_4bit(model, cache, capsys)
    assert "4bit slots: reading" in said and "100%" in said and "re-quantizing every" not in said
