"""The default model, smolmoe, as every command opens it: built on first use, with its sidecar.

The sidecar (the draft predictor and the surrogates) is what SPICE runs with;
a first use without it would run SPICE half-blind, so it is calibrated then
too, with progress bars (a few minutes on 2 cores), unless asked not to.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspice.calibrate.run import ensure_sidecar
from pyspice.formats.sidecar import default_sidecar_path
from pyspice.models.smolmoe_build import build_smolmoe


def default_model(*, sidecar: bool = True, progress: bool = True, note: Callable[[str], None]) -> Path:
    """The default model's GGUF, built on first use; with `sidecar`, its sidecar too."""
    path = build_smolmoe(progress=progress)
    if sidecar:
        with_sidecar(path, progress=progress, note=note)
    elif not default_sidecar_path(path).is_file():
        note("--no-sidecar: the default model runs without a calibration sidecar")
    return path


def with_sidecar(model: Path, *, progress: bool = True, note: Callable[[str], None], **settings: Any) -> Path:
    """`model`'s sidecar, calibrated first if it has none (`settings`: run_calibration's)."""
    out = default_sidecar_path(model)
    if not out.is_file():
        note(
            f"first use of {model.name}: calibrating its sidecar {out.name} (the draft predictor and "
            "surrogates SPICE runs with; a few minutes; --no-sidecar skips it)"
        )
    return ensure_sidecar(model, progress=progress, **settings)
