"""vllm-jsonl: routing logged from vLLM's fused-MoE top-k, one JSON object a line.

    {"type": "meta", "model": "deepseek-ai/DeepSeek-V2-Lite-Chat", "n_layers": 27, "n_experts": 64,
     "top_k": 6}
    {"type": "route", "token_idx": 0, "layer": 1, "topk_ids": [8, 26, 56, 57, 60, 43],
     "topk_weights": [0.31, 0.2, 0.15, 0.13, 0.11, 0.1]}

The meta line, when there is one, comes first; every other line is a route:
one token's experts at one layer (the layer's number in the model) and their
gate weights (optional, but present on every route or on none). A layer's
token_idx counts up by one; a token_idx not above the last one of its layer
starts a new sequence (a new prompt), and so does every file. Within a
sequence, routes may come token by token or layer by layer (a prefill batch).

Memory: one sequence's routes at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.formats.importers.recording import (
    RecordedSequence,
    RecordingError,
    RecordingHeader,
    layer_counts_problem,
    where,
)

_DAMAGED = "a damaged recording"
_ID_LIMIT = 1 << 31  # ids are parsed into int64; no model has this many experts


@dataclass
class _LayerRoutes:
    first_token: int
    last_token: int
    ids: list[list[int]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


def is_vllm_jsonl(first_line: str) -> bool:
    """Whether a file's first line is one of vllm-jsonl's objects."""
    try:
        first = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(first, dict) and first.get("type") in ("meta", "route")


def open_vllm_jsonl(path: Path) -> tuple[RecordingHeader, Iterator[RecordedSequence]]:
    """The file's meta line (if it has one) and its sequences, read as they are iterated."""
    header = RecordingHeader()
    for line, text in _lines(path):
        record = _object(path, line, text)
        if record.get("type") == "meta":
            header = _header(path, line, record)
        break
    return header, _sequences(path)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the file's non-blank lines."""
    with open(path, encoding="utf-8") as f:
        line = 0
        try:
            for line, text in enumerate(f, 1):  # line names a failure below
                if text.strip():
                    yield line, text
        except UnicodeDecodeError as exc:
            raise RecordingError(
                f"{where(path, line + 1)}: not UTF-8 text ({exc.reason}): {_DAMAGED}"
            ) from None


def _object(path: Path, line: int, text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise RecordingError(f"{where(path, line)}: not a JSON object ({exc}): {_DAMAGED}") from None
    if not isinstance(record, dict):
        raise RecordingError(
            f"{where(path, line)}: a JSON {type(record).__name__}, not an object: {_DAMAGED}"
        )
    return record


def _count(path: Path, line: int, record: dict[str, Any], key: str, low: int) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RecordingError(
            f"{where(path, line)}: {key} must be an integer of at least {low}, not {value!r:.40}"
        )
    return value


def _header(path: Path, line: int, record: dict[str, Any]) -> RecordingHeader:
    model = record.get("model")
    if model is not None and not isinstance(model, str):
        raise RecordingError(f"{where(path, line)}: model must be a name, not {model!r:.40}")
    return RecordingHeader(
        model=model or None,
        n_layers=_count(path, line, record, "n_layers", 1),
        n_expert=_count(path, line, record, "n_experts", 1),
        top_k=_count(path, line, record, "top_k", 1),
        line=line,
    )


def _int_list(path: Path, line: int, value: Any, key: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
    ):
        raise RecordingError(
            f"{where(path, line)}: {key} must be a list of integers, not {value!r:.60}: {_DAMAGED}"
        )
    if any(not -_ID_LIMIT < v < _ID_LIMIT for v in value):
        raise RecordingError(
            f"{where(path, line)}: {key} {value!r:.60} names an expert no model has: {_DAMAGED}"
        )
    return value


def _number_list(path: Path, line: int, value: Any, key: str) -> list[float]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int | float) for v in value
    ):
        raise RecordingError(
            f"{where(path, line)}: {key} must be a list of numbers, not {value!r:.60}: {_DAMAGED}"
        )
    return value


