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


def test_sim_runs_edge_mode_on_the_disk_profile_over_a_text_trace(
    synth_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text traced teacher-forced (record -f), replayed on the disk profile: the
    recorded model's own file, every lossless row at or above the bound on bytes read."""
    from pyspice.api import Llama
    from pyspice.cli.main import main
    from pyspice.measure.record import record_bench_trace

    model = synth_model("qwen2moe")
    text = "Experts are read from the model file into a pool of RAM slots. " * 8
    trace = tmp_path / "trace"
    forced = record_bench_trace(model, trace, prompt_tokens=4, n_predict=8, threads=1, text=text)
    llm = Llama(str(model), verbose=False, n_ctx=128)
    try:
        assert forced == list(llm.tokenize(text.encode(), add_bos=True))[4:12]  # fed, not generated
    finally:
        llm.close()
    plot = tmp_path / "disk.png"
    args = ["sim", "-m", str(model), "--trace", str(trace), "--profile", "disk", "--ram-budget", "25%,50%"]
    rc = main([*args, "--policies", "lru,exact,spice:exact", "--json", "--plot", str(plot)])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["target"] for r in rows} == {"source"}
    bound = {r["budget"]: r["disk_read_bytes_per_token"] for r in rows if r["policy"] == "belady"}
    assert set(bound) == {"25%", "50%"} and all(b > 0 for b in bound.values())
    for r in rows:
        assert r["decoded_tokens"] == 8
        assert r["disk_read_bytes_per_token"] >= bound[r["budget"]] * (1 - 1e-9), r["policy"]
    assert plot.stat().st_size > 0
