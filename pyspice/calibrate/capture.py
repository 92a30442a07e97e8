"""Capture: run a text through the model and record every MoE hook call into a trace.

The model runs the exact plan (every routed expert exact, on the host) with a
`TraceRecorder` as its policy; the text is evaluated in independent chunks of
n_ctx tokens from an empty cache (as perplexity does), up to a token cap.

Bounds (independent of the number of layers, except the disk, which is linear
in layers and capped in tokens):
- memory: the model, plus at most `max_buffer_bytes` (64 MiB) of unwritten
  trace rows, plus one micro-batch's copies;
- disk: tokens x MoE layers x (2 n_embd + n_expert + 2 k) x 2 bytes
  (hidden and shared in float16, probs float16, ids int16, weights float16).

Interrupting leaves an incomplete trace; running the capture again on the same
directory resumes after the last token every layer holds.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pyspice.engine.decode_trace import model_geometry, trace_meta
from pyspice.engine.llama_log import llama_log_dropping
from pyspice.formats.trace import TraceReader, TraceRecorder, TraceWriter

# llama.cpp's warning on closing a context whose compute buffer grew after its reserve
_BUFFER_GREW = re.compile(r"compute buffer size of .* does not match expectation")


@dataclass(frozen=True)
class CaptureConfig:
    tokens: int = 8192  # cap on captured tokens
    n_ctx: int = 512  # tokens per independent chunk
    threads: int | None = None
    chunk_tokens: int = 512  # rows per trace chunk file
    max_buffer_bytes: int = 64 << 20


def capture(
    model_path: str | os.PathLike[str],
    text: str,
    out: str | os.PathLike[str],
    config: CaptureConfig | None = None,
    *,
    corpus: str = "",
    progress: bool = True,
    on_chunk: Callable[[int, int], None] | None = None,
) -> TraceReader:
    """Record the hook calls of `text` (at most config.tokens tokens) into the trace directory `out`.

    An existing complete trace of the same model is reused as it is; an
    incomplete one is resumed."""
    # lazy: loads libllama; the calibration library imports this module without running a model
    from pyspice.api import Llama

    config = config or CaptureConfig()
    model = Path(model_path)
    out_dir = Path(out)
    if (out_dir / "meta.json").exists():
        try:
            done = TraceReader(out_dir)
            if done.meta.fingerprint and done.n_tokens > 0:
                return done
        except ValueError:
            pass  # incomplete: resume below
    geo = model_geometry(model)
    meta = trace_meta(model, geo, "calibration", {"corpus": corpus, "n_ctx": config.n_ctx})
    writer = TraceWriter(
        out_dir,
        meta,
        resume=True,
        chunk_tokens=config.chunk_tokens,
        max_buffer_bytes=config.max_buffer_bytes,
    )
    recorder = TraceRecorder(writer)
    threads = config.threads or max(1, os.cpu_count() or 1)
    llm = Llama(
        str(model),
        policy=recorder,
        n_ctx=config.n_ctx,
        n_batch=config.n_ctx,
        n_ubatch=config.n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        # the capture runs on the host, where it was checked; a GPU would only move the
        # attention of one prompt pass, and the default there (-ngl 99) would change that
        n_gpu_layers=0,
        # every row must reach the last layer: without logits_all llama.cpp keeps only the rows
        # whose logits are wanted after the last layer's attention
        logits_all=True,
        verbose=False,
    )
    try:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        total = min(len(tokens), config.tokens)
        if total < 2:
            raise ValueError("the calibration text is empty")
        starts = list(range(0, total, config.n_ctx))
        bar = tqdm(
            total=total,
            initial=min(writer.resume_from, total),
            unit="tok",
            desc="capture",
            disable=not progress,
            file=sys.stderr,
        )
        with writer:
            for i, start in enumerate(starts):
                stop = min(start + config.n_ctx, total)
                if stop <= writer.resume_from:
                    continue
                recorder.set_position(start)
                llm.reset()  # type: ignore[no-untyped-call]
                llm.eval(tokens[start:stop])
                bar.update(stop - max(start, writer.resume_from))
                if on_chunk is not None:
                    on_chunk(i + 1, len(starts))
            writer.meta.extra["tokens_in_text"] = len(tokens)
        bar.close()
    finally:
        # The hook joins the graph after llama.cpp reserved its compute buffer, and with
        # every row's logits kept the hooked graph needs a little more (50.9 MiB against
        # 49.7 on smolmoe at 256 tokens): ggml grows the buffer on the first batch, and the
        # context's destructor warns of it. Only the capture keeps every row, so only its
        # close hides that one line.
        with llama_log_dropping(_BUFFER_GREW):
            llm.close()
    return TraceReader(out_dir)
