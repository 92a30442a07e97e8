"""Calibration memory does not grow with the number of layers (slow, kept out of CI: `-m slow`).

Qwen2-57B-A14B-shaped models with 2 and with 4 layers are calibrated on the
same few tokens; the peak of the memory Python and numpy allocate (tracemalloc:
trace buffers, fitting arrays, dequantized experts; not the model, which
llama.cpp maps from the file) must be the same within 10%. The 4-layer model
needs about 45 GB of temporary disk (F32 before quantizing) and the run takes
many minutes on two cores.
"""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import pytest

from pyspice.models import synth

_DISK_NEEDED = 45 * 10**9


def _peak(model: Path, text: str, work: Path) -> int:
    from pyspice.calibrate.capture import CaptureConfig
    from pyspice.calibrate.lore_fit import LoreConfig
    from pyspice.calibrate.pipeline import CalibrateConfig, calibrate

    config = CalibrateConfig(
        capture=CaptureConfig(tokens=128, n_ctx=64, threads=2),
        lore=LoreConfig(rank=4, report_ranks=(4,), max_train_tokens=64, max_heldout_tokens=32),
        draft_rank=16,
    )
    tracemalloc.start()
    try:
        calibrate(model, text, work / "s.spice.gguf", work / "w", config, progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_peak_memory_equal_for_2_and_4_layers(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    free = shutil.disk_usage(tmp_path).free
    if free < _DISK_NEEDED:
        pytest.skip(f"needs {_DISK_NEEDED / 1e9:.0f} GB free under {tmp_path}, has {free / 1e9:.1f} GB")
    text = topics["assert"] + topics["with"] + topics["for"]
    peaks = {}
    for layers in (2, 4):
        model = synth.synthesize(
            "qwen2moe", "qwen2-57b-a14b", tmp_path / f"q{layers}.gguf", layers=layers, quant="Q4_K_M"
        )
        peaks[layers] = _peak(model, text, tmp_path / f"run{layers}")
        model.unlink()
    assert abs(peaks[4] - peaks[2]) <= 0.1 * peaks[2], peaks
