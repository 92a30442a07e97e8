"""Perplexity computed the way llama.cpp's `llama-perplexity` computes it.

The text is tokenized once (BOS only where the vocabulary asks for it, special
tokens not parsed), cut into chunks of n_ctx tokens (a trailing partial chunk
is dropped), each chunk is evaluated from an empty cache with its first token
replaced by BOS when the vocabulary adds one, and only the second half of each
chunk is scored: tokens first+1 .. n_ctx-1 with first = n_ctx / 2, so every
scored token has at least n_ctx / 2 tokens of context. Log-probabilities use a
float maximum and a double sum of float exponentials, as upstream does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class PplResult:
    ppl: float
    tokens: int  # scored tokens
    chunks: int
    top1_agreement: float | None = None  # with the reference model's greedy next token, if one was given
    reference_ppl: float | None = None
    # the greedy next token at every scored position (keep_argmax=True): what two runs of one
    # model under different policies are compared on, token by token
    argmax: npt.NDArray[np.int32] | None = None


def chunk_tokens(tokens: list[int], n_ctx: int) -> list[list[int]]:
    if n_ctx < 4:
        raise ValueError(f"context must be at least 4 tokens, got {n_ctx}")
    n_chunk = len(tokens) // n_ctx
    if n_chunk < 1 or len(tokens) < 2 * n_ctx:
        raise ValueError(
            f"the text tokenizes to {len(tokens)} tokens; perplexity with a context of {n_ctx} needs at "
            f"least {2 * n_ctx}"
        )
    return [tokens[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunk)]


def token_nll(logits: npt.NDArray[np.float32], targets: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """-log softmax(logits)[target] per row, as llama-perplexity's log_softmax computes it."""
    mx = logits.max(axis=1, keepdims=True)
    shifted = logits - mx  # float, as upstream
    sums = np.exp(shifted).sum(axis=1, dtype=np.float64)
    picked = shifted[np.arange(len(targets)), targets].astype(np.float64)
    result: npt.NDArray[np.float64] = np.log(sums) - picked
    return result


def _chunk_logits(llm: Any, chunk: list[int], first: int) -> npt.NDArray[np.float32]:
    tokens = list(chunk)
    if llm._model.add_bos_token():
        tokens[0] = llm.token_bos()
    llm.reset()  # n_tokens = 0: eval clears the cache from there
    llm.eval(tokens)
    rows: npt.NDArray[np.float32] = np.array(llm.scores[first : len(tokens) - 1], dtype=np.float32)
    return rows


def perplexity(
    llm: Any,
    text: str,
    n_ctx: int = 512,
    *,
    reference: Any = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
    max_chunks: int | None = None,
    keep_argmax: bool = False,
) -> PplResult:
    """Perplexity of `llm` (a llama_cpp.Llama made with logits_all=True, n_ctx >= `n_ctx`) on `text`.

    With `reference` (another such Llama on the same vocabulary), also the share
    of scored positions where both models' greedy next tokens agree. With
    `max_chunks`, only the first that many chunks are scored. With `keep_argmax`, the
    result carries the greedy next token of every scored position (top1_agreement).
    """
    if max_chunks is not None and max_chunks < 1:  # max(1, ...) once made --chunks 0 score one chunk
        raise ValueError(f"--chunks {max_chunks}: must be at least 1 (leave it out to score them all)")
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    chunks = chunk_tokens(tokens, n_ctx)
    if max_chunks is not None:
        chunks = chunks[:max_chunks]
    first = n_ctx // 2
    nll = ref_nll = 0.0
    count = agree = 0
    greedy: list[npt.NDArray[np.int32]] = []
    for i, chunk in enumerate(chunks):
        logits = _chunk_logits(llm, chunk, first)
        targets = np.asarray(chunk[first + 1 :], dtype=np.int64)
        nll += float(token_nll(logits, targets).sum())
        if keep_argmax:
            greedy.append(logits.argmax(axis=1).astype(np.int32))
        if reference is not None:
            ref_logits = _chunk_logits(reference, chunk, first)
            ref_nll += float(token_nll(ref_logits, targets).sum())
            agree += int((ref_logits.argmax(axis=1) == logits.argmax(axis=1)).sum())
        count += len(targets)
        if on_chunk is not None:
            on_chunk(i + 1, len(chunks), math.exp(nll / count))
    ppl = math.exp(nll / count)
    if not math.isfinite(ppl):
        raise RuntimeError(f"perplexity is not finite ({ppl}): the model produced invalid logits")
    argmax = np.concatenate(greedy) if keep_argmax else None
    if reference is None:
        return PplResult(ppl=ppl, tokens=count, chunks=len(chunks), argmax=argmax)
    return PplResult(
        ppl=ppl,
        tokens=count,
        chunks=len(chunks),
        top1_agreement=agree / count,
        reference_ppl=math.exp(ref_nll / count),
        argmax=argmax,
    )


def top1_agreement(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> float:
    """Share of scored positions where two runs' greedy next tokens are the same."""
    if a.shape != b.shape:
        raise ValueError(f"runs scored different positions ({a.shape[0]} vs {b.shape[0]}): same text and -c")
    return float((a == b).mean()) if a.size else 1.0
