"""Synthetic models against the built llama.cpp: they quantize, load and generate.

Needs the native build (`make build`); like every native test it fails without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from llama_cpp import Llama

from pyspice.models import synth

TINY_SHAPES = ("tiny", "tiny-odd")

# quant -> (type of ffn_gate_exps / ffn_up_exps, ffn_down_exps types at expert width 256 (tiny),
# ffn_down_exps types at width 384 (tiny-odd)). gate/up rows are n_embd = 256 wide in both
# shapes; down rows are the expert width, so only they meet llama-quantize's K-quant
# fallback. Q5_K_M is a mix: ffn_down goes to Q6_K (or its fallback Q8_0) on some layers.
EXPERT_TYPES: dict[str, tuple[str, set[str], set[str]]] = {
    "Q8_0": ("Q8_0", {"Q8_0"}, {"Q8_0"}),
    "Q4_0": ("Q4_0", {"Q4_0"}, {"Q4_0"}),
    "Q5_1": ("Q5_1", {"Q5_1"}, {"Q5_1"}),
    "Q4_K": ("Q4_K", {"Q4_K"}, {"Q5_0"}),
    "Q6_K": ("Q6_K", {"Q6_K"}, {"Q8_0"}),
    "Q5_K_M": ("Q5_K", {"Q5_K", "Q6_K"}, {"Q5_1", "Q8_0"}),
}


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("synth-f32")
    return {
        (arch, shape): synth.synthesize(arch, shape, root / f"{arch}-{shape}.gguf")
        for arch in synth.ARCHS
        for shape in TINY_SHAPES
    }


def _generate(path: Path, n_tokens: int = 8) -> list[int]:
    """Greedy tokens after a short prompt; every logit row computed on the way must be finite."""
    # One thread: tiny models gain nothing from more, and ggml's spinning
    # barriers slow to a crawl when something else shares the cores.
    llm = Llama(
        model_path=str(path),
        n_ctx=256,
        n_batch=64,
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        verbose=False,
    )
    try:
        prompt = llm.tokenize(b"The quick brown fox")
        tokens: list[int] = []
        for token in llm.generate(prompt, temp=0.0):
            tokens.append(token)
            if len(tokens) == n_tokens:
                break
        assert np.isfinite(llm.scores[: llm.n_tokens]).all()
        assert llm.n_vocab() == 32000
        return tokens
    finally:
        llm.close()


def _expert_types(path: Path) -> dict[str, set[str]]:
    """ffn_{gate,up,down}_exps -> the set of tensor types over all MoE layers."""
    types: dict[str, set[str]] = {}
    for name, qtype in synth.tensor_types(path).items():
        if name.endswith("_exps.weight"):
            types.setdefault(name.split(".")[2], set()).add(qtype)
    return types


@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("arch", synth.ARCHS)
def test_f32_loads_and_generates(f32_models: dict[tuple[str, str], Path], arch: str, shape: str) -> None:
    first = _generate(f32_models[arch, shape])
    assert len(first) == 8
    assert _generate(f32_models[arch, shape]) == first  # greedy decoding is reproducible


@pytest.mark.parametrize("quant", sorted(EXPERT_TYPES))
@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("arch", synth.ARCHS)
def test_quantized_expert_types(
    f32_models: dict[tuple[str, str], Path], tmp_path: Path, arch: str, shape: str, quant: str
) -> None:
    out = synth.quantize(f32_models[arch, shape], tmp_path / f"{quant}.gguf", quant)
    gate_up, down_tiny, down_odd = EXPERT_TYPES[quant]
    types = _expert_types(out)
    assert types["ffn_gate_exps"] == {gate_up}
    assert types["ffn_up_exps"] == {gate_up}
    assert types["ffn_down_exps"] == (down_tiny if shape == "tiny" else down_odd)
    assert len(_generate(out, n_tokens=4)) == 4


def test_synthesize_quantized_end_to_end(tmp_path: Path) -> None:
    out = synth.synthesize("deepseek2", "tiny", tmp_path / "m.gguf", quant="Q4_K", seed=3)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # the F32 temporary is gone
    assert GGUFReader(out).fields["pyspice.synth.seed"].contents() == 3
    assert _expert_types(out) == {
        "ffn_gate_exps": {"Q4_K"},
        "ffn_up_exps": {"Q4_K"},
        "ffn_down_exps": {"Q4_K"},
    }
    assert len(_generate(out, n_tokens=4)) == 4
