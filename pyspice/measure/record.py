"""What validating the simulator against `pyspice bench` needs from the real engine.

`python -m pyspice.measure.record trace MODEL OUT [--prompt-tokens 128] [-n 32] [-t 2]`
writes a pyspice.formats.trace directory (TraceWriter: the one trace format) of
exactly what bench runs: its default prompt cut to --prompt-tokens tokens,
then -n greedy tokens. The prompt is evaluated one token per call so every
layer records every row (in a batch llama.cpp hands the last layer only the
rows whose logits are wanted); the KV cache, and so the decoded tokens, are
the ones bench's batched prompt gives (tokens.json lets you check), and
`meta.extra["prompt_tokens"]` has the simulator replay those rows as one
untimed prompt step that warms the device tier as bench's prompt does. With
`-f FILE` the trace is of a text instead: its first --prompt-tokens + -n tokens,
every one fed (teacher-forced, nothing generated), so the decode steps route
as the text does -- a trace of calibration text to tune on, or of held-out text
to judge on, where bench's greedy continuation may repeat itself.

`python -m pyspice.measure.record costs MODEL OUT.json [--position 128]` measures
this machine's per-layer and per-expert times where bench measures TPOT: one
token decoded at KV position --position (not 0, as `pyspice probe` does), a
different token each repeat (so routing, and what the caches hold, varies as in
decoding), all routed experts exact versus all dropped, interleaved, with the
dropping policy's own Python cost taken out of the rest of the layer. It writes a cost
profile in `pyspice probe`'s format for `pyspice sim --probe`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.api import Llama
from pyspice.engine.decode_trace import greedy_next
from pyspice.engine.probe import measure_decode_step
from pyspice.formats.profile import model_fingerprint, save_profile
from pyspice.formats.trace import TraceMeta, TraceWriter
from pyspice.measure.bench import DEFAULT_PROMPT
from pyspice.policy import HookCall, Plan
from pyspice.policy.base import PolicyBase
from pyspice.policy.profile import PROFILE_VERSION, BatchCost, CostProfile
from pyspice.sim.records import select_runs


class _Recorder(PolicyBase):
    """A policy that writes every call's rows to a TraceWriter and runs the exact default plan."""

    name = "record"

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.next_token: dict[int, int] = {}
        self.reads_probs = "probs" in writer.meta.fields
        self.reads_shared = "shared" in writer.meta.fields

    def decide(self, call: HookCall) -> Plan:
        start = self.next_token.get(call.layer, 0)
        fields = {name: np.array(getattr(call, name), copy=True) for name in self.writer.meta.fields}
        self.writer.add(call.layer, start, **fields)
        self.next_token[call.layer] = start + call.n_tokens
        return Plan()


def _open(model: Path, threads: int) -> Llama:
    return Llama(
        str(model), policy="exact", n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False
    )


