"""Miss handler: one action for every (token, selected expert) of a call.

- resident -> device, exact;
- copy on its way (a prefetch) -> device if waiting for it is cheaper than
  running it on the host, else host;
- absent, gate weight low and surrogate error within the quality budget
  (lossy levels only) -> surrogate;
- every other miss -> fetched now (high priority) or run on the host,
  choosing how many to fetch by the cost model and what is already on the
  bus, and fetching only when that beats all-host by a margin (paper 4.3).
  Ablations force all-host or all-fetch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
)
from pyspice.policy.spice.config import SpiceConfig
from pyspice.policy.spice.cost import CostModel

ErrorLookup = Callable[[int], "npt.NDArray[np.float32] | None"]


@dataclass
class MissDecision:
    # [n_tokens, n_expert_used]; a decode step's one row as a list (written to the plan as
    # is); None: the default plan's (resident -> device, the rest -> host)
    actions: npt.NDArray[np.int32] | list[list[int]] | None
    fetch: list[int]  # experts of this layer to copy now
    busy: list[int]  # experts this call runs on the device (resident, awaited or fetched)


class MissHandler:
    def __init__(self, config: SpiceConfig, cost: CostModel, surrogate_error: ErrorLookup | None) -> None:
        self.config = config
        self.cost = cost
        self.surrogate_error = surrogate_error if config.substitutes else None
        # decode-step constants, so a call does no cost-model arithmetic it can skip
        self.host1 = cost.host_us(1)
        self.dev1 = cost.device_us(1)
        # with the device no faster than the host and no overlap (the emulated device),
        # fetching a miss can only add the copy's wait: never worth it in the cost model
        self.fetch_can_win = cost.overlap or self.dev1 < self.host1
        self._good: dict[int, frozenset[int]] = {}
        # a decode step goes through decide_step (plain Python) unless the cost model
        # must weigh fetches against the host
        self.decode_in_python = config.miss_mode != "cost" or not self.fetch_can_win
        # per layer: whether a decode step's actions are always the default plan's (resident
        # -> device, everything else -> host): lossless, nothing fetched, and even a copy
        # already on the bus not worth waiting for
        self.default_step = [
            not config.substitutes
            and self.decode_in_python
            and config.miss_mode != "fetch"
            and cost.copy_us(il) + self.dev1 > self.host1
            for il in range(len(cost.expert_bytes))
        ]
        # the same for a prompt batch: waiting for a copy never beats the host when device
        # work is host work (the emulated device), whatever the batch size
        self.default_batch = [d and not cost.overlap for d in self.default_step]

    def decide(
        self,
        layer: int,
        ids: npt.NDArray[np.int32],
        weights: npt.NDArray[np.float32],
        residency: npt.NDArray[np.int8],
    ) -> MissDecision:
        if ids.shape[0] == 1 and self.decode_in_python:
            return self._decide_step(layer, ids, weights, residency)
        cfg, cost = self.config, self.cost
        decode = ids.shape[0] == 1
        if decode:  # top-k ids are distinct, one token each
            experts = ids[0]
            inverse: npt.NDArray[np.intp] | None = None
            counts: npt.NDArray[np.int64] | None = None
        else:
            experts, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
            inverse = inv.reshape(ids.shape)
        states = residency[layer, experts]
        resident = states == RESIDENCY_RESIDENT
        per_expert = np.where(resident, ACTION_DEVICE, ACTION_HOST).astype(np.int32)

        # lossy levels: low-weight activations of absent experts with a good surrogate
        surrogate: npt.NDArray[np.bool_] | None = None
        errors = self.surrogate_error(layer) if self.surrogate_error is not None else None
        if errors is not None:
            absent = states == RESIDENCY_ABSENT
            absent_act = absent[None, :] if inverse is None else absent[inverse]
            surrogate = (
                absent_act & (errors[ids] <= cfg.surrogate_max_error) & (weights < cfg.surrogate_max_weight)
            )
            if not surrogate.any():
                surrogate = None

        def tokens(i: int) -> int:
            n = 1 if counts is None else int(counts[i])
            if surrogate is not None:
                n -= (
                    int(surrogate[0, i])
                    if inverse is None
                    else int(np.count_nonzero(surrogate[inverse == i]))
                )
            return n

        misses: list[int] = []  # indices into experts
        if not resident.all():
            copy_us = cost.copy_us(layer)
            n_queued = -1  # counted when first needed
            for i in np.flatnonzero(~resident).tolist():
                n = tokens(i)
                if n == 0:
                    continue  # every activation substituted
                s = states[i]
                if s == RESIDENCY_ABSENT:
                    misses.append(i)
                    continue
                # a prefetch on its way: wait for it, or run it on the host meanwhile
                if cfg.miss_mode == "fetch":
                    per_expert[i] = ACTION_DEVICE
                    continue
                wait, n_queued = self._prefetch_wait_us(s, copy_us, residency, n_queued)
                host, dev = (self.host1, self.dev1) if decode else (cost.host_us(n), cost.device_us(n))
                if wait + dev <= host:
                    per_expert[i] = ACTION_DEVICE

        fetch: list[int] = []
        if misses and cfg.miss_mode == "fetch":
            fetch = [int(experts[i]) for i in misses]
        elif misses and cfg.miss_mode == "cost" and self.fetch_can_win:
            miss_tokens = [tokens(i) for i in misses]
            due = np.flatnonzero(per_expert == ACTION_DEVICE)
            device_due = sum(cost.device_us(1 if counts is None else int(counts[i])) for i in due.tolist())
            bus_busy = bool(np.count_nonzero(residency == RESIDENCY_COPYING))
            j = cost.choose_fetches(
                layer, miss_tokens, device_due, cost.copy_us(layer) if bus_busy else 0.0, cfg.fetch_margin
            )
            if j:
                ranked = sorted(range(len(misses)), key=lambda m: -miss_tokens[m])[:j]
                fetch = [int(experts[misses[m]]) for m in ranked]
        for e in fetch:
            per_expert[experts == e] = ACTION_DEVICE

        actions = per_expert[None, :] if inverse is None else per_expert[inverse]
        if surrogate is not None:
            actions = actions.copy()
            actions[surrogate] = ACTION_SURROGATE
        busy = experts[per_expert == ACTION_DEVICE].tolist()
        return MissDecision(actions, fetch, busy)

    @staticmethod
    def _prefetch_wait_us(
        state: int, copy_us: float, residency: npt.NDArray[np.int8], n_queued: int
    ) -> tuple[float, int]:
        """Expected wait for an expert whose prefetch is on its way: one copy if it is on
        the bus, else about half the queue ahead of it. `n_queued` (< 0: not counted yet)
        comes back counted, so a call counts the queue at most once."""
        if state == RESIDENCY_COPYING:
            return copy_us, n_queued
        if n_queued < 0:
            n_queued = int(np.count_nonzero(residency == RESIDENCY_QUEUED))
        return copy_us * (1.0 + n_queued / 2.0), n_queued

    def _decide_step(
        self,
        layer: int,
        ids: npt.NDArray[np.int32],
        weights: npt.NDArray[np.float32],
        residency: npt.NDArray[np.int8],
    ) -> MissDecision:
        """One decode token when no miss can be worth fetching by the cost model (or the
        ablation decides it): plain Python over a dozen experts, cheaper than numpy calls."""
        return self.decide_step(layer, ids[0].tolist(), weights, residency[layer].tolist(), residency)

    def decide_step(
        self,
        layer: int,
        experts: list[int],
        weights: npt.NDArray[np.float32],
        row: Sequence[int],
        residency: npt.NDArray[np.int8],
    ) -> MissDecision:
        """`_decide_step` on the token's experts and the layer's residency row as plain
        Python sequences (a list, or that row's bytes)."""
        cfg = self.config
        good = self._good_surrogates(layer) if self.surrogate_error is not None else None
        w: list[float] = weights[0].tolist() if good else []
        # the shortest wait (a copy already on the bus) already loses to the host:
        # no in-flight expert is worth waiting for, whatever the queue holds
        wait_loses = cfg.miss_mode != "fetch" and self.cost.copy_us(layer) + self.dev1 > self.host1
        actions: list[int] = []
        fetch: list[int] = []
        busy: list[int] = []
        n_queued = -1
        for k, e in enumerate(experts):
            s = row[e]
            if s == RESIDENCY_RESIDENT:
                actions.append(ACTION_DEVICE)
                busy.append(e)
                continue
            if s == RESIDENCY_ABSENT:
                if good and e in good and w[k] < cfg.surrogate_max_weight:
                    actions.append(ACTION_SURROGATE)
                elif cfg.miss_mode == "fetch":
                    actions.append(ACTION_DEVICE)
                    fetch.append(e)
                    busy.append(e)
                else:
                    actions.append(ACTION_HOST)
                continue
            # a prefetch on its way: wait for it, or run it on the host meanwhile
            if wait_loses:
                actions.append(ACTION_HOST)
                continue
            if cfg.miss_mode != "fetch":
                wait, n_queued = self._prefetch_wait_us(s, self.cost.copy_us(layer), residency, n_queued)
                if wait + self.dev1 > self.host1:
                    actions.append(ACTION_HOST)
                    continue
            actions.append(ACTION_DEVICE)
            busy.append(e)
        return MissDecision([actions], fetch, busy)

    def _good_surrogates(self, layer: int) -> frozenset[int]:
        """Experts of `layer` whose surrogate is within the level's error budget (cached)."""
        good = self._good.get(layer)
        if good is None:
            errors = self.surrogate_error(layer) if self.surrogate_error is not None else None
            limit = self.config.surrogate_max_error
            good = frozenset([] if errors is None else np.flatnonzero(np.asarray(errors) <= limit).tolist())
            self._good[layer] = good
        return good
