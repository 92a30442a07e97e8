"""What pyspice keeps on disk between runs, and removing it (`pyspice cache`).

Everything here is a cache: deleting any of it costs time, never a result.
- `models`: the built-in models (`pyspice models build`), their sidecars and the dense
  model they are made from (seconds to rebuild, minutes to calibrate again);
- `slot-copies`: the lossy levels' low-precision slot copies (slot_cache.py; minutes to
  make again), in $PYSPICE_SLOT_CACHE where that names a folder;
- `profiles`: cost profiles `pyspice probe` measured (a probe to run again);
- `calibration`: an interrupted calibration's captures, which a rerun resumes from;
- `other`: anything else in the folder (an interrupted `eval`'s scratch).

Slot copies are the large ones, and the ones that outlive their use: a copy whose model
file was moved, deleted or rewritten is never read again. Such a copy is `stale`, as is
a file an interrupted save left behind; `pyspice cache clear --stale` removes only those.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pyspice.engine.slot_cache import SlotCache, is_kept_file, kept_source
from pyspice.paths import cache_dir
from pyspice.runtime.constants import SLOT_4BIT, SLOT_5BIT

KINDS = ("slot-copies", "models", "profiles", "calibration", "other")
_FOLDERS = {"models": "models", "profiles": "profiles", "calibrate": "calibration"}
_PRECISIONS = {SLOT_4BIT: "4-bit", SLOT_5BIT: "5-bit"}  # a file's spice.slot_copies.precision


@dataclass(frozen=True)
class CacheEntry:
    """One file or folder of a cache."""

    kind: str  # one of KINDS
    path: Path
    size: int  # bytes, a folder's files summed
    note: str  # what it is, for a person
    stale: bool = False  # slot copies nothing will read again


def slot_copies_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where slot copies are kept: $PYSPICE_SLOT_CACHE's folder, else the default one (also
    where $PYSPICE_SLOT_CACHE is `off`: copies kept before it was turned off are still there)."""
    return (SlotCache.from_environment(environ) or SlotCache.default()).directory


def cache_entries(root: Path | None = None, slot_dir: Path | None = None) -> list[CacheEntry]:
    """Every entry of pyspice's cache folder `root` (default: pyspice.paths.cache_dir()) and
    of the slot copies' folder `slot_dir` (default: slot_copies_dir()), by kind, then name."""
    root = root if root is not None else cache_dir()
    slot_dir = slot_dir if slot_dir is not None else slot_copies_dir()
    entries: list[CacheEntry] = []
    if slot_dir.is_dir():
        # only the files a save names: $PYSPICE_SLOT_CACHE may name a folder of the user's own
        entries += [_slot_entry(p) for p in sorted(slot_dir.iterdir()) if is_kept_file(p.name)]
    if root.is_dir():
        for top in sorted(root.iterdir()):
            if top.resolve() == slot_dir.resolve():
                continue
            kind = _FOLDERS.get(top.name) if top.is_dir() else None
            if kind is None:
                entries.append(CacheEntry("other", top, _size(top), _other_note(top)))
                continue
            entries += [CacheEntry(kind, p, _size(p), _note(kind, p)) for p in sorted(top.iterdir())]
    return sorted(entries, key=lambda e: (KINDS.index(e.kind), str(e.path)))


def remove(entries: Iterable[CacheEntry]) -> int:
    """Delete the entries' files and folders; the bytes freed. One that is already gone
    (another process cleared it) frees nothing and is no error."""
    freed = 0
    for e in entries:
        try:
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.rmtree(e.path)
            else:
                e.path.unlink()
        except FileNotFoundError:
            continue
        freed += e.size
    return freed


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).lstat().st_size
            except OSError:  # removed while we walk
                continue
    return total


def _slot_entry(path: Path) -> CacheEntry:
    size = _size(path)
    name = path.name
    if ".tmp-" in name:
        pid = name.rsplit(".tmp-", 1)[1]
        if _alive(int(pid)):
            return CacheEntry("slot-copies", path, size, f"being written by process {pid}")
        return CacheEntry("slot-copies", path, size, "left by an interrupted save", stale=True)
    try:
        import gguf

        fields = gguf.GGUFReader(path).fields
        key = str(fields["spice.slot_copies.model"].contents())
        precision = _PRECISIONS.get(int(fields["spice.slot_copies.precision"].contents()), "?-bit")
    except Exception as err:  # gguf-py's ValueError, KeyError, struct.error...: a run refuses it too
        return CacheEntry("slot-copies", path, size, f"unreadable ({type(err).__name__})", stale=True)
    source = kept_source(key)
    if source is None:
        return CacheEntry(
            "slot-copies", path, size, f"{precision}, from an older pyspice: never read again", stale=True
        )
    status = source.status()
    said = {
        "current": "",
        "changed": ": the model file changed since, never read again",
        "missing": ": the model file is gone (moved, deleted, or on a drive not mounted now)",
    }[status]
    return CacheEntry(
        "slot-copies", path, size, f"{precision}, of {source.path}{said}", stale=status != "current"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _note(kind: str, path: Path) -> str:
    name = path.name
    if kind == "models":
        if name.endswith(".spice.gguf"):
            return "calibration sidecar (draft predictor and surrogates)"
        if name.startswith("smolmoe"):
            return "built-in model (pyspice models build)"
        if name.endswith(".gguf"):
            return "dense model the built-in models are made from"
        return "a model build's scratch"
    if kind == "profiles":
        return "cost profile (pyspice probe)"
    return "an interrupted calibration's captures (a rerun resumes from them)"


def _other_note(path: Path) -> str:
    if path.name.startswith("eval-"):
        return "an interrupted pyspice eval's scratch"
    return "unknown to this pyspice"
