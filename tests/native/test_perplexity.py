"""`pyspice eval ppl` gives llama-perplexity's number for the same model, text and context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyspice.cli.main import main
from tests.native.conftest import ModelFactory
from tests.native.upstream_tools import llama_perplexity

N_CTX = 128


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text(topics["assert"] + topics["with"], encoding="utf-8")  # ~5 chunks of 128 tokens
    return path


def _llama_perplexity(model: Path, text: Path) -> float:
    # -fa off: pyspice opens models without flash attention; "auto" would round differently
    return llama_perplexity(
        "-m", str(model), "-f", str(text), "-c", str(N_CTX), "-b", str(N_CTX), "-t", "2", "-fa", "off"
    )


@pytest.mark.parametrize("policy", ["stock", "exact"])
def test_eval_ppl_equals_llama_perplexity(
    synth_model: ModelFactory, text_file: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = synth_model("qwen2moe", quant="Q8_0")
    expected = _llama_perplexity(model, text_file)
    argv = ["eval", "ppl", "-m", str(model), "-f", str(text_file), "-c", str(N_CTX), "-t", "2", "--json"]
    assert main([*argv, "--policy", policy]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"ppl", "tokens"}
    assert doc["tokens"] > 0 and doc["tokens"] % (N_CTX // 2 - 1) == 0  # 63 scored tokens per chunk
    # llama-perplexity prints 4 decimals; the logits are the same computation
    assert doc["ppl"] == pytest.approx(expected, abs=1.5e-4, rel=1e-5)


def test_eval_ppl_compares_policies_token_by_token(
    synth_model: ModelFactory, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--policies scores each policy on the same model; lossless ones give the same
    perplexity token by token as in a prompt batch, and a lossy ablation differs."""
    model = synth_model("qwen2moe", quant="Q8_0")
    argv = [
        "eval",
        "ppl",
        "-m",
        str(model),
        "-f",
        str(text_file),
        "-c",
        str(N_CTX),
        "-t",
        "2",
        "--chunks",
        "1",
    ]
    assert main([*argv, "--policy", "exact", "--json"]) == 0
    batched = json.loads(capsys.readouterr().out)["ppl"]
    assert (
        main([*argv, "--token-by-token", "--device-budget", "25%", "--policies", "exact,lru,host", "--json"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["policies"]
    assert [r["policy"] for r in rows] == ["exact", "lru", "host"]
    assert all(r["chunks"] == 1 and r["tokens"] == N_CTX // 2 - 1 for r in rows)
    assert rows[0]["ppl"] == rows[1]["ppl"] == rows[2]["ppl"]  # lossless: the same logits, bit for bit
    assert rows[0]["ppl"] == pytest.approx(batched, rel=1e-3)  # batch size changes rounding, not much more
    assert rows[1]["change_vs_first"] == 0.0 and rows[2]["hit_rate"] == 0.0
    assert [r["agreement_vs_first"] for r in rows] == [1.0, 1.0, 1.0]  # the same greedy tokens
    assert [r["planning"] for r in rows] == ["sync"] * 3  # rules: no planner thread
    # the share run exactly on the host, and how many fewer than the first policy's: `host` runs
    # them all there, exact (a quarter preloaded) the rest
    assert rows[2]["host_rate"] == 1.0 and 0.0 < rows[0]["host_rate"] < 1.0
    assert rows[0]["host_cut_vs_first"] == 0.0
    assert rows[2]["host_cut_vs_first"] == pytest.approx(1.0 - 1.0 / rows[0]["host_rate"])
