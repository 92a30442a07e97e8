"""`pyspice bench` end to end: JSON shape, and a run with policy fallbacks is invalid (non-zero exit)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

BENCH = [
    sys.executable,
    "-m",
    "pyspice",
    "bench",
    "-n",
    "4",
    "--repeat",
    "1",
    "--prompt-tokens",
    "16",
    "-t",
    "2",
]


def test_bench_json_has_the_stats_record_and_tokens(synth_model, tmp_path: Path) -> None:
    model = synth_model("qwen2moe", "tiny", "Q8_0")
    out = subprocess.run(
        [
            *BENCH,
            "-m",
            str(model),
            "--policies",
            "stock,exact,lru",
            "--device-budget",
            "50%",
            "--json",
            "--plot",
            str(tmp_path / "b.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert set(doc["policies"]) == {"stock", "exact", "lru"}
    for rec in doc["policies"].values():
        assert len(rec["tokens"]) == 4 and "hit_rate" in rec and "misses" in rec and "tpot_ms" in rec
    assert doc["policies"]["lru"]["tokens"] == doc["policies"]["stock"]["tokens"]
    lru = doc["policies"]["lru"]
    assert 0.0 <= lru["decode_hit_rate"] <= 1.0 and lru["activations"] > 0
    assert (tmp_path / "b.png").stat().st_size > 0
    assert "emulated device" in out.stderr


def test_a_policy_needing_a_device_without_one_is_a_clear_error(synth_model) -> None:
    model = synth_model("qwen2moe", "tiny", "Q8_0")
    out = subprocess.run(
        [*BENCH, "-m", str(model), "--policies", "stock,lru"], capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "--device-budget" in out.stderr


def test_a_run_with_policy_fallbacks_is_invalid(synth_model, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from pyspice.cli.main import main
    from pyspice.policy import registry

    class Broken:
        name = "exact-py"

        def decide(self, call):  # type: ignore[no-untyped-def]
            raise RuntimeError("broken on purpose")

    spec = registry.policy_spec("exact-py")
    monkeypatch.setitem(registry._SPECS, "exact-py", dataclasses.replace(spec, factory=Broken))
    model = synth_model("qwen2moe", "tiny", "Q8_0")
    rc = main(
        [
            "bench",
            "-m",
            str(model),
            "--policies",
            "stock,exact-py",
            "-n",
            "2",
            "--repeat",
            "1",
            "--prompt-tokens",
            "8",
            "-t",
            "2",
        ]
    )
    assert rc == 1
    assert "INVALID" in capsys.readouterr().err


def test_the_first_policy_is_the_baseline_unless_told(synth_model) -> None:
    model = synth_model("qwen2moe", "tiny", "Q8_0")
    run = [*BENCH, "-m", str(model), "--device-budget", "50%", "--no-sidecar", "--policies", "lru,exact"]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "x lru" in out.stdout  # no stock needed: ratios divide by the first policy
    told = subprocess.run([*run, "--baseline", "exact"], capture_output=True, text=True)
    assert told.returncode == 0 and "x exact" in told.stdout
    missing = subprocess.run([*run, "--baseline", "stock"], capture_output=True, text=True)
    assert missing.returncode != 0 and "not among --policies" in missing.stderr
