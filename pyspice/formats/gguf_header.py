"""The one GGUF header reader: metadata and tensor directory, never tensor data.

`gguf.GGUFReader` maps and parses every array and tensor view, which takes
over a second on a 32000-token vocabulary; this reads the header in
milliseconds. `pyspice inspect` (formats.model_info) summarizes long arrays
and decodes strings; copying a tokenizer (models.synth) wants every item,
with strings as raw bytes (a token need not be valid UTF-8, and a copy must
be exact). Every read is bounds-checked: a truncated file is one clear error.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"

# per scalar type: its struct format, and its numpy dtype for whole arrays
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "?"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}


class ModelFileError(ValueError):
    """The file is missing, not a GGUF, or truncated/corrupt."""


@dataclass(frozen=True)
class ArraySummary:
    """A long metadata array, kept as its element type and length only."""

    item_type: str
    length: int


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None  # an array's element type


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the contiguous dimension
    type_id: int  # a gguf.GGMLQuantizationType value (checked by the caller)
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class RawHeader:
    version: int
    metadata: list[KeyValue]
    tensors: list[TensorEntry]
    end: int  # where the header ends (the data section starts at the next alignment)


def tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of ggml type `type_name` and `shape` (ne[0] first) in the
    data section, before the alignment pads it."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows = 1
    for n in shape[1:]:
        rows *= n
    return (shape[0] // block) * type_size * rows


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(
        self, buf: Any, path: Path, max_array_items: int | None, raw_strings: bool, keep: Collection[str] = ()
    ) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.max_array_items = max_array_items
        self.raw_strings = raw_strings
        self.keep = keep

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path} is truncated or corrupt: its GGUF header ends early "
                "(re-download or rebuild the file)"
            )

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def raw_string(self) -> bytes:
        n = int(self.take("<Q"))
        self._need(n)
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def string(self) -> str | bytes:
        raw = self.raw_string()
        return raw if self.raw_strings else raw.decode("utf-8", errors="replace")

    def _string_run(self, count: int, keep: bool) -> list[bytes] | None:
        """`count` strings, skipped or (keep) as raw bytes, in one tight loop: a tokenizer's
        vocabulary and merges are most of a header."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        items: list[bytes] | None = [] if keep else None
        for _ in range(count):
            if end - pos < 8:
                self.pos = pos
                self._need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self._need(n)
            if items is not None:
                items.append(bytes(buf[pos : pos + n]))
            pos += n
        self.pos = pos
        return items

    def value(self, vtype: int, key: str = "") -> tuple[Any, GGUFValueType | None]:
        """The value and, for an array, its element type (`key` is in self.keep: decoded
        whatever its length, strings as raw bytes)."""
        if vtype == GGUFValueType.STRING:
            return self.string(), None
        if vtype != GGUFValueType.ARRAY:
            return self.take(self._scalar(vtype)[0]), None
        sub = self._type(int(self.take("<I")))
        count = int(self.take("<Q"))
        if key in self.keep and sub == GGUFValueType.STRING:
            return self._string_run(count, keep=True), sub
        if self.max_array_items is not None and count > self.max_array_items and key not in self.keep:
            self._skip(sub, count)
            return ArraySummary(sub.name.lower(), count), sub
        if sub in _SCALARS:
            dtype = np.dtype(_SCALARS[sub][1])
            self._need(dtype.itemsize * count)
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += items.nbytes
            return items.tolist(), sub
        return [self.value(sub)[0] for _ in range(count)], sub

    def _skip(self, sub: GGUFValueType, count: int) -> None:
        if sub in _SCALARS:
            n = struct.calcsize(_SCALARS[sub][0]) * count
            self._need(n)
            self.pos += n
        elif sub == GGUFValueType.STRING:
            self._string_run(count, keep=False)
        else:
            for _ in range(count):
                self.value(sub)

    def _scalar(self, vtype: int) -> tuple[str, str]:
        formats = _SCALARS.get(vtype)
        if formats is None:
            raise ModelFileError(f"{self.path} is corrupt: unknown metadata value type {vtype}")
        return formats

    def _type(self, vtype: int) -> GGUFValueType:
        try:
            return GGUFValueType(vtype)
        except ValueError:
            raise ModelFileError(f"{self.path} is corrupt: unknown metadata value type {vtype}") from None


def parse_header(
    buf: Any,
    path: Path,
    *,
    max_array_items: int | None = None,
    raw_strings: bool = False,
    keep: Collection[str] = (),
) -> RawHeader:
    """The header of the GGUF in `buf` (bytes, mmap or memoryview; `path` names it in errors).

    max_array_items: longer arrays become an ArraySummary (None: decode all);
    raw_strings: strings as bytes, not decoded; keep: keys whose arrays are decoded
    whatever their length, their strings as raw bytes (what a check needs whole)."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF model (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path, max_array_items, raw_strings, keep)
    cur.pos = 4
    version = int(cur.take("<I"))
    n_tensors = int(cur.take("<Q"))
    n_kv = int(cur.take("<Q"))
    metadata: list[KeyValue] = []
    for _ in range(n_kv):
        key = cur.raw_string().decode("utf-8", errors="replace")
        vtype = cur._type(int(cur.take("<I")))
        value, sub = cur.value(vtype, key)
        metadata.append(KeyValue(key, value, vtype, sub))
    tensors: list[TensorEntry] = []
    for _ in range(n_tensors):
        name = cur.raw_string().decode("utf-8", errors="replace")
        n_dims = int(cur.take("<I"))
        shape = tuple(int(cur.take("<Q")) for _ in range(n_dims))
        type_id = int(cur.take("<I"))
        offset = int(cur.take("<Q"))
        tensors.append(TensorEntry(name, shape, type_id, offset))
    return RawHeader(version, metadata, tensors, cur.pos)
