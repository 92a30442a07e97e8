"""Routing replay's mapping of a trace onto a model of another geometry (engine/replay.py):
rows stay distinct and in range, equal geometry replays the ids as recorded, and where
decode steps start in the trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.engine.replay import (
    decode_start_of,
    load_routing_replay,
    map_expert_rows,
    replay_workload,
    trace_decode_start,
)
from pyspice.formats.trace import TraceMeta
from pyspice.runtime import LayerInfo
from tests.unit.test_regime import write_trace


def _rows(n_expert: int, k: int, n: int = 200, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(n)])


def _distinct_in_range(rows: np.ndarray, n_expert: int) -> bool:
    return bool(
        rows.min() >= 0 and rows.max() < n_expert and all(len(set(r.tolist())) == len(r) for r in rows)
    )


def test_equal_geometry_replays_the_ids_as_recorded() -> None:
    trace = _rows(64, 6)
    np.testing.assert_array_equal(map_expert_rows(trace, 64, 64, 6), trace)
    np.testing.assert_array_equal(map_expert_rows(trace, 64, 64, 4), trace[:, :4])  # the first k


@pytest.mark.parametrize(
    ("n_trace", "k_trace", "n_model", "k_model"),
    [(32, 4, 64, 6), (64, 6, 32, 4), (8, 2, 8, 4), (64, 8, 64, 6), (32, 4, 8, 8), (60, 4, 64, 6)],
)
def test_other_geometries_map_to_distinct_experts_of_the_model(
    n_trace: int, k_trace: int, n_model: int, k_model: int
) -> None:
    trace = _rows(n_trace, k_trace)
    mapped = map_expert_rows(trace, n_trace, n_model, k_model)
    assert mapped.shape == (len(trace), k_model) and mapped.dtype == np.int32
    assert _distinct_in_range(mapped, n_model)
    # the same trace row maps to the same model row: reuse in the trace stays reuse
    again = map_expert_rows(np.concatenate([trace[:5], trace[:5]]), n_trace, n_model, k_model)
    np.testing.assert_array_equal(again[:5], again[5:])


def test_more_experts_spread_the_trace_over_all_of_them() -> None:
    # 32 -> 64 experts, top-4 -> top-6: e stands for 2e (and 2e + 1 in the extra slots)
    mapped = map_expert_rows(np.array([[3, 10, 0, 31]]), 32, 64, 6)
    assert mapped.tolist() == [[6, 20, 0, 62, 7, 21]]
    assert set(np.unique(map_expert_rows(_rows(32, 4, 500), 32, 64, 6))) == set(range(64))


def test_a_row_needs_as_many_experts_as_it_names() -> None:
    with pytest.raises(ValueError, match="at least 8 experts"):
        map_expert_rows(_rows(8, 2), 8, 4, 8)


def _meta(**extra: object) -> TraceMeta:
    return TraceMeta(
        model="m",
        fingerprint="",
        n_layers=2,
        moe_layers=[0, 1],
        n_expert=8,
        n_expert_used=2,
        n_embd=4,
        source="decode",
        extra=dict(extra),
    )


def test_decode_steps_start_after_a_recorded_prompt() -> None:
    assert decode_start_of(_meta(prompt_tokens=128), 160) == 128  # measure.record: prompt rows kept
    assert decode_start_of(_meta(prompt_tokens=128, prompt_rows_skipped=128), 31) == 0  # bench --trace
    assert decode_start_of(_meta(), 50) is None  # a text: the decode continues after the prompt
    assert decode_start_of(_meta(prompt_tokens=40), 32) == 8  # wraps as the positions do


def test_a_partly_skipped_prompt_starts_decode_where_its_kept_rows_end() -> None:
    """The replay and the simulator read one rule (TraceMeta.prompt_rows): a recorder
    that kept 6 of a 10-token prompt's rows decodes from the trace's 7th token."""
    meta = _meta(prompt_tokens=10, prompt_rows_skipped=4)
    assert meta.prompt_rows == 6
    assert decode_start_of(meta, 20) == 6


def _layers(n_moe: int, n_expert: int) -> list[LayerInfo]:
    dense = LayerInfo(0, False, 0, 16, 32, 0, 0, 0, 0)
    return [dense] + [LayerInfo(il, True, n_expert, 16, 32, 0, 0, 0, 100) for il in range(1, n_moe + 1)]


def test_a_real_recording_replays_only_onto_its_own_shape(tmp_path: Path) -> None:
    ids = np.stack([_rows(8, 2, n=12, seed=s) for s in range(3)], axis=1).astype(np.int32)  # [T, 3, 2]
    path = write_trace(tmp_path / "imported", ids, 8)  # ids-only, as `pyspice trace import` writes
    replay = load_routing_replay(path, _layers(3, 8), 2)
    assert (replay.ids[:, 1:] == ids).all() and "same geometry" in replay.note
    for layers, k in ((_layers(4, 8), 2), (_layers(3, 16), 2), (_layers(3, 8), 4)):
        with pytest.raises(ValueError, match="replay it on a model of its shape"):
            load_routing_replay(path, layers, k)


def test_an_imported_recordings_decode_continues_after_the_prompt(tmp_path: Path) -> None:
    """A recording is one text: after a prompt of P tokens replayed from its start, the
    decode replays token P on, not the prompt's own first tokens again; the simulator's
    workload and the token bench records read the same rule."""
    ids = np.stack([_rows(8, 2, n=12, seed=s) for s in range(3)], axis=1).astype(np.int32)
    path = write_trace(tmp_path / "imported", ids, 8)
    replay = load_routing_replay(path, _layers(3, 8), 2)
    assert replay.decode_start is None
    assert replay.decode_start_after(5) == 5 == trace_decode_start(path, 5)
    assert replay.decode_start_after(14) == 2  # wraps as the positions do
    wl = replay_workload(replay, [1, 2, 3], 8, decode_tokens=4, prompt_tokens=5)
    routed = np.stack([np.stack([c.ids for c in step.calls]) for step in wl.steps if step.decode])
    np.testing.assert_array_equal(routed[:, :, 0, :], ids[5:9])
    # a record that says where its decode started is replayed from there
    old = replay_workload(replay, [1, 2, 3], 8, decode_tokens=4, prompt_tokens=5, decode_start=0)
    first = next(step for step in old.steps if step.decode)
    np.testing.assert_array_equal(np.stack([c.ids for c in first.calls])[:, 0, :], ids[0])
    # a prompt the hook did not see is left out, but the decode still starts after it
    unhooked = replay_workload(replay, [1, 2, 3], 8, decode_tokens=4, prompt_tokens=5, prompt_hooked=False)
    assert all(step.decode for step in unhooked.steps)
    np.testing.assert_array_equal(np.stack([c.ids for c in unhooked.steps[0].calls])[:, 0, :], ids[5])
