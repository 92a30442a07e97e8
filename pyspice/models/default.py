"""The built-in models (smolmoe, smolmoe-b) as every command opens them: built on first use, with a sidecar.

The sidecar (the draft predictor and the surrogates) is what SPICE runs with;
a first use without it would run SPICE without its draft predictor, so it is
calibrated then too, with progress bars (a few minutes on 2 cores), unless
asked not to (--no-sidecar, which says so in one line).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspice.calibrate.run import ensure_sidecar
from pyspice.formats.sidecar import default_sidecar_path
from pyspice.models.builtin import adopt_tuned_levels
from pyspice.models.smolmoe_build import build_smolmoe
from pyspice.models.smolmoe_recipe import RECIPE_NAME

Note = Callable[[str], None]


def default_model(
    name: str = RECIPE_NAME, *, sidecar: bool = True, progress: bool = True, note: Note
) -> Path:
    """Built-in model `name`'s GGUF, built on first use; with `sidecar`, its sidecar too."""
    return prepare(build_smolmoe(name=name, progress=progress), sidecar=sidecar, progress=progress, note=note)


def prepare(model: Path, *, sidecar: bool, progress: bool = True, note: Note, **settings: Any) -> Path:
    """`model`, with its sidecar beside it made first if `sidecar` and there is none
    (`settings`: run_calibration's keywords, for smaller runs in tests)."""
    out = default_sidecar_path(model)
    if not sidecar:
        if not out.is_file():
            note(f"--no-sidecar: {model.name} runs without a calibration sidecar")
        return model
    if not out.is_file():
        note(
            f"first use of {model.name}: calibrating its sidecar {out.name} (the draft predictor and "
            "surrogates SPICE runs with; a few minutes; --no-sidecar skips it)"
        )
    ensure_sidecar(model, progress=progress, **settings)
    if not settings:  # the sidecar of the default calibration: the thresholds tuned for it
        adopt_tuned_levels(model, out, note)
    return model
