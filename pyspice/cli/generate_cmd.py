"""`pyspice generate`: one-shot generation, streamed or as one JSON document."""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from typing import Any

from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    add_prompt_args,
    add_sampling_args,
    add_sidecar_arg,
    open_model,
    read_prompt,
)
from pyspice.cli.help_levels import advanced
from pyspice.engine.decode_trace import finish_decode_trace, start_decode_trace


def register(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "generate", help="generate text from a prompt", description=__doc__
    )
    add_model_args(p)
    add_prompt_args(p)
    add_sampling_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument(
        "--json", action="store_true", help='print {"text", "tokens", "stats"} instead of streaming'
    )
    advanced(
        p.add_argument(
            "--trace",
            metavar="DIR",
            default=None,
            help="record every decode step's MoE inputs and routing into this trace directory (pyspice sim)",
        )
    )
    p.set_defaults(func=run)
    return p


class _Utf8Stream:
    """Emits text as soon as the token bytes form complete UTF-8 characters
    (a token may end inside a character); invalid bytes become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return str(self._decoder.decode(data))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


def generate_tokens(
    llm: Any, prompt: str, args: argparse.Namespace, on_text: Any = None
) -> tuple[str, list[int]]:
    prompt_tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    out: list[int] = []
    stream = _Utf8Stream()
    pieces: list[str] = []
    eos = llm.token_eos()
    for token in llm.generate(
        prompt_tokens,
        top_k=args.top_k,
        top_p=args.top_p,
        temp=args.temp,
        repeat_penalty=args.repeat_penalty,
        reset=True,
    ):
        if token == eos or len(out) >= args.n_predict:
            break
        out.append(int(token))
        text = stream.feed(llm.detokenize([token], prev_tokens=prompt_tokens + out[:-1]))
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)
        if len(out) >= args.n_predict:
            break
    tail = stream.flush()
    if tail:
        pieces.append(tail)
        if on_text is not None:
            on_text(tail)
    return "".join(pieces), out


def run(args: argparse.Namespace) -> int:
    llm = open_model(args, seed=args.seed)
    prompt = read_prompt(args)
    recorder = None
    if getattr(args, "trace", None):
        recorder = start_decode_trace(llm, args.trace, llm.spice_policy)

    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    text, tokens = generate_tokens(llm, prompt, args, None if args.json else echo)
    if recorder is not None:
        finish_decode_trace(recorder, tokens=tokens)
    if args.json:
        json.dump({"text": text, "tokens": tokens, "stats": llm.spice_stats()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n")
    llm.close()
    return 0
