"""Command-line surface: only working commands are listed, flags follow llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pyspice.cli.generate_cmd import _Utf8Stream
from pyspice.cli.main import build_parser


def test_help_lists_only_implemented_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for cmd in ("generate", "bench", "models"):
        assert cmd in out
    assert "not implemented" not in out.lower()


def test_generate_takes_llama_cpp_flags() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "-m",
            "x.gguf",
            "-p",
            "hi",
            "-n",
            "5",
            "-c",
            "128",
            "-t",
            "2",
            "-s",
            "7",
            "--temp",
            "0",
            "--top-k",
            "3",
            "--top-p",
            "0.5",
            "-ngl",
            "0",
            "--policy",
            "exact-py",
            "--json",
        ]
    )
    assert (args.model, args.prompt, args.n_predict, args.ctx_size, args.threads, args.seed) == (
        "x.gguf",
        "hi",
        5,
        128,
        2,
        7,
    )
    assert (args.temp, args.top_k, args.top_p, args.policy, args.json) == (0.0, 3, 0.5, "exact-py", True)


def test_model_may_be_positional_and_text_aliases_file() -> None:
    args = build_parser().parse_args(["generate", "m.gguf", "--text", "prompt.txt"])
    assert args.model_pos == "m.gguf" and str(args.file) == "prompt.txt"


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "-m", "x", "-p", "y", "--policy", "nope"])


def test_utf8_stream_holds_partial_characters() -> None:
    s = _Utf8Stream()
    euro = "€".encode()
    assert s.feed(euro[:1]) == ""
    assert s.feed(euro[1:]) == "€"
    assert s.feed(b"ab") == "ab"
    # an invalid byte becomes U+FFFD and does not hold back what follows
    assert s.feed(b"\xffok") == "\ufffdok"
    assert s.feed(euro[:2]) == ""
    assert s.flush() == "\ufffd"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "eval"])
def test_no_mmap_and_mlock_reach_the_run_config(command: str, tmp_path: Path) -> None:
    """llama.cpp's --no-mmap and --mlock, on every command that loads a model."""
    from pyspice.cli.common import run_config

    model = tmp_path / "m.gguf"
    argv = {"generate": ["-p", "hi"], "eval": ["ppl"]}.get(command, [])
    sub = [command, *argv[:1]] if command == "eval" else [command]
    rest = argv[1:] if command == "eval" else argv
    args = build_parser().parse_args([*sub, "-m", str(model), *rest, "--no-mmap", "--mlock"])
    config = run_config(args, model=model)
    assert (config.use_mmap, config.use_mlock) == (False, True)
    plain = run_config(build_parser().parse_args([*sub, "-m", str(model), *rest]), model=model)
    assert (plain.use_mmap, plain.use_mlock) == (True, False)  # llama.cpp's defaults


def test_mlock_with_a_ram_budget_is_refused_before_loading(tmp_path: Path) -> None:
    from pyspice.engine import RunConfig

    with pytest.raises(ValueError, match=r"--mlock .* with --ram-budget they stay in the file"):
        RunConfig(model=tmp_path / "m.gguf", ram_budget="50%", use_mlock=True)


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and action path of the parser (`trace fit`, ...)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found += _commands(sub, (*prefix, name))
    return found


def test_every_command_renders_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    # a stray '%' in a help text only fails when --help is asked for
    commands = _commands(build_parser())
    assert ("trace", "fit") in commands and ("sim",) in commands
    for path in commands:
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args([*path, "--help"])
        assert stop.value.code == 0, path
        assert "usage:" in capsys.readouterr().out