class _Reader:
    """Routes of one file, cut into sequences."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.k = 0
        self.k_line = 0
        self.has_weights: bool | None = None
        self.weights_line = 0

    def route(self, line: int, record: dict[str, Any]) -> tuple[int, int, list[int], list[float] | None]:
        path = self.path
        token = _count(path, line, record, "token_idx", 0)
        layer = _count(path, line, record, "layer", 0)
        if token is None or layer is None:
            missing = "token_idx" if token is None else "layer"
            raise RecordingError(f"{where(path, line)}: a route without {missing}: {_DAMAGED}")
        ids = _int_list(path, line, record.get("topk_ids"), "topk_ids")
        if self.k == 0:
            self.k, self.k_line = len(ids), line
        elif len(ids) != self.k:
            raise RecordingError(
                f"{where(path, line)}: the route lists {len(ids)} experts, line {self.k_line} lists "
                f"{self.k}: a recording has one top-k for every route (mixed k)"
            )
        raw_weights = record.get("topk_weights")
        if self.has_weights is None:
            self.has_weights, self.weights_line = raw_weights is not None, line
        elif (raw_weights is not None) != self.has_weights:
            has, lacks = (line, self.weights_line) if raw_weights is not None else (self.weights_line, line)
            raise RecordingError(
                f"{where(path, line)}: line {has} has topk_weights, line {lacks} has none: a "
                "recording has weights on every route or on none"
            )
        weights = None
        if raw_weights is not None:
            weights = _number_list(path, line, raw_weights, "topk_weights")
            if len(weights) != len(ids):
                raise RecordingError(
                    f"{where(path, line)}: {len(weights)} topk_weights for {len(ids)} topk_ids: {_DAMAGED}"
                )
        return token, layer, ids, weights


def _sequences(path: Path) -> Iterator[RecordedSequence]:
    reader = _Reader(path)
    current: dict[int, _LayerRoutes] = {}
    routes = 0
    for line, text in _lines(path):
        record = _object(path, line, text)
        kind = record.get("type")
        if kind == "meta":
            if routes:
                raise RecordingError(f"{where(path, line)}: a meta line after routes: it must come first")
            continue
        if kind != "route":
            raise RecordingError(
                f"{where(path, line)}: a line of type {kind!r:.40}, not 'meta' or 'route': {_DAMAGED}"
            )
        token, layer, ids, weights = reader.route(line, record)
        routes += 1
        rows = current.get(layer)
        if rows is not None and token <= rows.last_token:  # the token count starts again: a new prompt
            yield _assemble(path, current, reader.has_weights)
            current, rows = {}, None
        if rows is None:
            rows = current[layer] = _LayerRoutes(first_token=token, last_token=token - 1)
        if token != rows.last_token + 1:
            raise RecordingError(
                f"{where(path, line)}: layer {layer} jumps from token_idx {rows.last_token} to {token} "
                f"(line {rows.lines[-1]}): routes are missing: {_DAMAGED}"
            )
        rows.last_token = token
        rows.ids.append(ids)
        rows.lines.append(line)
        if weights is not None:
            rows.weights.append(weights)
    if not routes:
        raise RecordingError(f"{path}: the file holds no routes; leave it out")
    yield _assemble(path, current, reader.has_weights)


def _assemble(path: Path, layers: dict[int, _LayerRoutes], has_weights: bool | None) -> RecordedSequence:
    order = sorted(layers)
    problem = layer_counts_problem(
        path, {il: len(layers[il].ids) for il in order}, {il: layers[il].lines[-1] for il in order}
    )
    if problem is not None:
        raise RecordingError(problem)
    starts = {il: layers[il].first_token for il in order}
    if len(set(starts.values())) > 1:
        a, b = order[0], next(il for il in order if starts[il] != starts[order[0]])
        raise RecordingError(
            f"{where(path, layers[b].lines[0])}: layer {b} starts at token_idx {starts[b]}, layer {a} at "
            f"{starts[a]} (every MoE layer of a sequence routes the same tokens): {_DAMAGED}"
        )
    ids = np.stack([np.asarray(layers[il].ids, dtype=np.int64) for il in order], axis=1)
    lines = np.stack([np.asarray(layers[il].lines, dtype=np.int64) for il in order], axis=1)
    weights = None
    if has_weights:
        weights = np.stack([np.asarray(layers[il].weights, dtype=np.float32) for il in order], axis=1)
    n = int(ids.shape[0])
    return RecordedSequence(
        path=path,
        first_line=int(lines.min()),
        layers=tuple(order),
        ids=ids,
        lines=lines,
        weights=weights,
        batches=((0, n),),  # vLLM logs no batch: the sequence is the unit a warm-up run fills
    )
