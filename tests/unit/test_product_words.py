"""The product speaks of itself: no tracked file says how its work was organised.

A constant justified by the number of a work log or a tracker entry is justified
by nothing a reader can open; what justifies it is a measurement and the page that has it
(docs/results/). The design the code cites is docs/design.md, in the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Built from parts so that this file does not match itself.
_WORK_WORDS = re.compile(
    "|".join(
        (
            r"\b[Ss]ession[- ]?[0-9]",
            r"\b[Ii]ssues? #?[0-9]",
            r"\blease[sd]?\b",
            r"\b[Ss]top [0-9]",
            r"\bthis " + "session",
            "DESIGN" + r"\.md|DESIGN" + " section",
        )
    )
)


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    return [p for p in files if p.is_file() and p.suffix not in (".png", ".gguf", ".npz")]


def test_no_tracked_file_says_how_the_work_was_organised() -> None:
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if _WORK_WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "words about how the work was organised:\n" + "\n".join(found)


def test_results_hold_what_their_pages_cite() -> None:
    out = subprocess.run(
        ["python3", str(ROOT / "scripts" / "results-check.py"), str(ROOT)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
