"""The lossy levels' low-precision slot copies, kept on disk between runs.

Making them re-quantizes every routed expert: about 5 MiB/s on two cores (858 MiB
took 164 s for a 3-MoE-layer slice of DeepSeek-V2-Lite), so a whole model would wait
tens of minutes at every start of `spice:fast`. libspice writes the copies it made to
a GGUF (spice_runtime_slot_copies_save) and reads them back at disk speed
(spice_runtime_slot_copies_load), using a file only where it was made from the same
model file by the same ggml build; otherwise the copies are made again and the file
replaced.

Where: $PYSPICE_SLOT_CACHE, a directory, or `off` to make them at every run; by
default the `slot-copies` folder of pyspice's cache directory (pyspice.paths). A file
is named after the model file (its name and a hash of where it is) and the precision;
deleting the folder only costs the next run the time to make them again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pyspice.formats.sidecar import fingerprint
from pyspice.paths import cache_dir
from pyspice.runtime import Runtime, SpiceError
from pyspice.units import format_bytes

ENV = "PYSPICE_SLOT_CACHE"
OFF = "off"
# room left free on the cache's disk after a save: copies never fill it
FREE_MARGIN = 1 << 30


@dataclass(frozen=True)
class SlotCache:
    """A folder of slot copies, one GGUF per model file and precision."""

    directory: Path

    @classmethod
    def default(cls) -> SlotCache:
        """The `slot-copies` folder of pyspice's cache directory."""
        return cls(cache_dir() / "slot-copies")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> SlotCache | None:
        """The cache $PYSPICE_SLOT_CACHE names (None for `off`), else the default folder."""
        value = environ.get(ENV, "").strip()
        if value.lower() == OFF:
            return None
        return cls(Path(value).expanduser()) if value else cls.default()

    def for_model(self, model: Path) -> KeptCopies | None:
        """The copies kept for the model file `model` (None where it is no file: nothing to key them by)."""
        return KeptCopies(self, model) if model.is_file() else None


# the names KeptCopies.path gives, and a save's temporary file beside one
# (spice_slot_cache_write writes PATH.tmp-PID, then renames it)
_KEPT_FILE = re.compile(r".+\.[45]bit-slots\.gguf(\.tmp-\d+)?$")


def is_kept_file(name: str) -> bool:
    """Whether a file name is one a save of slot copies makes (or writes first)."""
    return _KEPT_FILE.match(name) is not None


@dataclass(frozen=True)
class KeptCopies:
    """One model file's copies in a SlotCache."""

    cache: SlotCache
    model: Path

    def path(self, precision: str) -> Path:
        """One file per model file (its name and where it is) and precision: a model
        rewritten in place replaces its own copies, two of one name elsewhere do not meet."""
        name = self.model.name
        stem = name[: -len(".gguf")] if name.endswith(".gguf") else name
        where = hashlib.sha256(os.fsencode(self.model.resolve())).hexdigest()[:8]
        return self.cache.directory / f"{stem}-{where}.{precision}-slots.gguf"

    def model_key(self) -> str:
        """What names the model to libspice: its fingerprint (tensors and sampled bytes) and
        the file's size and modification time, so that a file rewritten in place is a new
        model even where the sampled blocks did not change; then where the file is, last,
        so that `pyspice cache` can tell copies whose model is gone (kept_source)."""
        st = self.model.stat()
        return (
            f"{fingerprint(self.model)} size {st.st_size} mtime_ns {st.st_mtime_ns} "
            f"path {self.model.resolve()}"
        )

    def load(self, runtime: Runtime, wanted: int, precision: str, say: Callable[[str], None]) -> bool:
        """Give `runtime` the copies kept at `precision` (SLOT_* `wanted`); False where
        there are none to use (a stale file is said, then made again; set_tier says what
        was read). The runtime's device tier is removed first: its slots may read the
        copies held now."""
        path = self.path(precision)
        if not path.is_file():
            return False
        runtime.set_device(None)
        try:
            runtime.load_slot_copies(wanted, path, self.model_key())
        except (SpiceError, OSError) as err:
            say(f"{precision} slots: the kept copies are not used ({err}); making them again")
            return False
        return True

    def save(self, runtime: Runtime, precision: str, say: Callable[[str], None]) -> None:
        """Keep the copies `runtime` made for the next run, where the disk has room; a
        failure is said and costs only the next run's time to make them."""
        size, _ = runtime.slot_copies()
        path = self.path(precision)
        directory = self.cache.directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(directory).free
            if free < size + FREE_MARGIN:
                say(
                    f"{precision} slots: the copies are not kept for the next run: {directory} has "
                    f"{format_bytes(free)} free, they take {format_bytes(size)} "
                    f"(set {ENV} to a folder with room, or to off)"
                )
                return
            t0 = time.monotonic()
            runtime.save_slot_copies(path, self.model_key())
        except (SpiceError, OSError) as err:
            say(f"{precision} slots: the copies are not kept for the next run ({err})")
            return
        say(
            f"{precision} slots: copies kept in {path} ({format_bytes(size)}, written in "
            f"{time.monotonic() - t0:.1f} s); the next run reads them instead of making them"
        )


@dataclass(frozen=True)
class KeptSource:
    """The model file a kept copy was made from, as its model key names it."""

    path: Path
    size: int
    mtime_ns: int

    def status(self) -> str:
        """`current` (the file is there as it was), `changed` (rewritten since: the next run
        makes the copies again) or `missing` (moved or deleted: nothing will read them)."""
        try:
            st = self.path.stat()
        except OSError:
            return "missing"
        return "current" if (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns) else "changed"


_KEY = re.compile(r"^\S+ size (?P<size>\d+) mtime_ns (?P<mtime>\d+) path (?P<path>.+)$", re.DOTALL)


def kept_source(model_key: str) -> KeptSource | None:
    """Where the copies under `model_key` (KeptCopies.model_key) came from; None for a key
    of a pyspice before the path was part of it (the next run refuses those copies)."""
    m = _KEY.match(model_key)
    if m is None:
        return None
    return KeptSource(Path(m["path"]), int(m["size"]), int(m["mtime"]))
