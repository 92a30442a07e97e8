"""SPICE in the real engine with the routing-history predictor instead of a sidecar:
fitted on a short recorded trace of the model itself, it plans prefetches from expert
ids, and the output stays bit-identical to stock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.cli.bench_cmd import _record_trace
from pyspice.formats.trace import TraceReader
from pyspice.policy.spice import routing_history
from pyspice.policy.spice.history_lookahead import HistoryLookahead

from .golden import greedy_run, load

N_DECODE = 16


@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q8_0"), ("deepseek2", "Q5_K_M")])
def test_spice_with_the_history_predictor_is_lossless(
    synth_model, tmp_path: Path, arch: str, quant: str
) -> None:  # type: ignore[no-untyped-def]
    llm = load(synth_model(arch, "tiny", quant))
    try:
        ref = greedy_run(llm, "stock", n_decode=N_DECODE)
        # a short trace of the model's own routing is what a model without a sidecar fits on
        prompt = tuple(llm.tokenize(b"A short trace to fit the predictor on", add_bos=True))
        _record_trace(llm, str(tmp_path / "trace"), ["exact"], prompt, 48)
        ids, _weights = TraceReader(tmp_path / "trace").routing()
        first = np.zeros(len(ids), dtype=bool)
        first[0] = True
        model = routing_history.fit(ids, first, TraceReader(tmp_path / "trace").meta.n_expert, 2)
        model.save(tmp_path / "history.npz")

        llm.set_device("25%", 8.0, 5.0, manual_clock=True)
        said = llm.spice_engine.set_history_predictor(tmp_path / "history.npz")
        assert "routing-history predictor" in said
        got = greedy_run(llm, "spice", n_decode=N_DECODE)
        assert got.tokens == ref.tokens
        assert np.array_equal(got.logits, ref.logits)
        assert got.stats["policy_fallbacks"] == 0
        assert got.stats["prefetch_issued"] > 0
        history = llm.spice_engine.policy_context().predictor
        assert isinstance(history, HistoryLookahead) and history.last >= 0  # it saw the calls' ids
    finally:
        llm.close()
