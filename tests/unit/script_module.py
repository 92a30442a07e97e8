"""A script of scripts/ (a file name with dashes, not a package) loaded as a module, so
unit tests can call its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(file_name: str) -> ModuleType:
    """scripts/<file_name> as a fresh module named after it (dashes as underscores)."""
    path = SCRIPTS / file_name
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    assert spec and spec.loader, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
