"""The documents of each calibration source, extracted deterministically and offline.

A source is a set of named documents from something every machine of this
kind has installed, with the versions that pin it:

- `pydoc`: CPython's `pydoc_data.topics` (its language reference topics);
- `man`: the English manual pages that Debian's required packages ship
  (coreutils, util-linux, dpkg, apt), turned from roff into plain text here,
  so no formatter's version or terminal width enters the text;
- `code`: the top-level modules of CPython's standard library, as source.

Fortune databases and the Debian Reference are never a source: they are kept
for judging the models on text no recipe or sidecar was fitted to.
"""

from __future__ import annotations

import gzip
import platform
import re
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Debian's "required" packages: present on every Debian machine, so no install step is needed
MAN_PACKAGES: tuple[str, ...] = ("coreutils", "util-linux", "dpkg", "apt")
_MAN_DIR = re.compile(r"^/usr/share/man/man[1-8]/[^/]+\.gz$")  # English pages only: no locale folder


@dataclass(frozen=True)
class SourceDocs:
    """One source's documents (key -> text) and the package versions they came from."""

    docs: dict[str, str]
    packages: dict[str, str]  # package -> version


def pydoc_docs() -> SourceDocs:
    # lazy: a large stdlib module, read only when the corpus is built
    from pydoc_data.topics import topics

    return SourceDocs(dict(topics), {"cpython": platform.python_version()})


def code_docs() -> SourceDocs:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = {p.name: p.read_text(encoding="utf-8") for p in sorted(stdlib.glob("*.py"))}
    return SourceDocs(docs, {"cpython": platform.python_version()})


def _dpkg(*args: str) -> str:
    try:
        result = subprocess.run(["dpkg-query", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise RuntimeError("the man-page source needs dpkg-query (a Debian machine)") from exc
    if result.returncode != 0:
        raise RuntimeError(f"dpkg-query {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def man_docs() -> SourceDocs:
    docs: dict[str, str] = {}
    packages: dict[str, str] = {}
    for package in MAN_PACKAGES:
        packages[package] = _dpkg("-W", "-f", "${Version}", package).strip()
        pages = sorted(line for line in _dpkg("-L", package).splitlines() if _MAN_DIR.match(line))
        for page in pages:
            path = Path(page)
            if path.is_symlink() or not path.is_file():
                continue  # aliases of another page (and pages a minimal image left out)
            docs[f"{package}/{path.name[: -len('.gz')]}"] = roff_to_text(
                gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
            )
    return SourceDocs(docs, packages)


SOURCES: dict[str, Callable[[], SourceDocs]] = {"pydoc": pydoc_docs, "man": man_docs, "code": code_docs}

# roff escapes as plain text; anything not listed is dropped
_GLYPHS = {
    "em": "--",
    "en": "-",
    "hy": "-",
    "lq": '"',
    "rq": '"',
    "oq": "'",
    "cq": "'",
    "aq": "'",
    "dq": '"',
    "bu": "*",
    "co": "(C)",
    "rg": "(R)",
    "tm": "(TM)",
    "mu": "x",
    "<=": "<=",
    ">=": ">=",
    "->": "->",
    "ti": "~",
    "ha": "^",
    "ga": "`",
    "ul": "_",
    "ba": "|",
    "rs": "\\",
}
_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[+-]?\d+|\*(?:\[[^\]]*\]|\(..|.)|\((..)|\[([^\]]*)\]|n(?:\(..|.)|(.))"
)
_SIMPLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "`", ".": "."}
_FONT_MACROS = {"B", "I", "SM", "SB"}
_ALTERNATING = {"BR", "RB", "BI", "IB", "RI", "IR"}
_HEADINGS = {"SH", "SS"}
_PARAGRAPH = {"PP", "P", "LP", "TP", "TQ", "HP", "sp", "br", "RS", "RE", "EX", "EE", "nf", "fi"}


def _unescape(text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        glyph = m.group(1) or m.group(2)
        if glyph is not None:
            return _GLYPHS.get(glyph, "")
        single = m.group(3)
        return _SIMPLE.get(single, "") if single is not None else ""

    return _ESCAPE.sub(sub, text)


def _args(rest: str) -> list[str]:
    """A request's arguments: words, or "quoted strings"."""
    return [a[1:-1] if a.startswith('"') else a for a in re.findall(r'"[^"]*"?|\S+', rest)]


def roff_to_text(source: str) -> str:
    """Plain text of a man page: headings and paragraphs kept, fonts and requests dropped."""
    out: list[str] = []
    skipping = False  # inside a macro definition or an ignored block
    for line in source.splitlines():
        if skipping:
            skipping = not line.startswith("..")
            continue
        if line.startswith(('.\\"', "'\\\"", '.\\"')) or line in (".", "'"):
            continue
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name in ("de", "ig", "am"):
                skipping = True
            elif name in _HEADINGS:
                out += ["", _unescape(" ".join(_args(rest)))]
            elif name in _PARAGRAPH:
                out.append("")
            elif name == "IP":
                args = _args(rest)
                out += ["", _unescape(args[0])] if args else [""]
            elif name in _FONT_MACROS:
                out.append(_unescape(" ".join(_args(rest))))
            elif name in _ALTERNATING:
                out.append(_unescape("".join(_args(rest))))
            continue  # any other request sets up formatting: no text of its own
        out.append(_unescape(line))
    text = "\n".join(s.rstrip() for s in out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
