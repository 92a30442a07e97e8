"""Fixtures for tests that need the built native library and synthetic models.

These tests do not skip when the build is missing: `make test` builds first,
and a missing build must fail loudly rather than pass by doing nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

ModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """synth_model(arch, shape="tiny", quant=None) -> path of a synthetic GGUF, made once per session."""
    from pyspice.models.synth import synthesize

    root = tmp_path_factory.mktemp("models")
    made: dict[tuple[str, str, str | None], Path] = {}

    def make(arch: str, shape: str = "tiny", quant: str | None = None) -> Path:
        key = (arch, shape, quant)
        if key not in made:
            made[key] = synthesize(arch, shape, root / f"{arch}-{shape}-{quant or 'F32'}.gguf", quant=quant)
        return made[key]

    return make
