"""A HookCall's lifetime: read after `decide` returns, it raises; arrays a
policy took during a call stay memory-safe afterwards, even after `Llama.close()`
(their contents are then unspecified). Before, the kept views pointed into the
graph's buffers: stale data after the call, a segfault after close."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyspice.policy import HookCall, Plan

from .golden import greedy_run, load


class Keeps:
    """Keeps the HookCall and every array it reads, as a careless policy would."""

    name = "keeps"
    reads_probs = True  # the graph hands the probabilities over only to a policy that says so

    def __init__(self) -> None:
        self.calls: list[HookCall] = []
        self.arrays: list[np.ndarray] = []

    def decide(self, call: HookCall) -> Plan:
        self.calls.append(call)
        for arr in (call.hidden, call.probs, call.ids, call.weights, call.residency):
            if arr is not None:
                self.arrays.append(arr)
        return Plan()


@pytest.fixture(scope="module")
def model_path(synth_model) -> Path:  # type: ignore[no-untyped-def]
    return synth_model("qwen2moe", "tiny", "Q8_0")  # type: ignore[no-any-return]


def test_a_hookcall_read_after_decide_raises(model_path: Path) -> None:
    llm = load(model_path)
    try:
        llm.set_device("50%")
        policy = Keeps()
        ref = greedy_run(llm, "exact", n_decode=4)
        got = greedy_run(llm, policy, n_decode=4)
        assert np.array_equal(got.logits, ref.logits)
        assert got.stats["policy_fallbacks"] == 0  # every read it made was one it declared
        assert policy.calls
        for name in ("hidden", "probs", "ids", "weights", "shared", "residency"):
            with pytest.raises(RuntimeError, match=r"read after Policy\.decide returned.*copy what you keep"):
                getattr(policy.calls[-1], name)
        assert policy.calls[-1].n_tokens == 1  # the sizes stay readable
        # arrays taken during the call are still readable (contents unspecified), and read-only
        assert all(np.isfinite(a.astype(np.float64).sum()) for a in policy.arrays)
        assert not any(a.flags.writeable for a in policy.arrays)
    finally:
        llm.close()


# in a child process: before the fix this died by SIGSEGV, which would take pytest with it
KEEP_AFTER_CLOSE = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pyspice.policy import Plan
    from tests.native.golden import greedy_run, load

    class Keeps:
        name = "keeps"
        reads_probs = True
        arrays = []
        def decide(self, call):
            self.arrays += [call.hidden, call.probs, call.ids, call.residency]
            return Plan()

    llm = load(sys.argv[1])
    llm.set_device("50%")
    policy = Keeps()
    greedy_run(llm, policy, n_decode=2)
    how = sys.argv[2]
    if how == "close":
        llm.close()
    else:
        del llm
    import gc
    gc.collect()
    # read every kept array, and write over the graph's old memory meanwhile
    junk = [np.ones(1 << 16) for _ in range(64)]
    total = sum(float(a.astype(np.float64).sum()) for a in policy.arrays if a is not None)
    print("read", len(policy.arrays), "arrays", np.isfinite(total) or True)
    """
)


@pytest.mark.parametrize("how", ["close", "del"])
def test_arrays_kept_past_close_are_memory_safe(model_path: Path, how: str) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", KEEP_AFTER_CLOSE, str(model_path), how],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "read " in done.stdout


def test_only_decode_sized_calls_stay_cached(model_path: Path) -> None:
    """A prompt batch's HookCall (and the arrays its fields were copied into, the hidden
    rows of every token) is not kept once the call ends: kept per layer, they were 8.7
    MiB of an edge-mode SPICE row's peak RSS on smolmoe-b. Decode steps' calls are."""
    from pyspice.runtime.hook_calls import _MAX_CACHED_ROWS

    llm = load(model_path)
    try:
        llm.set_device("50%")
        policy = Keeps()
        greedy_run(llm, policy, n_decode=4)
        assert max(c.n_tokens for c in policy.calls) > _MAX_CACHED_ROWS  # the prompt came through
        cached = list(llm.spice_engine.runtime._calls.values())
        assert cached and all(c.n_tokens <= _MAX_CACHED_ROWS for c in cached)
    finally:
        llm.close()
