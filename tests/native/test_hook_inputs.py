"""The hook's graph input: ONE packed source per MoE layer (hidden rows,
gate weights, ids as F32), the router probabilities and the shared-expert output
only when the registered policy reads them, and the flags in llama.cpp's
graph-reuse check, so a graph built without probabilities is never reused for a
policy that reads them.

On a GPU build each source of the hook's op is one blocking device-to-host copy
at the CPU split; on this CPU build the scheduler's own debug print
(GGML_SCHED_DEBUG=2, the same output the GPU check reads) shows the op's sources.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from pyspice.policy import HookCall, HookInputError, Plan, Rule, policy_reads
from pyspice.policy.rule import KEEP_LRU, MISS_FETCH
from pyspice.runtime import Runtime

from .golden import greedy_run, load

# one prompt batch and two decode steps of a policy that reads what argv[2] names
SCHED_SCRIPT = textwrap.dedent(
    """
    import sys
    from pyspice.api import Llama
    from pyspice.policy import Plan

    class Reads:
        name = "reads"
        reads_probs = "probs" in sys.argv[2]
        reads_shared = "shared" in sys.argv[2]
        def decide(self, call):
            return Plan()

    llm = Llama(sys.argv[1], policy="stock", n_ctx=128, n_batch=32, n_threads=2, verbose=True)
    llm.set_policy("stock" if sys.argv[2] == "stock" else Reads())
    print("@@ graphs with the hook", file=sys.stderr, flush=True)
    llm.eval(llm.tokenize(b"one packed input per layer", add_bos=True))
    llm.eval([5])
    llm.eval([6])
    """
)

# "node #  49 (    CUSTOM):        ffn_moe_out-0 (   3K) [  CPU         ] use=1,c=1: <src> <src> ..."
# with each source printed as " %20.20s (%5.5s) [%5.5s %8.8s]"
NODE = re.compile(
    r"^node #\s*\d+ \(\s*(?P<op>\w+)\):\s*(?P<name>\S+) \(.*?\) \[.*?\] use=\d+,c=\d:(?P<srcs>.*)$"
)


def sched_nodes(model: Path, reads: str) -> list[tuple[str, str, int]]:
    """(op, name, number of sources) of every node the scheduler printed for the graphs
    built once the policy was set."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCHED_SCRIPT, str(model), reads],
        cwd=root,
        env={**os.environ, "GGML_SCHED_DEBUG": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stderr.split("@@ graphs with the hook", 1)[1]
    nodes = []
    for line in text.splitlines():
        m = NODE.match(line)
        if m:
            nodes.append((m["op"], m["name"], m["srcs"].count("[")))
    assert nodes, "GGML_SCHED_DEBUG=2 printed no nodes"
    return nodes


@pytest.fixture(scope="module")
def qwen(synth_model) -> Path:  # type: ignore[no-untyped-def]
    return synth_model("qwen2moe", "tiny", "Q8_0")  # type: ignore[no-any-return]


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
@pytest.mark.parametrize("reads", ["nothing", "probs", "shared", "probs+shared"])
def test_the_hook_op_has_one_source(synth_model, arch: str, reads: str) -> None:  # type: ignore[no-untyped-def]
    nodes = sched_nodes(synth_model(arch, "tiny", "Q8_0"), reads)
    hooks = [n for n in nodes if n[0] == "CUSTOM"]
    # three graphs (prompt, two decode steps: the second reuses the first's, so the
    # scheduler prints two), each with one hook op per MoE layer
    moe_layers = 4 if arch == "qwen2moe" else 3
    assert len(hooks) == 2 * moe_layers
    assert {n[2] for n in hooks} == {1}, hooks  # before: 5 (cur, probs, ids, weights, shexp)
    assert all(n[1].startswith("ffn_moe_out-") for n in hooks)
    # the packing: cast ids + one concat per optional input + the tail and the final concat
    parts = [n for n in nodes if n[1].startswith("ffn_moe_hook_part-")]
    extra = ("probs" in reads) + ("shared" in reads)
    assert len(parts) == len(hooks) * (1 + extra)
    assert len([n for n in nodes if n[1].startswith("ffn_moe_hook_in-")]) == len(hooks)


def test_without_a_hook_nothing_is_packed(qwen: Path) -> None:
    nodes = sched_nodes(qwen, "stock")
    assert not [n for n in nodes if n[0] == "CUSTOM" or n[1].startswith("ffn_moe_hook")]
    assert [n for n in nodes if n[0] == "MUL_MAT_ID"]  # upstream's routed experts


class Reads:
    """Records what each call hands over; reads only what it declares."""

    def __init__(self, probs: bool = False, shared: bool = False) -> None:
        self.name = f"reads({'probs' if probs else ''}{'+shared' if shared else ''})"
        self.reads_probs = probs
        self.reads_shared = shared
        self.seen: list[dict[str, Any]] = []

    def decide(self, call: HookCall) -> Plan:
        got: dict[str, Any] = {
            "layer": call.layer,
            "ids": np.array(call.ids),
            "weights": np.array(call.weights),
        }
        if self.reads_probs:
            got["probs"] = np.array(call.probs)
        if self.reads_shared:
            shared = call.shared
            got["shared"] = None if shared is None else np.array(shared)
        self.seen.append(got)
        return Plan()


def n_reused(llm: Any) -> int:
    return int(llama_cpp.llama_perf_context(llm._ctx.ctx).n_reused)


def runtime_of(llm: Any) -> Runtime:
    return llm.spice_engine.require_runtime()  # type: ignore[no-any-return]


def decode(llm: Any, n: int) -> None:
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])


