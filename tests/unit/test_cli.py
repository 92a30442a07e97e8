"""Command-line surface: only working commands are listed, flags follow llama.cpp."""

from __future__ import annotations

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
