"""Device bytes of a bench row, as llama.cpp and libspice report them.

llama.cpp reports every buffer it allocates for a model and its context while
loading them ("CUDA0 model buffer size = 123.45 MiB", "... KV buffer size",
"... compute buffer size"; the compute buffer holds what op offload copies to
the GPU for prompt batches); `llama_buffer_report()` collects those lines
from llama.cpp's log while a model loads, and `device_bytes()` adds up the
buffers that are not in host memory, with the slots of a libspice device
tier for the rows that use one. The executor's own activations are not in
this sum: libspice does not report them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pyspice.engine.llama_log import llama_log_tap

# "load_tensors:        CUDA0 model buffer size =   123.45 MiB", likewise KV and compute
_BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([0-9.]+) MiB")
KINDS = {"model": "weights", "KV": "kv", "compute": "compute"}


@dataclass(frozen=True)
class Buffer:
    kind: str  # "weights", "kv" or "compute"
    name: str  # the ggml buffer's name: "CUDA0", "CPU_Mapped", "CUDA_Host", ...
    nbytes: int


def is_device_buffer(name: str) -> bool:
    """Whether a ggml buffer of this name lives in device memory: every buffer but the
    host ones (CPU, CPU_Mapped, CPU_REPACK, CPU_Experts, and pinned *_Host)."""
    return not (name.startswith("CPU") or name.endswith("_Host"))


def parse_buffer_lines(text: str) -> list[Buffer]:
    """The buffer-size lines of llama.cpp's log text (to the MiB's hundredth it prints)."""
    return [
        Buffer(KINDS[m.group(2)], m.group(1), round(float(m.group(3)) * 2**20))
        for m in _BUFFER_LINE.finditer(text)
    ]


@dataclass
class BufferReport:
    """What llama.cpp said it allocated while a model loaded (filled on leaving
    llama_buffer_report)."""

    buffers: list[Buffer] = field(default_factory=list)
    text: str = ""  # everything llama.cpp logged meanwhile (debug lines included)

    def device(self) -> dict[str, int]:
        """Bytes in device memory by kind."""
        out = {kind: 0 for kind in KINDS.values()}
        for b in self.buffers:
            if is_device_buffer(b.name):
                out[b.kind] += b.nbytes
        return out


@contextmanager
def llama_buffer_report() -> Iterator[BufferReport]:
    """Collect llama.cpp's buffer reports of the models and contexts made inside the
    block (its log, kept from the callback installed before: llama_log_tap)."""
    report = BufferReport()
    pieces: list[str] = []
    with llama_log_tap(lambda _level, text: pieces.append(text), forward=False):
        try:
            yield report
        finally:
            report.text = "".join(pieces)
            report.buffers = parse_buffer_lines(report.text)


def device_bytes(report: BufferReport | None, slot_bytes: int = 0) -> dict[str, int]:
    """A row's device bytes: llama.cpp's device buffers (weights, KV cache, compute
    buffers) and a device tier's slots; "total" sums them."""
    out = report.device() if report is not None else {kind: 0 for kind in KINDS.values()}
    out["slots"] = int(slot_bytes)
    out["total"] = sum(out.values())
    return out


# rows at "the same device bytes" differ by at most this share
SAME_BYTES = 0.05


def device_match_lines(rows: dict[str, dict[str, int]], reference: str | None = None) -> list[str]:
    """Which rows hold the same device bytes (within SAME_BYTES) as the reference row:
    `reference`, else upstream-ncmoe (the budget-matched llama.cpp row), else the first
    row with device-tier slots; nothing when no row has device bytes to compare."""
    totals = {name: d.get("total", 0) for name, d in rows.items()}
    if reference is None:
        with_slots = [name for name, d in rows.items() if d.get("slots", 0) > 0]
        reference = "upstream-ncmoe" if "upstream-ncmoe" in rows else next(iter(with_slots), None)
    if reference is None or not totals.get(reference):
        return []
    ref = totals[reference]
    same: list[str] = []
    other: list[str] = []
    none: list[str] = []
    for name, total in totals.items():
        if name == reference:
            continue
        share = total / ref - 1
        if not total:
            none.append(name)
        else:
            (same if abs(share) <= SAME_BYTES else other).append(f"{name} ({share:+.0%})")
    return [
        f"device bytes vs {reference} ({ref / 2**20:.1f} MiB): within {SAME_BYTES:.0%}: "
        f"{', '.join(same) or 'none'}; not: {', '.join(other) or 'none'}"
        + (f"; none on the device: {', '.join(none)}" if none else "")
    ]
