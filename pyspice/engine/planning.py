"""Where SPICE policies plan: on the hook's thread (synchronous) or on libspice's
planner thread while the graph runs on (asynchronous; spice_runtime_enable_async).

Only the shipped planning policies (`spice:*`, `abl-*`) plan asynchronously: they
declare the rule the engine runs each call by meanwhile. Users' policies, the
trace recorder and the baselines (rules already) keep their paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from pyspice.policy import PolicyContext
from pyspice.policy.spice.cost import CostModel
from pyspice.runtime.store import AsyncParams

# Measured on the 2-core development machine (docs/results/planning.md, "Synchronous
# where the decode takes every core"). Where the decode takes
# every core, planning inline beats giving the planner a core of its own: asynchronous
# at -t 1 against synchronous at -t 2 (smolmoe, 50% emulated tier, TPOT ms) spice:exact
# 18.7 vs 13.9, spice:balanced 23.3 vs 14.5, spice:fast 19.8 vs 13.8 -- the second graph
# thread is worth more -- and asynchronous at -t 2 (the planner sharing the graph's
# cores, parked when idle) only equals synchronous (11.4 vs 11.4 on smolmoe-b). Where the
# decode leaves a core free, the planner runs there at no cost to the graph and the hook
# thread stops waiting for Python: at -t 1, smolmoe-b, emulated 25% and 50%, 3 rounds of
# 2 repeats, asynchronous decoded in 0.91-0.95x synchronous's TPOT for every
# SPICE level. So the default follows the run: asynchronous when the decode's threads are
# fewer than the cores this process may use, synchronous when they take every core.
# The lossy levels too, but deterministically (Planning.chosen): free-running, which
# experts a plan has landed by the time a call comes depends on the planner's timing,
# and so which activations are substituted or run from low-precision slots. spice:fast
# read +4.87% and +6.24% perplexity in two runs of the same command (fortunes-min, 6
# chunks, token by token, 25%, two runs) -- the planner's timing, not the
# text, moved it -- and thresholds tuned on one run's noise do not hold on the next.
# Applied exactly one layer late (the free-running lag measured 1.01-1.03 layers), a
# plan is the same in every run; the hook's thread then waits for a plan not done yet,
# which for a ~40 us plan on a core of its own is seldom (bench column `wait us`;
# docs/results/planning.md). Which copies have landed when a call comes follows
# the tier's clock: an emulated tier's then moves a modelled layer per call
# (virtual_layer_ns), so a run repeats to the bit; a real device's copies take the
# time they take.
LOSSY_PLAN_LAG = 1


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

    def chosen(
        self,
        experts_on_disk: bool = False,
        say: Callable[[str], None] | None = None,
        decode_threads: int | None = None,
        lossy: bool = False,
    ) -> Planning:
        """How this run plans, every default taken: `asynchronous` set, and a lossy
        level's deterministic lag. With the routed experts on disk (--ram-budget) the
        default is asynchronous: only the engine's rule, which runs every call there,
        keeps the misses it reads (SpiceConfig.retention_decay); planning synchronously
        reads them into scratch and drops them, for 1.9-2.4x the bytes in the simulator.
        Otherwise it is asynchronous where the decode's threads leave the planner a core
        of its own (planner_may_poll; None: taken as every core), else synchronous
        (measured: the comment above). A lossy level (`lossy`) planning asynchronously
        by default does so deterministically, each plan applied LOSSY_PLAN_LAG layers
        late: its plans then do not depend on the planner's timing (free-running,
        spice:fast's perplexity moved by 1.4 points between two runs), and its
        thresholds were tuned and judged that way.

        A default taken is told through `say` (the engine's say-once notes), so the
        user learns which one ran and how to choose; nothing is said otherwise."""
        if self.deterministic_lag > 0:
            return replace(self, asynchronous=True)
        if self.asynchronous is not None:
            return self
        if experts_on_disk:
            if say is not None:
                say(
                    "with --ram-budget, SPICE policies plan on a planner thread "
                    "(asynchronous), whose rule keeps the experts a miss reads "
                    "(--planning sync to choose)"
                )
            return replace(self, asynchronous=True)
        spare_core = planner_may_poll(decode_threads)
        if say is not None:
            threads = f"{decode_threads} decode {'thread leaves' if decode_threads == 1 else 'threads leave'}"
            if not spare_core:
                how = "on the hook's thread (synchronous): the decode's threads take every core"
            elif lossy:
                how = (
                    f"on a planner thread, each plan applied exactly {LOSSY_PLAN_LAG} MoE layer later "
                    f"whatever the planner's timing (as their thresholds were tuned): {threads} it a core"
                )
            else:
                how = f"on a planner thread (asynchronous): {threads} it a core"
            whose = "lossy SPICE levels" if lossy else "SPICE policies"
            say(f"{whose} plan {how} (--planning sync|async to choose)")
        if not spare_core:
            return replace(self, asynchronous=False)
        return replace(self, asynchronous=True, deterministic_lag=LOSSY_PLAN_LAG if lossy else 0)

    @property
    def label(self) -> str:
        """How a chosen planning plans, as records name it: sync, async (free-running) or
        detK (deterministic, K layers late)."""
        if not self.asynchronous:
            return "sync"
        return f"det{self.deterministic_lag}" if self.deterministic_lag > 0 else "async"

    def expected_lag(self) -> int:
        """MoE layers from a call to its plan's use: the deterministic lag, else the one
        measured free-running (1.0-1.1 on smolmoe, docs/results/planning.md)."""
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


def virtual_layer_ns(ctx: PolicyContext) -> int:
    """The step per token of a hook call of an emulated tier's virtual clock in
    deterministic planning (spice_runtime_set_clock_step): a decode step's modelled time
    in one MoE layer, the policy's own cost model's (CostModel.layer_us: the probe's rest
    of a layer plus the experts a token picks); a prompt batch's call moves it that much
    per token, generously (a batch shares its weight reads), so the copies a prompt's
    plans ask for land as they do on the wall clock. Copies then land by the calls
    before a call, not by the wall clock, so a deterministic run repeats exactly: which
    experts a call finds in their slots -- 5-bit or 4-bit copies for the lossy levels,
    the model's weights on the host otherwise -- decides its output. On the wall clock
    spice:balanced's perplexity change read +0.44% and -0.19% in two runs of one command
    at det1 (fortunes-min, 6 chunks, 25%;)."""
    cost = CostModel.from_context(ctx)
    return max(1, round(cost.layer_us(max(1, ctx.n_expert_used)) * 1e3))
