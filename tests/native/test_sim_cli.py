"""`pyspice sim` end to end: a trace recorded through the hook, replayed on profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.native.conftest import ModelFactory


def _record(model: Path, out: Path, n_tokens: int) -> None:
    from pyspice.measure.record import record_bench_trace

    tokens = record_bench_trace(model, out, prompt_tokens=4, n_predict=n_tokens + 1)
    assert len(tokens) == n_tokens + 1


@pytest.mark.parametrize("arch", ["qwen2moe"])
def test_sim_replays_a_recorded_trace_on_profiles(
    synth_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str
) -> None:
    from pyspice.cli.main import main

    model = synth_model(arch)
    trace = tmp_path / "trace"
    _record(model, trace, 8)
    plot = tmp_path / "fig7.png"
    rc = main(
        [
            "sim",
            "-m",
            str(model),
            "--trace",
            str(trace),
            "--target",
            "deepseek-v2-lite:Q4_K_M",
            "--profile",
            "rtx4060,a800",
            "--device-budget",
            "25%,50%",
            "--policies",
            "host,lru,adapmoe,exact",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2 * 2 * 5
    assert {(r["profile"], r["budget"]) for r in rows if r["policy"] == "belady"} == {
        (p, b) for p in ("rtx4060", "a800") for b in ("25%", "50%")
    }
    for r in rows:
        assert r["simulated"] is True
        if r["policy"] != "belady":
            assert r["tpot_ms"] > 0 and r["policy_fallbacks"] == 0
            assert r["decoded_tokens"] == 8
    by = {(r["profile"], r["budget"], r["policy"]): r for r in rows}
    # a faster bus and device make the same policy faster on the same trace
    assert by[("a800", "25%", "lru")]["tpot_ms"] < by[("rtx4060", "25%", "lru")]["tpot_ms"]
    # no replacement policy misses less than Belady's MIN
    for p in ("rtx4060", "a800"):
        for b in ("25%", "50%"):
            bound = by[(p, b, "belady")]
            assert by[(p, b, "lru")]["fallback_rate"] >= bound["fallback_rate"]
    assert plot.stat().st_size > 0


def test_sim_target_source_runs_on_a_hardware_profile(
    synth_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--target source with a hardware profile: the recorded model's own sizes there."""
    from pyspice.cli.main import main
    from pyspice.sim.targets import source_target

    model = synth_model("qwen2moe")
    trace = tmp_path / "trace"
    _record(model, trace, 4)
    argv = ["sim", "-m", str(model), "--trace", str(trace), "--target", "source"]
    rc = main([*argv, "--profile", "rtx4060", "--device-budget", "50%", "--policies", "lru", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["lru", "belady"]
    assert rows[0]["target"] == f"source:{model.name}" and rows[0]["tpot_ms"] > 0
    # the simulated bytes are the model file's own: per token, at most every routed expert once
    target = source_target(model)
    assert 0 < rows[0]["bytes_per_token"] <= sum(target.expert_bytes) * target.n_expert
