"""The LoRE surrogate executor in libspice: its arithmetic against numpy, and
its place in the hook: exact policies never touch it, a zero surrogate is a
drop, surrogate bytes come out of the device budget, and a plan asking for a
surrogate that is not loaded runs exactly and is counted as a fallback."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from pyspice.api import Llama
from pyspice.policy import ACTION_DEVICE, ACTION_DROP, ACTION_HOST, ACTION_SURROGATE, HookCall, Plan
from pyspice.policy.substitute import SubstitutePolicy
from pyspice.runtime import SpiceError, surrogate_apply

from .golden import greedy_run, load

N_DECODE = 6
ARCHS = [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")]


def reference(
    a: np.ndarray, b: np.ndarray, alpha: float, h: np.ndarray, w: np.ndarray, shared: np.ndarray | None
) -> np.ndarray:
    """w * (alpha * shared + B A h) in float64, with A and B rounded to f16 as libspice stores them."""
    a16 = a.astype(np.float16).astype(np.float64)
    b16 = b.astype(np.float16).astype(np.float64)
    y = (h.astype(np.float64) @ a16.T) @ b16.T
    if shared is not None:
        y = y + alpha * shared.astype(np.float64)
    return w.astype(np.float64)[:, None] * y  # type: ignore[no-any-return]


@pytest.mark.parametrize("rank", [0, 1, 3, 8, 32])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("n_rows,n_threads", [(1, 1), (1, 2), (5, 2), (3, 4), (16, 3)])
def test_apply_matches_numpy(rank: int, with_shared: bool, n_rows: int, n_threads: int) -> None:
    rng = np.random.default_rng(1000 * rank + 10 * n_rows + n_threads)
    n_embd = 200  # not a multiple of any SIMD width or of the column split
    a = (rng.standard_normal((rank, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    b = rng.standard_normal((n_embd, rank)).astype(np.float32)
    h = rng.standard_normal((n_rows, n_embd)).astype(np.float32)
    shared = rng.standard_normal((n_rows, n_embd)).astype(np.float32) if with_shared else None
    w = rng.uniform(0.05, 1.0, n_rows).astype(np.float32)
    alpha = float(rng.uniform(-1.5, 1.5))
    start = rng.standard_normal((n_rows, n_embd)).astype(np.float32)  # it accumulates into out

    got = surrogate_apply(a, b, alpha, h, w, shared, out=start.copy(), n_threads=n_threads)
    want = start + reference(a, b, alpha, h, w, shared)
    scale = np.abs(want).max() + 1.0
    assert np.abs(got - want).max() <= 2e-6 * scale * max(1, rank) ** 0.5
    if rank == 0 and not with_shared:
        assert np.array_equal(got, start)  # nothing to add: out untouched, bit for bit


def test_apply_rounds_the_matrices_to_f16() -> None:
    """The stored precision is f16: the result follows the rounded matrices,
    not the f32 ones (a test that would pass for either proves nothing)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)
    h = rng.standard_normal((2, 64)).astype(np.float32)
    w = np.ones(2, np.float32)
    got = surrogate_apply(a, b, 0.0, h, w)
    f32 = (h.astype(np.float64) @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    f16 = reference(a, b, 0.0, h, w, None)
    assert np.abs(got - f16).max() < 1e-4 < np.abs(got - f32).max()


def test_apply_rejects_bad_shapes() -> None:
    h = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError):
        surrogate_apply(np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), 1.0, h, np.ones(2))
    with pytest.raises(SpiceError):
        surrogate_apply(
            np.zeros((2, 8), np.float32), np.zeros((8, 2), np.float32), 1.0, h, np.ones(2), n_threads=0
        )


# ---- through a model -------------------------------------------------------------------


class Everything:
    """Every activation gets one action."""

    def __init__(self, action: int) -> None:
        self.action = action
        self.name = f"all-{action}"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), self.action, np.int32))


