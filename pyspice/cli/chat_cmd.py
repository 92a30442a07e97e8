"""`pyspice chat`: talk to a model in the terminal, its experts placed by pyspice.

The conversation is formatted with the model's own chat template (the GGUF's
`tokenizer.chat_template`, through llama-cpp-python's chat handling), the
answer streams as it is generated, and the history stays in the context (its
KV cache is reused turn to turn). Commands: `/stats` (the stats record;
`/stats json` for all of it), `/reset` (new conversation, stats cleared),
`/quit` (or Ctrl-D). Ctrl-C stops the current answer and keeps the session.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    add_sampling_args,
    add_sidecar_arg,
    open_model,
)
from pyspice.cli.stats_text import stats_lines
from pyspice.units import format_bytes

COMMANDS = "/stats [json], /reset, /quit (or Ctrl-D); Ctrl-C stops an answer"


def register(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "chat", help="interactive chat in the model's own chat format"
    )
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_args(p)
    add_sampling_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument("-sys", "--system-prompt", default=None, help="system message opening the conversation")
    # an answer runs until the model ends it (or the context is full), as in llama.cpp
    p.set_defaults(func=run, n_predict=-1)
    for action in p._actions:
        if action.dest == "n_predict":
            action.help = (
                "tokens per answer at most (default: until the model ends it or the context is full)"
            )
    return p


@dataclass
class ChatSession:
    llm: Any
    args: argparse.Namespace
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = []
        if self.args.system_prompt:
            self.messages.append({"role": "system", "content": self.args.system_prompt})
        self.llm.reset()
        self.llm.spice_reset_stats()

    def template_label(self) -> str:
        fmt = self.llm.chat_format
        if fmt == "chat_template.default":
            return "the model's own (tokenizer.chat_template)"
        if "tokenizer.chat_template" in self.llm.metadata:
            return f"{fmt!r} (recognized from the model's template)"
        return f"none in the GGUF: llama-cpp-python's {fmt!r} format"

    def banner(self) -> str:
        llm = self.llm
        tier = llm.spice_device
        device = (
            f"{'emulated ' if tier.emulated else ''}device {format_bytes(tier.budget_bytes)} ({tier.budget})"
            if tier is not None
            else "no device tier"
        )
        return (
            f"pyspice chat: {llm.metadata.get('general.name', llm.model_path)} | policy {llm.spice_policy} | "
            f"{device}\nchat template: {self.template_label()}\ncommands: {COMMANDS}"
        )

    def answer(self, text: str) -> None:
        """One turn: stream the reply to `out`; a status line follows on `err`."""
        self.messages.append({"role": "user", "content": text})
        before = self.llm.spice_snapshot()
        started = time.perf_counter()
        pieces: list[str] = []
        interrupted = False
        args = self.args
        try:
            stream = self.llm.create_chat_completion(
                messages=self.messages,
                stream=True,
                max_tokens=args.n_predict if args.n_predict > 0 else None,
                temperature=args.temp,
                top_k=args.top_k,
                top_p=args.top_p,
                repeat_penalty=args.repeat_penalty,
            )
            try:
                for chunk in stream:
                    piece = chunk["choices"][0]["delta"].get("content")
                    if piece:
                        pieces.append(piece)
                        self.out.write(piece)
                        self.out.flush()
            except KeyboardInterrupt:
                interrupted = True
                stream.close()
        except ValueError as exc:
            # llama-cpp-python says so when the conversation outgrows the context
            self.messages.pop()
            self.out.write("\n")
            print(
                f"pyspice: {exc}: the conversation no longer fits -c {args.ctx_size}; "
                "/reset starts a new one",
                file=self.err,
            )
            return
        except KeyboardInterrupt:
            interrupted = True  # during the prompt's prefill
        # the partial answer stays in the history: the context holds what the user saw
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.out.write("\n")
        self.out.flush()
        after = self.llm.spice_snapshot()
        print(self.status_line(before, after, time.perf_counter() - started, interrupted), file=self.err)

    def status_line(self, before: Any, after: Any, wall_s: float, interrupted: bool) -> str:
        decoded = after.timing.decoded_tokens - before.timing.decoded_tokens
        decode_s = after.timing.decode_s - before.timing.decode_s
        prefill = after.timing.prefill_tokens - before.timing.prefill_tokens
        acts = after.total.activations - before.total.activations
        hits = after.total.hits - before.total.hits
        parts = [
            f"{decoded} tokens decoded in {wall_s:.1f} s",
            f"{decoded / decode_s:.1f} tok/s" if decode_s > 0 else "",
            f"prompt {prefill} tokens" if prefill else "",
        ]
        if self.llm.spice_policy != "stock":
            parts.append(f"{acts} expert activations")
            if self.llm.spice_device is not None and acts:
                moved = after.total.bytes_h2d - before.total.bytes_h2d
                label = "emulated bus" if self.llm.spice_device.emulated else "bus"
                parts.append(f"hit rate {hits / acts:.0%}, {format_bytes(moved)} over the {label}")
        text = " | ".join(p for p in parts if p)
        return f"[{'stopped: ' if interrupted else ''}{text}]"

    def stats_text(self, full: bool) -> str:
        record = self.llm.spice_stats()
        if full:
            return json.dumps(record, indent=1)
        lines = stats_lines(record)
        return "stats since the last /reset:\n" + "\n".join(lines)

    def handle(self, line: str) -> bool:
        """False when the session ends."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command in ("/quit", "/exit", "/q"):
                return False
            if command == "/stats":
                print(self.stats_text(rest.strip() == "json"), file=self.out)
            elif command == "/reset":
                self.reset()
                print("(new conversation; stats cleared)", file=self.out)
            else:
                print(f"unknown command {command}: {COMMANDS}", file=self.out)
            self.out.flush()
            return True
        self.answer(text)
        return True


def _read_line(prompt: str) -> str | None:
    """A line from the user; None at end of input."""
    try:
        return input(prompt)
    except EOFError:
        return None


def run(args: argparse.Namespace) -> int:
    # Ctrl-C must stop an answer even when we were started with SIGINT ignored (a
    # shell's background job, nohup): Python then never installs its own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    llm = open_model(args, seed=args.seed)
    try:
        session = ChatSession(llm, args)
        print(session.banner(), file=sys.stderr)
        sys.stderr.flush()
        while True:
            try:
                line = _read_line("> ")
            except KeyboardInterrupt:
                print("\n(Ctrl-C stops an answer; /quit or Ctrl-D leaves)", file=sys.stderr)
                continue
            if line is None:
                print(file=sys.stdout)
                break
            if not session.handle(line):
                break
    finally:
        llm.close()
    return 0
