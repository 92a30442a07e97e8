"""Where pyspice keeps models and sidecars: the user cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/pyspice, else ~/.cache/pyspice (created on demand)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "pyspice"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
