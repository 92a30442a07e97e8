"""The stats record of docs/design.md section 11, from raw counters."""

from __future__ import annotations

import pytest

from pyspice.stats import STATS_KEYS, Counters, StatsSnapshot, Timing, stats_record


def test_record_has_every_key_and_derives_rates() -> None:
    total = Counters(
        hook_calls=10,
        activations=100,
        hits=60,
        misses_fetched=10,
        misses_host=20,
        misses_surrogate=10,
        bytes_h2d=4000,
        stall_ns=2_000_000,
        policy_ns=50_000,
        policy_calls=10,
    )
    snap = StatsSnapshot(
        total=total,
        layers={3: total},
        timing=Timing(prefill_tokens=50, prefill_s=0.5, decoded_tokens=4, decode_s=0.2),
    )
    rec = stats_record(snap)
    assert set(STATS_KEYS) <= set(rec)
    assert rec["hit_rate"] == 0.6
    assert abs(rec["fallback_rate"] - 0.4) < 1e-12
    assert rec["misses"] == {"fetched": 10, "host": 20, "surrogate": 10, "dropped": 0}
    assert rec["bytes_per_token"] == 1000.0  # per decoded token only
    assert rec["stall_ms_per_token"] == 0.5
    assert rec["policy_us_per_call"] == 5.0
    assert rec["tpot_ms"] == 50.0
    assert rec["prefill_tps"] == 100.0
    assert rec["layers"]["3"]["hit_rate"] == 0.6


def test_empty_record_has_no_division_errors() -> None:
    rec = stats_record(StatsSnapshot())
    assert rec["hit_rate"] == 0.0 and rec["tpot_ms"] == 0.0 and rec["layers"] == {}


def test_counters_add() -> None:
    a = Counters(hits=1, activations=2)
    a.add(Counters(hits=3, activations=4, dropped=1))
    assert (a.hits, a.activations, a.misses) == (4, 6, 1)


def test_bench_decode_hit_rate_leaves_the_prompt_out() -> None:
    from pyspice.measure.bench import decode_hit_rate

    prompt = {"activations": 400, "hit_rate": 10 / 400}  # a cold prompt batch: 10 hits
    total = {"activations": 520, "hit_rate": (10 + 90) / 520}  # then 120 decode activations, 90 hits
    assert decode_hit_rate(total, prompt) == 0.75
    assert decode_hit_rate(prompt, prompt) == 0.0  # nothing decoded


def test_bench_decode_misses_leave_the_prompt_out() -> None:
    from pyspice.measure.bench import decode_misses

    prompt = {"misses": {"fetched": 0, "host": 512, "surrogate": 3, "dropped": 0}}
    total = {"misses": {"fetched": 2, "host": 700, "surrogate": 9, "dropped": 0}}
    assert decode_misses(total, prompt) == {"fetched": 2, "host": 188, "surrogate": 6}
    assert decode_misses(prompt, prompt) == {"fetched": 0, "host": 0, "surrogate": 0}  # nothing decoded


def test_bench_per_call_of_decode_calls_leaves_the_prompt_batch_out() -> None:
    """One prompt call of 100 us hook time and four decode calls of 2 us: every call's
    average is 21.6 us, the decode calls' 2 us."""
    from pyspice.measure.bench import decode_per_call

    prompt = {"hook_calls": 1, "per_call": {"hook_us": 100.0, "exec_us": 90.0}}
    total = {"hook_calls": 5, "per_call": {"hook_us": (100.0 + 4 * 2.0) / 5, "exec_us": (90.0 + 4 * 1.5) / 5}}
    got = decode_per_call(total, prompt)
    assert got == pytest.approx({"hook_us": 2.0, "exec_us": 1.5})
    assert decode_per_call(prompt, prompt) == {"hook_us": 0.0, "exec_us": 0.0}  # nothing decoded


def test_bench_planner_wait_of_decode_calls_leaves_the_prompt_out() -> None:
    from pyspice.measure.bench import decode_planner_wait

    # 24 prompt calls waited 100 us each (a 128-row snapshot); 72 decode calls 2 us each
    prompt = {"hook_calls": 24, "planning": {"wait_us_per_call": 100.0}}
    total = {"hook_calls": 96, "planning": {"wait_us_per_call": (24 * 100.0 + 72 * 2.0) / 96}}
    assert abs(decode_planner_wait(total, prompt) - 2.0) < 1e-9
    # synchronous rows have no planning record's wait
    assert decode_planner_wait({"hook_calls": 96, "planning": {}}, {"hook_calls": 24}) == 0.0


def test_bench_table_shows_the_store_time_of_decode_calls() -> None:
    """The store's own time (issuing and polling copies) is the hook thread's too: on a
    GPU it was 9-18 us per copy, 10x the deciding time of the rows that copy."""
    from pyspice.measure.bench import PolicyResult, format_table

    stats = {"per_call": {"store_us": 99.0}, "per_call_decode": {"store_us": 47.25}}
    copying = PolicyResult("spice:exact", prefill_tps=[100.0], tpot_ms=[4.0], tokens=[1], stats=stats)
    exact = PolicyResult("exact", prefill_tps=[100.0], tpot_ms=[3.5], tokens=[1], stats={})
    table = format_table({"exact": exact, "spice:exact": copying}, "exact")
    header, _, exact_row, copying_row = table.splitlines()[:4]
    assert "store us" in header
    column = header.index("store us") + len("store us")  # right-aligned under its header
    assert copying_row[:column].rstrip().endswith("47.2")  # decode calls alone, not every call
    assert exact_row[:column].rstrip().endswith("0.0")
