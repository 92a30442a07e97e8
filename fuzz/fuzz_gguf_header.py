"""atheris harness: the GGUF header reader on arbitrary bytes.

Contract: header_from_buffer and summarize raise ModelFileError or return; any
other exception is a crash. Run with -timeout=1 (a hang over 1 s) and
-rss_limit_mb=512. `python fuzz/fuzz_gguf_header.py fuzz/corpus/gguf_header
-max_total_time=15 -timeout=1 -rss_limit_mb=512`."""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from pyspice.formats.gguf_header import ModelFileError
    from pyspice.formats.model_info import header_from_buffer, summarize

NAME = Path("fuzzed.gguf")


def one_input(data: bytes) -> None:
    try:
        header = header_from_buffer(data, NAME, len(data))
        summarize(header)
    except ModelFileError:
        pass  # the documented error


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
