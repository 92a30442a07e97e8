"""The built-in models: MoEs made offline from SmolLM2-135M-Instruct by a committed recipe.

- `smolmoe`: shared expert 512 + 32 routed experts of 32 neurons, top-12
  (37.5% of routed experts per token, 58% of FFN neurons active), calibrated
  on CPython's `pydoc_data.topics`: the quality default (chat, generate,
  serve, eval ppl).
- `smolmoe-b`: the same widths routed top-4 (12.5% of routed experts per
  token, as Qwen2-57B-A14B's 8 of 64; routed experts hold 2/3 of each FFN),
  calibrated on a pinned mix of documentation and code (corpus_mix): the
  benchmark default (bench, sim traces, eval predictor|surrogate), the
  routing regime the policies are tuned in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pyspice.models.smolmoe_recipe import RECIPE_NAME, MoeShape

BENCH_NAME = "smolmoe-b"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    shape: MoeShape  # the shape `models derive` fits
    mixed_corpus: bool  # calibrated on the pinned mix (corpus_mix), not pydoc topics alone


BUILTIN: dict[str, BuiltinModel] = {
    RECIPE_NAME: BuiltinModel(RECIPE_NAME, MoeShape(), mixed_corpus=False),
    BENCH_NAME: BuiltinModel(BENCH_NAME, MoeShape(n_expert_used=4), mixed_corpus=True),
}
MODEL_NAMES: tuple[str, ...] = tuple(BUILTIN)


def builtin(name: str) -> BuiltinModel:
    try:
        return BUILTIN[name]
    except KeyError:
        raise ValueError(f"no built-in model {name!r}; choose one of {', '.join(MODEL_NAMES)}") from None


# smolmoe_build.model_path's file names: NAME-rVERSION-SHA8-QUANT.gguf
_BUILT_NAME = re.compile(r"^(?P<name>.+)-r\d+-[0-9a-f]{8}-[A-Z0-9_]+\.gguf$")


def builtin_of(model: Path | None) -> str | None:
    """The built-in model `model` is a build of (by its file name), or None."""
    m = _BUILT_NAME.match(model.name) if model is not None else None
    return m.group("name") if m is not None and m.group("name") in BUILTIN else None
