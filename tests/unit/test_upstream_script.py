"""scripts/upstream.py applies patches with git am and fails loudly, naming the patch."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.script_module import load_script as load_script_file


def load_script() -> ModuleType:
    return load_script_file("upstream.py")


def make_patch(tmp: Path, name: str, old: str, new: str) -> Path:
    """A git format-patch file changing hello.txt from old to new."""
    repo = tmp / f"src-{name}"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "hello.txt").write_text(old)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    (repo / "hello.txt").write_text(new)
    subprocess.run([*git, "commit", "-qam", f"area: {name}"], cwd=repo, check=True)
    out = subprocess.run([*git, "format-patch", "-1", "--stdout"], cwd=repo, check=True, capture_output=True)
    patch = tmp / f"{name}.patch"
    patch.write_bytes(out.stdout)
    return patch


def test_series_applies_in_order(tmp_path: Path) -> None:
    up = load_script()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "hello.txt").write_text("hello\n")
    first = make_patch(tmp_path, "first", "hello\n", "hello world\n")
    up.apply_series(tree, [first])
    assert (tree / "hello.txt").read_text() == "hello world\n"


def test_a_patch_that_does_not_apply_names_itself_and_how_to_regenerate(tmp_path: Path) -> None:
    up = load_script()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "hello.txt").write_text("something else entirely\n")
    bad = make_patch(tmp_path, "bad", "hello\n", "hello world\n")
    with pytest.raises(up.UpstreamError) as info:
        up.apply_series(tree, [bad])
    message = str(info.value)
    assert "bad.patch does not apply" in message
    assert "make patches-export" in message
