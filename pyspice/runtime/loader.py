"""libspice loaded through cffi (ABI mode), its declarations derived from the installed
`spice.h` so that the two cannot drift apart."""

from __future__ import annotations

import re
import threading
from typing import Any

from pyspice.build_info import BuildInfo, load_build_info


def cdef_from_header(text: str) -> str:
    """Turn spice.h into declarations cffi's ABI mode parses.

    Drops comments, preprocessor lines (keeping `#define NAME <int>`), the
    export macro and the C++ guards.
    """
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if re.fullmatch(r"#define\s+SPICE_\w+\s+-?\d+", stripped):
                lines.append(stripped)
            continue
        if stripped in ('extern "C" {', "}"):
            continue
        lines.append(line.replace("SPICE_API ", ""))
    return "\n".join(lines)


class _Native:
    """The loaded library and its cffi namespace (one per process is enough,
    but nothing forces that: each Runtime holds a reference)."""

    _lock = threading.Lock()
    _instance: _Native | None = None

    def __init__(self, info: BuildInfo) -> None:
        import cffi

        header = (info.lib_dir / "spice.h").read_text()
        self.ffi = cffi.FFI()
        self.ffi.cdef(cdef_from_header(header))
        self.lib: Any = self.ffi.dlopen(str(info.libspice))
        self.info = info

    @classmethod
    def get(cls) -> _Native:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Native(load_build_info())
            return cls._instance


def native() -> Any:
    """The cffi library object (for tests and diagnostics)."""
    return _Native.get().lib
