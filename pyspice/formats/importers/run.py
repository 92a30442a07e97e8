"""Import a routing recording into an ids-only trace (`pyspice trace import`).

Each file's sequences are read one at a time, checked (the readers check
syntax, token order and layer counts; here: the model's geometry, expert ids
in range, one k, one set of layers, weights on all or none), cleared of
warm-up batches and streamed into a TraceWriter in a hidden folder beside
the output, which is renamed to the output only when every file has been
read. A bad row is one RecordingError naming its file and line, and leaves
nothing behind; memory is one file's rows plus the writer's chunk buffers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.formats.importers.csv_ids import open_csv_ids
from pyspice.formats.importers.inputs import CSV_IDS, VLLM_JSONL, detect_format, list_inputs
from pyspice.formats.importers.recording import (
    RecordedSequence,
    RecordingError,
    RecordingHeader,
    check_routes,
    dummy_batches,
    where,
)
from pyspice.formats.importers.vllm_jsonl import open_vllm_jsonl
from pyspice.formats.trace import TraceMeta, TraceWriter

_OPENERS: dict[str, Callable[[Path], tuple[RecordingHeader, Iterator[RecordedSequence]]]] = {
    CSV_IDS: open_csv_ids,
    VLLM_JSONL: open_vllm_jsonl,
}
# tokens per chunk file: the 94k-token moe-beyond trace is 6 files a layer of 192 KiB (16384 x top-6 int16)
CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class ModelShape:
    """A model's published geometry, as `--shape` names it."""

    name: str
    n_layers: int
    moe_layers: tuple[int, ...]
    n_expert: int
    top_k: int
    n_embd: int = 0


@dataclass(frozen=True)
class ImportOptions:
    format: str | None = None  # None: told by each file's first line
    shape: ModelShape | None = None
    n_expert: int | None = None
    model_name: str | None = None  # None: the recording's own, the shape's, or the folder's name
    chunk_tokens: int = CHUNK_TOKENS


