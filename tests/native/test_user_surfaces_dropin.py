"""`pyspice.Llama` is a drop-in `llama_cpp.Llama`: the same calls give
the same greedy output, `exact` is bit-identical to `stock` (the reference)
and really runs the hook, and the pyspice options are keyword arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

import pyspice

PROMPTS = ("Hello", "The capital of France is", "1, 2, 3,")
CHAT = [{"role": "user", "content": "Say something."}]
SETTINGS: dict[str, Any] = {"n_ctx": 256, "n_threads": 2, "n_threads_batch": 2, "seed": 7, "verbose": False}


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def model(request: pytest.FixtureRequest, synth_model: Any) -> Path:
    quant = None if request.param == "F32" else request.param
    path: Path = synth_model("qwen2moe", "tiny", quant)
    return path


def _calls(llm: llama_cpp.Llama) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for prompt in PROMPTS:
        out[f"tokenize {prompt}"] = llm.tokenize(prompt.encode())
        done = llm.create_completion(prompt, max_tokens=6, temperature=0)
        out[f"completion {prompt}"] = done["choices"][0]["text"]
        stream = llm.create_completion(prompt, max_tokens=6, temperature=0, stream=True)
        out[f"stream {prompt}"] = "".join(chunk["choices"][0]["text"] for chunk in stream)
    chat = llm.create_chat_completion(messages=CHAT, max_tokens=6, temperature=0)
    out["chat"] = chat["choices"][0]["message"]["content"]
    chunks = llm.create_chat_completion(messages=CHAT, max_tokens=6, temperature=0, stream=True)
    out["chat stream"] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return out


def test_same_calls_same_greedy_output_as_llama_cpp(model: Path) -> None:
    upstream = llama_cpp.Llama(str(model), **SETTINGS)
    try:
        expected = _calls(upstream)
    finally:
        upstream.close()
    llm = pyspice.Llama(str(model), policy="exact", **SETTINGS)
    try:
        got = _calls(llm)
        stats = llm.spice_stats()
    finally:
        llm.close()
    assert got == expected
    assert any(text for key, text in got.items() if not key.startswith("tokenize"))
    assert got["stream Hello"] == got["completion Hello"]
    # the hook really ran: every MoE layer of every evaluated token went through it
    assert stats["policy"] == "exact" and stats["hook_calls"] > 0 and stats["activations"] > 0


def _logits(model: Path, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    llm = pyspice.Llama(str(model), logits_all=True, **SETTINGS, **options)
    try:
        llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog"))
        for _ in range(4):  # a few decode steps too, each token on its own
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return llm.scores[: llm.n_tokens].copy(), llm.spice_stats()
    finally:
        llm.close()


def test_exact_logits_are_bit_identical_to_stock(model: Path) -> None:
    stock, stock_stats = _logits(model, policy="stock")
    exact, exact_stats = _logits(model, policy="exact")
    assert stock.shape == exact.shape and np.isfinite(stock).all()
    assert np.array_equal(stock.view(np.uint32), exact.view(np.uint32))
    assert stock_stats["hook_calls"] == 0 and exact_stats["hook_calls"] > 0


def test_pyspice_options_are_keyword_arguments(model: Path) -> None:
    llm = pyspice.Llama(
        str(model), policy="lru", device_budget="25%", emulate_bandwidth=4.0, emulate_latency=5.0, **SETTINGS
    )
    try:
        assert llm.spice_policy == "lru"
        assert llm.spice_device is not None and llm.spice_device.emulated
        assert llm.spice_device.bandwidth_gbps == 4.0 and llm.spice_device.latency_us == 5.0
        llm.create_completion("Hello", max_tokens=4, temperature=0)
        stats = llm.spice_stats()
        assert stats["policy"] == "lru" and stats["misses"]["fetched"] > 0
    finally:
        llm.close()
    with pytest.raises(ValueError, match="unknown policy"):
        pyspice.Llama(str(model), policy="no-such-policy", **SETTINGS)


def test_no_mmap_reads_the_weights_and_gives_the_same_logits(model: Path) -> None:
    """--no-mmap / RunConfig(use_mmap=False) reaches llama.cpp, and the weights read into
    RAM compute what the mapped ones do."""
    from pyspice.engine import RunConfig

    logits = []
    for use_mmap in (True, False):
        config = RunConfig(model=model, policy="exact", threads=2, n_ctx=256, use_mmap=use_mmap)
        llm = pyspice.Llama.from_config(config, logits_all=True, note=lambda _m: None)
        try:
            mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
            assert llm.model_params.load_mode == mode
            llm.eval(llm.tokenize(b"The capital of France is"))
            logits.append(np.array(llm.scores[: llm.n_tokens]))
        finally:
            llm.close()
    assert np.array_equal(logits[0], logits[1])


def test_llama_resolves_its_settings_as_the_cli_does(model: Path, tmp_path: Path) -> None:
    """Plain `pyspice.Llama(...)` decides pyspice's defaults by RunConfig.resolve, as
    `pyspice generate` does: the sidecar beside the model is looked at, a policy that
    needs it fails on a bad one before anything loads, and the CLI's checks apply."""
    beside = tmp_path / "m.gguf"
    beside.symlink_to(model)
    (tmp_path / "m.spice.gguf").write_text("not a sidecar")
    said: list[str] = []
    llm = pyspice.Llama(str(beside), policy="exact", spice_note=said.append, **SETTINGS)
    try:
        assert llm.spice_policy == "exact" and llm.spice_sidecar is None
    finally:
        llm.close()
    assert any(line.startswith("warning: ignoring") and "m.spice.gguf" in line for line in said)
    with pytest.raises(ValueError, match="sidecar beside the model cannot be used"):
        pyspice.Llama(str(beside), policy="spice", device_budget="50%", **SETTINGS)
    with pytest.raises(ValueError, match="need --device-budget"):
        pyspice.Llama(str(model), policy="exact", emulate_bandwidth=4.0, **SETTINGS)
    # no policy and no tier: exact, said as the CLI says it
    said.clear()
    llm = pyspice.Llama(str(model), spice_note=said.append, **SETTINGS)
    try:
        assert llm.spice_policy == "exact"
    finally:
        llm.close()
    assert any("using policy 'exact'" in line for line in said)
