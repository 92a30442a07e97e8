"""Cost profiles on disk: one JSON file per (model file, machine) in the user cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pyspice.outputs import atomic_output
from pyspice.paths import cache_dir
from pyspice.policy.profile import PROFILE_VERSION, CostProfile


def model_fingerprint(path: Path) -> str:
    """A hash of the model file's first MiB: which file a profile belongs to."""
    with path.open("rb") as fh:
        return hashlib.sha256(fh.read(1 << 20)).hexdigest()[:16]


def profile_path(model_path: Path) -> Path:
    directory = cache_dir() / "profiles"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{model_path.stem}-{model_fingerprint(model_path)}.json"


def save_profile(profile: CostProfile, path: Path) -> Path:
    with atomic_output(path) as tmp:  # a cache another process may be reading
        tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    return path


def load_profile(path: Path) -> CostProfile:
    doc = json.loads(Path(path).read_text())
    if doc.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"{path}: cost profile version {doc.get('version')}, expected {PROFILE_VERSION}; "
            "run `pyspice probe` again"
        )
    return CostProfile.from_json(doc)
