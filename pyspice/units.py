"""Byte quantities on the command line: `2GiB`, `512MiB`, `1.5GB`, `123456`, or `25%`.

Bytes are the canonical unit for the device budget (quant types make expert
sizes differ); a percentage is a share of what holding every routed expert
takes (`whole_tier_bytes`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def slot_bytes(bytes_per_expert: Sequence[int], n_expert: Sequence[int]) -> int:
    """A tier slot's bytes, per layer's expert size and count: the largest expert of a
    layer with routed experts (0: none). libspice lays slots out at one stride, and every
    expert held takes a slot of the budget (spice_store_slot_bytes_for)."""
    return max((int(b) for b, n in zip(bytes_per_expert, n_expert, strict=True) if n > 0), default=0)


def whole_tier_bytes(bytes_per_expert: Sequence[int], n_expert: Sequence[int]) -> int:
    """Bytes of a tier holding every routed expert: one slot each (`slot_bytes`), so a
    model whose layers mix quantization types wastes the difference. Where experts are
    all one size this is the routed-expert bytes; it is what a 100% budget means."""
    return slot_bytes(bytes_per_expert, n_expert) * sum(int(n) for n in n_expert if n > 0)


@dataclass(frozen=True)
class Budget:
    """Either an absolute byte count or a share (0..1] of a whole tier's bytes
    (`whole_tier_bytes`: the routed-expert bytes where experts are all one size)."""

    bytes: int | None = None
    share: float | None = None

    def resolve(self, whole_tier: int) -> int:
        if self.bytes is not None:
            return self.bytes
        assert self.share is not None
        return int(self.share * whole_tier)

    def __str__(self) -> str:
        return f"{self.share:.0%}" if self.share is not None else format_bytes(self.bytes or 0)


def parse_budget(text: str) -> Budget:
    raw = text.strip()
    if raw.endswith("%"):
        try:
            pct = float(raw[:-1])
        except ValueError:
            raise ValueError(f"bad budget {text!r}: expected e.g. 25%") from None
        if not 0 < pct <= 100:
            raise ValueError(f"bad budget {text!r}: a share must be in (0%, 100%]")
        return Budget(share=pct / 100)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", raw)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"bad budget {text!r}: expected bytes with a unit (2GiB, 512MiB, 1.5GB) or a share (25%)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"bad budget {text!r}: must be at least one byte")
    return Budget(bytes=int(value))


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
