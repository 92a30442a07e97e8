#!/usr/bin/env python3
"""Check that docs/results holds what its pages cite, and nothing else.

`make results-check` (part of `make test`) fails when:

- a page names a file that is not there (a bare name or a path under
  docs/results, in prose, a link or a command);
- a file under docs/results is named by no page (a record nobody reads);
- the index (docs/results/README.md) does not link every page;
- a file name carries a date, a commit hash or a run counter: those belong
  inside the record (`"measured": {...}`), not in its name;
- a tracked file outside docs/results names docs/results/X and X is missing.

Run from anywhere: `python scripts/results-check.py [REPO]`. Prints one line
per problem and exits 1 if there is any.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RESULTS = Path("docs/results")
INDEX = "README.md"
# what a results folder holds; a token with one of these endings is a citation
EXTENSIONS = ("json", "png", "txt", "log", "md", "csv", "svg")
_TOKEN = re.compile(r"[A-Za-z0-9_./~${}-]+\.(?:" + "|".join(EXTENSIONS) + r")\b")
_OUTSIDE_REF = re.compile(r"docs/results/([A-Za-z0-9_./-]+\.(?:" + "|".join(EXTENSIONS) + r"))\b")
_BAD_NAME = (
    (re.compile(r"\d{4}-\d{2}-\d{2}"), "a date"),
    (re.compile(r"(?:^|[-_])[0-9a-f]{7,40}(?:[-_.]|$)"), "a commit hash"),
    (re.compile(r"session\d+|[-_]call\d+", re.I), "a run counter"),
)


def _is_user_path(token: str) -> bool:
    """Files on the reader's machine, not in the repository (inputs, outputs)."""
    return token.startswith(("/", "~", "$", "{")) or "$" in token


def _cited(page: Path, root: Path) -> set[str]:
    """Names under docs/results that a page cites; problems for missing ones are the caller's."""
    names: set[str] = set()
    for token in _TOKEN.findall(page.read_text(encoding="utf-8")):
        if _is_user_path(token) or "://" in token:
            continue
        token = token.removeprefix("./")
        if token.startswith(str(RESULTS) + "/"):
            names.add(token[len(str(RESULTS)) + 1 :])
        elif "/" not in token:
            names.add(token)
        # any other relative path (../design.md, pyspice/sim/profiles/x.json) is checked below
    return names


def _other_paths(page: Path, root: Path) -> list[str]:
    problems = []
    for token in _TOKEN.findall(page.read_text(encoding="utf-8")):
        if _is_user_path(token) or "://" in token or "/" not in token:
            continue
        token = token.removeprefix("./")
        if token.startswith(str(RESULTS) + "/"):
            continue
        if not ((page.parent / token).exists() or (root / token).exists()):
            problems.append(f"{page.relative_to(root)}: names {token}, which is not in the repository")
    return problems


def _tracked(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    return [root / p for p in out.stdout.decode().split("\0") if p]


def check(root: Path) -> list[str]:
    results = root / RESULTS
    files = sorted(p for p in results.rglob("*") if p.is_file())
    pages = [p for p in files if p.suffix == ".md"]
    problems: list[str] = []

    cited: set[str] = set()
    for page in pages:
        names = _cited(page, root)
        for name in sorted(names):
            if not (results / name).exists():
                problems.append(f"{page.relative_to(root)}: names {name}, which is not in {RESULTS}")
        cited |= {n for n in names if n != page.name}
        problems += _other_paths(page, root)

    for f in files:
        rel = f.relative_to(results).as_posix()
        if rel != INDEX and rel not in cited:
            problems.append(f"{RESULTS}/{rel}: named by no page (cite it from a page, or delete it)")
        for pattern, what in _BAD_NAME:
            if pattern.search(f.name):
                problems.append(f"{RESULTS}/{rel}: the name carries {what}; put it inside the record")

    index = results / INDEX
    if not index.exists():
        problems.append(f"{RESULTS}/{INDEX}: missing (the index: one line per claim, each with its page)")
    else:
        linked = _cited(index, root)
        for page in pages:
            if page.name != INDEX and page.name not in linked:
                problems.append(f"{RESULTS}/{INDEX}: does not link {page.name}")

    for path in _tracked(root):
        if path.is_relative_to(results) or not path.is_file() or path.suffix in (".png", ".gguf"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for name in sorted(set(_OUTSIDE_REF.findall(text))):
            if not (results / name).exists():
                problems.append(f"{path.relative_to(root)}: names docs/results/{name}, which is missing")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = check(root.resolve())
    for line in problems:
        print(line)
    if problems:
        print(f"results-check: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("results-check: every page's files are there and every file is cited")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