class Table:
    """A sidecar-like object: the same shapes for every expert, values from a seed."""

    def __init__(
        self, n_embd: int, rank: int, alpha: float, zero_b: bool, skip: frozenset[Any] = frozenset()
    ):
        self.n_embd, self.rank, self.alpha, self.zero_b, self.skip = n_embd, rank, alpha, zero_b, skip

    def surrogate(
        self, layer: int, expert: int
    ) -> tuple[float, npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        if (layer, expert) in self.skip:
            return None
        rng = np.random.default_rng(100 * layer + expert)
        a = (rng.standard_normal((self.rank, self.n_embd)) / np.sqrt(self.n_embd)).astype(np.float32)
        b = rng.standard_normal((self.n_embd, self.rank)).astype(np.float32) * 0.05
        return self.alpha, a, (np.zeros_like(b) if self.zero_b else b)


def n_embd_of(llm: Llama) -> int:
    return int(next(info.n_embd for info in llm.spice_layers() if info.is_moe))


def all_experts(llm: Llama) -> list[tuple[int, int]]:
    return [(info.il, e) for info in llm.spice_layers() if info.is_moe for e in range(info.n_expert)]


@pytest.fixture(params=ARCHS, ids=[arch for arch, _ in ARCHS])
def model(request: pytest.FixtureRequest, synth_model: Any) -> Any:
    arch, quant = request.param
    llm = load(synth_model(arch, "tiny", quant))
    yield llm
    llm.close()


def test_exact_policies_never_touch_surrogates(model: Llama) -> None:
    ref = greedy_run(model, "stock", n_decode=N_DECODE)
    loaded = model.set_surrogates(Table(n_embd_of(model), 4, 0.9, zero_b=False))
    assert loaded.count == len(all_experts(model)) and loaded.device_bytes > 0
    for policy in ("exact", Everything(ACTION_HOST), Everything(ACTION_DEVICE)):
        run = greedy_run(model, policy, n_decode=N_DECODE)
        assert np.array_equal(run.logits, ref.logits), policy
        assert run.stats["misses"]["surrogate"] == 0


def test_a_zero_surrogate_is_a_drop(model: Llama) -> None:
    """alpha = 0 and B = 0 (A random): the executor runs and adds exactly nothing."""
    model.set_surrogates(Table(n_embd_of(model), 4, 0.0, zero_b=True))
    dropped = greedy_run(model, Everything(ACTION_DROP), n_decode=N_DECODE)
    zero = greedy_run(model, Everything(ACTION_SURROGATE), n_decode=N_DECODE)
    assert np.array_equal(zero.logits, dropped.logits)
    assert zero.stats["misses"]["surrogate"] == zero.stats["activations"] > 0
    assert zero.stats["policy_fallbacks"] == 0


def test_surrogates_change_the_output(model: Llama) -> None:
    """A non-zero surrogate is neither a drop nor exact, and the shared-expert
    stand-in (rank 0, alpha 1) is neither either: the executor is really used."""
    ref = greedy_run(model, "stock", n_decode=N_DECODE)
    dropped = greedy_run(model, Everything(ACTION_DROP), n_decode=N_DECODE)
    model.set_surrogates(Table(n_embd_of(model), 4, 0.5, zero_b=False))
    low_rank = greedy_run(model, Everything(ACTION_SURROGATE), n_decode=N_DECODE)
    policy = SubstitutePolicy(resident=(), mode="shared")
    model.set_surrogates(policy.surrogate_source(None, n_embd_of(model)))
    shared = greedy_run(model, policy, n_decode=N_DECODE)
    for run in (low_rank, shared):
        assert run.stats["policy_fallbacks"] == 0
        assert not np.array_equal(run.logits, dropped.logits)
        assert not np.array_equal(run.logits, ref.logits)
    assert not np.array_equal(low_rank.logits, shared.logits)
    again = greedy_run(model, policy, n_decode=N_DECODE)  # and it is deterministic
    assert np.array_equal(again.logits, shared.logits)


def test_a_plan_asking_for_a_missing_surrogate_runs_exactly(model: Llama, capsys: Any) -> None:
    ref = greedy_run(model, "stock", n_decode=N_DECODE)
    model.clear_surrogates()
    none = greedy_run(model, Everything(ACTION_SURROGATE), n_decode=N_DECODE)
    assert np.array_equal(none.logits, ref.logits)
    assert none.stats["policy_fallbacks"] == none.stats["hook_calls"] > 0
    assert none.stats["misses"]["surrogate"] == 0
    assert "no surrogates are loaded" in capsys.readouterr().err

    # one missing expert per MoE layer: the calls that select it fall back, the others run surrogates
    skip = frozenset((il, 0) for il, _ in all_experts(model))
    model.set_surrogates(Table(n_embd_of(model), 2, 0.0, zero_b=True, skip=skip))
    assert model.spice_surrogates().count == len(all_experts(model)) - len(skip)
    part = greedy_run(model, Everything(ACTION_SURROGATE), n_decode=N_DECODE)
    s = part.stats
    assert 0 < s["policy_fallbacks"] < s["hook_calls"]
    assert 0 < s["misses"]["surrogate"] < s["activations"]
    assert "does not have" in model.spice_engine.require_runtime().last_error()
    model.clear_surrogates()


def test_substitute_policy_keeps_resident_experts_exact(model: Llama) -> None:
    """Everything resident: the substitute policy is exact whatever its mode."""
    ref = greedy_run(model, "stock", n_decode=N_DECODE)
    model.set_surrogates(Table(n_embd_of(model), 4, 0.5, zero_b=False))
    run = greedy_run(model, SubstitutePolicy(all_experts(model), "surrogate"), n_decode=N_DECODE)
    assert np.array_equal(run.logits, ref.logits)
    assert run.stats["misses"]["surrogate"] == 0


def test_surrogate_bytes_come_out_of_the_device_budget(synth_model: Any) -> None:
    llm = load(synth_model("qwen2moe", "tiny", "Q8_0"))
    try:
        rt = llm.spice_engine.require_runtime()
        expert_bytes = llm.spice_layers()[0].bytes_per_expert
        budget = 10 * expert_bytes
        n_embd = n_embd_of(llm)
        llm.set_device(budget, 8.0, 5.0, manual_clock=True)
        assert rt.preload() == 10
        store_used = rt._n.lib.spice_store_used_bytes

        # rank chosen so that all surrogates together are about 3.5 experts
        n = len(all_experts(llm))
        rank = int(3.5 * expert_bytes / n / (4 * n_embd))
        table = Table(n_embd, rank, 1.0, zero_b=False)
        with pytest.raises(ValueError, match="do not fit the device budget"):
            llm.set_surrogates(table)  # the tier is full of experts
        assert llm.spice_surrogates().count == 0

        llm.set_device(budget, 8.0, 5.0, manual_clock=True)  # an empty tier
        loaded = llm.set_surrogates(table)
        assert loaded.count == n
        assert loaded.device_bytes == n * (4 * rank * n_embd + 4)  # f16 A and B, f32 alpha
        assert store_used(rt._n.lib.spice_runtime_get_store(rt._rt)) == loaded.device_bytes
        assert rt.preload() == 10 - 4  # 3.5 experts' worth of surrogates cost 4 slots
        llm.set_device(budget, 8.0, 5.0, manual_clock=True)  # a fresh tier holds the surrogates first
        assert store_used(rt._n.lib.spice_runtime_get_store(rt._rt)) == loaded.device_bytes
        assert rt.preload() == 6

        # over budget: refused, nothing stays loaded, the budget is whole again
        with pytest.raises(ValueError, match="do not fit the device budget"):
            llm.set_surrogates(Table(n_embd, 4 * rank, 1.0, zero_b=False))
        assert llm.spice_surrogates().count == 0 and llm.spice_surrogates().device_bytes == 0
        llm.set_device(budget, 8.0, 5.0, manual_clock=True)
        assert rt.preload() == 10

        # surrogates loaded first, then a tier too small for them: refused by name
        llm.clear_device()
        llm.set_surrogates(Table(n_embd, rank, 1.0, zero_b=False))
        with pytest.raises(SpiceError, match="surrogates need"):
            llm.set_device(2 * expert_bytes, 8.0, 5.0, manual_clock=True)
    finally:
        llm.close()


class RecordingDrop:
    """Drops every activation and records which (layer, expert) were selected."""

    name = "recording-drop"

    def __init__(self) -> None:
        self.selected: set[tuple[int, int]] = set()

    def decide(self, call: HookCall) -> Plan:
        self.selected.update((call.layer, int(e)) for e in np.unique(call.ids))
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), ACTION_DROP, np.int32))


