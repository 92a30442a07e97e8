"""Routing replay: a recorded trace's expert ids, laid out for libspice to use
instead of the router's (spice_runtime_set_routing_replay).

For timing on random-weight real-shape models, whose routers pick experts
with no locality: replayed ids give hit rates and TPOT the locality of real
routing. Outputs are not the model's (the gate weights stay the router's), so
such runs are timing only.

A recording of a real model's routing (an ids-only trace, `pyspice trace
import`) replays only onto a model of its shape: MoE layers, experts and k.
A trace of our own runs of another geometry is mapped, and the mapping said in
one note:

- layers by index: the model's j-th MoE layer replays the trace's
  (j mod L)-th of its L MoE layers;
- experts by block: trace expert e of n_t stands for the model's experts
  floor(e * n_m / n_t) onwards (itself when n_m = n_t); a token's first slots
  take the first expert of each of its trace experts' blocks, in the trace's
  order, and slots beyond the trace's top-k the blocks' next experts; an id
  already taken in the row moves to the next free one (mod n_m), so every
  row names distinct experts. Equal geometry replays the trace's ids as
  recorded (the first k of each row when the trace routes more per token).

Positions: trace tokens in order, one per hooked row, wrapping at the end
(libspice's rule). A run's prompt replays from the trace's first token; where
its decode replays from depends on what the trace holds
(`RoutingReplay.decode_start_after`):

- a recorded run's prompt and decode (`python -m pyspice.measure.record
  trace`, whose meta names `prompt_tokens`): the recorded decode, from the
  recorded prompt's length;
- a run's decode steps alone (`bench --trace` skips the prompt's rows): from
  token 0, the recorded decode's first step;
- a text (an imported recording, a calibration text: no prompt named): the
  decode continues after this run's prompt, as a real text's decode would.
  Replaying such a decode from token 0 would re-walk the routing that the
  prompt's batch has just routed, and a cache looks better on it than on the
  text's continuation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pyspice.formats.trace import TraceMeta, TraceReader
from pyspice.runtime.handle import LayerInfo
from pyspice.sim.targets import TargetModel
from pyspice.sim.workload import ReplayWindow, Workload


@dataclass(frozen=True)
class RoutingReplay:
    ids: npt.NDArray[np.int32]  # [tokens, n_layers, k] over all the model's layers (dense rows 0)
    # the trace token a recorded decode starts at; None: the trace is a text, whose
    # decode continues after the run's prompt (the module's docstring)
    decode_start: int | None
    source: Path
    note: str  # how the trace maps onto the model, for the user

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def decode_start_after(self, prompt_tokens: int) -> int:
        """The trace token a decode replays first after a prompt of `prompt_tokens`
        replayed from the trace's start."""
        return first_decode_token(self.decode_start, prompt_tokens, self.n_tokens)


def first_decode_token(decode_start: int | None, prompt_tokens: int, n_tokens: int) -> int:
    """The trace token a decode replays first: a recorded decode's start, or for a text
    (None) the token after a prompt of `prompt_tokens`, wrapping as the positions do."""
    if decode_start is not None:
        return decode_start
    return max(0, prompt_tokens) % n_tokens if n_tokens > 0 else 0


def trace_decode_start(path: Path, prompt_tokens: int) -> int:
    """The trace token that a run replaying the trace at `path` after a prompt of
    `prompt_tokens` decodes from first (bench records it, so the simulator replays the
    window the run did)."""
    reader = TraceReader(path)
    return first_decode_token(decode_start_of(reader.meta, reader.n_tokens), prompt_tokens, reader.n_tokens)


