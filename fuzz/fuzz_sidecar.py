"""atheris harness: the sidecar reader on arbitrary bytes (written to a file, since it
maps one). Contract: Sidecar.load raises a ValueError (ModelFileError,
SidecarDataError, SidecarMismatchError and "not a pyspice sidecar" are all
ValueErrors) or returns. `python fuzz/fuzz_sidecar.py fuzz/corpus/sidecar
-max_total_time=15 -timeout=1 -rss_limit_mb=512`."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from pyspice.formats.sidecar import Sidecar

FILE = Path(tempfile.mkdtemp(prefix="fuzz-sidecar-")) / "s.spice.gguf"


def one_input(data: bytes) -> None:
    FILE.write_bytes(data)
    try:
        sidecar = Sidecar.load(FILE, None)
        for il in sidecar.moe_layers[:4]:
            sidecar.surrogate(il, 0)
    except ValueError:
        pass  # the documented errors


if __name__ == "__main__":
    try:
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()
    finally:
        os.unlink(FILE) if FILE.exists() else None
