"""Routing replay (spice_runtime_set_routing_replay, `bench --replay-routing`): the hook
uses a recorded trace's expert ids instead of the router's, and everything after the
snapshot sees them -- the policy (a recording one here), the store's residency and hit
counters; token positions advance per hooked row (a prompt batch's rows in order, the
last layer's lone output row at the batch's end, then one per decode step), wrapping at
the trace's end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.api import Llama
from pyspice.formats.trace import TraceMeta, TraceWriter
from pyspice.policy import RESIDENCY_RESIDENT, HookCall, Plan
from pyspice.runtime import SpiceError

T = 7  # trace tokens: fewer than the prompt, so the prompt wraps around
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]  # 11 tokens
N_DECODE = 5


class Recording:
    """Runs the default plan and keeps every call's layer and ids."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[int, np.ndarray]] = []

    def decide(self, call: HookCall) -> Plan:
        self.calls.append((call.layer, np.array(call.ids, copy=True)))
        return Plan()


@pytest.fixture(scope="module")
def llm(synth_model):  # type: ignore[no-untyped-def]
    # logits of the last row only: llama.cpp hands the last layer of a prompt batch one row
    model = Llama(
        str(synth_model("qwen2moe", "tiny", "Q8_0")),
        policy="stock",
        n_ctx=128,
        n_batch=64,
        n_ubatch=64,
        n_threads=2,
        n_threads_batch=2,
        verbose=False,
    )
    yield model
    model.close()


def replay_ids(llm: Llama, seed: int = 0) -> np.ndarray:
    """[T, n_layers, k] distinct ids per row, different at every (token, layer)."""
    layers = llm.spice_layers()
    k = llm.policy_context().n_expert_used
    rng = np.random.default_rng(seed)
    ids = np.zeros((T, len(layers), k), dtype=np.int32)
    for info in layers:
        if info.is_moe:
            for t in range(T):
                ids[t, info.il] = rng.choice(info.n_expert, size=k, replace=False)
    return ids


def run(llm: Llama, policy: Recording) -> None:
    llm.set_policy(policy)
    llm.reset()
    llm.spice_reset_stats()
    llm.eval(PROMPT)
    token = 1
    for _ in range(N_DECODE):
        llm.eval([token])
        token += 1


def expected_rows(llm: Llama, layer: int, n_rows: int, first_token: int, ids: np.ndarray) -> np.ndarray:
    return np.stack([ids[(first_token + t) % T, layer] for t in range(n_rows)])


def test_the_hook_sees_exactly_the_replayed_ids(llm) -> None:  # type: ignore[no-untyped-def]
    rt = llm.spice_engine.runtime
    ids = replay_ids(llm)
    moe = [info.il for info in llm.spice_layers() if info.is_moe]
    rt.set_routing_replay(ids)
    try:
        assert rt.routing_replay_position() == 0
        policy = Recording()
        run(llm, policy)
        assert rt.routing_replay_position() == (len(PROMPT) + N_DECODE) % T
    finally:
        rt.set_routing_replay(None)
    assert rt.routing_replay_position() == -1
    prompt_calls, decode_calls = policy.calls[: len(moe)], policy.calls[len(moe) :]
    for il, got in prompt_calls:
        rows = got.shape[0]
        # every layer gets the whole prompt but the last, which gets the row whose logits are wanted
        assert rows == (1 if il == moe[-1] else len(PROMPT))
        np.testing.assert_array_equal(got, expected_rows(llm, il, rows, len(PROMPT) - rows, ids))
    assert len(decode_calls) == N_DECODE * len(moe)
    for step in range(N_DECODE):
        for il, got in decode_calls[step * len(moe) : (step + 1) * len(moe)]:
            np.testing.assert_array_equal(got, ids[(len(PROMPT) + step) % T, il][None, :])


