"""What the simulator replays: the hook calls of a recorded run, step by step.

A step is one evaluation (a prompt micro-batch or one decoded token); it holds
one call per MoE layer with the arrays a policy sees (hidden, probs, ids,
weights, optional shared). Traces on disk are read by pyspice.formats.trace (one
format, shared with calibration); `from_trace` adapts its reader, and
`from_arrays` takes plain token-major arrays (tests, scratch recordings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.formats.trace import TraceReader


@dataclass
class SimCall:
    layer: int
    ids: npt.NDArray[np.int32]  # [n_tokens, k]
    weights: npt.NDArray[np.float32]  # [n_tokens, k]
    probs: npt.NDArray[np.float32] | None = None  # [n_tokens, n_expert]
    hidden: npt.NDArray[np.float32] | None = None  # [n_tokens, n_embd]
    shared: npt.NDArray[np.float32] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class SimStep:
    calls: list[SimCall]
    decode: bool  # counts toward per-token figures (TPOT); prompt steps only warm the tier

    @property
    def n_tokens(self) -> int:
        return self.calls[0].n_tokens if self.calls else 0


@dataclass
class Workload:
    n_layers: int
    n_expert: tuple[int, ...]  # per layer, 0 for dense layers
    n_expert_used: int
    n_embd: int
    steps: list[SimStep] = field(default_factory=list)
    source: str = ""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(il for il, n in enumerate(self.n_expert) if n > 0)

    @property
    def decoded_tokens(self) -> int:
        return sum(s.n_tokens for s in self.steps if s.decode)

    @staticmethod
    def from_arrays(
        n_layers: int,
        moe_layers: Sequence[int],
        n_expert: int,
        ids: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
        *,
        probs: npt.ArrayLike | None = None,
        hidden: npt.ArrayLike | None = None,
        prompt_tokens: int = 0,
        source: str = "arrays",
    ) -> Workload:
        """Token-major arrays: ids/weights [T, L_moe, k], probs [T, L_moe, n_expert],
        hidden [T, L_moe, n_embd]. The first `prompt_tokens` tokens form one prompt
        step (one batched call per layer); every later token is a decode step."""
        ids_a = np.asarray(ids, dtype=np.int32)
        if ids_a.ndim != 3 or ids_a.shape[1] != len(moe_layers):
            raise ValueError(f"ids must be [tokens, {len(moe_layers)} MoE layers, k], got {ids_a.shape}")
        n_tok, _, k = ids_a.shape
        w_a = (
            np.asarray(weights, dtype=np.float32)
            if weights is not None
            else np.full(ids_a.shape, 1.0 / k, np.float32)
        )
        p_a = np.asarray(probs, dtype=np.float32) if probs is not None else None
        h_a = np.asarray(hidden, dtype=np.float32) if hidden is not None else None
        n_embd = int(h_a.shape[-1]) if h_a is not None else 0
        per_layer = tuple(n_expert if il in set(moe_layers) else 0 for il in range(n_layers))
        wl = Workload(n_layers, per_layer, int(k), n_embd, source=source)
        bounds = ([(0, prompt_tokens)] if prompt_tokens > 0 else []) + [
            (t, t + 1) for t in range(prompt_tokens, n_tok)
        ]
        for lo, hi in bounds:
            calls = [
                SimCall(
                    layer=il,
                    ids=ids_a[lo:hi, j],
                    weights=w_a[lo:hi, j],
                    probs=p_a[lo:hi, j] if p_a is not None else None,
                    hidden=h_a[lo:hi, j] if h_a is not None else None,
                )
                for j, il in enumerate(moe_layers)
            ]
            wl.steps.append(SimStep(calls, decode=hi - lo == 1 and lo >= prompt_tokens))
        return wl


@dataclass(frozen=True)
class ReplayWindow:
    """The part of a trace a bench run replayed, as its record says: a prompt of
    `prompt_tokens` from the trace's start, then the decode of `n_predict` tokens (the
    first comes from the prompt's logits) from `decode_start` (None: a record from before
    bench kept it; engine/replay.py's rule gives it)."""

    prompt_tokens: int
    n_predict: int
    decode_start: int | None = None


def from_trace(path: Path, sequences: tuple[int, int] | None = None) -> Workload:
    """A trace directory written by pyspice.formats.trace (`generate/bench --trace`). Every
    token is a decode step, unless meta.extra names `prompt_tokens`: those first
    tokens then form one prompt step (it warms the tier, it is not timed). A trace of
    decode steps only (`generate/bench --trace`, which skip the prompt's rows and say
    how many in `prompt_rows_skipped`) holds none of them.

    `sequences` (first, last), 1-based and inclusive, replays only those sequences of
    the trace (an imported recording's prompts), one after another; the prompt step
    then belongs to the first sequence only when it is the trace's first."""
    reader = TraceReader(path)
    meta = reader.meta
    prompt_rows = meta.prompt_rows
    lo, hi = 0, reader.n_tokens
    if sequences is not None:
        spans = reader.sequences()
        first, last = sequences
        if not 1 <= first <= last <= len(spans):
            raise ValueError(f"{path}: sequences {first}-{last} are outside the trace's 1-{len(spans)}")
        lo, hi = spans[first - 1][0], spans[last - 1][1]
        prompt_rows = min(prompt_rows, hi) if lo == 0 else 0
    fields = tuple(f for f in ("ids", "weights", "probs", "hidden") if f in meta.fields)
    arrays = {il: reader.layer(il, fields) for il in meta.moe_layers}

    def stack(name: str) -> npt.NDArray[Any] | None:
        if name not in fields:
            return None
        return np.stack([np.asarray(arrays[il][name])[lo:hi] for il in meta.moe_layers], axis=1)

    return Workload.from_arrays(
        meta.n_layers,
        meta.moe_layers,
        meta.n_expert,
        stack("ids"),  # type: ignore[arg-type]
        stack("weights"),
        probs=stack("probs"),
        hidden=stack("hidden"),
        prompt_tokens=prompt_rows,
        source=str(path),
    )


def repeated(workload: Workload, passes: int, *, cold_passes: int = 1) -> Workload:
    """`workload` run `passes` times over on one model, as a bench row repeats its run in
    one process: the tier's slots and the policy's state carry from one pass to the
    next. The decode steps of the first `cold_passes` only warm (bench's cold run, which
    a warm TPOT leaves out); the later passes' decode steps are timed, so the TPOT is
    their mean."""
    if passes < 1 or not 0 <= cold_passes < passes:
        raise ValueError(f"passes {passes} with {cold_passes} cold: at least one pass must be timed")
    steps: list[SimStep] = []
    for n in range(passes):
        steps += [step if n >= cold_passes else SimStep(step.calls, decode=False) for step in workload.steps]
    return Workload(
        workload.n_layers,
        workload.n_expert,
        workload.n_expert_used,
        workload.n_embd,
        steps,
        workload.source,
    )