def test_probs_after_a_graph_without_them_are_the_graphs(qwen: Path) -> None:
    """A decode graph built without probabilities is reused step after step; the policy
    that reads them then gets a graph of its own (not the stale one), with the router's
    real probabilities: the gate weights are their values at the selected ids, and the
    ids are their top-k."""
    llm = load(qwen)
    try:
        quiet, loud = Reads(), Reads(probs=True)
        llm.set_policy(quiet)
        llm.reset()
        llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog.", add_bos=True))
        decode(llm, 3)
        assert runtime_of(llm).hook_flags() == 0
        reused = n_reused(llm)
        assert reused >= 2  # decode steps reuse one graph

        llm.set_policy(loud)
        assert runtime_of(llm).hook_flags() == 1  # SPICE_HOOK_WANT_PROBS
        decode(llm, 1)
        assert n_reused(llm) == reused  # other flags: a new graph
        decode(llm, 2)
        assert n_reused(llm) == reused + 2  # the same flags: reused again

        k = llm.policy_context().n_expert_used
        assert len(loud.seen) == 3 * 4 and all("probs" in s for s in loud.seen)
        for s in loud.seen:
            probs, ids, weights = s["probs"], s["ids"], s["weights"]
            assert probs.shape == (1, 8) and np.isfinite(probs).all()
            np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)  # qwen2moe: softmax
            # qwen2moe takes the weights straight from the probabilities (no renormalisation)
            assert np.array_equal(weights, np.take_along_axis(probs, ids, axis=1))
            assert set(ids[0].tolist()) == set(np.argsort(probs[0])[-k:].tolist())
    finally:
        llm.close()


def test_shared_output_only_when_asked(qwen: Path) -> None:
    llm = load(qwen)
    try:
        policy = Reads(shared=True)
        llm.set_policy(policy)
        assert runtime_of(llm).hook_flags() == 2  # SPICE_HOOK_WANT_SHEXP
        llm.reset()
        llm.eval(llm.tokenize(b"shared experts", add_bos=True))
        decode(llm, 2)
        assert policy.seen and all(s["shared"] is not None for s in policy.seen)
        assert all(np.isfinite(s["shared"]).all() and np.abs(s["shared"]).sum() > 0 for s in policy.seen)
    finally:
        llm.close()


class ReadsUndeclared:
    name = "undeclared"

    def __init__(self, field: str) -> None:
        self.field = field
        self.errors: list[str] = []

    def decide(self, call: HookCall) -> Plan:
        try:
            getattr(call, self.field)
        except HookInputError as exc:
            self.errors.append(str(exc))
            raise
        return Plan()