def test_without_a_replay_the_router_decides(llm) -> None:  # type: ignore[no-untyped-def]
    policy = Recording()
    run(llm, policy)
    ids = replay_ids(llm)
    n_moe = sum(info.is_moe for info in llm.spice_layers())
    decode = policy.calls[n_moe:]
    replayed = [ids[(len(PROMPT) + i // n_moe) % T, il][None, :] for i, (il, _) in enumerate(decode)]
    assert any(not np.array_equal(got, want) for (_, got), want in zip(decode, replayed, strict=True))


def test_seek_and_bad_replays(llm) -> None:  # type: ignore[no-untyped-def]
    rt = llm.spice_engine.runtime
    ids = replay_ids(llm)
    with pytest.raises(SpiceError):
        rt.seek_routing_replay(0)  # nothing to seek
    bad = ids.copy()
    moe = next(info for info in llm.spice_layers() if info.is_moe)
    bad[3, moe.il, 1] = bad[3, moe.il, 0]  # an expert twice in a row
    with pytest.raises(SpiceError, match="twice"):
        rt.set_routing_replay(bad)
    bad[3, moe.il, 1] = moe.n_expert  # out of range
    with pytest.raises(SpiceError, match="outside"):
        rt.set_routing_replay(bad)
    with pytest.raises(SpiceError):
        rt.set_routing_replay(ids[:, :-1])  # not the model's layers
    assert rt.routing_replay_position() == -1  # refused: nothing changed
    rt.set_routing_replay(ids)
    try:
        rt.seek_routing_replay(T + 3)
        assert rt.routing_replay_position() == 3
        policy = Recording()
        llm.set_policy(policy)
        llm.reset()
        llm.eval([1])
        assert all(np.array_equal(got, ids[3, il][None, :]) for il, got in policy.calls)
    finally:
        rt.set_routing_replay(None)


def _decode_hits(llm: Llama, ids: np.ndarray) -> tuple[int, int]:
    """(decode hits, hits the replayed ids predict from the residency table)."""
    rt = llm.spice_engine.runtime
    rt.set_routing_replay(ids)
    try:
        policy = Recording()
        llm.set_policy(policy)  # the tier starts empty: fill it, then nothing moves (default plans)
        rt.preload()
        residency = rt.residency().copy()
        llm.reset()
        llm.eval([1])
        before = llm.spice_stats()
        for token in range(2, 2 + N_DECODE):
            llm.eval([token])
        after = llm.spice_stats()
        assert np.array_equal(rt.residency(), residency)
    finally:
        rt.set_routing_replay(None)
    hits = round(after["hit_rate"] * after["activations"]) - round(before["hit_rate"] * before["activations"])
    n_moe = sum(info.is_moe for info in llm.spice_layers())
    decode = policy.calls[len(policy.calls) - N_DECODE * n_moe :]
    predicted = sum(int((residency[il, got.ravel()] == RESIDENCY_RESIDENT).sum()) for il, got in decode)
    return hits, predicted


def test_the_store_counts_hits_of_the_replayed_ids(llm) -> None:  # type: ignore[no-untyped-def]
    layers = [info for info in llm.spice_layers() if info.is_moe]
    per = layers[0].bytes_per_expert
    # the first layer whole and half of the second resident: which experts of layer 1 a
    # replay names decides its hits there
    llm.set_device(int(per * (layers[0].n_expert + layers[1].n_expert // 2)))
    try:
        k = llm.policy_context().n_expert_used
        resident_half = np.arange(layers[1].n_expert // 2)
        absent_half = resident_half + layers[1].n_expert // 2
        ids = replay_ids(llm)
        hot, cold = ids.copy(), ids.copy()
        hot[:, layers[1].il] = resident_half[:k]
        cold[:, layers[1].il] = absent_half[:k]
        hot_hits, hot_predicted = _decode_hits(llm, hot)
        cold_hits, cold_predicted = _decode_hits(llm, cold)
    finally:
        llm.clear_device()
        llm.set_policy("stock")
    assert (hot_hits, cold_hits) == (hot_predicted, cold_predicted)
    assert hot_hits - cold_hits == N_DECODE * k  # layer 1's activations: all hits, then none


@pytest.mark.parametrize(
    ("extra", "decode_start", "first_decoded"),
    [
        ({"prompt_tokens": 4}, 4, 4),  # rows of a 4-token prompt, one per call, then decode steps
        ({}, None, 2),  # a text: the decode continues after this run's 2-token prompt
    ],
)
def test_a_trace_replays_through_the_engine(  # type: ignore[no-untyped-def]
    llm, tmp_path: Path, extra: dict[str, int], decode_start: int | None, first_decoded: int
) -> None:
    layers = llm.spice_layers()
    moe = [info for info in layers if info.is_moe]
    k = llm.policy_context().n_expert_used
    ids = replay_ids(llm)
    meta = TraceMeta(
        model="recorded.gguf",
        fingerprint="",
        n_layers=len(layers),
        moe_layers=[info.il for info in moe],
        n_expert=moe[0].n_expert,
        n_expert_used=k,
        n_embd=moe[0].n_embd,
        source="decode",
        extra=extra,
    )
    with TraceWriter(tmp_path / "trace", meta) as writer:
        for info in moe:
            writer.add(
                info.il,
                0,
                hidden=np.zeros((T, info.n_embd), np.float32),
                probs=np.zeros((T, info.n_expert), np.float32),
                ids=ids[:, info.il],
                weights=np.full((T, k), 1.0 / k, np.float32),
            )
    replay = llm.spice_engine.set_routing_replay(tmp_path / "trace")
    try:
        assert replay is not None and replay.decode_start == decode_start and "same geometry" in replay.note
        np.testing.assert_array_equal(replay.ids[:, [i.il for i in moe]], ids[:, [i.il for i in moe]])
        policy = Recording()
        llm.set_policy(policy)
        llm.reset()
        llm.spice_engine.replay_prompt()
        llm.eval([1, 2])
        policy.calls.clear()
        llm.spice_engine.replay_decode(2)
        llm.eval([3])
        assert policy.calls
        assert all(np.array_equal(got, ids[first_decoded, il][None, :]) for il, got in policy.calls)
    finally:
        llm.spice_engine.set_routing_replay(None)
        llm.set_policy("stock")