def map_expert_rows(trace_ids: npt.NDArray[np.integer], n_trace: int, n_model: int, k: int) -> np.ndarray:
    """Rows of trace expert ids [T, k_t] (distinct ids < n_trace) as rows of k distinct
    model experts < n_model, by the block rule of the module's docstring."""
    rows = np.asarray(trace_ids, dtype=np.int64)
    if k > n_model:
        raise ValueError(f"a row of {k} distinct experts needs at least {k} experts, not {n_model}")
    if n_trace == n_model and k <= rows.shape[1]:
        return rows[:, :k].astype(np.int32)
    k_t = rows.shape[1]
    first = rows * n_model // n_trace  # each trace expert's block start
    out = np.empty((rows.shape[0], k), dtype=np.int32)
    for t in range(rows.shape[0]):
        taken: set[int] = set()
        for slot in range(k):
            e = (int(first[t, slot % k_t]) + slot // k_t) % n_model
            while e in taken:
                e = (e + 1) % n_model
            taken.add(e)
            out[t, slot] = e
    return out


def geometry_note(meta: TraceMeta, n_tokens: int, moe: list[LayerInfo], k: int) -> str:
    n_model = moe[0].n_expert
    head = (
        f"routing replay: {n_tokens} tokens of {meta.model}'s recorded routing "
        f"({len(meta.moe_layers)} MoE layers, top-{meta.n_expert_used} of {meta.n_expert}) replace the "
        "router's expert ids on every hooked row (timing only: the gate weights stay the router's, "
        "the outputs are not the model's)"
    )
    same = len(meta.moe_layers) == len(moe) and meta.n_expert == n_model and meta.n_expert_used >= k
    if same:
        return head + "; same geometry: ids as recorded"
    parts = [f"on a model of {len(moe)} MoE layers, top-{k} of {n_model}:"]
    if len(meta.moe_layers) != len(moe):
        parts.append(f"model MoE layer j replays trace layer j mod {len(meta.moe_layers)};")
    if meta.n_expert != n_model:
        parts.append(f"trace expert e stands for model experts from e*{n_model}//{meta.n_expert} on;")
    if k > meta.n_expert_used:
        parts.append(f"slots beyond the trace's {meta.n_expert_used} take the next expert of each block;")
    elif k < meta.n_expert_used:
        parts.append(f"the first {k} of each recorded row;")
    if meta.n_expert != n_model or k > meta.n_expert_used:
        parts.append("an id taken twice in a row moves to the next free expert;")
    return head + "; " + " ".join(parts).rstrip(";")


def decode_start_of(meta: TraceMeta, n_tokens: int) -> int | None:
    """The trace token a recorded decode starts at, or None for a text, whose decode
    continues after the run's prompt (see the module's docstring)."""
    if not meta.extra.get("prompt_tokens"):
        return None
    return meta.prompt_rows % n_tokens if n_tokens > 0 else 0


def load_routing_replay(path: Path, layers: list[LayerInfo], n_expert_used: int) -> RoutingReplay:
    """The trace at `path` as ids for a model of `layers` routing `n_expert_used` per token."""
    reader = TraceReader(path)
    if reader.n_tokens < 1:
        raise ValueError(f"{path}: the trace holds no tokens to replay")
    trace_ids, _weights = reader.routing()  # [T, L_t, k_t]
    moe = [info for info in layers if info.is_moe]
    if not moe:
        raise ValueError("routing replay needs a model with MoE layers")
    meta = reader.meta
    if meta.ids_only and (len(meta.moe_layers), meta.n_expert, meta.n_expert_used) != (
        len(moe),
        moe[0].n_expert,
        n_expert_used,
    ):
        # a real model's recording is replayed as it was or not at all: mapped onto
        # another shape its locality would no longer be the model's
        raise ValueError(
            f"{path} is a recording of {meta.model}'s routing ({len(meta.moe_layers)} MoE layers, "
            f"top-{meta.n_expert_used} of {meta.n_expert}); this model routes {len(moe)} MoE layers, "
            f"top-{n_expert_used} of {moe[0].n_expert}: replay it on a model of its shape, e.g. "
            "`pyspice models synth --arch deepseek2 --shape deepseek-v2-lite` for DeepSeek-V2-Lite"
        )
    ids = np.zeros((reader.n_tokens, len(layers), n_expert_used), dtype=np.int32)
    for j, info in enumerate(moe):
        src = trace_ids[:, j % trace_ids.shape[1], :]
        ids[:, info.il, :] = map_expert_rows(src, reader.meta.n_expert, info.n_expert, n_expert_used)
    return RoutingReplay(
        ids=ids,
        decode_start=decode_start_of(reader.meta, reader.n_tokens),
        source=Path(path),
        note=geometry_note(reader.meta, reader.n_tokens, moe, n_expert_used),
    )


def replay_workload(
    replay: RoutingReplay,
    moe_layers: Sequence[int],
    n_expert: int,
    *,
    decode_tokens: int,
    prompt_tokens: int = 0,
    prompt_hooked: bool = True,
    decode_start: int | None = None,
) -> Workload:
    """What a run replaying `replay` routes, for the simulator: a prompt of `prompt_tokens`
    from the trace's start (left out where the run's hook did not see the prompt's
    batches), then `decode_tokens` decode steps from where the decode after that prompt
    starts (`decode_start`, where a record says where the run's decode started), both
    wrapping at the end (bench seeks the replay so: measure.bench.run_one)."""
    n = replay.n_tokens
    start = decode_start if decode_start is not None else replay.decode_start_after(prompt_tokens)
    decode = [(start + i) % n for i in range(max(0, decode_tokens))]
    prompt = [i % n for i in range(prompt_tokens if prompt_hooked else 0)]
    ids = replay.ids[np.array(prompt + decode, dtype=np.int64)][:, list(moe_layers), :]
    n_layers = int(replay.ids.shape[1])
    return Workload.from_arrays(
        n_layers, list(moe_layers), n_expert, ids, prompt_tokens=len(prompt), source=str(replay.source)
    )


def _target_layers(target: TargetModel) -> list[LayerInfo]:
    moe = set(target.moe_layers)
    return [
        LayerInfo(il, il in moe, target.n_expert if il in moe else 0, 0, 0, 0, 0, 0, target.expert_bytes[il])
        for il in range(target.n_layers)
    ]


def replayed_workload(
    trace: Path, target: TargetModel, window: ReplayWindow, *, prompt_hooked: bool = True
) -> Workload:
    """What a bench run that replayed `trace` on a model of `target`'s shape routed in
    `window` (measure.bench.run_one, measure.isolated_row.run_once seek it so); the
    prompt's batches are left out where the run's hook did not see them."""
    rep = load_routing_replay(trace, _target_layers(target), target.n_expert_used)
    return replay_workload(
        rep,
        target.moe_layers,
        target.n_expert,
        decode_tokens=window.n_predict - 1,
        prompt_tokens=window.prompt_tokens,
        prompt_hooked=prompt_hooked,
        decode_start=window.decode_start,
    )