@pytest.mark.parametrize(
    "field,flag",
    [("probs", "reads_probs"), ("shared", "reads_shared"), ("next_logits", "reads_next_logits")],
)
def test_reading_an_undeclared_input_is_a_clear_error(
    qwen: Path, field: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = load(qwen)
    try:
        policy = ReadsUndeclared(field)
        llm.set_policy(policy)
        llm.reset()
        llm.eval(llm.tokenize(b"no probabilities here", add_bos=True))
        decode(llm, 1)
        assert policy.errors and f"{flag} = True" in policy.errors[0] and "'undeclared'" in policy.errors[0]
        assert llm.spice_stats()["policy_fallbacks"] > 0  # each such call ran exactly instead
        assert f"{flag} = True" in capsys.readouterr().err  # warned once, with the fix
    finally:
        llm.close()


class ReadsNext:
    """Records each call's MoE input and the graph's next-layer router logits."""

    name = "reads-next"
    reads_next_logits = True

    def __init__(self) -> None:
        self.seen: list[tuple[int, np.ndarray, np.ndarray | None]] = []

    def decide(self, call: HookCall) -> Plan:
        nxt = call.next_logits
        self.seen.append((call.layer, np.array(call.hidden), None if nxt is None else np.array(nxt)))
        return Plan()


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_the_graph_hands_over_the_next_layers_router_logits(synth_model, arch: str) -> None:  # type: ignore[no-untyped-def]
    """LLAMA_MOE_HOOK_WANT_NEXT_LOGITS (patch 0004): each MoE layer's call carries the
    next MoE layer's router applied to its own input, computed in the graph; the last
    MoE layer's carries none; the model's output does not change."""
    from pyspice.formats.routers import RouterReader

    path = synth_model(arch, "tiny", "Q8_0")
    llm = load(path)
    try:
        ref = greedy_run(llm, "exact", n_decode=3)
        policy = ReadsNext()
        got = greedy_run(llm, policy, n_decode=3)
        assert runtime_of(llm).hook_flags() == 4  # SPICE_HOOK_WANT_NEXT_LOGITS
        assert np.array_equal(got.logits, ref.logits)  # an extra graph input only
        moe = [i.il for i in llm.spice_layers() if i.is_moe]
        routers = RouterReader(path)
        checked = 0
        for layer, hidden, logits in policy.seen:
            nxt = next((m for m in moe if m > layer), None)
            if nxt is None:
                assert logits is None, f"layer {layer} is the last MoE layer"
                continue
            router = routers(nxt)
            assert router is not None and logits is not None
            want = hidden.astype(np.float64) @ router.astype(np.float64).T
            assert logits.shape == want.shape
            np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            checked += 1
        assert checked >= (len(moe) - 1) * 4  # the prompt and three steps at every layer with a next
    finally:
        llm.close()


def test_a_rule_that_prefetches_by_the_next_router_asks_the_graph(qwen: Path) -> None:
    """adapmoe's rule reads the graph's logits (2 us, not 8-10, on smolmoe-b); a rule
    without prefetch_next does not ask for them, and a greedy run is the reference's."""
    llm = load(qwen)
    try:
        ref = greedy_run(llm, "stock", n_decode=4)
        llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        got = greedy_run(llm, "adapmoe", n_decode=4)
        assert runtime_of(llm).hook_flags() == 4
        assert np.array_equal(got.logits, ref.logits)
        assert got.stats["prefetch_issued"] > 0
        llm.set_policy("lru")
        assert runtime_of(llm).hook_flags() == 0
    finally:
        llm.close()


class InstallsRules:
    """A synchronous policy whose every plan installs a rule: one that prefetches by
    the next layer's router while `next` is set, else one that does not."""

    name = "installs-rules"

    def __init__(self) -> None:
        self.next = True
        self.by_next: Rule | None = None
        self.plain = Rule(miss=MISS_FETCH, keep=KEEP_LRU)

    def attach(self, ctx: Any) -> None:
        routers = tuple(ctx.router(il) if ctx.n_expert[il] else None for il in range(ctx.n_layers))
        self.by_next = Rule(miss=MISS_FETCH, keep=KEEP_LRU, prefetch_next=True, routers=routers)

    def decide(self, call: HookCall) -> Plan:
        return Plan(rule=self.by_next if self.next else self.plain)


def test_a_rule_a_plan_installs_gets_its_graph_inputs_from_the_next_decode(qwen: Path) -> None:
    """The graph cannot change while it runs: the hook is registered again before the
    next decode, asking for the next-layer logits a plan's rule prefetches by, and no
    longer once a plan installs a rule that does not."""
    llm = load(qwen)
    try:
        ref = greedy_run(llm, "stock", n_decode=4)
        llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        policy = InstallsRules()
        got = greedy_run(llm, policy, n_decode=4)
        rt = runtime_of(llm)
        assert rt.hook_flags() == 4  # SPICE_HOOK_WANT_NEXT_LOGITS, from the second decode on
        assert np.array_equal(got.logits, ref.logits)
        policy.next = False
        llm.eval([5])  # its plans install the plain rule while it runs ...
        assert rt.hook_flags() == 4
        llm.eval([6])  # ... and the next decode's graph leaves the logits out
        assert rt.hook_flags() == 0
    finally:
        llm.close()


def test_surrogates_bring_the_shared_output(qwen: Path) -> None:
    """The surrogate executor needs alpha * shared: libspice asks for the shared-expert
    output while surrogates are loaded, whatever the registration said."""
    llm = load(qwen)
    try:
        rt = runtime_of(llm)
        llm.set_policy("exact")
        assert rt.hook_flags() == 0
        info = next(i for i in llm.spice_layers() if i.is_moe)
        rt.set_surrogate(info.il, 0, 1.0, np.zeros((0, info.n_embd)), np.zeros((info.n_embd, 0)))
        assert rt.hook_flags() == 2
        rt.clear_surrogates()
        assert rt.hook_flags() == 0
    finally:
        llm.close()


def test_graph_reuse_counts_match_stock(qwen: Path) -> None:
    """The hook (no flags) changes nothing about graph reuse: decode steps reuse their graph
    exactly as often as upstream's do."""
    llm = load(qwen)
    try:
        counts = []
        for policy in ("stock", "exact"):
            llm.set_policy(policy)
            llm.reset()
            before = n_reused(llm)
            llm.eval(llm.tokenize(b"count the reuses", add_bos=True))
            decode(llm, 6)
            counts.append(n_reused(llm) - before)
        assert counts[0] == counts[1] and counts[0] >= 5
    finally:
        llm.close()


def test_policy_reads_defaults() -> None:
    class Minimal:
        name = "minimal"

        def decide(self, call: HookCall) -> Plan:
            return Plan()

    assert policy_reads(Minimal()) == (False, False)
    assert policy_reads(Reads(probs=True, shared=True)) == (True, True)
