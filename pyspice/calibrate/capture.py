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
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from pyspice.formats.model_info import read_header
from pyspice.formats.sidecar import fingerprint

if TYPE_CHECKING:
    from pyspice.api import Llama
from pyspice.engine.llama_log import llama_log_dropping
from pyspice.formats.trace import TraceMeta, TraceReader, TraceRecorder, TraceWriter
from pyspice.policy import Policy, make_policy, policy_spec


@dataclass(frozen=True)
class ModelGeometry:
    arch: str
    n_layers: int
    moe_layers: list[int]
    n_expert: int
    n_expert_used: int
    n_embd: int
    has_shared: bool
    gating: str  # "softmax" | "sigmoid"


_GATING = {1: "softmax", 2: "sigmoid"}
# llama.cpp's warning on closing a context whose compute buffer grew after its reserve
_BUFFER_GREW = re.compile(r"compute buffer size of .* does not match expectation")


def model_geometry(model_path: str | os.PathLike[str]) -> ModelGeometry:
    """Layer geometry of a MoE GGUF from its metadata and tensor names (header only)."""
    header = read_header(Path(model_path))

    def kv(key: str, default: Any = None) -> Any:
        return header.metadata.get(key, default)

    arch = str(kv("general.architecture", ""))
    names = {t.name for t in header.tensors}
    n_layers = int(kv(f"{arch}.block_count", 0))
    moe = [il for il in range(n_layers) if f"blk.{il}.ffn_gate_inp.weight" in names]
    if not moe:
        raise ValueError(f"{Path(model_path).name} has no MoE layers: nothing to calibrate")
    gating_id = int(kv(f"{arch}.expert_gating_func", 0) or 0)
    if gating_id not in (0, 1, 2):
        raise ValueError(f"expert gating function {gating_id} of {arch} is not supported by the predictor")
    return ModelGeometry(
        arch=arch,
        n_layers=n_layers,
        moe_layers=moe,
        n_expert=int(kv(f"{arch}.expert_count", 0)),
        n_expert_used=int(kv(f"{arch}.expert_used_count", 0)),
        n_embd=int(kv(f"{arch}.embedding_length", 0)),
        has_shared=any(f"blk.{il}.ffn_up_shexp.weight" in names for il in moe),
        gating=_GATING.get(gating_id, "softmax"),  # 0 (unset): softmax, as llama.cpp for V2 / qwen2moe
    )


@dataclass(frozen=True)
class CaptureConfig:
    tokens: int = 8192  # cap on captured tokens
    n_ctx: int = 512  # tokens per independent chunk
    threads: int | None = None
    chunk_tokens: int = 512  # rows per trace chunk file
    max_buffer_bytes: int = 64 << 20


def trace_meta(model_path: Path, geo: ModelGeometry, source: str, extra: dict[str, Any]) -> TraceMeta:
    fields = ["hidden", "probs", "ids", "weights"] + (["shared"] if geo.has_shared else [])
    return TraceMeta(
        model=model_path.name,
        fingerprint=fingerprint(model_path),
        n_layers=geo.n_layers,
        moe_layers=list(geo.moe_layers),
        n_expert=geo.n_expert,
        n_expert_used=geo.n_expert_used,
        n_embd=geo.n_embd,
        fields=fields,
        source=source,
        extra=extra,
    )


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


def start_decode_trace(llm: Llama, out: str | os.PathLike[str], policy: str | None = None) -> TraceRecorder:
    """Record the decode steps of `llm` from now on into a new trace directory `out`
    (`generate/bench --trace`). The model keeps running `policy`'s plans (a Python
    policy of that name; the exact plan for `exact` and `stock`); one-token calls are
    recorded, prompt batches are not (see TraceRecorder). Finish with finish_decode_trace."""
    name = policy or llm.spice_policy
    # a rule policy records under the exact plan: routing does not depend on a lossless
    # policy, and the recorder must see every call, which a rule's never reach Python
    inner = cast("Policy | None", make_policy(name) if policy_spec(name).kind == "python" else None)
    model = Path(llm.model_path)
    geo = model_geometry(model)
    meta = trace_meta(model, geo, "decode", {"policy": name})
    writer = TraceWriter(out, meta, chunk_tokens=64)
    recorder = TraceRecorder(writer, inner, decode_only=True)
    llm.set_policy(recorder)
    return recorder


def finish_decode_trace(recorder: TraceRecorder, **extra: Any) -> TraceReader:
    """Close the trace (complete) with `extra` (e.g. prompt_tokens, tokens) in its meta."""
    recorder.writer.meta.extra.update(extra)
    recorder.writer.meta.extra["prompt_rows_skipped"] = recorder.skipped_tokens
    recorder.writer.close()
    return TraceReader(recorder.writer.path)
