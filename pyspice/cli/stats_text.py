"""The stats record as a person reads it: each figure rounded, with its unit
(`tpot_ms: 791.7 ms`, `hit_rate: 43.1%`, `bytes_per_token: 12.00 MiB/token`), nested
records on one line each. The unit comes from the key's suffix, the naming rule
of pyspice.stats; `/stats json` keeps the full precision."""

from __future__ import annotations

from typing import Any

from pyspice.units import format_bytes

# key suffix -> unit printed after the number (pyspice.stats names every timed figure so)
_TIME_UNITS = (("_ms_per_token", "ms/token"), ("_ms", "ms"), ("_us_per_call", "us/call"),
               ("_us_per_plan", "us/plan"), ("_us", "us"), ("_tps", "tok/s"))  # fmt: skip


def format_figure(key: str, value: Any) -> str:
    """One figure with its unit; integers and flags as they are."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or (isinstance(value, int) and "bytes" not in key):
        return str(value)
    if not isinstance(value, int | float):
        return str(value)
    if key.endswith(("_rate", "_share")):
        return f"{value:.1%}"
    if "bytes" in key:
        per = "/token" if key.endswith("_per_token") else ""
        return format_bytes(value) + per
    for suffix, unit in _TIME_UNITS:
        if key.endswith(suffix):
            return f"{_rounded(value)} {unit}"
    return _rounded(value)


def _rounded(value: float) -> str:
    """Four significant figures at most, no exponent for everyday sizes."""
    if value == 0 or 0.01 <= abs(value) < 1e6:
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return f"{value:.3g}"


def stats_lines(record: dict[str, Any]) -> list[str]:
    """`key: figure` lines, a nested record as `key: sub figure, ...` on one line."""
    lines = []
    for key, value in record.items():
        if key == "layers":
            lines.append(f"  layers: {len(value)} MoE layers (/stats json shows each)")
        elif isinstance(value, dict):
            lines.append(f"  {key}: " + ", ".join(f"{k} {format_figure(k, v)}" for k, v in value.items()))
        else:
            lines.append(f"  {key}: {format_figure(key, value)}")
    return lines
