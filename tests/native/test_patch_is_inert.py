"""With no hook registered, the patched build computes exactly what upstream does.

An unpatched libllama + ggml (`make pristine`: same upstream, same flags, no
patches) runs in a subprocess through plain llama_cpp, pointed at it with
LLAMA_CPP_LIB_PATH; our build runs the same model the same way. The logits of
a prompt batch and of greedy decode steps must be bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyspice.build_info import load_build_info

SCRIPT = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
model, out = sys.argv[1], sys.argv[2]
llm = llama_cpp.Llama(model, n_ctx=256, n_batch=128, n_threads=2, n_threads_batch=2, logits_all=True,
                      verbose=False)
prompt = llm.tokenize(b"The patch must be invisible when nobody registers a hook.", add_bos=True)
llm.eval(prompt)
for _ in range(16):
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
np.save(out, llm.scores[: llm.n_tokens])
print(json.dumps({"lib": llama_cpp.llama_cpp._lib._name,
                  "patched": hasattr(llama_cpp.llama_cpp._lib, "llama_set_moe_hook")}))
"""


def pristine_lib_dir() -> Path:
    return load_build_info().source_dir / "build" / "pristine" / "bin"


def run(model: Path, out: Path, lib_dir: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    if lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(out)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")])
def test_unpatched_upstream_and_ours_without_hook_agree(
    synth_model, tmp_path: Path, arch: str, quant: str
) -> None:
    lib_dir = pristine_lib_dir()
    assert (lib_dir / "libllama.so").is_file(), f"no unpatched build at {lib_dir}; run `make pristine`"
    model = synth_model(arch, "tiny", quant)
    theirs = run(model, tmp_path / "upstream.npy", lib_dir)
    ours = run(model, tmp_path / "ours.npy", None)
    assert theirs["patched"] is False and ours["patched"] is True  # really two different libraries
    assert np.array_equal(np.load(tmp_path / "upstream.npy"), np.load(tmp_path / "ours.npy"))


def test_version_warns_about_an_unpatched_library() -> None:
    """`pyspice --version` with llama_cpp pointed at upstream's own libllama: no MoE hook."""
    lib_dir = pristine_lib_dir()
    assert (lib_dir / "libllama.so").is_file(), f"no unpatched build at {lib_dir}; run `make pristine`"
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "pyspice", "--version"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert f"libllama: {(lib_dir / 'libllama.so').resolve()}" in out
    assert "not pyspice's patched build" in out and "patch series" not in out
