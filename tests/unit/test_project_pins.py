"""The upstream pin lives in upstream.lock; everything else must agree with it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lock() -> dict[str, str]:
    values = {}
    for line in (ROOT / "upstream.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def test_pyproject_pins_the_locked_llama_cpp_python() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if d.startswith("llama-cpp-python")]
    assert pins == [f"llama-cpp-python=={lock()['LLAMA_CPP_PYTHON_VERSION']}"]


def test_lock_has_a_sha256() -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", lock()["LLAMA_CPP_PYTHON_SHA256"])


def test_series_lists_every_patch_in_order() -> None:
    series = [
        line.strip()
        for line in (ROOT / "patches" / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    on_disk = sorted(p.name for p in (ROOT / "patches").glob("*.patch"))
    assert series == on_disk
    for i, name in enumerate(series, start=1):
        assert re.fullmatch(rf"{i:04d}-[a-z0-9]+(-[a-z0-9_]+)+\.patch", name), name


def test_torch_is_optional_and_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("torch") for d in project["dependencies"])
    assert "torch==2.13.0" in project["optional-dependencies"]["calibrate"]
