"""Trace format: write/read round trip, token-major routing, replay, resume after interruption."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyspice.formats.trace import TraceError, TraceMeta, TraceReader, TraceWriter, scan_chunks
from pyspice.sim.workload import from_trace

N_EMBD, N_EXPERT, K = 8, 6, 2
LAYERS = [1, 2, 4]


def meta(**kw: object) -> TraceMeta:
    base: dict[str, object] = dict(
        model="tiny.gguf",
        fingerprint="sha256:x",
        n_layers=5,
        moe_layers=LAYERS,
        n_expert=N_EXPERT,
        n_expert_used=K,
        n_embd=N_EMBD,
        fields=["hidden", "probs", "ids", "weights", "shared"],
    )
    base.update(kw)
    return TraceMeta(**base)  # type: ignore[arg-type]


def records(n: int, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for il in LAYERS:
        probs = rng.random((n, N_EXPERT)).astype(np.float32)
        probs /= probs.sum(axis=1, keepdims=True)
        ids = np.argsort(-probs, axis=1)[:, :K].astype(np.int32)
        out[il] = {
            "hidden": rng.standard_normal((n, N_EMBD)).astype(np.float32),
            "probs": probs,
            "ids": ids,
            "weights": np.take_along_axis(probs, ids, axis=1),
            "shared": rng.standard_normal((n, N_EMBD)).astype(np.float32),
        }
    return out


def write_calls(w: TraceWriter, recs: dict[int, dict[str, np.ndarray]], sizes: list[int]) -> None:
    start = 0
    for size in sizes:
        for il in LAYERS:
            w.add(il, start, **{k: v[start : start + size] for k, v in recs[il].items()})
        start += size


def test_round_trip_layer_routing_and_replay(tmp_path: Path) -> None:
    recs = records(37)
    with TraceWriter(tmp_path / "t", meta(), chunk_tokens=8) as w:
        write_calls(w, recs, [5, 1, 1, 20, 10])
    r = TraceReader(tmp_path / "t")
    assert r.meta.complete and r.n_tokens == 37 and r.meta.moe_layers == LAYERS
    assert len(scan_chunks(tmp_path / "t")[2]) > 1  # really chunked
    for il in LAYERS:
        d = r.layer(il)
        np.testing.assert_array_equal(d["ids"], recs[il]["ids"])
        np.testing.assert_allclose(d["hidden"].astype(np.float32), recs[il]["hidden"], rtol=1e-3, atol=1e-3)
        assert d["hidden"].dtype == np.float16 and d["ids"].dtype == np.int16
    ids, weights = r.routing()
    assert ids.shape == (37, len(LAYERS), K)
    np.testing.assert_array_equal(ids[:, 1], recs[2]["ids"])
    np.testing.assert_allclose(weights[:, 2], recs[4]["weights"], atol=1e-3)
    calls = list(r.calls())
    assert len(calls) == 37 * len(LAYERS)
    c = calls[3 * 7 + 2]  # token 7, third MoE layer
    assert c.layer == 4 and c.n_tokens == 1
    np.testing.assert_array_equal(c.ids[0], recs[4]["ids"][7])
    assert c.shared is not None
    np.testing.assert_allclose(c.shared[0], recs[4]["shared"][7], atol=1e-2)


def test_writer_memory_is_bounded_by_flushing(tmp_path: Path) -> None:
    recs = records(40)
    with TraceWriter(tmp_path / "t", meta(), chunk_tokens=10_000, max_buffer_bytes=300) as w:
        write_calls(w, recs, [1] * 40)
        assert sum(w._buf_bytes.values()) <= 300
    assert TraceReader(tmp_path / "t").n_tokens == 40


def test_interrupted_trace_is_detected_and_resumes(tmp_path: Path) -> None:
    recs = records(30, seed=1)
    path = tmp_path / "t"
    with pytest.raises(KeyboardInterrupt), TraceWriter(path, meta(), chunk_tokens=4) as w:
        start = 0
        for size in (6, 6, 6):
            for il in LAYERS:
                w.add(il, start, **{k: v[start : start + size] for k, v in recs[il].items()})
            start += size
        w.add(1, 18, **{k: v[18:20] for k, v in recs[1].items()})  # one layer ahead of the others
        raise KeyboardInterrupt
    assert not json.loads((path / "meta.json").read_text())["complete"]
    with pytest.raises(TraceError, match="incomplete"):
        TraceReader(path)
    with pytest.raises(TraceError, match="resume"):
        TraceWriter(path, meta())
    w2 = TraceWriter(path, meta(), resume=True, chunk_tokens=4)
    assert w2.resume_from == 18
    with w2:
        write_calls(w2, recs, [10, 10, 10])  # the caller replays from the start; written rows are skipped
    r = TraceReader(path)
    assert r.n_tokens == 30
    for il in LAYERS:
        np.testing.assert_array_equal(r.layer(il)["ids"], recs[il]["ids"])


def test_resume_refuses_another_model(tmp_path: Path) -> None:
    path = tmp_path / "t"
    w = TraceWriter(path, meta())
    w.flush()
    with pytest.raises(TraceError, match="another model"):
        TraceWriter(path, meta(n_embd=16), resume=True)


def test_add_checks_fields_and_order(tmp_path: Path) -> None:
    recs = records(4)
    w = TraceWriter(tmp_path / "t", meta())
    with pytest.raises(TraceError, match="fields"):
        w.add(1, 0, hidden=recs[1]["hidden"])
    with pytest.raises(TraceError, match="token order"):
        w.add(1, 2, **recs[1])
    with pytest.raises(TraceError, match="not a MoE layer"):
        w.add(3, 0, **recs[1])


def test_recorder_keeps_decode_steps_only(tmp_path: Path) -> None:
    from pyspice.formats.trace import TraceRecorder
    from pyspice.policy.base import HookCall

    recs = records(6)
    w = TraceWriter(tmp_path / "t", meta(), chunk_tokens=2)
    rec = TraceRecorder(w, decode_only=True)

    def call(il: int, rows: slice) -> HookCall:
        r = recs[il]
        return HookCall(
            il, r["hidden"][rows], r["probs"][rows], r["ids"][rows], r["weights"][rows], r["shared"][rows]
        )

    # a 3-token prompt batch: the last MoE layer sees only the row whose logits are wanted
    for il in LAYERS:
        rec.decide(call(il, slice(0, 1) if il == LAYERS[-1] else slice(0, 3)))
    for t in (3, 4, 5):  # three decode steps
        for il in LAYERS:
            rec.decide(call(il, slice(t, t + 1)))
    w.close()
    r = TraceReader(tmp_path / "t")
    assert r.n_tokens == 3 and rec.skipped_tokens == 3
    np.testing.assert_array_equal(r.layer(4)["ids"], recs[4]["ids"][3:6])


def test_recorder_asks_its_inner_policy_at_every_call(tmp_path: Path) -> None:
    """An inner policy may decide calls in advance (Plan.resume_layer), but the recorder
    must see every call to record it, so it takes that permission back."""
    from pyspice.formats.trace import TraceRecorder
    from pyspice.policy.base import HookCall, Plan

    class Skips:
        name = "skips"

        def decide(self, call: HookCall) -> Plan:
            return Plan(resume_layer=LAYERS[0])

    recs = records(1)
    rec = TraceRecorder(TraceWriter(tmp_path / "t", meta()), Skips())
    r = recs[LAYERS[0]]
    plan = rec.decide(HookCall(LAYERS[0], r["hidden"], r["probs"], r["ids"], r["weights"], r["shared"]))
    assert plan.resume_layer == -1


def _small_trace(path: Path) -> Path:
    with TraceWriter(path, meta(), chunk_tokens=4) as w:
        write_calls(w, records(8), [4, 4])
    return path


def _edit_meta(path: Path, **changes: object) -> None:
    raw = json.loads((path / "meta.json").read_text())
    raw.update(changes)
    (path / "meta.json").write_text(json.dumps(raw))


def _rewrite_chunk(path: Path, **fields: np.ndarray) -> None:
    chunk = scan_chunks(path)[LAYERS[0]][0].path
    with np.load(chunk) as z:
        data = {k: z[k] for k in z.files}
    data.update(fields)
    np.savez(chunk, **data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "meta.json").write_text('{"model": '), r"meta\.json is not valid JSON"),
        (lambda p: (p / "meta.json").write_text("[1, 2]"), "holds a list, not an object"),
        (lambda p: _edit_meta(p, n_expert_used=N_EXPERT + 1), "n_expert_used = 7 exceeds n_expert = 6"),
        (lambda p: _edit_meta(p, n_embd="wide"), "n_embd must be a int"),
        (lambda p: _edit_meta(p, moe_layers=[1, 9]), r"moe_layers must be distinct layer numbers in 0\.\.4"),
        (lambda p: _edit_meta(p, version="1"), "version must be a int"),
        (lambda p: _edit_meta(p, n_tokens=99), "complete with 99 tokens, but its chunk files hold 8"),
        (lambda p: scan_chunks(p)[LAYERS[0]][0].path.write_bytes(b"junk"), "a damaged trace chunk"),
        (lambda p: _rewrite_chunk(p, hidden=np.zeros((4, 9), np.float16)), r"'hidden' is float16\[4, 9\]"),
        (lambda p: _rewrite_chunk(p, ids=np.full((4, K), N_EXPERT, np.int16)), r"expert ids outside 0\.\.5"),
        (lambda p: _rewrite_chunk(p, ids=np.zeros((4, K), np.float32)), r"'ids' is float32"),
    ],
    ids=["json", "not-object", "k>n", "type", "layers", "version", "missing-chunk", "junk-chunk",
         "shape", "ids-range", "dtype"],
)  # fmt: skip
def test_a_damaged_trace_is_a_trace_error_naming_the_file(tmp_path: Path, damage: Any, message: str) -> None:
    """Before, these raised JSONDecodeError, TypeError, BadZipFile or IndexError from deep
    inside the reader (fuzz/fuzz_trace.py found them), or read on with wrong shapes."""
    path = _small_trace(tmp_path / "t")
    damage(path)
    with pytest.raises(TraceError, match=message) as err:
        r = TraceReader(path)
        r.routing()
        list(r.calls())
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("extra", "decoded"),
    [({}, 12), ({"prompt_tokens": 4}, 8), ({"prompt_tokens": 4, "prompt_rows_skipped": 4}, 12)],
)
def test_the_simulator_decodes_every_row_of_a_trace_that_skipped_its_prompt(
    tmp_path: Path, extra: dict[str, int], decoded: int
) -> None:
    """bench/generate --trace record decode steps only and name the prompt they skipped:
    none of the trace's rows is that prompt (the simulator once took the first
    prompt_tokens rows for it, and found nothing left to decode in a 63-token trace
    after a 128-token prompt)."""
    with TraceWriter(tmp_path / "t", meta(extra=extra), chunk_tokens=8) as w:
        write_calls(w, records(12), [1] * 12)
    assert from_trace(tmp_path / "t").decoded_tokens == decoded


def test_the_simulator_takes_a_partly_skipped_prompts_kept_rows_as_its_prompt(tmp_path: Path) -> None:
    """6 of a 10-token prompt's rows recorded, then 6 decode steps: the replay starts
    decoding at the 7th row (TraceMeta.prompt_rows), and so does the simulator."""
    with TraceWriter(
        tmp_path / "t", meta(extra={"prompt_tokens": 10, "prompt_rows_skipped": 4}), chunk_tokens=8
    ) as w:
        write_calls(w, records(12), [1] * 12)
    assert from_trace(tmp_path / "t").decoded_tokens == 6
