"""`pyspice cache`: what is kept on disk, which slot copies are stale, and clearing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from pyspice.cli.main import main
from pyspice.engine.cache_contents import cache_entries, remove, slot_copies_dir
from pyspice.engine.slot_cache import SlotCache, kept_source


def write_copies(path: Path, model_key: str, precision: int = 1) -> Path:
    """A file of slot copies as libspice writes one, without the tensors (what is listed
    reads only the header)."""
    w = gguf.GGUFWriter(str(path), arch="spice-slot-copies")
    w.add_int32("spice.slot_copies.precision", precision)
    w.add_string("spice.slot_copies.model", model_key)
    w.add_string("spice.slot_copies.quantizer", "test")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def key_for(model: Path) -> str:
    """KeptCopies.model_key without the fingerprint's reads of a real GGUF."""
    st = model.stat()
    return f"sha256:0 size {st.st_size} mtime_ns {st.st_mtime_ns} path {model.resolve()}"


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    root, slots = tmp_path / "pyspice", tmp_path / "slots"
    root.mkdir()
    slots.mkdir()
    return root, slots


def test_the_model_key_names_the_file_it_was_made_from(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr("pyspice.engine.slot_cache.fingerprint", lambda p: "sha256:abc")
    kept = SlotCache(tmp_path / "c").for_model(model)
    assert kept is not None
    source = kept_source(kept.model_key())
    assert source is not None and source.path == model.resolve() and source.size == 64
    assert source.status() == "current"
    assert kept_source("sha256:abc size 1 mtime_ns 2") is None  # a key from before the path


def test_a_path_with_spaces_survives_the_key(tmp_path: Path) -> None:
    model = tmp_path / "a model dir" / "m  x.gguf"
    model.parent.mkdir()
    model.write_bytes(b"x")
    source = kept_source(key_for(model))
    assert source is not None and source.path == model.resolve()


def test_copies_are_stale_when_their_model_changed_or_is_gone(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    root, slots = folders
    here, rewritten, gone = (tmp_path / n for n in ("here.gguf", "rewritten.gguf", "gone.gguf"))
    for m in (here, rewritten, gone):
        m.write_bytes(b"model")
    write_copies(slots / "here-1.4bit-slots.gguf", key_for(here))
    write_copies(slots / "rewritten-1.5bit-slots.gguf", key_for(rewritten), precision=2)
    write_copies(slots / "gone-1.4bit-slots.gguf", key_for(gone))
    write_copies(slots / "old-1.4bit-slots.gguf", "sha256:0 size 5 mtime_ns 1")
    rewritten.write_bytes(b"a longer model")
    gone.unlink()
    by_name = {e.path.name: e for e in cache_entries(root, slots)}
    assert not by_name["here-1.4bit-slots.gguf"].stale
    assert f"4-bit, of {here.resolve()}" == by_name["here-1.4bit-slots.gguf"].note
    assert (
        by_name["rewritten-1.5bit-slots.gguf"].stale
        and "5-bit" in by_name["rewritten-1.5bit-slots.gguf"].note
    )
    assert "changed" in by_name["rewritten-1.5bit-slots.gguf"].note
    assert by_name["gone-1.4bit-slots.gguf"].stale and "gone" in by_name["gone-1.4bit-slots.gguf"].note
    assert by_name["old-1.4bit-slots.gguf"].stale and "older pyspice" in by_name["old-1.4bit-slots.gguf"].note


def test_partial_files_are_stale_unless_a_save_is_writing_them(folders: tuple[Path, Path]) -> None:
    root, slots = folders
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (slots / f"m-1.4bit-slots.gguf.tmp-{dead.pid}").write_bytes(b"half")
    (slots / f"m-1.5bit-slots.gguf.tmp-{os.getpid()}").write_bytes(b"half")  # this process: alive
    (slots / "m-1.4bit-slots.gguf").write_bytes(b"not a gguf")
    by_name = {e.path.name: e for e in cache_entries(root, slots)}
    assert by_name[f"m-1.4bit-slots.gguf.tmp-{dead.pid}"].stale
    writing = by_name[f"m-1.5bit-slots.gguf.tmp-{os.getpid()}"]
    assert not writing.stale and "being written" in writing.note
    assert by_name["m-1.4bit-slots.gguf"].stale and "unreadable" in by_name["m-1.4bit-slots.gguf"].note


def test_files_a_save_does_not_name_are_left_alone(folders: tuple[Path, Path], capsys, monkeypatch) -> None:
    # PYSPICE_SLOT_CACHE may name a folder that holds the user's own models
    root, slots = folders
    for name in ("model.gguf", "notes.txt", "m-1.4bit-slots.gguf.bak", "m.3bit-slots.gguf"):
        (slots / name).write_bytes(b"mine")
    assert cache_entries(root, slots) == []
    monkeypatch.setenv("XDG_CACHE_HOME", str(root.parent / "xdg"))
    monkeypatch.setenv("PYSPICE_SLOT_CACHE", str(slots))
    assert main(["cache", "clear", "all"]) == 0
    assert len(list(slots.iterdir())) == 4


def test_every_folder_is_listed_by_kind_with_folder_sizes(folders: tuple[Path, Path]) -> None:
    root, slots = folders
    (root / "models").mkdir()
    (root / "models" / "smolmoe-b-r1-x-Q8_0.gguf").write_bytes(bytes(100))
    (root / "models" / "smolmoe-b-r1-x-Q8_0.spice.gguf").write_bytes(bytes(10))
    (root / "profiles").mkdir()
    (root / "profiles" / "m-abc.json").write_text("{}")
    (root / "calibrate" / "m-123" / "captures").mkdir(parents=True)
    (root / "calibrate" / "m-123" / "captures" / "a.npy").write_bytes(bytes(7))
    (root / "calibrate" / "m-123" / "b.npy").write_bytes(bytes(5))
    (root / "eval-xyz").mkdir()
    entries = cache_entries(root, slots)
    assert [e.kind for e in entries] == ["models", "models", "profiles", "calibration", "other"]
    calibration = next(e for e in entries if e.kind == "calibration")
    assert calibration.size == 12 and "resumes" in calibration.note
    assert "sidecar" in next(e.note for e in entries if e.path.name.endswith(".spice.gguf"))
    assert not any(e.stale for e in entries)


def test_the_slot_folder_inside_the_cache_is_listed_once(tmp_path: Path) -> None:
    root = tmp_path / "pyspice"
    (root / "slot-copies").mkdir(parents=True)
    (root / "slot-copies" / "x-1.4bit-slots.gguf.tmp-1").write_bytes(b"")
    entries = cache_entries(root, root / "slot-copies")
    assert [e.kind for e in entries] == ["slot-copies"]


def test_remove_frees_what_it_deletes_and_skips_what_is_gone(folders: tuple[Path, Path]) -> None:
    root, slots = folders
    (root / "calibrate" / "w").mkdir(parents=True)
    (root / "calibrate" / "w" / "a").write_bytes(bytes(9))
    (slots / "x-1.4bit-slots.gguf").write_bytes(bytes(3))
    entries = cache_entries(root, slots)
    (slots / "x-1.4bit-slots.gguf").unlink()  # another process cleared it first
    assert remove(entries) == 9
    assert not (root / "calibrate" / "w").exists()


def test_slot_copies_are_listed_where_the_environment_keeps_them(tmp_path: Path) -> None:
    assert slot_copies_dir({"PYSPICE_SLOT_CACHE": str(tmp_path)}) == tmp_path
    off = slot_copies_dir({"PYSPICE_SLOT_CACHE": "off"})  # still the default folder's copies
    assert off.name == "slot-copies" and off == slot_copies_dir({})


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PYSPICE_SLOT_CACHE", str(tmp_path / "slots"))
    (tmp_path / "slots").mkdir()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"model")
    write_copies(tmp_path / "slots" / "m-1.4bit-slots.gguf", key_for(model))
    write_copies(
        tmp_path / "slots" / "gone-1.4bit-slots.gguf", "sha256:0 size 1 mtime_ns 1 path /nowhere/x.gguf"
    )
    (tmp_path / "xdg" / "pyspice" / "profiles").mkdir(parents=True)
    (tmp_path / "xdg" / "pyspice" / "profiles" / "m-1.json").write_text("{}")
    return tmp_path / "xdg" / "pyspice", tmp_path / "slots"


def test_the_list_names_sizes_and_stale_copies(user_cache, capsys) -> None:
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "m-1.4bit-slots.gguf: 4-bit, of" in out
    assert "gone-1.4bit-slots.gguf" in out and "[stale]" in out
    assert "1 stale slot copies" in out and "pyspice cache clear --stale" in out
    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {e["kind"] for e in doc["entries"]} == {"slot-copies", "profiles"}
    assert [e["stale"] for e in doc["entries"] if e["kind"] == "slot-copies"] == [True, False]


def test_clear_stale_removes_only_those_and_dry_run_nothing(user_cache, capsys) -> None:
    root, slots = user_cache
    assert main(["cache", "clear", "--stale", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and (slots / "gone-1.4bit-slots.gguf").exists()
    assert main(["cache", "clear", "--stale"]) == 0
    out = capsys.readouterr().out
    assert "1 entries, freed" in out
    assert not (slots / "gone-1.4bit-slots.gguf").exists() and (slots / "m-1.4bit-slots.gguf").exists()
    assert main(["cache", "clear", "all"]) == 0
    assert not any(slots.iterdir()) and not any((root / "profiles").iterdir())


def test_clear_names_what_it_needs(user_cache, capsys) -> None:
    assert main(["cache", "clear"]) != 0
    assert "name what to remove" in capsys.readouterr().err
    assert main(["cache", "clear", "modles"]) != 0
    assert "no kind modles" in capsys.readouterr().err
    assert main(["cache", "clear", "models", "--stale"]) != 0
    assert "--stale is for slot copies only" in capsys.readouterr().err
