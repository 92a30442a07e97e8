"""Which files an import reads, in which order, and in which format.

A folder stands for the recording files directly inside it (*.csv, *.jsonl,
*.ndjson; hidden files skipped). Files are taken in natural order (numbers by
value: prompt_2 before prompt_10), whether a folder or the shell listed them,
so a glob and its folder give the same trace. A file's format is told by its
first line: the csv-ids header, or a JSON object of vllm-jsonl.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from pyspice.formats.importers.csv_ids import HEADER, is_csv_ids
from pyspice.formats.importers.recording import RecordingError
from pyspice.formats.importers.vllm_jsonl import is_vllm_jsonl

CSV_IDS = "csv-ids"
VLLM_JSONL = "vllm-jsonl"
FORMATS = (CSV_IDS, VLLM_JSONL)
SUFFIXES = (".csv", ".jsonl", ".ndjson")
_FIRST_LINE_LIMIT = 1 << 16  # a header or a meta line is far shorter; a longer line is not one


def natural_key(path: Path) -> list[str | int]:
    """Sort key that orders the numbers in a name by value."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", str(path)))]


def list_inputs(inputs: Sequence[Path]) -> list[Path]:
    """The recording files named by `inputs` (files, or folders of them), in natural order."""
    files: list[Path] = []
    for given in inputs:
        if given.is_dir():
            found = [
                p
                for p in given.iterdir()
                if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in SUFFIXES
            ]
            if not found:
                raise RecordingError(
                    f"{given}: the folder holds no recording files ({', '.join('*' + s for s in SUFFIXES)})"
                )
            files.extend(found)
        elif given.is_file():
            files.append(given)
        elif not given.exists():
            raise RecordingError(f"{given}: no such file or folder")
        else:
            raise RecordingError(f"{given}: not a regular file or folder")
    seen: dict[Path, Path] = {}
    for path in files:
        key = path.resolve()
        if key in seen:
            raise RecordingError(f"{path}: given twice (also as {seen[key]}): name each file once")
        seen[key] = path
    return sorted(files, key=natural_key)


def detect_format(path: Path) -> str:
    """csv-ids or vllm-jsonl, from the file's first non-blank line."""
    with open(path, "rb") as f:
        raw = f.readline(_FIRST_LINE_LIMIT)
        while raw and not raw.strip():
            raw = f.readline(_FIRST_LINE_LIMIT)
    if not raw:
        raise RecordingError(f"{path}: an empty file; leave it out")
    text = raw[:_FIRST_LINE_LIMIT].decode("utf-8-sig", errors="replace")
    if is_vllm_jsonl(text):
        return VLLM_JSONL
    if is_csv_ids(text):
        return CSV_IDS
    raise RecordingError(
        f"{path}: cannot tell the recording's format: its first line is neither the csv-ids header "
        f'({",".join(HEADER)}) nor a vllm-jsonl object ({{"type": "meta"|"route", ...}}); '
        f"give --format ({', '.join(FORMATS)}) if it is one of them"
    )
