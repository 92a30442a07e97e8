"""`auto`: the default on a tier, the simulator's ranking on this machine's probe and a
routing sample (both cached), a lossless run, and `exact` where there is no tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspice.engine.auto_policy import AUTO_CANDIDATES, SAMPLE_KIND, SAMPLE_REPLY, SAMPLE_TOKENS, sample_dir
from pyspice.formats.profile import profile_path
from pyspice.formats.trace import read_meta

from .golden import greedy_run, load


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own: the probe and the routing sample are made in it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_auto_on_an_emulated_tier_ranks_runs_the_fastest_and_stays_exact(
    synth_model, own_cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a tiny model's one-token expert time can measure 0 on busy cores, and such a probe
    # is not saved (test_auto_rank checks that rule): here the probe is kept whatever it says
    monkeypatch.setattr("pyspice.engine.auto_policy.plausible", lambda _probe: True)
    path = synth_model("qwen2moe", "tiny", "Q8_0")
    llm = load(path)
    try:
        ref = greedy_run(llm, "stock")
        llm.set_device("50%", 8.0, 5.0)
        said: list[str] = []
        llm.spice_say = said.append
        got = greedy_run(llm, "auto")
        choice = llm.spice_auto_choice
        assert choice is not None
        assert llm.spice_policy == choice.policy == choice.ranking.best.row
        ranked = [r.row for r in choice.ranking.rows]
        assert set(ranked) | {row for row, _ in choice.ranking.left_out} == set(AUTO_CANDIDATES)
        times = [r.tpot_ms for r in choice.ranking.rows]
        assert times == sorted(times) and all(t > 0 for t in times)
        assert any(line.startswith(f"auto: using '{choice.policy}'") for line in said)
        assert np.array_equal(got.logits, ref.logits)  # whatever it picks is lossless
        # first use made the probe and the sample, in the cache
        assert profile_path(path).is_file()
        sample = sample_dir(path)
        assert read_meta(sample).complete and choice.sample == sample
        stamps = (profile_path(path).stat().st_mtime_ns, (sample / "meta.json").stat().st_mtime_ns)
        llm.set_policy("auto")  # later uses read both back, and choose the same
        assert llm.spice_policy == choice.policy
        assert (profile_path(path).stat().st_mtime_ns, (sample / "meta.json").stat().st_mtime_ns) == stamps
    finally:
        llm.close()


def test_auto_is_the_default_on_a_tier_and_exact_without_one(synth_model, own_cache) -> None:
    from pyspice.api import Llama

    path = synth_model("qwen2moe", "tiny", "Q8_0")
    plain = Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        assert plain.spice_policy == "exact" and plain.spice_auto_choice is None
    finally:
        plain.close()
    edge = Llama(str(path), ram_budget="50%", n_ctx=256, n_threads=2, verbose=False)
    try:
        choice = edge.spice_auto_choice
        assert choice is not None and edge.spice_policy == choice.policy
        assert "profiles/disk.json" in choice.priced_by  # the disk tier is never probed by auto
        assert not profile_path(path).exists()
    finally:
        edge.close()


def test_an_unfinished_routing_sample_is_recorded_again(synth_model, own_cache) -> None:
    path = synth_model("qwen2moe", "tiny", "Q8_0")
    sample = sample_dir(path)
    sample.mkdir(parents=True)
    (sample / "meta.json").write_text("{}")  # what an interrupted or foreign writer left
    abandoned = sample.with_name(sample.name + ".partial-999999999")  # no such process
    abandoned.mkdir()
    llm = load(path)
    try:
        llm.set_device("50%", 8.0, 5.0)
        llm.spice_say = lambda _line: None
        llm.set_policy("auto")
        assert read_meta(sample).complete
        assert not abandoned.exists()
        assert not list(sample.parent.glob("*.partial*"))  # its own folder renamed into place
    finally:
        llm.close()


def test_the_routing_sample_reads_the_fixed_reply_and_replaces_a_greedy_one(synth_model, own_cache) -> None:
    """The sample is the model reading a fixed reply (teacher-forced), not its own greedy
    decode, whose loops a cache holds too well; a sample recorded the old way is redone."""
    from pyspice.formats.trace import TraceReader

    path = synth_model("qwen2moe", "tiny", "Q8_0")
    llm = load(path)
    try:
        llm.set_device("50%", 8.0, 5.0)
        llm.spice_say = lambda _line: None
        llm.set_policy("auto")
        sample = sample_dir(path)
        meta = read_meta(sample)
        reply = list(llm.tokenize(SAMPLE_REPLY.encode("utf-8"), add_bos=False))[:SAMPLE_TOKENS]
        assert meta.extra["sample"] == SAMPLE_KIND and meta.extra["tokens"] == reply
        assert len(reply) == SAMPLE_TOKENS
        # the prompt's rows are whole (one token a call), so they warm the simulated tier
        assert meta.prompt_rows == meta.extra["prompt_tokens"] > 0
        assert TraceReader(sample).n_tokens == meta.prompt_rows + SAMPLE_TOKENS
        # a complete sample of another kind (the greedy samples of before) is recorded again
        doc = (sample / "meta.json").read_text().replace(f'"sample": "{SAMPLE_KIND}"', '"sample": "greedy"')
        (sample / "meta.json").write_text(doc)
        assert read_meta(sample).extra["sample"] == "greedy"
        llm.set_policy("auto")
        assert read_meta(sample).extra["sample"] == SAMPLE_KIND
    finally:
        llm.close()