@dataclass(frozen=True)
class ImportSummary:
    path: Path
    format: str
    model: str
    files: int
    sequences: int
    tokens: int
    moe_layers: int
    n_expert: int
    top_k: int
    has_weights: bool
    dropped_batches: int
    dropped_tokens: int

    def line(self) -> str:
        weights = "ids and weights" if self.has_weights else "ids only"
        return (
            f"imported {self.files} {self.format} files into {self.path}: {self.sequences} sequences, "
            f"{self.tokens} tokens, {self.moe_layers} MoE layers x {self.n_expert} experts, "
            f"top-{self.top_k}, {weights}; {self.dropped_batches} dummy batches dropped "
            f"({self.dropped_tokens} tokens)"
        )


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """A hidden folder beside `out` to fill; renamed to `out` when the block succeeds,
    removed when it fails (Ctrl-C too), so `out` appears whole or not at all."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        if out.exists():
            raise RecordingError(f"{out} appeared while importing; remove it or pick another -o")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_folder(out: Path) -> None:
    """Refuse an output that exists before reading anything."""
    if out.exists() or out.is_symlink():
        raise RecordingError(f"-o {out} already exists; remove it or pick another path for the trace")


class _Importer:
    """The state of one import: what the recording said of its model, and the trace so far."""

    def __init__(self, options: ImportOptions, tmp: Path) -> None:
        self.options = options
        self.tmp = tmp
        self.said: dict[str, tuple[Any, str]] = {}  # fact -> (value, who said it)
        shape = options.shape
        if shape is not None:
            by = f"--shape {shape.name}"
            for key, value in (
                ("n_expert", shape.n_expert),
                ("top_k", shape.top_k),
                ("n_layers", shape.n_layers),
            ):
                self._agree(key, value, by)
        if options.n_expert is not None:
            self._agree("n_expert", options.n_expert, "--n-expert")
        self.first: RecordedSequence | None = None
        self.writer: TraceWriter | None = None
        self.starts: list[int] = []
        self.tokens = 0
        self.dropped_batches = 0
        self.dropped_tokens = 0

    def _agree(self, key: str, value: Any, said_by: str) -> None:
        if value is None:
            return
        known = self.said.get(key)
        if known is None:
            self.said[key] = (value, said_by)
        elif known[0] != value:
            raise RecordingError(
                f"{said_by} says {key} = {value}, but {known[1]} says {known[0]}: they must agree "
                "(the wrong --shape/--n-expert, or recordings of different models)"
            )

    def value(self, key: str) -> Any:
        known = self.said.get(key)
        return None if known is None else known[0]

    def header(self, path: Path, header: RecordingHeader) -> None:
        by = f"{where(path, header.line)} (meta line)"
        self._agree("model", header.model, by)
        self._agree("n_layers", header.n_layers, by)
        self._agree("n_expert", header.n_expert, by)
        self._agree("top_k", header.top_k, by)

    def add(self, seq: RecordedSequence) -> None:
        at = where(seq.path, seq.first_line)
        n_expert = self.value("n_expert")
        if n_expert is None:
            raise RecordingError(
                f"{at}: the recording does not say how many experts the model has: give --n-expert N, "
                "or --shape NAME for a published model"
            )
        if self.first is None:
            self._check_geometry(seq, at)
            self.first = seq
        else:
            self._check_like_first(seq, at)
        check_routes(seq, n_expert)
        dummies = dummy_batches(seq)
        if dummies:
            mask = np.ones(seq.n_tokens, dtype=bool)
            for start, stop in dummies:
                mask[start:stop] = False
            self.dropped_batches += len(dummies)
            self.dropped_tokens += seq.n_tokens - int(mask.sum())
            seq = seq.keep(mask)
        if seq.n_tokens == 0:
            return
        writer = self.writer if self.writer is not None else self._open_writer(seq)
        for j, il in enumerate(seq.layers):
            rows: dict[str, np.ndarray] = {"ids": seq.ids[:, j]}
            if seq.weights is not None:
                rows["weights"] = seq.weights[:, j]
            writer.add(il, self.tokens, **rows)
        self.starts.append(self.tokens)
        self.tokens += seq.n_tokens

    def _check_geometry(self, seq: RecordedSequence, at: str) -> None:
        top_k = self.value("top_k")
        if top_k is not None and seq.k != top_k:
            raise RecordingError(
                f"{at}: the rows select {seq.k} experts per token, {self.said['top_k'][1]} says top-{top_k}"
            )
        n_layers = self.value("n_layers")
        if n_layers is not None and seq.layers[-1] >= n_layers:
            raise RecordingError(
                f"{at}: the recording routes layer {seq.layers[-1]}, but {self.said['n_layers'][1]} says the "
                f"model has {n_layers} layers (0..{n_layers - 1})"
            )
        shape = self.options.shape
        if shape is not None:
            other = [il for il in seq.layers if il not in shape.moe_layers]
            if other:
                raise RecordingError(
                    f"{at}: layer {other[0]} is not a MoE layer of {shape.name} (its MoE layers are "
                    f"{shape.moe_layers[0]}..{shape.moe_layers[-1]}): the wrong --shape, or a recording "
                    "that numbers its layers otherwise"
                )

    def _check_like_first(self, seq: RecordedSequence, at: str) -> None:
        first = self.first
        assert first is not None
        was = where(first.path, first.first_line)
        if seq.k != first.k:
            raise RecordingError(
                f"{at}: the rows select {seq.k} experts per token, those of {was} {first.k}: a recording "
                "has one top-k for every row (mixed k)"
            )
        if seq.layers != first.layers:
            extra = sorted(set(seq.layers) ^ set(first.layers))
            raise RecordingError(
                f"{at}: the sequence routes {len(seq.layers)} layers, that of {was} {len(first.layers)} "
                f"(they differ in layer {extra[0]}): every sequence routes the same MoE layers"
            )
        if (seq.weights is None) != (first.weights is None):
            has, lacks = (at, was) if seq.weights is not None else (was, at)
            raise RecordingError(
                f"{has} has gate weights, {lacks} has none: a recording has weights on every row or on none"
            )

    def _open_writer(self, seq: RecordedSequence) -> TraceWriter:
        shape = self.options.shape
        meta = TraceMeta(
            model="",  # named at the end, once every meta line is read
            fingerprint="",  # no model file: the recording names its model only
            n_layers=self.value("n_layers") or seq.layers[-1] + 1,
            moe_layers=list(seq.layers),
            n_expert=self.value("n_expert"),
            n_expert_used=seq.k,
            n_embd=shape.n_embd if shape is not None else 0,
            fields=["ids", "weights"] if seq.weights is not None else ["ids"],
            source="imported",
            hidden_rows=False,
        )
        self.writer = TraceWriter(self.tmp, meta, chunk_tokens=self.options.chunk_tokens)
        return self.writer


def import_recording(
    inputs: Sequence[Path], out: Path, options: ImportOptions | None = None
) -> ImportSummary:
    """Read the recording files (or folders of them) `inputs` into the ids-only trace `out`."""
    options = options or ImportOptions()
    check_output_folder(out)
    files = list_inputs(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = options.format
    with atomic_directory(out) as tmp:
        importer = _Importer(options, tmp)
        for path in files:
            found = options.format or detect_format(path)
            if fmt is None:
                fmt = found
            elif found != fmt:
                raise RecordingError(
                    f"{path}: a {found} file among {fmt} files ({files[0]}): import one format at a time"
                )
            header, sequences = _OPENERS[fmt](path)
            importer.header(path, header)
            for seq in sequences:
                importer.add(seq)
        writer = importer.writer
        if writer is None:
            raise RecordingError(
                f"nothing to import: every batch of the {len(files)} files was dummy rows (every token "
                "routed to the same experts at every layer)"
            )
        shape_name = options.shape.name if options.shape is not None else None
        folder = inputs[0] if inputs[0].is_dir() else inputs[0].resolve().parent
        model = options.model_name or importer.value("model") or shape_name or folder.resolve().name
        writer.meta.model = model
        writer.meta.sequence_starts = importer.starts
        writer.meta.extra.update(
            imported_format=fmt,
            imported_files=len(files),
            recording=folder.resolve().name,
            dropped_batches=importer.dropped_batches,
            dropped_tokens=importer.dropped_tokens,
            **({"shape": shape_name} if shape_name else {}),
        )
        writer.close()
        meta = writer.meta
    assert fmt is not None
    return ImportSummary(
        path=out,
        format=fmt,
        model=meta.model,
        files=len(files),
        sequences=len(importer.starts),
        tokens=meta.n_tokens,
        moe_layers=len(meta.moe_layers),
        n_expert=meta.n_expert,
        top_k=meta.n_expert_used,
        has_weights=meta.has_weights,
        dropped_batches=importer.dropped_batches,
        dropped_tokens=importer.dropped_tokens,
    )
