"""What every recording reader hands over, and the checks all of them share.

A reader turns one file into `RecordedSequence`s: the expert ids of every
(token, MoE layer) of one prompt, the line each row came from (so a later
check can still name it), and the batches the recorder ran together (the
unit a logger's warm-up rows fill). Everything that does not depend on the
file's syntax is checked here: expert ids inside the model's count and
distinct within a row, finite weights, and batches of identical routes
(warm-up or dummy rows) found so the importer can drop them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt


class RecordingError(ValueError):
    """A routing recording that cannot be imported; the message names the file and line."""


def where(path: Path, line: int) -> str:
    """`path:line`, or `path` alone when no line is known (0)."""
    return f"{path}:{line}" if line > 0 else str(path)


@dataclass(frozen=True)
class RecordingHeader:
    """What a recording says of its model itself; None where it says nothing."""

    model: str | None = None
    n_layers: int | None = None
    n_expert: int | None = None
    top_k: int | None = None
    line: int = 0  # the line that says it (0: no such line)


@dataclass
class RecordedSequence:
    """One prompt's routing, token-major: ids[t, j] are the experts token t chose at layers[j]."""

    path: Path
    first_line: int
    layers: tuple[int, ...]  # model layer numbers, ascending
    ids: npt.NDArray[np.int64]  # [T, L, k]
    lines: npt.NDArray[np.int64]  # [T, L]: the line each row came from
    weights: npt.NDArray[np.float32] | None  # [T, L, k], None when the recording has no weights
    batches: tuple[tuple[int, int], ...]  # token ranges the recorder ran together, covering 0..T

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    def at(self, t: int, j: int) -> str:
        return where(self.path, int(self.lines[t, j]))

    def keep(self, mask: npt.NDArray[np.bool_]) -> RecordedSequence:
        """The sequence without the tokens `mask` leaves out (batch ranges renumbered)."""
        kept = np.flatnonzero(mask)
        new_index = np.cumsum(mask) - 1
        batches = []
        for start, stop in self.batches:
            inside = kept[(kept >= start) & (kept < stop)]
            if inside.size:
                batches.append((int(new_index[inside[0]]), int(new_index[inside[-1]]) + 1))
        return RecordedSequence(
            self.path,
            self.first_line,
            self.layers,
            self.ids[kept],
            self.lines[kept],
            None if self.weights is None else self.weights[kept],
            tuple(batches),
        )


def layer_counts_problem(path: Path, counts: dict[int, int], last_lines: dict[int, int]) -> str | None:
    """The layer whose token count differs from the others' (one message), or None.

    Every MoE layer of one forward pass routes the same tokens, so a layer with
    fewer or more rows is a cut or damaged recording; the odd one out is the
    layer whose count differs from the most common one."""
    values = list(counts.values())
    if len(set(values)) <= 1:
        return None
    common = max(set(values), key=values.count)
    odd = next(il for il, n in counts.items() if n != common)
    other = next(il for il, n in counts.items() if n == common)
    return (
        f"{where(path, last_lines[odd])}: layer {odd} has {counts[odd]} tokens, layer {other} "
        f"{common} (every MoE layer of a sequence routes the same tokens): the recording is cut or "
        "damaged; record it again or leave this file out"
    )


def check_routes(seq: RecordedSequence, n_expert: int) -> None:
    """Expert ids inside 0..n_expert-1 and distinct within each row; finite weights."""
    ids = seq.ids
    bad = (ids < 0) | (ids >= n_expert)
    if bad.any():
        t, j, i = (int(v) for v in np.argwhere(bad)[0])
        raise RecordingError(
            f"{seq.at(t, j)}: expert id {int(ids[t, j, i])} is outside 0..{n_expert - 1} "
            f"(the model has {n_expert} experts): a damaged recording, or the wrong --n-expert/--shape"
        )
    if seq.k > 1:
        ordered = np.sort(ids, axis=2)
        twice = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
        if twice.any():
            t, j = (int(v) for v in np.argwhere(twice)[0])
            raise RecordingError(
                f"{seq.at(t, j)}: the row selects one expert twice ({ids[t, j].tolist()}); the "
                "top-k experts of a token are distinct: a damaged recording"
            )
    if seq.weights is not None:
        finite = np.isfinite(seq.weights).all(axis=2)
        if not finite.all():
            t, j = (int(v) for v in np.argwhere(~finite)[0])
            raise RecordingError(f"{seq.at(t, j)}: a weight is not a finite number: a damaged recording")


def dummy_batches(seq: RecordedSequence) -> list[tuple[int, int]]:
    """The batches of two or more tokens in which every token chose the same experts at every
    layer: what loggers write for warm-up or padding runs, never a real prompt's routing
    (a real model's tokens spread over its experts within a few tokens)."""
    out = []
    ordered = np.sort(seq.ids, axis=2)  # a route is a set of experts: order does not matter
    for start, stop in seq.batches:
        if stop - start >= 2 and bool((ordered[start:stop] == ordered[start]).all()):
            out.append((start, stop))
    return out


def runs(values: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(start, stop) ranges of equal consecutive values."""
    out = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i))
            start = i
    return tuple(out)
