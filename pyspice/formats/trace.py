"""One trace format for calibration captures and decode traces.

A trace is a directory:

- `meta.json`: a `TraceMeta` (format version, model name and fingerprint,
  layer geometry, fields present, token count, source, free-form `extra`,
  and `complete`, written last by a clean close);
- chunk files `L{layer:04d}_T{start:010d}_N{count:07d}.npz`, each one MoE layer
  times a contiguous token range. Floats are stored as float16 (clipped to its
  range), expert ids as int16 (int32 when there are more than 32767 experts).

Fields (all [n, ...] over the chunk's tokens):

    hidden     [n, n_embd]          MoE input
    probs      [n, n_expert]        router probabilities
    ids        [n, k]               selected experts
    weights    [n, k]               their gate weights
    shared     [n, n_embd]          optional: shared-expert output before its gate
    expert_out [n, k, n_embd]       optional: outputs of the selected experts

An ids-only trace (`hidden_rows: false` in meta.json; fields ("ids",) or
("ids", "weights")) holds routing alone, as a real model's routing recording
gives it (`pyspice trace import`): no hidden, probs or expert rows, `n_embd`
may be 0, and its header carries what a reader needs without a model (MoE
layers, experts, k, and `sequence_starts`, the first token of each prompt).
Anything that asks such a trace for hidden rows or probabilities gets a
TraceError naming what is absent; `routing()` works on it (uniform gate
weights when the recording has none).

A chunk file appears under its final name only when it is completely written
(written to a temporary name, then renamed), so an interrupted writer leaves
whole chunks and a meta.json with `complete: false`; `TraceWriter(...,
resume=True)` continues after the tokens every layer already has. The writer
keeps at most `max_buffer_bytes` of unwritten rows in memory (the largest
layer buffer is flushed first), whatever the number of layers.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.outputs import atomic_output
from pyspice.policy.base import HookCall, Plan, Policy, PolicyBase, attach_policy, is_lossless, policy_reads
from pyspice.policy.context import PolicyContext

FORMAT = "pyspice-trace"
FORMAT_VERSION = 2  # 2: ids-only traces (hidden_rows, sequence_starts); version 1 traces read as before
FIELDS: tuple[str, ...] = ("hidden", "probs", "ids", "weights", "shared", "expert_out")
REQUIRED_FIELDS: tuple[str, ...] = ("hidden", "probs", "ids", "weights")
IDS_ONLY_FIELDS: tuple[tuple[str, ...], ...] = (("ids",), ("ids", "weights"))
SOURCES = ("calibration", "decode", "imported")  # imported: another runtime's recording (trace import)
_CHUNK_RE = re.compile(r"^L(\d{4})_T(\d{10})_N(\d{7})\.npz$")
_F16_MAX = float(np.finfo(np.float16).max)


class TraceError(ValueError):
    """A trace directory that cannot be read or continued."""


@dataclass
class TraceMeta:
    model: str  # model name (file name or general.name)
    fingerprint: str  # pyspice.formats.sidecar.fingerprint() of the model file, or "" if unknown
    n_layers: int
    moe_layers: list[int]
    n_expert: int
    n_expert_used: int
    n_embd: int
    fields: list[str] = field(default_factory=lambda: list(REQUIRED_FIELDS))
    source: str = "calibration"  # "calibration" | "decode" | "imported"
    n_tokens: int = 0  # tokens every MoE layer has (set by the writer)
    complete: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # False for an ids-only trace: no hidden/probs rows exist (a recording of routing alone)
    hidden_rows: bool = True
    # the first token of each sequence (prompt) in the trace, ascending from 0; [] = one sequence
    sequence_starts: list[int] = field(default_factory=list)
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        unknown = [f for f in self.fields if f not in FIELDS]
        if unknown:
            raise TraceError(f"unknown trace fields {unknown}; known: {', '.join(FIELDS)}")
        if self.hidden_rows:
            missing = [f for f in REQUIRED_FIELDS if f not in self.fields]
            if missing:
                raise TraceError(
                    f"a trace needs the fields {', '.join(REQUIRED_FIELDS)}; missing {missing} "
                    "(a trace of routing alone says so with hidden_rows: false)"
                )
        elif tuple(self.fields) not in IDS_ONLY_FIELDS:
            allowed = " or ".join(str(list(f)) for f in IDS_ONLY_FIELDS)
            raise TraceError(
                f"an ids-only trace (hidden_rows: false) holds the fields {allowed}, not {self.fields}"
            )
        if self.source not in SOURCES:
            raise TraceError(f"trace source must be one of {SOURCES}, got {self.source!r}")
        self.moe_layers = [int(il) for il in self.moe_layers]
        self.sequence_starts = [int(t) for t in self.sequence_starts]

    @property
    def ids_only(self) -> bool:
        """Routing alone: no hidden rows or probabilities (an imported recording)."""
        return not self.hidden_rows

    @property
    def kind(self) -> str:
        return "ids-only" if self.ids_only else "full"

    @property
    def has_weights(self) -> bool:
        return "weights" in self.fields

    @property
    def prompt_rows(self) -> int:
        """How many of the trace's first tokens are a prompt's rows: `extra['prompt_tokens']`
        less the rows the recorder skipped (`extra['prompt_rows_skipped']`: generate/bench
        --trace keep decode steps only, so none), 0 when the meta names no prompt. The
        simulator's prompt step and routing replay's first decode step both read it."""
        prompt = self.extra.get("prompt_tokens", 0)
        skipped = self.extra.get("prompt_rows_skipped", 0)
        return max(0, int(prompt or 0) - int(skipped or 0))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, raw: Any) -> TraceMeta:
        if not isinstance(raw, dict):
            raise TraceError(f"not a pyspice trace (meta.json holds a {type(raw).__name__}, not an object)")
        if raw.get("format") != FORMAT:
            raise TraceError(f"not a pyspice trace (format {raw.get('format')!r})")
        if isinstance(raw.get("version"), int) and raw["version"] > FORMAT_VERSION:
            raise TraceError(
                f"trace format version {raw.get('version')} is newer than this pyspice reads "
                f"({FORMAT_VERSION}): upgrade pyspice"
            )
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in raw.items() if k in known}
        check_meta_values(values)
        return cls(**values)

    def compatible_with(self, other: TraceMeta) -> bool:
        """Same model, geometry and fields (what resuming requires)."""
        keys = ("model", "fingerprint", "n_layers", "moe_layers", "n_expert", "n_expert_used", "n_embd",
                "hidden_rows")  # fmt: skip
        return all(getattr(self, k) == getattr(other, k) for k in keys) and set(self.fields) == set(
            other.fields
        )


_META_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "fingerprint": (str,), "n_layers": (int,), "moe_layers": (list,),
    "n_expert": (int,), "n_expert_used": (int,), "n_embd": (int,), "fields": (list,),
    "source": (str,), "n_tokens": (int,), "complete": (bool,), "extra": (dict,),
    "version": (int,), "hidden_rows": (bool,), "sequence_starts": (list,),
}  # fmt: skip
_META_LIMIT = 1 << 24  # no model has more layers, experts or embedding width; bounds what a reader allocates


def check_meta_values(values: dict[str, Any]) -> None:
    """A meta.json's values as the reader relies on them: types, ranges, and layers, experts
    and fields that agree (one TraceError naming the first problem)."""
    problem = _meta_problem(values)
    if problem is not None:
        raise TraceError(f"{problem} (a damaged meta.json: record the trace again)")


def _meta_problem(values: dict[str, Any]) -> str | None:
    for key, types in _META_TYPES.items():
        if key in values and (
            not isinstance(values[key], types) or (types == (int,) and isinstance(values[key], bool))
        ):
            want = "true/false" if types == (bool,) else types[0].__name__
            return f"{key} must be a {want}, not {values[key]!r:.40}"
    for key in ("n_layers", "n_expert", "n_expert_used", "n_embd", "model", "fingerprint", "moe_layers"):
        if key not in values:
            return f"{key} is missing"
    for key in ("n_layers", "n_expert", "n_expert_used", "n_embd"):
        # an ids-only trace may not know the model's width (nothing of that width is stored)
        low = 0 if key == "n_embd" and values.get("hidden_rows") is False else 1
        if not low <= values[key] <= _META_LIMIT:
            return f"{key} = {values[key]} is outside {low}..{_META_LIMIT}"
    if values["n_expert_used"] > values["n_expert"]:
        return f"n_expert_used = {values['n_expert_used']} exceeds n_expert = {values['n_expert']}"
    if values.get("n_tokens", 0) < 0:
        return f"n_tokens = {values['n_tokens']} is negative"
    layers = values["moe_layers"]
    if (
        not layers
        or any(isinstance(il, bool) or not isinstance(il, int) for il in layers)
        or any(not 0 <= il < values["n_layers"] for il in layers)
        or len(set(layers)) != len(layers)
    ):
        return f"moe_layers must be distinct layer numbers in 0..{values['n_layers'] - 1}, not {layers!r:.60}"
    if "fields" in values and any(not isinstance(f, str) for f in values["fields"]):
        return f"fields must be names, not {values['fields']!r:.60}"
    starts = values.get("sequence_starts", [])
    if any(isinstance(t, bool) or not isinstance(t, int) for t in starts) or (
        starts and (starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)))
    ):
        return f"sequence_starts must be ascending token numbers from 0, not {starts!r:.60}"
    return None


def _field_shape(meta: TraceMeta, name: str, count: int) -> tuple[int, ...]:
    width = {"hidden": meta.n_embd, "probs": meta.n_expert, "ids": meta.n_expert_used,
             "weights": meta.n_expert_used, "shared": meta.n_embd}  # fmt: skip
    if name == "expert_out":
        return (count, meta.n_expert_used, meta.n_embd)
    return (count, width[name])


@dataclass(frozen=True)
class Chunk:
    layer: int
    start: int
    count: int
    path: Path

    @property
    def stop(self) -> int:
        return self.start + self.count


def _chunk_name(layer: int, start: int, count: int) -> str:
    return f"L{layer:04d}_T{start:010d}_N{count:07d}.npz"


def scan_chunks(path: Path) -> dict[int, list[Chunk]]:
    """The complete chunk files of a trace directory, per layer, in token order."""
    out: dict[int, list[Chunk]] = {}
    for entry in os.scandir(path):
        m = _CHUNK_RE.match(entry.name)
        if m is None:
            continue
        layer, start, count = (int(g) for g in m.groups())
        out.setdefault(layer, []).append(Chunk(layer, start, count, Path(entry.path)))
    for chunks in out.values():
        chunks.sort(key=lambda c: c.start)
    return out


def _contiguous_tokens(chunks: list[Chunk]) -> int:
    """Tokens 0..n-1 covered without a gap by these chunks."""
    n = 0
    for c in chunks:
        if c.start != n:
            break
        n = c.stop
    return n


def _store_dtype(name: str, n_expert: int) -> type:
    if name == "ids":
        return np.int16 if n_expert <= np.iinfo(np.int16).max else np.int32
    return np.float16


def _to_store(name: str, value: npt.ArrayLike, n_expert: int) -> np.ndarray:
    arr = np.asarray(value)
    dtype = _store_dtype(name, n_expert)
    if dtype is np.float16:
        return np.clip(arr.astype(np.float32, copy=False), -_F16_MAX, _F16_MAX).astype(np.float16)
    return arr.astype(dtype)


class TraceWriter:
    """Streams hook records into a trace directory.

    `add(layer, token_start, **fields)` appends rows for tokens token_start ..
    token_start + n - 1 of one MoE layer. Rows of a layer must come in token
    order without gaps. With resume=True an existing incomplete trace of the
    same model continues: `resume_from` is the first token not yet written for
    every layer, and rows before it are ignored.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: TraceMeta,
        *,
        resume: bool = False,
        chunk_tokens: int = 512,
        max_buffer_bytes: int = 64 << 20,
    ) -> None:
        self.path = Path(path)
        self.meta = meta
        self.chunk_tokens = max(1, int(chunk_tokens))
        self.max_buffer_bytes = int(max_buffer_bytes)
        self._buf: dict[int, dict[str, list[np.ndarray]]] = {}
        self._buf_start: dict[int, int] = {}
        self._buf_rows: dict[int, int] = {}
        self._buf_bytes: dict[int, int] = {}
        self._next: dict[int, int] = {il: 0 for il in meta.moe_layers}
        self._closed = False
        self.resume_from = 0
        meta_path = self.path / "meta.json"
        if meta_path.exists():
            old = read_meta(self.path)
            if not resume:
                raise TraceError(f"{self.path} already holds a trace; remove it or resume it")
            if old.complete:
                raise TraceError(f"{self.path} holds a complete trace; remove it to record a new one")
            if not old.compatible_with(meta):
                raise TraceError(f"{self.path} holds a trace of another model or shape; remove it")
            self.resume_from = self._drop_partial_tail()
            meta.extra = {**old.extra, **meta.extra}
        else:
            self.path.mkdir(parents=True, exist_ok=True)
        for il in meta.moe_layers:
            self._next[il] = self.resume_from
        meta.complete = False
        meta.n_tokens = self.resume_from
        self._write_meta()

    def _drop_partial_tail(self) -> int:
        """Keep, for every layer, only chunks below the token count all layers share."""
        chunks = scan_chunks(self.path)
        common = min((_contiguous_tokens(chunks.get(il, [])) for il in self.meta.moe_layers), default=0)
        for layer_chunks in chunks.values():
            for c in layer_chunks:
                if c.stop > common:
                    c.path.unlink()
        for entry in os.scandir(self.path):
            if entry.name.endswith(".tmp.npz"):
                os.unlink(entry.path)
        return common

    def _write_meta(self) -> None:
        with atomic_output(self.path / "meta.json") as tmp:
            tmp.write_text(self.meta.to_json())

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.flush(complete=False)

    def add(self, layer: int, token_start: int, **fields: npt.ArrayLike) -> None:
        if self._closed:
            raise TraceError("the trace writer is closed")
        if layer not in self._next:
            raise TraceError(f"layer {layer} is not a MoE layer of this trace ({self.meta.moe_layers})")
        names = set(fields)
        expected = set(self.meta.fields)
        if names != expected:
            raise TraceError(f"add() needs exactly the fields {sorted(expected)}, got {sorted(names)}")
        arrays = {k: np.asarray(v) for k, v in fields.items()}
        n = int(arrays["ids"].shape[0])
        if any(int(a.shape[0]) != n for a in arrays.values()):
            raise TraceError("all fields of one add() must have the same number of rows")
        skip = self.resume_from - token_start
        if skip >= n:
            return  # already written before an interruption
        if skip > 0:
            arrays = {k: a[skip:] for k, a in arrays.items()}
            token_start += skip
            n -= skip
        if token_start != self._next[layer]:
            raise TraceError(
                f"layer {layer}: rows must follow in token order; expected token {self._next[layer]}, "
                f"got {token_start}"
            )
        stored = {k: _to_store(k, a, self.meta.n_expert) for k, a in arrays.items()}
        if layer not in self._buf:
            self._buf[layer] = {k: [] for k in stored}
            self._buf_start[layer] = token_start
            self._buf_rows[layer] = 0
            self._buf_bytes[layer] = 0
        for k, a in stored.items():
            self._buf[layer][k].append(a)
        self._buf_rows[layer] += n
        self._buf_bytes[layer] += sum(a.nbytes for a in stored.values())
        self._next[layer] = token_start + n
        if self._buf_rows[layer] >= self.chunk_tokens:
            self._flush_layer(layer)
        while sum(self._buf_bytes.values()) > self.max_buffer_bytes:
            self._flush_layer(max(self._buf_bytes, key=lambda il: self._buf_bytes[il]))

    def _flush_layer(self, layer: int) -> None:
        parts = self._buf.pop(layer, None)
        if parts is None:
            return
        start = self._buf_start.pop(layer)
        count = self._buf_rows.pop(layer)
        self._buf_bytes.pop(layer)
        if count == 0:
            return
        data = {k: np.concatenate(v, axis=0) for k, v in parts.items()}
        name = _chunk_name(layer, start, count)
        with atomic_output(self.path / name, ".tmp.npz") as tmp:
            np.savez(tmp, **data)  # type: ignore[arg-type]

    def flush(self, complete: bool = False) -> None:
        for layer in list(self._buf):
            self._flush_layer(layer)
        counts = [self._next[il] for il in self.meta.moe_layers]
        self.meta.n_tokens = min(counts, default=0)
        self.meta.complete = complete
        self._write_meta()

    def close(self) -> None:
        if self._closed:
            return
        counts = {self._next[il] for il in self.meta.moe_layers}
        if len(counts) > 1:
            self.flush(complete=False)
            self._closed = True
            raise TraceError(f"layers of the trace hold different token counts {sorted(counts)}")
        self.flush(complete=True)
        self._closed = True


