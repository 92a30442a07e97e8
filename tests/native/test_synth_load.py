"""Synthetic models against the built llama.cpp: they quantize, load and generate.

Needs the native build (`make build`); like every native test it fails without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from llama_cpp import Llama
from llama_cpp._internals import LlamaModel

from pyspice.build_info import load_build_info
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


def _generate(path: Path, n_tokens: int = 8, n_vocab: int = 32000) -> list[int]:
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
        assert llm.n_vocab() == n_vocab
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


REAL_SHAPES = {"qwen2-57b-a14b": "qwen2moe", "deepseek-v2-lite": "deepseek2"}
TOKENIZER_TEXT = b"Hello world, MoE experts! 123 \xc3\xa9t\xc3\xa9 \xe4\xb8\x96\xe7\x95\x8c"
_ATTR_UNUSED = 1 << 1  # llama_token_attr LLAMA_TOKEN_ATTR_UNUSED


@contextmanager
def _vocab_only_model(tmp_path: Path, arch: str, dims: synth.SynthShape) -> Iterator[LlamaModel]:
    """llama.cpp's view of the tokenizer `synthesize` would write for `dims`.

    A file with the model's metadata and tokenizer but no tensors, loaded with
    vocab_only: the same load_hparams / load_vocab path as the full model, in
    milliseconds rather than the minutes a real-shape file takes to write.
    """
    tokenizer, n_vocab = synth.load_vocab(dims)
    path = tmp_path / f"{arch}-{dims.name}-{n_vocab}.vocab.gguf"
    writer = GGUFWriter(path, arch)
    for kv in [*synth._model_kv(arch, dims, n_vocab, seed=0), *tokenizer]:
        writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = LlamaModel(path_model=str(path), params=params, verbose=False)
    try:
        yield model
    finally:
        model.close()  # type: ignore[no-untyped-call]  # llama_cpp leaves it unannotated


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_real_shape_vocabulary(tmp_path: Path, shape: str) -> None:
    """The preset's upstream vocabulary has the published size and llama.cpp tokenizes with it."""
    arch = REAL_SHAPES[shape]
    dims = synth.SHAPES[shape]
    published = {"qwen2-57b-a14b": 151936, "deepseek-v2-lite": 102400}[shape]
    assert dims.n_vocab == published
    # upstream's file is already padded to the published size (with [PAD<id>] tokens)
    assert synth.read_vocab(load_build_info().vocab(dims.vocab))[1] == published
    with _vocab_only_model(tmp_path, arch, dims) as model:
        assert model.n_vocab() == published
        tokens = model.tokenize(TOKENIZER_TEXT, add_bos=False, special=False)
        assert 0 < len(tokens) < len(TOKENIZER_TEXT) and max(tokens) < published
        assert model.detokenize(tokens) == TOKENIZER_TEXT


@pytest.mark.parametrize(("arch", "vocab"), [("qwen2moe", "llama-spm"), ("qwen2moe", "qwen2")])
def test_padded_vocabulary_tokenizes_unchanged(tmp_path: Path, arch: str, vocab: str) -> None:
    """Padding (SentencePiece with scores; BPE with merges) adds ids and changes no tokenization."""
    plain = replace(synth.SHAPES["tiny"], vocab=vocab)
    n_tokens = synth.read_vocab(load_build_info().vocab(vocab))[1]
    padded = replace(plain, n_vocab=n_tokens + 64)
    with _vocab_only_model(tmp_path, arch, plain) as model:
        expected = model.tokenize(TOKENIZER_TEXT, add_bos=True, special=False)
    with _vocab_only_model(tmp_path, arch, padded) as model:
        assert model.n_vocab() == n_tokens + 64
        assert model.tokenize(TOKENIZER_TEXT, add_bos=True, special=False) == expected
        for token in (n_tokens, n_tokens + 63):
            assert model.token_get_text(token) == f"[PAD{token}]"
            assert model.token_get_attr(token) & _ATTR_UNUSED


def test_padded_model_loads_and_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """token_embd / output with the padded row count load and run."""
    shape = replace(synth.SHAPES["tiny"], name="tiny-padded", n_vocab=32000 + 64)
    monkeypatch.setitem(synth.SHAPES, shape.name, shape)
    out = synth.synthesize("qwen2moe", shape.name, tmp_path / "padded.gguf", layers=1)
    assert len(_generate(out, n_tokens=4, n_vocab=32000 + 64)) == 4
