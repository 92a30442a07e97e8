"""The pinned calibration mix: roff to text, splits per source, pins that fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspice.models import corpus_mix
from pyspice.models.corpus import SPLITS
from pyspice.models.corpus_mix import CorpusMismatchError, MixSplit, mix_text, source_docs
from pyspice.models.corpus_sources import SourceDocs, roff_to_text
from pyspice.models.smolmoe_recipe import recipe_dir

_PAGE = r""".\" generated page
.TH LS "1" "September 2022" "GNU coreutils 9.1" "User Commands"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
.PP
List information about the \fBFILE\fRs (the \(lqcurrent\(rq directory).
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with .
.de XX
.ft B
..
.BR ls (1)
"""


def test_roff_to_text_keeps_words_and_drops_requests() -> None:
    text = roff_to_text(_PAGE)
    assert text.startswith("NAME\nls - list directory contents\n\nDESCRIPTION")
    assert 'the FILEs (the "current" directory)' in text
    assert "-a, --all\ndo not ignore" in text
    assert "ls(1)" in text
    assert ".TH" not in text and "\\f" not in text and ".ft" not in text
    assert roff_to_text(_PAGE) == text  # deterministic


def _fake_sources(monkeypatch: pytest.MonkeyPatch, version: str = "1.0") -> None:
    docs_a = {f"a{i}": f"text of a{i}" for i in range(30)}
    docs_b = {f"b{i}": f"text of b{i}" for i in range(30)}
    monkeypatch.setattr(
        corpus_mix,
        "SOURCES",
        {
            "alpha": lambda: SourceDocs(docs_a, {"pkg-a": version}),
            "beta": lambda: SourceDocs(docs_b, {"pkg-b": "2.0"}),
        },
    )


def test_split_round_trips_and_interleaves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_sources(monkeypatch)
    split = MixSplit.create(("alpha", "beta"))
    (tmp_path / "split.json").write_text(split.to_json())
    again = MixSplit.from_file(tmp_path / "split.json")
    assert again == split
    for s in split.sources.values():
        assert s.keys["heldout"] and not set(s.keys["calibration"]) & set(s.keys["heldout"])
    docs = source_docs(split, "calibration")
    assert [src for src, _, _ in docs[:4]] == ["alpha", "beta", "alpha", "beta"]
    assert mix_text(split, "heldout", "beta").count("text of b") == len(split.sources["beta"].keys["heldout"])


def test_a_changed_source_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sources(monkeypatch)
    split = MixSplit.create(("alpha", "beta"))
    _fake_sources(monkeypatch, version="1.1")
    with pytest.raises(CorpusMismatchError, match="pinned to"):
        mix_text(split, "calibration")
    _fake_sources(monkeypatch)
    key = split.sources["alpha"].keys["heldout"][0]
    text_changed = {**corpus_mix.SOURCES["alpha"]().docs, key: "other text"}
    monkeypatch.setitem(corpus_mix.SOURCES, "alpha", lambda: SourceDocs(text_changed, {"pkg-a": "1.0"}))
    with pytest.raises(CorpusMismatchError, match="sha256"):
        mix_text(split, "heldout", "alpha")
    with pytest.raises(ValueError, match="unknown corpus source"):
        mix_text(split, "heldout", "gamma")


def test_committed_mix_is_pinned_per_source() -> None:
    split = MixSplit.from_file(recipe_dir("smolmoe-b") / "split.json")
    assert set(split.sources) == {"pydoc", "man", "code"}
    for name, s in split.sources.items():
        assert s.packages, name
        assert set(s.keys) == set(SPLITS) == set(s.sha256)
        assert s.keys["heldout"] and not set(s.keys["calibration"]) & set(s.keys["heldout"]), name
    # never the texts kept for judging the models
    keys = [k for s in split.sources.values() for part in SPLITS for k in s.keys[part]]
    assert not [k for k in keys if "fortune" in k.lower() or "debian-reference" in k.lower()]
