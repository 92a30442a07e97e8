"""Calibration and held-out text from CPython's `pydoc_data.topics`.

Every Python installation has this text, so calibration needs no download.
Its topics differ between Python versions, so the split itself is committed
(`models/smolmoe/split.json`): which topic keys calibrate and which are held
out, with the sha256 of each part's text as the deriving Python had it. A
different Python still gets the same keys; `text_of` reports whether the text
it produced is the committed one.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

SPLITS: tuple[str, ...] = ("calibration", "heldout")
_SEPARATOR = "\n\n"
_HELDOUT_EVERY = 5  # one topic in five is held out, chosen by a hash of its key


def _topics() -> dict[str, str]:
    # lazy: a large stdlib module, read only when the corpus is built
    from pydoc_data.topics import topics

    return dict(topics)


def make_split(keys: list[str]) -> dict[str, list[str]]:
    """Deterministic split of topic keys: held out when sha256(key) % 5 == 0."""
    heldout = [
        k for k in sorted(keys) if int(hashlib.sha256(k.encode()).hexdigest(), 16) % _HELDOUT_EVERY == 0
    ]
    held = set(heldout)
    return {"calibration": [k for k in sorted(keys) if k not in held], "heldout": heldout}


def join_topics(keys: list[str], topics: dict[str, str]) -> str:
    return _SEPARATOR.join(topics[k] for k in keys if k in topics)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Split:
    """The committed split: keys per part and the sha256 of each part's text."""

    keys: dict[str, list[str]]
    sha256: dict[str, str]
    python: str  # the Python version whose topics the hashes describe

    def to_json(self) -> str:
        return json.dumps({"python": self.python, "keys": self.keys, "sha256": self.sha256}, indent=1) + "\n"

    @classmethod
    def from_file(cls, path: Path) -> Split:
        raw = json.loads(path.read_text())
        return cls(keys=raw["keys"], sha256=raw["sha256"], python=raw["python"])

    @classmethod
    def create(cls) -> Split:
        """A fresh split of this Python's topics (what the first derivation commits)."""
        topics = _topics()
        keys = make_split(list(topics))
        sha = {part: text_sha256(join_topics(keys[part], topics)) for part in SPLITS}
        return cls(keys=keys, sha256=sha, python=platform.python_version())


@dataclass(frozen=True)
class PartText:
    text: str
    matches_split: bool  # this Python's text is the one the split was made from
    missing_keys: tuple[str, ...]  # keys of the split this Python's topics lack


def text_of(split: Split, part: str) -> PartText:
    """The text of one part ("calibration" or "heldout") under this Python."""
    if part not in SPLITS:
        raise ValueError(f"unknown part {part!r}; choose one of {', '.join(SPLITS)}")
    topics = _topics()
    keys = split.keys[part]
    text = join_topics(keys, topics)
    missing = tuple(k for k in keys if k not in topics)
    return PartText(text, text_sha256(text) == split.sha256[part], missing)


def topic_texts(split: Split, part: str) -> list[tuple[str, str]]:
    """(key, text) of each topic of one part that this Python has, in split order."""
    topics = _topics()
    return [(k, topics[k]) for k in split.keys[part] if k in topics]
