"""A script of scripts/ or tools/ (a file name with dashes, not a package) loaded as a
module, so unit tests can call its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(file_name: str) -> ModuleType:
    """scripts/<file_name> or tools/<file_name> as a fresh module named after it (dashes as
    underscores)."""
    path = next(
        (ROOT / d / file_name for d in ("scripts", "tools") if (ROOT / d / file_name).exists()),
        ROOT / "scripts" / file_name,
    )
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    assert spec and spec.loader, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
