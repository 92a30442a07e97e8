"""Where SPICE policies plan: on the hook's thread (synchronous) or on libspice's
planner thread while the graph runs on (asynchronous; spice_runtime_enable_async).

Only the shipped planning policies (`spice:*`, `abl-*`) plan asynchronously: they
declare the rule the engine runs each call by meanwhile. Users' policies, the
trace recorder and the baselines (rules already) keep their paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from pyspice.runtime import AsyncParams

# Issue 19 item 4, measured on the 2-core development machine. Where the decode takes
# every core, planning inline beats giving the planner a core of its own: asynchronous
# at -t 1 against synchronous at -t 2 (smolmoe, 50% emulated tier, TPOT ms) spice:exact
# 18.7 vs 13.9, spice:balanced 23.3 vs 14.5, spice:fast 19.8 vs 13.8 -- the second graph
# thread is worth more -- and asynchronous at -t 2 (the planner sharing the graph's
# cores, parked when idle) only equals synchronous (11.4 vs 11.4 on smolmoe-b). Where the
# decode leaves a core free, the planner runs there at no cost to the graph and the hook
# thread stops waiting for Python: at -t 1, smolmoe-b, emulated 25% and 50%, 3 rounds of
# 2 repeats (session 37), asynchronous decoded in 0.91-0.95x synchronous's TPOT for every
# SPICE level. So the default follows the run: asynchronous when the decode's threads are
# fewer than the cores this process may use, synchronous when they take every core.
# Except the lossy levels: their thresholds were tuned and judged planning synchronously,
# and planning asynchronously (the engine's rule substituting as the calls come, the
# policy's plans a layer late) spice:fast read +5.69% / +5.46% perplexity on held-out text
# at 25% / 50% (bound +5%) against +3.56% / +3.03% synchronously (fortunes-min, 6 chunks,
# token by token, -t 1; session 37). So off the disk tier they plan synchronously by
# default until they are tuned for it.


@dataclass(frozen=True)
class Planning:
    """asynchronous: None -- the default for this machine (default_asynchronous);
    deterministic_lag > 0: the plan of call c applied exactly at call c + lag (runs
    repeat exactly); max_lag: free-running plans older than this many MoE layers are
    dropped (None: the policy's own horizon, H_min)."""

    asynchronous: bool | None = None
    deterministic_lag: int = 0
    max_lag: int | None = None

    def __post_init__(self) -> None:
        if self.max_lag is not None and self.max_lag < 1:
            raise ValueError(f"--max-plan-lag must be at least 1 layer, got {self.max_lag}")
        if not 0 <= self.deterministic_lag <= 64:
            raise ValueError(
                f"--plan-lag must be 0 (free-running) or 1..64 layers, got {self.deterministic_lag}"
            )

    @property
    def asked_asynchronous(self) -> bool:
        """Asynchronous by the user's choice (--planning async, a deterministic lag), not
        by this machine's default: what lets a user's own planner object plan that way."""
        return self.deterministic_lag > 0 or self.asynchronous is True

    def resolved(
        self,
        experts_on_disk: bool = False,
        say: Callable[[str], None] | None = None,
        decode_threads: int | None = None,
        lossy: bool = False,
    ) -> bool:
        """Whether to plan asynchronously (deterministic mode implies it). With the
        routed experts on disk (--ram-budget) the default is asynchronous: only the
        engine's rule, which runs every call there, keeps the misses it reads
        (SpiceConfig.retention_decay); planning synchronously reads them into scratch
        and drops them, for 1.9-2.4x the bytes in the simulator. Otherwise it is
        asynchronous where the decode's threads leave the planner a core of its own
        (planner_may_poll; None: taken as every core), else synchronous (measured: the
        comment above); a lossy level (`lossy`) plans synchronously there, as it was tuned.

        A default taken is told through `say` (the engine's say-once notes), so the
        user learns which one ran and how to choose; nothing is said otherwise."""
        if self.deterministic_lag > 0:
            return True
        if self.asynchronous is not None:
            return self.asynchronous
        if experts_on_disk:
            if say is not None:
                say(
                    "with --ram-budget, SPICE policies plan on a planner thread "
                    "(asynchronous), whose rule keeps the experts a miss reads "
                    "(--planning sync to choose)"
                )
            return True
        spare_core = planner_may_poll(decode_threads)
        if lossy:
            if say is not None:
                say(
                    "lossy SPICE levels plan on the hook's thread (synchronous), as their thresholds "
                    "were tuned and judged (--planning async to choose)"
                )
            return False
        if say is not None:
            how = (
                f"on a planner thread (asynchronous): {decode_threads} decode "
                f"{'thread leaves' if decode_threads == 1 else 'threads leave'} it a core"
                if spare_core
                else "on the hook's thread (synchronous): the decode's threads take every core"
            )
            say(f"SPICE policies plan {how} (--planning sync|async to choose)")
        return spare_core

    def expected_lag(self) -> int:
        """MoE layers from a call to its plan's use: the deterministic lag, else the one
        measured free-running (1.0-1.1 on smolmoe, docs in the issue 19 note)."""
        return self.deterministic_lag if self.deterministic_lag > 0 else 1

    def params(
        self, horizon: int, with_probs: bool = False, with_shared: bool = False, idle_poll: bool = False
    ) -> AsyncParams:
        return AsyncParams(
            max_lag=self.max_lag if self.max_lag is not None else max(1, horizon),
            deterministic_lag=self.deterministic_lag,
            with_probs=with_probs,
            with_shared=with_shared,
            idle_poll=idle_poll,
        )


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a cpuset or
    taskset narrows), not every core the machine has."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def planner_may_poll(decode_threads: int | None) -> bool:
    """Whether an idle planner thread may poll for the next snapshot (AsyncParams.idle_poll):
    only with a core of its own, i.e. fewer decode threads than usable cores. ggml's
    threads spin between ops; a planner polling beside them on a full machine takes
    their time (2 cores, -t 2: spice:exact 14.1 ms/token polling, 11.4 parked at once
    on the emulated tier, 26.5 and 22.8 in edge mode), where parking costs the hook's
    thread one futex wake per post."""
    return decode_threads is not None and decode_threads < usable_cores()