def bench_prompt(llm: Any, prompt_tokens: int) -> list[int]:
    """bench's default prompt cut or repeated to `prompt_tokens` tokens, as bench does."""
    tokens = tuple(llm.tokenize(DEFAULT_PROMPT.encode("utf-8"), add_bos=True))
    body = tokens[1:] or tokens
    return list((tokens[:1] + body * (prompt_tokens // len(body) + 1))[:prompt_tokens])


def record_bench_trace(
    model: Path,
    out: Path,
    *,
    prompt_tokens: int = 128,
    n_predict: int = 32,
    threads: int = 2,
    text: str | None = None,
    forced_tokens: list[int] | None = None,
) -> list[int]:
    """Record bench's workload (or, with `text`, that text teacher-forced; with
    `forced_tokens`, bench's prompt and then those tokens fed, as a bench run that
    decoded them fed them); returns the tokens after the prompt."""
    llm = _open(model, threads)
    try:
        layers = llm.spice_layers()
        moe = [info.il for info in layers if info.is_moe]
        forced: list[int] | None = None
        if forced_tokens is not None:
            prompt, forced = bench_prompt(llm, prompt_tokens), list(forced_tokens)
            about = "pyspice bench's default prompt, one token per call, then given tokens fed"
        elif text is None:
            prompt = bench_prompt(llm, prompt_tokens)
            about = "pyspice bench's default prompt, one token per call"
        else:
            tokens = list(llm.tokenize(text.encode("utf-8"), add_bos=True))[: prompt_tokens + n_predict]
            if len(tokens) < prompt_tokens + n_predict:
                raise ValueError(f"the text has {len(tokens)} tokens; {prompt_tokens + n_predict} are needed")
            prompt, forced = tokens[:prompt_tokens], tokens[prompt_tokens:]
            about = "a text, every token fed one per call (teacher-forced)"
        meta = TraceMeta(
            model=model.name,
            fingerprint="",
            n_layers=len(layers),
            moe_layers=moe,
            n_expert=layers[moe[0]].n_expert,
            n_expert_used=llm.policy_context().n_expert_used,
            n_embd=layers[moe[0]].n_embd,
            source="decode",
            extra={
                "prompt_tokens": len(prompt),
                "prompt": about,
            },
        )
        writer = TraceWriter(out, meta)
        llm.set_policy(_Recorder(writer))
        llm.reset()  # type: ignore[no-untyped-call]
        for t in prompt:
            llm.eval([t])
        if forced is not None:
            for t in forced:
                llm.eval([t])
            generated = forced
        else:
            generated = [greedy_next(llm)]
            for _ in range(n_predict - 1):
                llm.eval([generated[-1]])
                generated.append(greedy_next(llm))
        writer.close()
    finally:
        llm.close()
    (out / "tokens.json").write_text(json.dumps(generated) + "\n")
    return generated


def measure_decode_costs(
    model: Path,
    *,
    position: int = 128,
    repeats: int = 30,
    threads: int = 2,
    bus_gbps: float = 12.0,
    bus_latency_us: float = 10.0,
) -> Any:
    """A pyspice.engine.probe.CostProfile for one-token decode steps at KV position `position`."""

    llm = _open(model, threads)
    try:
        layers = llm.spice_layers()
        n_moe = sum(1 for info in layers if info.is_moe)
        step = measure_decode_step(llm, bench_prompt(llm, position + repeats), position, repeats)
        expert, rest = step.expert_us, step.rest_us_per_layer
        types = {
            "/".join(str(t) for t in (i.type_gate, i.type_up, i.type_down)): i.bytes_per_expert
            for i in layers
            if i.is_moe
        }
        return CostProfile(
            version=PROFILE_VERSION,
            model=str(model),
            model_sha=model_fingerprint(model),
            threads=int(llm.n_threads),
            n_layers=len(layers),
            n_moe_layers=n_moe,
            expert_bytes=types,
            bus_gbps=bus_gbps,
            bus_latency_us=bus_latency_us,
            bus_source="emulated (set by the user)",
            device_expert_us=expert,
            device_source=f"emulated: the host's own time, one token at KV position {position}",
            batches=[BatchCost(tokens=1, expert_us=expert, rest_us_per_layer=rest)],
        )
    finally:
        llm.close()


def _decoded_tokens(spec: str, n_predict: int) -> list[int]:
    """The tokens a bench run fed while decoding (all it decoded but the last), from
    `RECORD[:LINE]` (its first run without a line): its stock row's, else its first
    row's that has them."""
    try:
        run = select_runs([spec])[0]
    except (ValueError, IndexError) as err:
        raise SystemExit(f"--tokens-of {spec}: {err or 'the record holds no bench run'}") from None
    ordered = [run.rows["stock"], *run.rows.values()] if "stock" in run.rows else list(run.rows.values())
    tokens = next((r.tokens for r in ordered if r.tokens), None)
    if not tokens:
        raise SystemExit(f"{spec}: no row of that run recorded its tokens")
    return list(tokens[: max(0, min(len(tokens), n_predict) - 1)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyspice.measure.record", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trace", help="record bench's workload as a trace")
    t.add_argument("model", type=Path)
    t.add_argument("out", type=Path)
    t.add_argument("--prompt-tokens", type=int, default=128)
    t.add_argument("-n", "--n-predict", type=int, default=32)
    t.add_argument("-t", "--threads", type=int, default=2)
    t.add_argument(
        "-f", "--file", type=Path, help="a text to trace instead, every token fed (teacher-forced)"
    )
    t.add_argument(
        "--tokens-of",
        metavar="RECORD[:LINE]",
        help="feed the tokens a `bench --json` run decoded (its stock row's; line 1 unless given) "
        "after bench's prompt, so the trace routes as that run did: the routing of a recorded GPU "
        "run for `pyspice sim --predict`",
    )
    c = sub.add_parser("costs", help="measure decode-step costs at bench's KV position")
    c.add_argument("model", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--position", type=int, default=128)
    c.add_argument("--repeat", type=int, default=30)
    c.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.what == "trace":
        forced = _decoded_tokens(args.tokens_of, args.n_predict) if args.tokens_of else None
        tokens = record_bench_trace(
            args.model,
            args.out,
            prompt_tokens=args.prompt_tokens,
            n_predict=args.n_predict,
            threads=args.threads,
            text=args.file.read_text(encoding="utf-8") if args.file is not None else None,
            forced_tokens=forced,
        )
        fed = args.file is not None or forced is not None
        steps = len(tokens) if fed else len(tokens) - 1  # greedy: the first is the prompt's
        print(f"recorded {args.prompt_tokens} prompt + {steps} decoded tokens into {args.out}")
    else:
        profile = measure_decode_costs(
            args.model, position=args.position, repeats=args.repeat, threads=args.threads
        )
        save_profile(profile, args.out)
        b = profile.batches[0]
        print(
            f"{args.out}: {b.rest_us_per_layer:.1f} us per layer, {b.expert_us:.2f} us per expert activation"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
