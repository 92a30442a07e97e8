"""The default model's first use, on a tiny stand-in: its sidecar is calibrated (with
progress bars) before the model opens, and the run then says it uses it;
--no-sidecar skips that with one line. (The real default model takes minutes to
build and calibrate, so `prepare` is driven here with a tiny synthetic model and
a short calibration; the CLI hands it smolmoe and the defaults.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pyspice.api import Llama
from pyspice.engine import RunConfig
from pyspice.formats.sidecar import default_sidecar_path
from pyspice.models.default import prepare
from tests.native.conftest import ModelFactory

SHORT = {"tokens": 512, "n_ctx": 128, "rank": 2, "draft_rank": 8, "expert_tokens": 128, "threads": 2}


@pytest.fixture
def fresh_model(synth_model: ModelFactory, tmp_path: Path) -> Path:
    model = tmp_path / "tiny.gguf"
    shutil.copy(synth_model("qwen2moe", "tiny", "Q8_0"), model)
    return model


def test_first_use_calibrates_the_sidecar_then_runs_with_it(
    fresh_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes: list[str] = []
    assert prepare(fresh_model, sidecar=True, note=notes.append, **SHORT) == fresh_model
    sidecar = default_sidecar_path(fresh_model)
    assert sidecar.is_file()
    assert any(n.startswith("first use of tiny.gguf: calibrating its sidecar") for n in notes)
    err = capsys.readouterr().err
    assert "capture" in err and "fit" in err  # the progress bars
    notes.clear()
    mtime = sidecar.stat().st_mtime_ns
    prepare(fresh_model, sidecar=True, note=notes.append, **SHORT)  # a second use reuses it
    assert not notes and sidecar.stat().st_mtime_ns == mtime
    config = RunConfig(fresh_model, policy="spice", device_budget="50%", threads=2, n_ctx=256)
    llm = Llama.from_config(config, note=notes.append)
    try:
        assert f"using the model's calibration sidecar {sidecar}" in notes
        assert llm.spice_sidecar is not None and llm.policy_context().predictor is not None
        assert llm.spice_policy == "spice"
    finally:
        llm.close()


def test_no_sidecar_skips_it_with_one_line(fresh_model: Path) -> None:
    notes: list[str] = []
    prepare(fresh_model, sidecar=False, note=notes.append)
    assert notes == ["--no-sidecar: tiny.gguf runs without a calibration sidecar"]
    assert not default_sidecar_path(fresh_model).exists()
    resolved = RunConfig(fresh_model, policy="spice", use_sidecar=False).resolve(notes.append)
    assert resolved.sidecar is None
