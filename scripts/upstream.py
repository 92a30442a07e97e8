#!/usr/bin/env python3
"""Obtain, verify, extract and patch the pinned upstream llama.cpp.

Upstream is the llama.cpp tree vendored in the llama-cpp-python source
distribution pinned in ``upstream.lock``. The tree is extracted into the build
directory, committed as a pristine git baseline (tag ``upstream``) and the
patches listed in ``patches/series`` are applied in order with ``git am``.
Upstream is never edited in place: to change a patch, edit the extracted tree,
commit, and regenerate with ``make patches-export``.

Usage:
  upstream.py fetch              download (if needed) and verify the sdist
  upstream.py prepare [--force]  fetch + extract + apply the series (skips when
                                 the tree already matches lock + patches)
  upstream.py prepare --pristine the same upstream without patches (reference build)
  upstream.py check              apply the series to a fresh scratch tree
  upstream.py export             regenerate patches/ from the tree's commits
  upstream.py sdist-path         print the verified sdist's path

Only the standard library is used, so this runs before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "upstream.lock"
PATCH_DIR = ROOT / "patches"
SERIES = PATCH_DIR / "series"
BUILD = Path(os.environ.get("PYSPICE_BUILD_DIR", ROOT / "build"))
DL_DIR = BUILD / "dl"
TREE = BUILD / "upstream" / "llama.cpp"
# the same upstream with no patches: built once so a test can prove the patch
# changes nothing when the hook is not registered
PRISTINE_TREE = BUILD / "upstream" / "llama.cpp-pristine"
STAMP_NAME = ".pyspice-stamp"
GIT_ID = ["-c", "user.name=pyspice", "-c", "user.email=pyspice@localhost"]


class UpstreamError(RuntimeError):
    pass


def read_lock() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    for key in ("LLAMA_CPP_PYTHON_VERSION", "LLAMA_CPP_PYTHON_SHA256"):
        if key not in values:
            raise UpstreamError(f"{LOCK} lacks {key}")
    return values


def read_series() -> list[Path]:
    patches: list[Path] = []
    for line in SERIES.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        path = PATCH_DIR / line
        if not path.is_file():
            raise UpstreamError(f"patches/series names {line}, which does not exist in patches/")
        patches.append(path)
    return patches


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_path(lock: dict[str, str]) -> Path:
    return DL_DIR / f"llama_cpp_python-{lock['LLAMA_CPP_PYTHON_VERSION']}.tar.gz"


def fetch() -> Path:
    lock = read_lock()
    path = sdist_path(lock)
    want = lock["LLAMA_CPP_PYTHON_SHA256"]
    if path.is_file() and sha256_of(path) == want:
        return path
    DL_DIR.mkdir(parents=True, exist_ok=True)
    version = lock["LLAMA_CPP_PYTHON_VERSION"]
    print(f"upstream: downloading llama-cpp-python=={version} source distribution", file=sys.stderr)
    # --no-binary for this one package only: its build dependencies come as
    # wheels (":all:" would compile cmake from source). Metadata preparation
    # needs scikit-build-core, which pip installs in its isolated env.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        "llama-cpp-python",
        f"llama-cpp-python=={version}",
        "-d",
        str(DL_DIR),
    ]
    subprocess.run(cmd, check=True)
    if not path.is_file():
        raise UpstreamError(f"pip download did not produce {path}")
    got = sha256_of(path)
    if got != want:
        path.unlink()
        raise UpstreamError(
            f"sha256 mismatch for {path.name}: got {got}, upstream.lock pins {want}. "
            "The registry served a different file; refusing to build from it."
        )
    return path


def stamp_text(lock: dict[str, str], patches: list[Path]) -> str:
    digest = hashlib.sha256()
    digest.update(lock["LLAMA_CPP_PYTHON_SHA256"].encode())
    for patch in patches:
        digest.update(patch.name.encode())
        digest.update(patch.read_bytes())
    return digest.hexdigest()


def git(tree: Path, *args: str, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *GIT_ID, *args],
        cwd=tree,
        check=False,
        text=True,
        stdout=subprocess.PIPE if quiet else None,
        stderr=subprocess.PIPE if quiet else None,
    )


def extract(sdist: Path, dest: Path) -> None:
    """Extract vendor/llama.cpp from the sdist into dest (which must not exist)."""
    prefix = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(prefix):
                continue
            member.name = member.name[len(prefix) :]
            # the sdist carries the submodule's `.git` link file; our tree gets its own repo
            if member.name and member.name.split("/")[0] != ".git":
                members.append(member)
        if not members:
            raise UpstreamError(f"{sdist.name} holds no vendor/llama.cpp tree")
        tar.extractall(dest, members=members, filter="tar")


def apply_series(tree: Path, patches: list[Path]) -> None:
    for cmd in (
        ["init", "-q"],
        ["add", "-A", "-f"],
        ["commit", "-q", "-m", "upstream (pristine)"],
        ["tag", "upstream"],
    ):
        result = git(tree, *cmd, quiet=True)
        if result.returncode != 0:
            raise UpstreamError(f"git {' '.join(cmd)} failed in {tree}: {result.stderr}")
    for patch in patches:
        result = git(tree, "am", "-q", "--keep-cr", str(patch), quiet=True)
        if result.returncode != 0:
            git(tree, "am", "--abort", quiet=True)
            raise UpstreamError(
                f"patch {patch.name} does not apply to upstream llama-cpp-python "
                f"{read_lock()['LLAMA_CPP_PYTHON_VERSION']}:\n{result.stderr.strip()}\n"
                "To fix it: run `make upstream` up to the previous patch, change the tree under "
                f"{TREE.relative_to(ROOT) if TREE.is_relative_to(ROOT) else TREE}, commit there, "
                "and regenerate the series with `make patches-export` "
                "(git format-patch upstream..HEAD)."
            )


def prepare(force: bool = False, pristine: bool = False) -> Path:
    lock = read_lock()
    patches = [] if pristine else read_series()
    tree = PRISTINE_TREE if pristine else TREE
    want = stamp_text(lock, patches)
    stamp = tree / STAMP_NAME
    if not force and stamp.is_file() and stamp.read_text().strip() == want:
        return tree
    sdist = fetch()
    if tree.exists():
        if (tree / ".git").exists() and git(tree, "diff", "--quiet", "HEAD", quiet=True).returncode != 0:
            raise UpstreamError(
                f"{tree} has uncommitted edits; commit them and run `make patches-export`, "
                "or discard them, before the tree is re-extracted."
            )
        shutil.rmtree(tree)
    what = "without patches" if pristine else f"and applying {len(patches)} patch(es)"
    print(f"upstream: extracting llama.cpp {what}", file=sys.stderr)
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    extract(sdist, tmp)
    apply_series(tmp, patches)
    tmp.rename(tree)
    (tree / STAMP_NAME).write_text(want + "\n")
    # keep the stamp out of `git status` in the tree
    with (tree / ".git" / "info" / "exclude").open("a") as fh:
        fh.write(f"{STAMP_NAME}\n")
    return tree


def check() -> None:
    patches = read_series()
    sdist = fetch()
    with tempfile.TemporaryDirectory(prefix="pyspice-upstream-") as scratch:
        tree = Path(scratch) / "llama.cpp"
        extract(sdist, tree)
        apply_series(tree, patches)
    print(f"upstream: all {len(patches)} patch(es) in patches/series apply to a clean tree")


def export() -> None:
    if not (TREE / ".git").exists():
        raise UpstreamError(f"no patched tree at {TREE}; run `make upstream` first")
    for old in PATCH_DIR.glob("*.patch"):
        old.unlink()
    result = git(
        TREE,
        "format-patch",
        "-q",
        "--no-signature",
        "--zero-commit",
        "--no-stat",
        "-o",
        str(PATCH_DIR),
        "upstream..HEAD",
        quiet=True,
    )
    if result.returncode != 0:
        raise UpstreamError(f"git format-patch failed: {result.stderr}")
    names = sorted(p.name for p in PATCH_DIR.glob("*.patch"))
    header = "# applied in order to a clean upstream tree by scripts/upstream.py\n"
    SERIES.write_text(header + "".join(f"{n}\n" for n in names))
    # the tree now matches the regenerated series
    (TREE / STAMP_NAME).write_text(stamp_text(read_lock(), read_series()) + "\n")
    print(f"upstream: wrote {len(names)} patch(es) to patches/")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["fetch", "prepare", "check", "export", "sdist-path", "tree-path"])
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--pristine", action="store_true", help="prepare: the unpatched tree")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch" or args.command == "sdist-path":
            print(fetch())
        elif args.command == "prepare":
            print(prepare(force=args.force, pristine=args.pristine))
        elif args.command == "tree-path":
            print(TREE)
        elif args.command == "check":
            check()
        else:
            export()
    except (UpstreamError, subprocess.CalledProcessError) as exc:
        print(f"upstream: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
