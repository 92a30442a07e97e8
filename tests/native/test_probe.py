"""`pyspice probe` measures a profile the policies and the simulator can read back."""

from __future__ import annotations

from pathlib import Path

from pyspice.engine.probe import measure_profile
from pyspice.formats.profile import load_profile, save_profile

from .golden import load


def test_probe_measures_and_round_trips(synth_model, tmp_path: Path) -> None:
    path = synth_model("qwen2moe", "tiny", "Q8_0")
    llm = load(path)
    try:
        profile = measure_profile(llm, path, bus_gbps=8.0, bus_latency_us=5.0, batch_sizes=(1, 4), repeats=2)
    finally:
        llm.close()
    assert [b.tokens for b in profile.batches] == [1, 4]
    assert all(b.expert_us >= 0 and b.rest_us_per_layer > 0 for b in profile.batches)
    assert profile.n_moe_layers == 4 and profile.bus_gbps == 8.0
    assert set(profile.expert_bytes) == {"Q8_0/Q8_0/Q8_0"}
    again = load_profile(save_profile(profile, tmp_path / "p.json"))
    assert again == profile
