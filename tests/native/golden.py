"""Helpers for golden runs: the same prompt and greedy decode under different policies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyspice.api import Llama
from pyspice.policy import ACTION_DEVICE, ACTION_HOST, HookCall, Plan

PROMPT = (
    "Mixture-of-Experts models route every token to a few experts out of many, so most of "
    "their weights sit idle for any one token; offloading them is the whole game."
)
N_DECODE = 64


@dataclass
class Run:
    logits: np.ndarray  # every position's logits: the prompt batch, then each decode step
    tokens: list[int]
    stats: dict[str, Any]


def load(path: Path, **kwargs: Any) -> Llama:
    kwargs.setdefault("n_ctx", 256)
    kwargs.setdefault("n_batch", 128)
    kwargs.setdefault("n_ubatch", 128)
    kwargs.setdefault("n_threads", 2)
    kwargs.setdefault("n_threads_batch", 2)
    return Llama(str(path), policy="stock", logits_all=True, verbose=False, **kwargs)


def greedy_run(llm: Llama, policy: Any, n_decode: int = N_DECODE, forced: list[int] | None = None) -> Run:
    """Prompt as one batch, then n_decode greedy single-token steps; all logits kept.
    With `forced` (teacher forcing), those tokens are fed instead of the argmax, one
    step each, so runs whose argmax may differ still score the same text."""
    llm.set_policy(policy)
    llm.reset()
    llm.spice_reset_stats()
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.eval(prompt)
    tokens: list[int] = []
    for step in range(n_decode if forced is None else len(forced)):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1])) if forced is None else forced[step]
        tokens.append(token)
        llm.eval([token])
    return Run(llm.scores[: llm.n_tokens].copy(), tokens, llm.spice_stats())


def prompt_length(llm: Llama) -> int:
    return len(llm.tokenize(PROMPT.encode(), add_bos=True))


class AllHost:
    """Every activation on the host; the device tier stays empty."""

    name = "all-host"

    def decide(self, call: HookCall) -> Plan:
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), ACTION_HOST, np.int32))


class AllDevice:
    """Every activation on the device: absent experts are fetched on demand."""

    name = "all-device"

    def decide(self, call: HookCall) -> Plan:
        assert call.residency is not None  # the policy sees the device tier
        return Plan(actions=np.full((call.n_tokens, call.n_expert_used), ACTION_DEVICE, np.int32))
