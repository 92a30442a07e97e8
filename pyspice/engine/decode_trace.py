"""A model's MoE geometry read from its header, and recording its decode steps into a
trace (`generate`/`bench --trace`, calibration's capture, and the routing sample
`--policy auto` ranks policies on)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from pyspice.formats.model_info import read_header
from pyspice.formats.sidecar import fingerprint
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


def start_decode_trace(llm: Any, out: str | os.PathLike[str], policy: str | None = None) -> TraceRecorder:
    """Record the decode steps of `llm` (a pyspice.Llama) from now on into a new trace directory `out`
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


def greedy_next(llm: Any) -> int:
    """The argmax token of the last evaluated position's logits (no sampler involved)."""
    # lazy: llama_cpp loads libllama on import; this module is imported before any model is
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
    return int(np.argmax(logits))
