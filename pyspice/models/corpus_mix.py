"""A pinned mix of calibration sources, each with its own held-out split.

The split (`models/<name>/split.json`) records, per source, the package
versions its documents came from, which document keys calibrate and which are
held out, and the sha256 of each part's text. Reading a part checks all of
it: a different package version or different text raises `CorpusMismatchError`
instead of silently calibrating on other text (smolmoe's pydoc-only split only
reports a difference; this one is the benchmark's, whose numbers must be
comparable).

The calibration text interleaves the sources document by document, so any
prefix of it (a sidecar calibrates on its first 8192 tokens) already mixes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyspice.models.corpus import SPLITS, make_split, text_sha256
from pyspice.models.corpus_sources import SOURCES, SourceDocs

_SEPARATOR = "\n\n"


class CorpusMismatchError(RuntimeError):
    """This machine's text of a pinned source is not the one the split was made from."""


@dataclass(frozen=True)
class SourceSplit:
    packages: dict[str, str]  # package -> version the text was extracted from
    keys: dict[str, list[str]]  # part -> document keys
    sha256: dict[str, str]  # part -> sha256 of the part's text (documents joined in key order)


@dataclass(frozen=True)
class MixSplit:
    sources: dict[str, SourceSplit]

    def to_json(self) -> str:
        raw = {
            "format": "mix",
            "sources": {
                name: {"packages": s.packages, "keys": s.keys, "sha256": s.sha256}
                for name, s in self.sources.items()
            },
        }
        return json.dumps(raw, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_file(cls, path: Path) -> MixSplit:
        raw = json.loads(path.read_text())
        if raw.get("format") != "mix":
            raise ValueError(f"{path} is not a mixed-corpus split")
        return cls(
            {
                name: SourceSplit(dict(s["packages"]), dict(s["keys"]), dict(s["sha256"]))
                for name, s in raw["sources"].items()
            }
        )

    @classmethod
    def create(cls, sources: tuple[str, ...] = tuple(SOURCES)) -> MixSplit:
        """A fresh split of this machine's sources (what a first derivation commits)."""
        out = {}
        for name in sources:
            got = SOURCES[name]()
            keys = make_split(list(got.docs))
            sha = {part: text_sha256(_join(got, keys[part])) for part in SPLITS}
            out[name] = SourceSplit(got.packages, keys, sha)
        return cls(out)


def is_mix(path: Path) -> bool:
    return bool(json.loads(path.read_text()).get("format") == "mix")


def _join(got: SourceDocs, keys: list[str]) -> str:
    return _SEPARATOR.join(got.docs[k] for k in keys)


def _checked(split: MixSplit, name: str) -> SourceDocs:
    pinned = split.sources[name]
    got = SOURCES[name]()
    if got.packages != pinned.packages:
        raise CorpusMismatchError(
            f"corpus source {name!r} is pinned to {pinned.packages}, but this machine has {got.packages}"
        )
    missing = [k for part in SPLITS for k in pinned.keys[part] if k not in got.docs]
    if missing:
        raise CorpusMismatchError(f"corpus source {name!r} lacks documents {', '.join(missing[:5])}")
    for part in SPLITS:
        sha = text_sha256(_join(got, pinned.keys[part]))
        if sha != pinned.sha256[part]:
            raise CorpusMismatchError(
                f"corpus source {name!r} ({part}) has sha256 {sha}, but the split pins {pinned.sha256[part]}"
            )
    return got


def source_docs(split: MixSplit, part: str, source: str | None = None) -> list[tuple[str, str, str]]:
    """(source, key, text) of each document of `part`, every source checked against its pin;
    all sources interleaved round-robin, or only `source`."""
    if part not in SPLITS:
        raise ValueError(f"unknown part {part!r}; choose one of {', '.join(SPLITS)}")
    names = list(split.sources) if source is None else [source]
    unknown = [n for n in names if n not in split.sources]
    if unknown:
        raise ValueError(f"unknown corpus source {unknown[0]!r}; choose one of {', '.join(split.sources)}")
    checked = {n: _checked(split, n) for n in names}
    per = [[(n, k, checked[n].docs[k]) for k in split.sources[n].keys[part]] for n in names]
    out = []
    for i in range(max(len(p) for p in per)):
        out += [p[i] for p in per if i < len(p)]
    return out


def mix_text(split: MixSplit, part: str, source: str | None = None) -> str:
    """The text of `part` of every source (interleaved) or of one."""
    return _SEPARATOR.join(text for _, _, text in source_docs(split, part, source))
