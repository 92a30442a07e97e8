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


class _FakeLlama:
    """The surface perplexity() uses: logits from a table, one row per position, with a
    chosen token's logit raised at chosen positions (a lossy policy's changed argmax)."""

    def __init__(self, vocab: int, bump: dict[int, int]) -> None:
        self.vocab, self.bump = vocab, bump
        self._model = self
        self.scores: np.ndarray = np.zeros((0, vocab), np.float32)

    def add_bos_token(self) -> bool:
        return False

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        return [b % self.vocab for b in text]

    def reset(self) -> None:
        self.scores = np.zeros((0, self.vocab), np.float32)

    def eval(self, tokens: list[int]) -> None:
        rows = np.zeros((len(tokens), self.vocab), np.float32)
        for i, t in enumerate(tokens):
            rows[i, (t + 1) % self.vocab] = 5.0
            if i in self.bump:
                rows[i, self.bump[i]] = 9.0
        self.scores = rows


def test_kept_argmax_gives_top1_agreement_between_two_runs() -> None:
    from pyspice.measure.perplexity import perplexity, top1_agreement

    text = "".join(chr(97 + i % 26) for i in range(64))
    exact = perplexity(_FakeLlama(200, {}), text, 16, keep_argmax=True)
    lossy = perplexity(_FakeLlama(200, {9: 3, 12: 4}), text, 16, keep_argmax=True)
    assert exact.argmax is not None and lossy.argmax is not None
    # 4 chunks of 16, positions 8..14 scored: 7 per chunk, 2 of them changed in each
    assert exact.tokens == lossy.tokens == 28 and exact.argmax.shape == (28,)
    assert top1_agreement(exact.argmax, exact.argmax) == 1.0
    assert top1_agreement(exact.argmax, lossy.argmax) == pytest.approx(20 / 28)
    assert lossy.ppl > exact.ppl
    assert perplexity(_FakeLlama(200, {}), text, 16).argmax is None  # kept only when asked
    with pytest.raises(ValueError, match="different positions"):
        top1_agreement(exact.argmax, exact.argmax[:5])