class Only(Table):
    """Non-zero surrogates for the pairs in `live`, zero (a drop) for the others."""

    def __init__(self, n_embd: int, live: set[tuple[int, int]]) -> None:
        super().__init__(n_embd, 3, 0.7, zero_b=False)
        self.live = live

    def surrogate(
        self, layer: int, expert: int
    ) -> tuple[float, npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        alpha, a, b = super().surrogate(layer, expert)  # type: ignore[misc]
        if (layer, expert) in self.live:
            return alpha, a, b
        return 0.0, a, np.zeros_like(b)


def short_run(llm: Llama, policy: Any) -> np.ndarray:
    llm.set_policy(policy)
    llm.reset()  # type: ignore[no-untyped-call]
    llm.eval([1, 450, 4996])  # three tokens: few selections, so some experts stay unused
    return llm.scores[: llm.n_tokens].copy()  # type: ignore[no-any-return]


def test_each_activation_uses_its_own_experts_surrogate(model: Llama) -> None:
    """Surrogates are looked up by (layer, selected expert): a non-zero
    surrogate of an expert nobody selects changes nothing, one of a selected
    expert changes the output."""
    recorder = RecordingDrop()
    dropped = short_run(model, recorder)
    unused = sorted(set(all_experts(model)) - recorder.selected)
    assert unused and recorder.selected  # three tokens cannot select every expert of every layer
    surrogate_all = Everything(ACTION_SURROGATE)
    model.set_surrogates(Only(n_embd_of(model), set(unused)))
    assert np.array_equal(short_run(model, surrogate_all), dropped)
    # the first MoE layer sees the same inputs in both runs, so its selections are the recorded ones
    first = min(il for il, _ in recorder.selected)
    used_first = {(il, e) for il, e in recorder.selected if il == first}
    model.set_surrogates(Only(n_embd_of(model), used_first))
    assert not np.array_equal(short_run(model, surrogate_all), dropped)
