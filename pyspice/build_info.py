"""Where the native build lives, read from `pyspice-build.json`.

`make build` (scripts/install-native.py) writes that file next to the patched
libraries inside the installed llama_cpp package. Reading it needs no native
code, so the CLI can explain a missing build instead of failing on import.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


class BuildNotFoundError(RuntimeError):
    """The patched native build is not installed in this environment."""


@dataclass(frozen=True)
class BuildInfo:
    source_dir: Path
    build_dir: Path
    bin_dir: Path
    upstream_dir: Path
    lib_dir: Path
    patch_series: tuple[str, ...]
    cuda: bool
    build_type: str
    libllama_sha256: str = ""  # of the libllama `make build` installed ("" from an older install)

    def tool(self, name: str) -> Path:
        """Path of an upstream tool we build (llama-quantize, llama-perplexity)."""
        path = self.bin_dir / name
        if not path.is_file():
            raise BuildNotFoundError(f"{name} not found at {path}; run `make build`")
        return path

    def vocab(self, name: str) -> Path:
        """A vocabulary-only GGUF shipped with the pinned upstream (e.g. 'llama-spm')."""
        path = self.upstream_dir / "models" / f"ggml-vocab-{name}.gguf"
        if not path.is_file():
            raise BuildNotFoundError(f"vocabulary {path} not found; run `make upstream`")
        return path

    @property
    def libspice(self) -> Path:
        return self.lib_dir / "libspice.so"

    @property
    def libllama(self) -> Path:
        return self.lib_dir / "libllama.so"


def llama_cpp_lib_dir() -> Path:
    """The lib/ folder llama_cpp loads its shared libraries from (not imported)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise BuildNotFoundError("llama_cpp is not installed; run `make build`")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def load_build_info() -> BuildInfo:
    path = llama_cpp_lib_dir() / "pyspice-build.json"
    if not path.is_file():
        raise BuildNotFoundError(
            f"no pyspice native build is installed ({path} is missing); run `make build` in the "
            "pyspice source tree"
        )
    raw = json.loads(path.read_text())
    return BuildInfo(
        source_dir=Path(raw["source_dir"]),
        build_dir=Path(raw["build_dir"]),
        bin_dir=Path(raw["bin_dir"]),
        upstream_dir=Path(raw["upstream_dir"]),
        lib_dir=Path(raw["lib_dir"]),
        patch_series=tuple(raw["patch_series"]),
        cuda=bool(raw["cuda"]),
        build_type=str(raw["build_type"]),
        libllama_sha256=str(raw.get("libllama_sha256", "")),
    )