def read_meta(path: Path) -> TraceMeta:
    """A trace directory's meta.json, checked (check_meta_values); a TraceError names the file."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise TraceError(f"{path} is not a pyspice trace (no meta.json)")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TraceError(
            f"{meta_path} is not valid JSON ({exc}); the trace is damaged: record it again"
        ) from None
    try:
        return TraceMeta.from_dict(raw)
    except TraceError as exc:
        raise TraceError(f"{meta_path}: {exc}") from None


class TraceReader:
    """Reads a trace directory. Refuses an incomplete trace unless allow_incomplete."""

    def __init__(self, path: str | os.PathLike[str], *, allow_incomplete: bool = False) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        if not self.meta.complete and not allow_incomplete:
            raise TraceError(
                f"{self.path} is an incomplete trace (interrupted); resume the capture or remove it"
            )
        self.chunks = scan_chunks(self.path)
        n = min((_contiguous_tokens(self.chunks.get(il, [])) for il in self.meta.moe_layers), default=0)
        if self.meta.complete and n < self.meta.n_tokens:
            raise TraceError(
                f"{self.path}: the trace is complete with {self.meta.n_tokens} tokens, but its chunk "
                f"files hold {n} for every layer (files missing or renamed); record it again"
            )
        self.n_tokens = n if not self.meta.complete else min(n, self.meta.n_tokens)
        starts = self.meta.sequence_starts
        if self.meta.complete and starts and starts[-1] >= self.n_tokens:
            raise TraceError(
                f"{self.path}: sequence_starts names token {starts[-1]}, but the trace holds "
                f"{self.n_tokens} tokens (a damaged meta.json: record or import it again)"
            )

    def _require(self, names: tuple[str, ...], purpose: str) -> None:
        """A TraceError naming the fields this trace lacks for `purpose`."""
        missing = [f for f in names if f not in self.meta.fields]
        if not missing:
            return
        if self.meta.ids_only:
            raise TraceError(
                f"{self.path} is an ids-only trace (routing alone, hidden rows absent): it has no "
                f"{', '.join(missing)} for {purpose}; use a trace recorded by pyspice "
                "(calibrate, generate/bench --trace) for that"
            )
        raise TraceError(
            f"{self.path}: the trace has no field(s) {missing} for {purpose} (it has {self.meta.fields})"
        )

    def sequences(self) -> list[tuple[int, int]]:
        """(start, stop) token ranges of the trace's sequences (one when the meta names none)."""
        starts = [t for t in self.meta.sequence_starts if t < self.n_tokens] or [0]
        return list(zip(starts, [*starts[1:], self.n_tokens], strict=True))

    def _load(self, chunk: Chunk, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The chunk's fields, checked against the meta (dtype, shape, expert ids) before use;
        a damaged file is a TraceError naming it."""
        damaged = f"{chunk.path}: a damaged trace chunk"
        try:
            z = np.load(chunk.path)
            if not isinstance(z, np.lib.npyio.NpzFile) or z.zip is None:
                raise TraceError(f"{damaged} (not an .npz archive); record the trace again")
            with z:
                out = {}
                for k in fields:
                    shape = _field_shape(self.meta, k, chunk.count)
                    dtype = np.dtype(_store_dtype(k, self.meta.n_expert))
                    member = f"{k}.npy"
                    if member not in z.zip.namelist():
                        raise TraceError(f"{damaged} (no field {k!r}); record the trace again")
                    # the member's size before inflating it: a small file cannot claim gigabytes
                    if z.zip.getinfo(member).file_size > math.prod(shape) * dtype.itemsize + 4096:
                        raise TraceError(f"{damaged} ({k!r} is larger than {shape}); record the trace again")
                    arr = z[k]
                    if arr.shape != shape or arr.dtype != dtype:
                        raise TraceError(
                            f"{damaged} ({k!r} is {arr.dtype}{list(arr.shape)}, the trace's meta "
                            f"says {dtype}{list(shape)}); record the trace again"
                        )
                    if k == "ids" and arr.size and (arr.min() < 0 or arr.max() >= self.meta.n_expert):
                        raise TraceError(
                            f"{damaged} (expert ids outside 0..{self.meta.n_expert - 1}); "
                            "record the trace again"
                        )
                    out[k] = arr
                return out
        except TraceError:
            raise
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, RuntimeError) as exc:
            raise TraceError(f"{damaged} ({type(exc).__name__}: {exc}); record the trace again") from None

    def layer(self, il: int, fields: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Every token of one layer, concatenated over its chunks (stored dtypes)."""
        names = tuple(fields) if fields is not None else tuple(self.meta.fields)
        self._require(names, "reading a layer")
        parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
        for c in self.chunks.get(il, []):
            if c.start >= self.n_tokens:
                break
            data = self._load(c, names)
            keep = min(c.count, self.n_tokens - c.start)
            for k in names:
                parts[k].append(data[k][:keep])
        if not parts[names[0]]:
            raise TraceError(f"the trace has no rows for layer {il}")
        return {k: np.concatenate(v, axis=0) for k, v in parts.items()}

    def routing(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """ids and weights of every (token, MoE layer): [T, L_moe, k] each, token-major.
        A trace without weights (an ids-only recording that has none) gives 1/k each."""
        T, L, k = self.n_tokens, len(self.meta.moe_layers), self.meta.n_expert_used
        ids = np.zeros((T, L, k), dtype=np.int32)
        weights = np.full((T, L, k), 1.0 / k, dtype=np.float32)
        names = ("ids", "weights") if self.meta.has_weights else ("ids",)
        for j, il in enumerate(self.meta.moe_layers):
            d = self.layer(il, names)
            ids[:, j] = d["ids"]
            if "weights" in d:
                weights[:, j] = d["weights"]
        return ids, weights

    def tokens(self, fields: tuple[str, ...] | None = None) -> Iterator[list[dict[str, np.ndarray]]]:
        """Per token, one record per MoE layer (in `meta.moe_layers` order): field -> row.

        Memory: one chunk per layer of the requested fields."""
        names = tuple(fields) if fields is not None else tuple(self.meta.fields)
        self._require(names, "reading tokens")
        cursors = {il: iter(self.chunks.get(il, [])) for il in self.meta.moe_layers}
        current: dict[int, tuple[Chunk, dict[str, np.ndarray]]] = {}
        for t in range(self.n_tokens):
            record = []
            for il in self.meta.moe_layers:
                cur = current.get(il)
                while cur is None or t >= cur[0].stop:
                    chunk = next(cursors[il])
                    cur = (chunk, self._load(chunk, names))
                    current[il] = cur
                chunk, data = cur
                record.append({"layer": np.int32(il), **{k: data[k][t - chunk.start] for k in names}})
            yield record

    def calls(self) -> Iterator[HookCall]:
        """The trace replayed as one-token hook calls (float32 arrays), token by token, layer by layer."""
        has_shared = "shared" in self.meta.fields
        names = ("hidden", "probs", "ids", "weights", *(("shared",) if has_shared else ()))
        self._require(names, "replaying hook calls")
        for record in self.tokens(names):
            for rec in record:
                yield HookCall(
                    int(rec["layer"]),
                    rec["hidden"].astype(np.float32)[None, :],
                    rec["probs"].astype(np.float32)[None, :],
                    rec["ids"].astype(np.int32)[None, :],
                    rec["weights"].astype(np.float32)[None, :],
                    rec["shared"].astype(np.float32)[None, :] if has_shared else None,
                )


class TraceRecorder(PolicyBase):
    """A policy that records every hook call into a TraceWriter.

    It runs `inner`'s plan (the exact plan when inner is None), so a recorded
    run is the run it records. Token positions count per layer from `position`
    (set it before each independent evaluation when resuming a capture).
    Copies what it reads: the call's arrays are views valid only during decide.

    decode_only=True records only one-token calls (decode steps): in a prompt
    batch llama.cpp hands the last layer only the rows whose logits are
    wanted, so a prompt's rows are not whole for every layer; the prompt
    still runs `inner`'s plan, unrecorded.
    """

    def __init__(
        self, writer: TraceWriter, inner: Policy | None = None, *, decode_only: bool = False
    ) -> None:
        self.writer = writer
        self.inner = inner
        self.decode_only = decode_only
        self.skipped_tokens = 0
        self._in_step = False
        self.name = f"trace+{inner.name}" if inner is not None else "trace"
        self._fields = tuple(writer.meta.fields)
        self._next: dict[int, int] = {il: 0 for il in writer.meta.moe_layers}
        self.calls = 0
        # what the hook must hand over: the fields it records, and what the inner policy reads
        inner_probs, inner_shared = policy_reads(inner)
        self.reads_probs = "probs" in self._fields or inner_probs
        self.reads_shared = "shared" in self._fields or inner_shared

    @property
    def lossless(self) -> bool:
        """As lossless as the plans it runs: a recorded run is the run it records."""
        return self.inner is None or is_lossless(self.inner)

    def attach(self, ctx: PolicyContext) -> None:
        if self.inner is not None:
            attach_policy(self.inner, ctx)

    def set_position(self, token: int) -> None:
        """The next call of every layer starts at this token."""
        for il in self._next:
            self._next[il] = int(token)

    def decide(self, call: HookCall) -> Plan:
        if self.decode_only:
            # a micro-batch is a decode step when its first MoE layer sees one token (the last
            # layer of a prompt batch sees one row too: the one whose logits are wanted)
            if call.layer == self.writer.meta.moe_layers[0]:
                self._in_step = call.n_tokens == 1
                if not self._in_step:
                    self.skipped_tokens += call.n_tokens
            if not self._in_step:
                return self._inner_plan(call)
        fields: dict[str, Any] = {}
        for name in self._fields:
            value = getattr(call, name) if name != "expert_out" else None
            if value is None:
                raise TraceError(f"the hook call of layer {call.layer} has no {name!r} to record")
            fields[name] = np.array(value, copy=True)
        start = self._next.get(call.layer)
        if start is None:
            raise TraceError(f"layer {call.layer} is not a MoE layer of this trace")
        self.writer.add(call.layer, start, **fields)
        self._next[call.layer] = start + call.n_tokens
        self.calls += 1
        return self._inner_plan(call)

    def _inner_plan(self, call: HookCall) -> Plan:
        plan: Plan = self.inner.decide(call) if self.inner is not None else Plan()
        if plan.resume_layer != -1:  # a recorder must see every call: the inner policy is asked at each
            plan = replace(plan, resume_layer=-1)
        return plan
