"""The perplexity arithmetic, checked against a float64 reference (no native code)."""

from __future__ import annotations

import numpy as np
import pytest

from pyspice.cli.main import build_parser
from pyspice.measure.perplexity import chunk_tokens, token_nll


def test_token_nll_matches_log_softmax() -> None:
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((7, 300)) * 5).astype(np.float32)
    targets = rng.integers(0, 300, 7)
    ref = -(logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True)))
    assert np.allclose(token_nll(logits, targets), ref[np.arange(7), targets], rtol=1e-5)


def test_chunks_drop_the_tail_and_need_two_contexts() -> None:
    assert [len(c) for c in chunk_tokens(list(range(1100)), 512)] == [512, 512]
    with pytest.raises(ValueError, match="needs at least 1024"):
        chunk_tokens(list(range(1000)), 512)


def test_eval_ppl_flags() -> None:
    args = build_parser().parse_args(["eval", "ppl", "m.gguf", "--text", "t.txt", "--json", "-t", "1"])
    assert (args.model_pos, str(args.file), args.json, args.ctx_size, args.threads) == (
        "m.gguf",
        "t.txt",
        True,
        512,
        1,
    )
    args = build_parser().parse_args(
        ["eval", "ppl", "-m", "m.gguf", "-f", "t.txt", "-c", "128", "--policy", "stock"]
    )
    assert (args.model, args.ctx_size, args.policy) == ("m.gguf", 128, "stock")


def test_models_build_flags() -> None:
    args = build_parser().parse_args(["models", "build", "smolmoe", "--quant", "q4_0"])
    assert (args.name, args.quant) == ("smolmoe", "Q4_0")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["models", "build", "smolmoe", "--quant", "Q4_K"])
