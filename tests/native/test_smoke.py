"""The build is what it claims to be: our patched library, loaded by plain llama_cpp, with the tools."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from pyspice.build_info import load_build_info
from pyspice.runtime import native
from tests.native.upstream_tools import llama_perplexity


def test_libllama_is_the_installed_patched_build() -> None:
    """The hook API marks a patched libllama; the sha256 make build recorded marks ours."""
    from pyspice.cli.version import HOOK_SYMBOL, file_sha256

    info = load_build_info()
    lib = ctypes.CDLL(str(info.libllama))
    assert hasattr(lib, HOOK_SYMBOL)
    assert info.libllama_sha256 == file_sha256(info.libllama.resolve())
    assert any("moe-expert-hook" in name for name in info.patch_series)


def test_libspice_is_linked_to_the_same_series() -> None:
    lib = native()
    from pyspice.runtime.loader import _Native

    series = _Native.get().ffi.string(lib.spice_build_patch_series()).decode()
    assert [s for s in series.splitlines() if s] == list(load_build_info().patch_series)


def test_plain_import_llama_cpp_loads_our_library() -> None:
    """Without importing pyspice, `import llama_cpp` must already use the patched build."""
    code = (
        "import ctypes, llama_cpp\n"
        "lib = llama_cpp.llama_cpp._lib\n"
        "print(lib._name)\n"
        "print(hasattr(lib, 'llama_set_moe_hook'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    info = load_build_info()
    assert Path(out[0]).resolve().parent == info.lib_dir.resolve()
    assert out[1] == "True"


def test_version_reports_our_library() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pyspice", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert "libllama: " in out and "moe-expert-hook" in out and "warning" not in out


def test_version_warns_about_another_build_of_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A libllama with the hook that is not the one make build installed (its sha256 differs)."""
    from dataclasses import replace

    import pyspice.cli.version as version

    info = replace(load_build_info(), libllama_sha256="0" * 64)
    monkeypatch.setattr(version, "load_build_info", lambda: info)
    report = version.version_report()
    assert "moe-expert-hook" in report and "is not the one `make build` installed" in report


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_llama_quantize_and_perplexity_run(synth_model, arch: str, tmp_path: Path) -> None:
    info = load_build_info()
    src = synth_model(arch, "tiny", None)
    out = tmp_path / "q8.gguf"
    subprocess.run(
        [str(info.tool("llama-quantize")), str(src), str(out), "Q8_0"], capture_output=True, check=True
    )
    assert out.stat().st_size < src.stat().st_size
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 60))
    ppl = llama_perplexity("-m", str(out), "-f", str(text), "-c", "128", "-t", "2", "-b", "128")
    assert ppl > 0
