"""A real-shape synthetic model, written and run: slow, kept out of CI (run with `-m slow`).

Two Qwen2-57B-A14B layers at F32 are a 20.5 GB temporary (each layer holds
2.0 billion parameters, the two embedding matrices 1.1 billion) before
llama-quantize turns them into a Q4_K_M file of about 3 GB, so this needs about
24 GB free under pytest's temporary directory (`--basetemp` moves it) and
takes minutes on two cores. Nothing here depends on how long it takes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from pyspice.models import synth

_DISK_NEEDED = 24 * 10**9  # F32 temporary + quantized file, with some margin


@pytest.mark.slow
def test_qwen2_57b_a14b_two_layers_loads_and_generates(tmp_path: Path) -> None:
    from pyspice.api import Llama

    free = shutil.disk_usage(tmp_path).free
    if free < _DISK_NEEDED:
        pytest.skip(f"needs {_DISK_NEEDED / 1e9:.0f} GB free under {tmp_path}, has {free / 1e9:.1f} GB")
    out = synth.synthesize("qwen2moe", "qwen2-57b-a14b", tmp_path / "q.gguf", layers=2, quant="Q4_K_M")
    assert [p.name for p in tmp_path.iterdir()] == ["q.gguf"]  # the F32 temporary is gone
    types = synth.tensor_types(out)
    assert not any(name.startswith("blk.2.") for name in types)
    # 3584-wide rows take K-quants; 2560-wide expert down rows are 10 x 256 and do too
    assert {types[f"blk.{i}.ffn_gate_exps.weight"] for i in range(2)} == {"Q4_K"}

    llm = Llama(str(out), policy="exact", n_ctx=128, n_batch=64, n_threads=2, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == 151936
        assert llm.n_embd() == 3584
        prompt = llm.tokenize(b"The quick brown fox")
        tokens: list[int] = []
        for token in llm.generate(prompt, temp=0.0):
            tokens.append(token)
            if len(tokens) == 4:
                break
        assert len(tokens) == 4 and all(0 <= t < 151936 for t in tokens)
        assert np.isfinite(llm.scores[: llm.n_tokens]).all()
        assert llm.spice_stats()["hook_calls"] > 0  # the routed experts ran through the hook
    finally:
        llm.close()
