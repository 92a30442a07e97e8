"""csv-ids: one prompt per CSV file, expert ids only.

The layout of the moe-beyond recording of DeepSeek-V2-Lite-Chat
(ngavhane/moe-beyond, `training_data_eamc/prompt_N_data.csv`):

    Layer ID,Batch Number,Token,Activated Expert IDs
    1,0,<｜begin▁of▁sentence｜>,"[8, 26, 56, 57, 60, 43]"

One row per (MoE layer, token): the layer's number in the model, the batch the
recorder ran the token in, the token's text (not imported: a trace holds
routing only) and the token's top-k experts in no particular order, without
gate weights. A layer's rows come in token order; layers may come one after
another (as moe-beyond writes them) or interleaved token by token.

Memory: one file's rows at a time (the largest moe-beyond file is 2.6 MB).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from pyspice.formats.importers.recording import (
    RecordedSequence,
    RecordingError,
    RecordingHeader,
    layer_counts_problem,
    runs,
    where,
)

HEADER = ("Layer ID", "Batch Number", "Token", "Activated Expert IDs")
# a list of integers; nine digits at most, so every id fits the int64 it is parsed into
_IDS = re.compile(r"\[\s*-?\d{1,9}(?:\s*,\s*-?\d{1,9})*\s*\]")
_EXAMPLE = '"[8, 26, 56, 57, 60, 43]"'


@dataclass
class _LayerRows:
    ids: list[str] = field(default_factory=list)  # the ids text of each row, brackets included
    lines: list[int] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)


def is_csv_ids(first_line: str) -> bool:
    """Whether a file's first line is the csv-ids header."""
    return tuple(c.strip() for c in next(csv.reader([first_line]), [])) == HEADER


def open_csv_ids(path: Path) -> tuple[RecordingHeader, Iterator[RecordedSequence]]:
    """The file's header (a csv-ids file says nothing of its model) and its one sequence."""
    with _open(path) as f:
        first = f.readline()
    if not is_csv_ids(first):
        raise RecordingError(
            f"{where(path, 1)}: not a csv-ids recording: its header is {first.strip()!r:.120}, "
            f"not {','.join(HEADER)!r}"
        )
    return RecordingHeader(), _sequences(path)


def _open(path: Path) -> TextIO:
    # utf-8-sig: a spreadsheet's byte-order mark is not part of the header
    return open(path, newline="", encoding="utf-8-sig")


def _sequences(path: Path) -> Iterator[RecordedSequence]:
    layers = _read_rows(path)
    if not layers:
        raise RecordingError(f"{path}: the file holds no routing rows, only its header; leave it out")
    yield _assemble(path, layers)


def _read_rows(path: Path) -> dict[int, _LayerRows]:
    layers: dict[int, _LayerRows] = {}
    k = 0
    k_line = 0
    with _open(path) as f:
        rows = csv.reader(f)
        try:
            next(rows)  # the header, checked by open_csv_ids
            for row in rows:
                line = rows.line_num
                if not row:
                    continue  # a blank line
                if len(row) != len(HEADER):
                    raise RecordingError(
                        f"{where(path, line)}: a row of {len(row)} fields, not {len(HEADER)} "
                        f"({','.join(HEADER)}): a damaged recording"
                    )
                layer_text, batch_text, _token, ids_text = row
                try:
                    layer, batch = int(layer_text), int(batch_text)
                except ValueError:
                    raise RecordingError(
                        f"{where(path, line)}: Layer ID {layer_text!r:.40} and Batch Number "
                        f"{batch_text!r:.40} must be integers: a damaged recording"
                    ) from None
                if layer < 0:
                    raise RecordingError(f"{where(path, line)}: Layer ID {layer} is negative")
                if _IDS.fullmatch(ids_text) is None:
                    raise RecordingError(
                        f"{where(path, line)}: Activated Expert IDs {ids_text!r:.80} is not a list of "
                        f"integers like {_EXAMPLE}: a damaged recording"
                    )
                n = ids_text.count(",") + 1
                if k == 0:
                    k, k_line = n, line
                elif n != k:
                    raise RecordingError(
                        f"{where(path, line)}: the row lists {n} experts, line {k_line} lists {k}: "
                        "a recording has one top-k for every row (mixed k)"
                    )
                rows_of = layers.setdefault(layer, _LayerRows())
                rows_of.ids.append(ids_text)
                rows_of.lines.append(line)
                rows_of.batches.append(batch)
        except csv.Error as exc:
            raise RecordingError(f"{where(path, rows.line_num)}: not valid CSV ({exc})") from None
        except UnicodeDecodeError as exc:
            raise RecordingError(
                f"{where(path, rows.line_num + 1)}: not UTF-8 text ({exc.reason}): a damaged recording"
            ) from None
    return layers


def _assemble(path: Path, layers: dict[int, _LayerRows]) -> RecordedSequence:
    order = sorted(layers)
    problem = layer_counts_problem(
        path, {il: len(layers[il].ids) for il in order}, {il: layers[il].lines[-1] for il in order}
    )
    if problem is not None:
        raise RecordingError(problem)
    first = layers[order[0]]
    for il in order[1:]:
        if layers[il].batches != first.batches:
            t = next(
                i for i, (a, b) in enumerate(zip(layers[il].batches, first.batches, strict=True)) if a != b
            )
            raise RecordingError(
                f"{where(path, layers[il].lines[t])}: token {t} of layer {il} is in batch "
                f"{layers[il].batches[t]}, at layer {order[0]} in batch {first.batches[t]} (line "
                f"{first.lines[t]}): the layers disagree on the tokens: a damaged recording"
            )
    n, k = len(first.ids), first.ids[0].count(",") + 1
    ids = np.empty((n, len(order), k), dtype=np.int64)
    for j, il in enumerate(order):
        # every text was checked to be a bracketed list of k integers: parse them in one go
        flat = np.fromstring(",".join(s[1:-1] for s in layers[il].ids), dtype=np.int64, sep=",")
        ids[:, j] = flat.reshape(n, k)
    lines = np.array([layers[il].lines for il in order], dtype=np.int64).T
    return RecordedSequence(
        path=path,
        first_line=int(lines.min()),
        layers=tuple(order),
        ids=ids,
        lines=lines,
        weights=None,
        batches=runs(first.batches),
    )
