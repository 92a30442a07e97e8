"""Ids-only traces: routing alone, readable without a model, refusing what they lack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.formats.trace import TraceError, TraceMeta, TraceReader, TraceWriter
from pyspice.sim.workload import from_trace

N_EXPERT, K = 8, 2
LAYERS = [1, 2, 3]


def ids_meta(fields: tuple[str, ...] = ("ids",), **kw: object) -> TraceMeta:
    base: dict[str, object] = dict(
        model="recorded-model",
        fingerprint="",
        n_layers=4,
        moe_layers=LAYERS,
        n_expert=N_EXPERT,
        n_expert_used=K,
        n_embd=0,
        fields=list(fields),
        source="imported",
        hidden_rows=False,
    )
    base.update(kw)
    return TraceMeta(**base)  # type: ignore[arg-type]


def routes(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in LAYERS]) for _ in range(n)]
    ).astype(np.int32)  # [n, L, k]


def write(path: Path, ids: np.ndarray, meta: TraceMeta, weights: np.ndarray | None = None) -> Path:
    with TraceWriter(path, meta, chunk_tokens=3) as w:
        for j, il in enumerate(LAYERS):
            fields = {"ids": ids[:, j]}
            if weights is not None:
                fields["weights"] = weights[:, j]
            w.add(il, 0, **fields)
    return path


def test_ids_only_round_trip_without_weights(tmp_path: Path) -> None:
    ids = routes(10)
    meta = ids_meta(sequence_starts=[0, 4, 7])
    path = write(tmp_path / "t", ids, meta)
    raw = json.loads((path / "meta.json").read_text())
    assert raw["hidden_rows"] is False and raw["fields"] == ["ids"] and raw["n_embd"] == 0
    r = TraceReader(path)
    assert r.meta.ids_only and r.meta.kind == "ids-only" and not r.meta.has_weights
    assert r.sequences() == [(0, 4), (4, 7), (7, 10)]
    got, weights = r.routing()
    np.testing.assert_array_equal(got, ids)
    np.testing.assert_allclose(weights, 1.0 / K)  # no weights recorded: uniform


def test_ids_only_with_weights_keeps_them(tmp_path: Path) -> None:
    ids = routes(5, seed=2)
    w = np.random.default_rng(3).random(ids.shape).astype(np.float32)
    r = TraceReader(write(tmp_path / "t", ids, ids_meta(("ids", "weights")), w))
    got_ids, got_w = r.routing()
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got_w, w, atol=1e-3)


def test_hidden_or_probs_on_an_ids_only_trace_name_what_is_missing(tmp_path: Path) -> None:
    r = TraceReader(write(tmp_path / "t", routes(4), ids_meta()))
    with pytest.raises(TraceError, match=r"ids-only trace .*no hidden, probs"):
        list(r.calls())
    with pytest.raises(TraceError, match=r"ids-only trace .*no probs"):
        r.layer(LAYERS[0], ("ids", "probs"))
    with pytest.raises(TraceError, match=r"ids-only trace .*no hidden"):
        next(r.tokens(("hidden",)))


def test_the_simulator_reads_an_ids_only_trace(tmp_path: Path) -> None:
    ids = routes(6)
    wl = from_trace(write(tmp_path / "t", ids, ids_meta()))
    assert wl.decoded_tokens == 6 and wl.moe_layers == tuple(LAYERS)
    np.testing.assert_array_equal(wl.steps[2].calls[1].ids[0], ids[2, 1])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(fields=["ids", "probs"]), "an ids-only trace .* holds the fields"),
        (dict(hidden_rows=True, n_embd=8), "a trace needs the fields .*hidden_rows: false"),
    ],
)
def test_meta_refuses_inconsistent_ids_only_headers(kw: dict[str, object], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        ids_meta(**kw)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sequence_starts": [0, 5, 3]}, "sequence_starts must be ascending"),
        ({"sequence_starts": [1]}, "sequence_starts must be ascending token numbers from 0"),
        ({"sequence_starts": [0, 40]}, "sequence_starts names token 40, but the trace holds 10"),
        ({"hidden_rows": True}, "n_embd = 0 is outside 1"),
        ({"hidden_rows": "no"}, "hidden_rows must be a true/false"),
    ],
)
def test_damaged_ids_only_meta_is_a_trace_error(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    path = write(tmp_path / "t", routes(10), ids_meta())
    raw = json.loads((path / "meta.json").read_text())
    raw.update(changes)
    (path / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(TraceError, match=message):
        TraceReader(path)


def test_a_version_1_trace_still_reads(tmp_path: Path) -> None:
    """Traces written before ids-only traces existed carry neither hidden_rows nor sequence_starts."""
    meta = TraceMeta("m", "", 4, LAYERS, N_EXPERT, K, 4, fields=["hidden", "probs", "ids", "weights"])
    n = 3
    rng = np.random.default_rng(0)
    with TraceWriter(tmp_path / "t", meta) as w:
        for j, il in enumerate(LAYERS):
            w.add(
                il,
                0,
                hidden=rng.standard_normal((n, 4)),
                probs=np.full((n, N_EXPERT), 1 / N_EXPERT),
                ids=routes(n)[:, j],
                weights=np.full((n, K), 0.5),
            )
    raw = json.loads((tmp_path / "t" / "meta.json").read_text())
    for key in ("hidden_rows", "sequence_starts"):
        del raw[key]
    raw["version"] = 1
    (tmp_path / "t" / "meta.json").write_text(json.dumps(raw))
    r = TraceReader(tmp_path / "t")
    assert not r.meta.ids_only and r.sequences() == [(0, n)] and len(list(r.calls())) == n * len(LAYERS)
