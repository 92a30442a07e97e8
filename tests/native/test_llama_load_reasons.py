"""llama.cpp's own reason for refusing a model reaches the user's one line. Before
engine.llama_log, llama-cpp-python's bare "Failed to load model from file" was all
anyone saw: llama.cpp's reason went to a log sent to /dev/null. The file here passes
read_header (every tensor it names is well formed) but lacks one llama.cpp needs, so
only llama.cpp can say what is wrong."""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from pyspice.api import Llama
from pyspice.engine.llama_log import ModelLoadError, llama_log_tap
from pyspice.formats.model_info import read_header
from pyspice.measure.device_bytes import llama_buffer_report

REASON = "tensor 'output_norm.weight' not found"


@pytest.fixture(scope="module")
def lacking_a_tensor(synth_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2moe with output_norm.weight renamed (same length: the header's
    layout holds)."""
    good: Path = synth_model("qwen2moe", "tiny")
    path = tmp_path_factory.mktemp("bad") / "renamed.gguf"
    data = good.read_bytes()
    assert data.count(b"output_norm.weight") == 1
    path.write_bytes(data.replace(b"output_norm.weight", b"output_norx.weight"))
    read_header(path)  # our reader has nothing against it
    return path


def _current_log_callback() -> int | None:
    cb = llama_cpp.llama_log_callback()
    data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
    return ctypes.cast(cb, ctypes.c_void_p).value


def test_the_api_raises_llama_cpps_reason(lacking_a_tensor: Path) -> None:
    before = _current_log_callback()
    with pytest.raises(ModelLoadError, match=f"could not load {lacking_a_tensor}: {REASON}") as caught:
        Llama(str(lacking_a_tensor), n_ctx=64, verbose=False)
    assert isinstance(caught.value, ValueError)  # what llama-cpp-python's callers catch
    assert _current_log_callback() == before  # llama-cpp-python's logger is back


def test_the_cli_prints_the_reason_in_one_line_and_changes_nothing(lacking_a_tensor: Path) -> None:
    digest = hashlib.sha256(lacking_a_tensor.read_bytes()).hexdigest()
    out = subprocess.run(
        [sys.executable, "-m", "pyspice", "generate", "-m", str(lacking_a_tensor), "-p", "hi", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("pyspice: error:")]
    assert len(errors) == 1, out.stderr
    assert f"llama.cpp could not load {lacking_a_tensor}: {REASON}" in errors[0]
    assert "Traceback" not in out.stderr
    assert hashlib.sha256(lacking_a_tensor.read_bytes()).hexdigest() == digest


def test_an_outer_tap_keeps_its_lines_across_an_inner_one(synth_model: Any, lacking_a_tensor: Path) -> None:
    """The bench collects llama.cpp's buffer report around pyspice.Llama, which taps the log
    itself: the inner tap must hand lines on and put the outer one back."""
    good = synth_model("qwen2moe", "tiny")
    with llama_buffer_report() as report:
        with pytest.raises(ModelLoadError):
            Llama(str(lacking_a_tensor), n_ctx=64, verbose=False)
        Llama(str(good), n_ctx=64, verbose=False).close()
    assert REASON in report.text  # seen by the outer tap through the inner one
    assert report.buffers, "the good load's buffer lines reached the outer tap after the inner one left"


def test_a_tap_that_raises_does_not_reach_llama_cpp(synth_model: Any) -> None:
    def broken(_level: int, _text: str) -> None:
        raise RuntimeError("a broken log consumer")

    with llama_log_tap(broken, forward=False):
        Llama(str(synth_model("qwen2moe", "tiny")), n_ctx=64, verbose=False).close()
