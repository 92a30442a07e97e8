"""`/stats` in chat: every figure rounded and with its unit, never a float's full repr."""

from __future__ import annotations

import re

from pyspice.cli.stats_text import format_figure, stats_lines
from pyspice.stats import Counters, StatsSnapshot, Timing, stats_record


def record() -> dict[str, object]:
    c = Counters(hook_calls=240, activations=960, hits=413, stall_ns=19_000_123, bytes_h2d=37_748_736,
                 policy_ns=1_234_567, policy_calls=240, hook_ns=190_004_321)  # fmt: skip
    timing = Timing(prefill_tokens=12, prefill_s=0.37, decoded_tokens=3, decode_s=2.3751583375)
    return stats_record(StatsSnapshot(total=c, layers={1: c}, timing=timing))


def test_figures_carry_units_and_are_rounded() -> None:
    assert format_figure("tpot_ms", 791.7194458333332) == "791.7 ms"
    assert format_figure("hit_rate", 0.43020833) == "43.0%"
    assert format_figure("prefill_tps", 32.43243243) == "32.43 tok/s"
    assert format_figure("policy_us_per_call", 5.1440291) == "5.144 us/call"
    assert format_figure("stall_ms_per_token", 6.333374) == "6.333 ms/token"
    assert format_figure("bytes_per_token", 12_582_912) == "12.00 MiB/token"
    assert format_figure("hook_calls", 240) == "240"
    assert format_figure("asynchronous", False) == "False"


def test_no_line_prints_a_long_float() -> None:
    lines = stats_lines(record())
    assert any(line.startswith("  tpot_ms: 791.7 ms") for line in lines), lines
    assert any(line.startswith("  layers: 1 MoE layers") for line in lines)
    long_float = re.compile(r"\d\.\d{5,}")
    assert not [line for line in lines if long_float.search(line)], lines
