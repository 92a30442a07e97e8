"""Every command's --help fits a screen; --help-all shows every option; hidden ones still parse."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

from pyspice.cli.main import build_parser

SCREEN_LINES = 45


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The top-level parser and every command and action under it (`trace fit`, `sim fit`, ...)."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, (*path, name))
    return found


PATHS = [path for path, _ in _parsers(build_parser())]


def _help(words: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        build_parser().parse_args(words)
    assert stop.value.code == 0, words
    return out.getvalue()


def _options(path: tuple[str, ...]) -> list[str]:
    parser = dict(_parsers(build_parser()))[path]
    return [option for action in parser._actions for option in action.option_strings]


def _listed(text: str) -> set[str]:
    """The option strings the help lists (its lines `  -x X, --xx X   help`)."""
    found = set()
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            found |= {part.split()[0] for part in invocation.split(", ")}
    return found


@pytest.fixture(autouse=True)
def _screen_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")


def test_every_command_is_walked() -> None:
    for path in ((), ("chat",), ("bench",), ("sim",), ("sim fit",), ("eval", "ppl"), ("trace", "fit")):
        assert path in PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "pyspice")
def test_help_fits_a_screen_and_names_help_all(path: tuple[str, ...]) -> None:
    text = _help([*path, "--help"])
    lines = text.splitlines()
    assert len(lines) <= SCREEN_LINES, f"{' '.join(path)} --help: {len(lines)} lines\n{text}"
    assert "--help-all" in text


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "pyspice")
def test_help_all_shows_every_option(path: tuple[str, ...]) -> None:
    full = _help([*path, "--help-all"])
    missing = [option for option in _options(path) if option not in _listed(full)]
    assert not missing, f"{' '.join(path)} --help-all lacks {missing}"
    assert "more option" not in full


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "pyspice")
def test_help_counts_what_it_hides(path: tuple[str, ...]) -> None:
    text = _help([*path, "--help"])
    parser = dict(_parsers(build_parser()))[path]
    hidden = [
        action
        for action in parser._actions
        if action.option_strings and not set(action.option_strings) & _listed(text)
    ]
    if hidden:
        assert f"{len(hidden)} more option" in text
        assert f"{parser.prog} --help-all" in text
    else:
        assert "more option" not in text


def test_common_options_are_basic_and_knobs_advanced() -> None:
    text = _listed(_help(["generate", "--help"]))
    for option in ("-m", "-p", "-f", "-n", "-c", "-t", "-ngl", "--policy", "--device-budget", "--ram-budget"):
        assert option in text, option
    for option in ("--emulate-bandwidth", "--planning", "--max-hook-tokens", "--sidecar", "--top-k", "-b"):
        assert option not in text, option
    bench = _listed(_help(["bench", "--help"]))
    assert {"--policies", "--repeat", "--plot", "--json"} <= bench
    assert "--memory-limit" not in bench
    assert {"--trace", "--target", "--profile"} <= _listed(_help(["sim", "--help"]))
    assert {"--host", "--port"} <= _listed(_help(["serve", "--help"]))


def test_help_all_gives_the_full_text_of_a_shortened_help() -> None:
    short = _help(["bench", "--help"])
    full = _help(["bench", "--help-all"])
    assert "NAME@detK" in full and "NAME@detK" not in short


def test_hidden_options_still_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "generate",
            "-p",
            "hi",
            "--emulate-bandwidth",
            "8",
            "--planning",
            "sync",
            "--top-k",
            "5",
            "--verbose",
        ]
    )
    assert (args.emulate_bandwidth, args.planning, args.top_k, args.verbose) == (8.0, "sync", 5, True)
    args = parser.parse_args(["bench", "--prompt-tokens", "0", "--baseline", "exact", "-b", "64"])
    assert (args.prompt_tokens, args.baseline, args.batch_size) == (0, "exact", 64)
    args = parser.parse_args(["serve", "--grace", "1", "--max-queue", "0", "--no-sidecar"])
    assert (args.grace, args.max_queue, args.no_sidecar) == (1.0, 0, True)
    args = parser.parse_args(["sim", "--trace", "t", "--show-profiles", "--target-layers", "8"])
    assert (args.show_profiles, args.target_layers) == (True, 8)


def test_hidden_options_keep_their_checks() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["generate", "-p", "hi", "--sidecar", "s.gguf", "--no-sidecar"])
    assert stop.value.code == 2
    assert "not allowed with argument --sidecar" in err.getvalue()


def test_help_all_leaves_help_as_it_was() -> None:
    parser = build_parser()
    generate = dict(_parsers(parser))[("generate",)]
    before = generate.format_help()
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help-all"])
    assert generate.format_help() == before
