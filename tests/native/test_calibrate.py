"""Calibration end to end on tiny synthetic models: capture (and resume), fit, sidecar, evals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli.main import main
from pyspice.formats.sidecar import Sidecar, SidecarMismatchError
from tests.native.conftest import ModelFactory

N_CTX = 128
TOKENS = 512


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text(topics["assert"] + topics["with"] + topics["for"], encoding="utf-8")
    return path


def calibrate(model: Path, text: Path, out: Path, *extra: str) -> dict[str, object]:
    argv = ["calibrate", "-m", str(model), "-o", str(out), "-f", str(text), "-c", str(N_CTX)]
    argv += ["--tokens", str(TOKENS), "--draft-rank", "8", "--rank", "4", "--work-dir", str(out) + ".work"]
    return argv + list(extra)  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_calibrate_writes_a_sidecar_for_the_model(
    arch: str, synth_model: ModelFactory, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = synth_model(arch)
    out = tmp_path / "m.spice.gguf"
    assert main(calibrate(model, text_file, out, "--json")) == 0  # type: ignore[arg-type]
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == TOKENS and doc["sidecar_bytes"] == out.stat().st_size
    assert not (tmp_path / "m.spice.gguf.work").exists()  # work files removed without --keep-work
    s = Sidecar.load(out, model)
    expected_layers = [0, 1, 2, 3] if arch == "qwen2moe" else [1, 2, 3]  # deepseek2: one dense lead layer
    assert s.moe_layers == expected_layers and s.tokens == TOKENS
    assert sorted(s.data.transitions) == expected_layers[:-1]
    assert all(t.scale != 0.0 for t in s.data.transitions.values())  # the identity part is kept
    entry = s.surrogate(expected_layers[0], 0)
    assert entry is not None
    _alpha, A, B = entry
    assert A.shape == (4, 256) and B.shape == (256, 4) and np.isfinite(A).all()
    errors = np.array([e for layer in s.surrogate_error.values() for e in layer])
    assert np.isfinite(errors).any() and (errors[np.isfinite(errors)] >= 0).all()
    counts = s.expert_counts(expected_layers[0])
    assert counts is not None and counts.sum() == TOKENS * s.data.n_expert_used
    # the predictor rolls out to the following MoE layers with probabilities
    p = s.predictor()
    out_probs = p.rollout(expected_layers[0], np.ones(256, dtype=np.float32), 2)
    assert [m for m, _ in out_probs] == expected_layers[1:3]
    assert abs(float(out_probs[0][1].sum()) - 1.0) < 1e-4


def test_sidecar_of_another_model_is_refused(
    synth_model: ModelFactory, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = synth_model("qwen2moe")
    other = synth_model("qwen2moe", quant="Q8_0")
    out = tmp_path / "m.spice.gguf"
    assert main(calibrate(model, text_file, out)) == 0  # type: ignore[arg-type]
    capsys.readouterr()
    with pytest.raises(SidecarMismatchError, match=model.name):
        Sidecar.load(out, other)
    argv = ["eval", "predictor", "-m", str(other), "--sidecar", str(out), "-f", str(text_file)]
    assert main(argv) != 0
    assert f"made for model {model.name}" in capsys.readouterr().err


def test_capture_resumes_after_an_interruption(
    synth_model: ModelFactory, text_file: Path, tmp_path: Path
) -> None:
    from pyspice.calibrate.capture import CaptureConfig, capture
    from pyspice.formats.trace import TraceReader

    model = synth_model("qwen2moe")
    text = text_file.read_text()
    config = CaptureConfig(tokens=3 * N_CTX, n_ctx=N_CTX, chunk_tokens=N_CTX)

    def stop_after_first(done: int, total: int) -> None:
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(model, text, tmp_path / "t", config, progress=False, on_chunk=stop_after_first)
    partial = TraceReader(tmp_path / "t", allow_incomplete=True)
    assert not partial.meta.complete and partial.n_tokens == N_CTX
    resumed = capture(model, text, tmp_path / "t", config, progress=False)
    fresh = capture(model, text, tmp_path / "fresh", config, progress=False)
    assert resumed.meta.complete and resumed.n_tokens == fresh.n_tokens == 3 * N_CTX
    for il in fresh.meta.moe_layers:
        a, b = resumed.layer(il), fresh.layer(il)
        np.testing.assert_array_equal(a["ids"], b["ids"])
        np.testing.assert_array_equal(a["hidden"], b["hidden"])


def test_eval_predictor_and_surrogate(
    synth_model: ModelFactory, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = synth_model("qwen2moe")
    out = tmp_path / "m.spice.gguf"
    assert main(calibrate(model, text_file, out)) == 0  # type: ignore[arg-type]
    capsys.readouterr()
    base = ["-m", str(model), "--sidecar", str(out), "-f", str(text_file), "--tokens", "256", "--json"]
    assert main(["eval", "predictor", *base, "--depth", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["depths"] == [1, 2]
    assert all(0.0 <= r <= 1.0 for r in doc["baseline_recall"] + doc["draft_recall"])
    assert abs(sum(doc["confidence_share"][0]) - 1.0) < 1e-6
    argv = ["eval", "surrogate", *base, "--ranks", "1,4", "-c", str(N_CTX), "--chunks", "1"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["ranks"] == [1, 4] and doc["error"]["drop"] == pytest.approx(1.0)
    ppl = doc["ppl"]["results"]
    assert set(ppl) == {"exact", "surrogate r1", "surrogate r4", "shared alone", "drop"}
    assert all(np.isfinite(v) and v > 1 for v in ppl.values())
    assert ppl["drop"] != ppl["exact"]  # half the experts dropped must change the model


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_decode_trace_from_generate_and_bench(
    command: str, synth_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyspice.formats.trace import TraceReader

    model = synth_model("deepseek2")
    out = tmp_path / "trace"
    if command == "generate":
        argv = ["generate", "-m", str(model), "-p", "Hello world", "-n", "6", "--temp", "0", "--json"]
    else:
        argv = ["bench", "-m", str(model), "--policies", "exact,host", "--baseline", "exact"]
        argv += ["-n", "6", "--repeat", "1", "--prompt-tokens", "16", "--json"]
    assert main([*argv, "--trace", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    trace = TraceReader(out)
    assert trace.meta.source == "decode" and trace.meta.moe_layers == [1, 2, 3]
    ids, weights = trace.routing()
    # the first generated token comes from the prompt batch (not recorded), the others from decode steps
    assert ids.shape == (5, 3, 2) and np.isfinite(weights).all()
    tokens = doc["tokens"] if command == "generate" else doc["policies"]["exact"]["tokens"]
    assert trace.meta.extra["tokens"] == tokens
    calls = list(trace.calls())
    assert len(calls) == 15 and calls[0].layer == 1 and calls[0].shared is not None
