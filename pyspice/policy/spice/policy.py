"""SPICE: speculative prefetch + surrogate substitution + cost-aware fetch-or-host.

One policy object per variant (quality level or ablation, see config.py).
For a decode step:

1. handle this layer's misses (misses.py): device / host / surrogate / fetch;
2. at every `plan_every`-th MoE layer (config.py; closer where the budget is
   tight), look ahead (lookahead.py): the predictor, anchored at this
   layer's MoE input, predicts the next layers' experts, at least up to the
   next planning layer plus H_min, deeper while confident;
3. there, plan prefetches, cancellations and where their room may come from
   (planner.py) around what step 1 keeps busy.

A layer that neither plans nor decides anything but the default (lossless, on
a device where waiting for a copy never pays) returns the default plan at once,
and the planning layer before it tells the engine so (Plan.resume_layer), which
then does not call Python there at all: inside the graph, with caches cold
after ggml's kernels, entering Python, each numpy call and each pass over the
residency table cost several times what they cost outside.

A prompt batch plans at every layer, H_min layers ahead by votes: the experts
its tokens are predicted to pick next, the most picked first.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import RESIDENCY_ABSENT, RESIDENCY_RESIDENT, HookCall, Plan, PolicyBase
from pyspice.policy.context import PolicyContext, RoutePredictor
from pyspice.policy.rule import KEEP_ALL, KEEP_DECAYED, MISS_COST, MISS_FETCH, MISS_HOST, Rule
from pyspice.policy.spice.config import SpiceConfig, spice_config
from pyspice.policy.spice.cost import CostModel
from pyspice.policy.spice.history_lookahead import HistoryLookahead
from pyspice.policy.spice.lookahead import (
    FirstLayerPrior,
    Rollout,
    RouterLookahead,
    look_ahead,
    look_ahead_batch,
    with_layer,
)
from pyspice.policy.spice.misses import MissDecision, MissHandler
from pyspice.policy.spice.planner import PrefetchPlanner

# resident experts on the device, the others on the host (the runtime only reads plans)
DEFAULT_PLAN = Plan()
NO_DECISION = MissDecision(None, [], [])


class SpicePolicy(PolicyBase):
    def __init__(self, config: SpiceConfig | str) -> None:
        self.config = spice_config(config) if isinstance(config, str) else config
        self.name = self.config.name
        self.ctx: PolicyContext | None = None
        # MoE layers between a call and the call its plan is applied at (0: the same call,
        # synchronous planning): set before attach, the look-ahead reaches that much further
        self.plan_lag = 0
        self.retains = False  # set at attach: see there

    @property
    def lossless(self) -> bool:
        """Whether this variant never substitutes (the engine loads surrogates only if not)."""
        return self.config.lossless

    @property
    def surrogate_limit(self) -> float | None:
        """The held-out surrogate error above which this variant never substitutes: the
        engine loads only the surrogates within it (None: lossless, it loads none)."""
        if self.config.lossless:
            return None
        return self.config.surrogate_max_error if self.config.substitutes else 0.0

    @property
    def slot_precision(self) -> str:
        """What the device tier's slots hold for this variant ("4bit": lossy copies)."""
        return self.config.slot_precision

    @property
    def preloads_tier(self) -> bool:
        """Whether the tier starts filled in layer order rather than empty (config.preload),
        as known once attached. Not where it retains (edge mode's disk tier): there every
        miss is read into the pool and kept, so the pool fills itself within the prompt,
        and a preload would only read up front what the run may never use."""
        return self.config.preload and not self.retains

    def attach(self, ctx: PolicyContext) -> None:
        cfg = self.config
        self.ctx = ctx
        self.cost = CostModel.from_context(ctx)
        # on a tier where a host action reads its expert first, misses are fetched and
        # kept by decayed use (asynchronous_rule), and a prefetch takes free room only: one
        # that took room by evict_from evicted what retention keeps, for 60-90% more bytes
        # read and 1-2% of TPOT in the simulator (docs/results/edge-mode.md)
        self.retains = cfg.miss_mode == "cost" and self.cost.host_reads
        k = max(1, ctx.n_expert_used)
        moe = ctx.moe_layers
        # a decode step plans at every `every`-th MoE layer, for at least the layers up to
        # the next plan plus H_min beyond them: `every` + 1 layers' experts on the device at
        # once, so only as far apart as the budget holds that twice over (else every layer).
        # Planning off the hook's thread (plan_lag > 0), a device tier plans more often
        every = cfg.plan_every_async if self.plan_lag > 0 and not self.retains else cfg.plan_every
        every = max(1, every) if cfg.deep else 1
        # the experts the tier holds at once: its slots, less what the surrogates reserve
        room = (ctx.budget_bytes or 0) - ctx.reserved_bytes
        self.n_slots = max(0, room) // max(1, ctx.slot_bytes)
        while every > 1 and self.n_slots < 2 * (every + 1) * k:
            every -= 1
        self.plan_every = every
        # a prompt batch plans at every layer: H_min of eq. 4 itself
        lag = max(0, self.plan_lag)
        self.batch_depth = {il: (self.cost.h_min(il, k, k) if cfg.deep else 1) + lag for il in moe}
        self.h_min = {il: self.cost.h_min(il, k, k) + every - 1 + lag for il in moe}
        self.h_max = {il: max(self.h_min[il], cfg.h_max + lag) for il in moe}
        if not cfg.deep:
            self.h_min = dict.fromkeys(moe, 1 + lag)
            self.h_max = dict.fromkeys(moe, 1 + lag)
        self.plans = [False] * ctx.n_layers  # whether a decode step plans at this layer
        for i, il in enumerate(moe):
            self.plans[il] = cfg.prefetch and i % every == 0
        predictor: RoutePredictor | None = ctx.predictor
        if predictor is None:
            predictor = RouterLookahead(ctx, max(self.h_max.values(), default=1))
        # the routing-history predictor rolls out from the call's ids, the others from its input
        self.history = predictor if isinstance(predictor, HistoryLookahead) else None
        if self.history is not None:
            self.history.reset()
        self.predictor: RoutePredictor = Rollout(predictor)
        self.planner = PrefetchPlanner(ctx, lag=lag)
        errors = ctx.surrogate_error if ctx.surrogates_loaded else None
        if cfg.substitutes and errors is None:
            print(
                f"pyspice: {self.name}: no surrogates loaded (none within error <= "
                f"{cfg.surrogate_max_error:g}, or no sidecar: give one with --sidecar, or build one with "
                "`pyspice calibrate`): misses are fetched or run exactly on the host",
                file=sys.stderr,
            )
        self.misses = MissHandler(cfg, self.cost, errors)
        self.resume = self._resume_layers(moe)
        self.n_prefetch = max(1, math.ceil(cfg.prefetch_share * k))
        self.k = ctx.n_expert_used
        # where a decode step that has nothing to plan may let the engine answer every call
        # up to (the next token's first planning layer; -1 where some layer decides misses)
        firsts = [il for il in moe if self.plans[il]]
        self.token_resume = firsts[0] if firsts and all(self.misses.default_step[il] for il in moe) else -1
        # the next token's first MoE layer, prefetched from a prior by the token's last plan
        # that still lands within the token: a plan applied `lag` layers late (asynchronous)
        # made at the token's last layer lands at the next token's first call, too late for
        # it (on the 4-layer DeepSeek-V2-Lite, free-running at every layer, that
        # layer then held no expert at all and 25% hit 0.346 against sync's 0.532)
        self.first_moe = moe[0] if moe else -1
        self.first_prior = FirstLayerPrior(ctx.n_expert[self.first_moe] if moe else 1)
        self.n_first = round(cfg.first_layer_share * k)
        in_time = [il for i, il in enumerate(moe) if self.plans[il] and i + lag < len(moe)]
        self.token_end = (in_time or firsts)[-1] if firsts and len(moe) > 1 and self.n_first > 0 else -1

    def asynchronous_rule(self) -> Rule:
        """What the engine runs each call by while this policy plans on libspice's
        planner thread (its plans -- prefetches, evictions -- land calls later): the
        miss handling of misses.py as a per-activation rule. Resident -> device; a
        prefetch in flight is waited for when that beats the host by the cost model;
        absent -> host (`host`), a demand fetch (`fetch`), or (`cost`) the misses
        whose fetch shortens the layer by `fetch_margin`, chosen as misses.py chooses
        them (CostModel.choose_fetches, weighing a copy against every token of a batch
        that waits for it); lossy levels substitute
        low-weight misses of experts whose surrogate is within the error budget.
        Where a host action reads its expert first (the disk tier), `cost` fetches
        every miss and keeps it, evicting by decayed use (SpiceConfig.retention_decay)."""
        assert self.ctx is not None, "attach the policy first"
        cfg, ctx = self.config, self.ctx
        miss = {"host": MISS_HOST, "fetch": MISS_FETCH, "cost": MISS_COST}[cfg.miss_mode]
        surrogate_set = None
        if cfg.substitutes and ctx.surrogates_loaded:
            table = np.zeros((ctx.n_layers, max(1, ctx.max_expert)), dtype=np.bool_)
            for il in ctx.moe_layers:
                errors = ctx.surrogate_error(il)
                if errors is not None:
                    good = np.asarray(errors)[: table.shape[1]] <= cfg.surrogate_max_error
                    table[il, : good.size] = good
            surrogate_set = table
        retain = self.retains
        # the next layer, which a lagged plan reaches too late, prefetched by the engine at
        # each planning layer (SpiceConfig.rule_next); not where the rule retains by use
        planning = self._rule_next_layers() if not retain and self.plan_lag > 0 else ()
        routers = ctx.rule_routers() if planning else None
        return Rule(
            miss=MISS_FETCH if retain else miss,
            keep=KEEP_DECAYED if retain else KEEP_ALL,
            decay=cfg.retention_decay if retain else 0.0,
            host_us=self.misses.host1,
            device_us=self.misses.dev1,
            host_points=self.cost.host_points,  # a batch's misses weighed at its token counts
            overlap=self.cost.overlap,
            margin=cfg.fetch_margin,
            surrogate_weight=cfg.surrogate_max_weight if surrogate_set is not None else 0.0,
            surrogate_set=surrogate_set,
            prefetch_next=routers is not None,
            routers=routers,
            next_layers=planning if routers is not None else None,
            next_room=routers is not None,
        )

    def _rule_next_layers(self) -> tuple[int, ...]:
        """The planning layers whose next layer the rule prefetches: those where the next
        layer's top-k lands within one layer's compute (H_min 1). Where copies take longer
        (a real bus and target-sized experts: H_min 5-24 in the simulator's Qwen2-57B and
        DeepSeek-V2-Lite tables), a guess one layer ahead lands after it is needed and only
        takes bus time and room from the plan's deeper prefetches: there the simulator
        measured 0.05 fewer hits and 3-6% more TPOT with it (docs/results/planning.md)."""
        assert self.ctx is not None
        cfg, moe, k = self.config, self.ctx.moe_layers, max(1, self.ctx.n_expert_used)
        if not (cfg.rule_next and cfg.prefetch):
            return ()
        return tuple(
            il for il, nxt in itertools.pairwise(moe) if self.plans[il] and self.cost.h_min(nxt, k, k) <= 1
        )

    def plan_horizon(self) -> int:
        """How many MoE layers ahead a plan of this policy reaches at least (its H_min,
        the closest over layers): a plan applied later than that is stale."""
        return max(1, min(self.h_min.values(), default=1))

    def decide(self, call: HookCall) -> Plan:
        if call.layer == self.first_moe:
            self.first_prior.note(call.ids)
        if self.history is not None:
            self.history.observe(call.layer, call.ids)
        if call.n_tokens != 1:
            return self._decide_batch(call, self._residency(call))
        layer = call.layer
        misses = self.misses
        plans = self.plans[layer]
        if misses.default_step[layer]:
            if not plans:
                return DEFAULT_PLAN  # nothing to plan, and every activation as the default plan has it
            # the default plan's actions; nothing it runs on the device is on its way (only
            # resident experts are), so no queued copy is awaited: busy can stay empty
            decision = NO_DECISION
            residency = self._residency(call)
            cells = residency.tobytes()  # the whole table as one bytes object (see planner.plan)
        else:
            residency = self._residency(call)
            cells = residency.tobytes()
            decision = self._decide_misses(call, residency, cells)
        if not plans:
            return Plan(actions=decision.actions, fetch=decision.fetch)
        if self.retains and len(cells) - cells.count(RESIDENCY_ABSENT) >= self.n_slots:
            # every slot holds or awaits an expert, and here a prefetch may take free room
            # only (attach): whatever a look-ahead predicts would be dropped. Retention keeps
            # the pool full after the first tokens, so on the disk tier the rest of the token
            # is left to the engine's rule: 5x fewer plans, the planner thread's time out of
            # the graph's cores (edge mode, 2 cores: 0.4-2.1 ms per token against lru in
            # three paired runs), the same reads and hits
            return Plan(decision.actions, decision.fetch, resume_layer=self.token_resume)
        predictions = look_ahead(
            self.predictor,
            layer,
            call.ids[0] if self.history is not None else call.hidden[0],
            self.k,
            self.h_min[layer],
            self.h_max[layer],
            self.config.tau,
            self.n_prefetch,
        )
        if layer == self.token_end:
            predictions = with_layer(predictions, self.first_moe, self.first_prior.top(self.n_first))
        prefetch = self.planner.plan(layer, predictions, residency, decision.busy, cells)
        return Plan(
            decision.actions,
            decision.fetch,
            prefetch.prefetch,
            prefetch.evict,
            () if self.retains else prefetch.evict_from,
            self.resume[layer],
        )

    def _decide_misses(self, call: HookCall, residency: npt.NDArray[np.int8], cells: bytes) -> MissDecision:
        """A decode step's misses when they need more than the default plan."""
        layer, misses = call.layer, self.misses
        ids: list[int] = call.ids.tolist()[0]
        if misses.decode_in_python:
            width = residency.shape[1]
            row = cells[layer * width : (layer + 1) * width]
            return misses.decide_step(layer, ids, call.weights, row, residency)
        return misses.decide(layer, call.ids, call.weights, residency)

    def _resume_layers(self, moe: Sequence[int]) -> list[int]:
        """Per planning layer: the next planning layer (the next token's first one after the
        last), when every decode call in between would only return the default plan -- the
        engine then need not call in between (Plan.resume_layer); else -1."""
        resume = [-1] * len(self.plans)
        planning = [i for i, il in enumerate(moe) if self.plans[il]]
        if len(planning) == len(moe):
            return resume  # nothing in between
        default = self.misses.default_step
        for n, i in enumerate(planning):
            j = planning[(n + 1) % len(planning)]
            between = [moe[m % len(moe)] for m in range(i + 1, j if j > i else j + len(moe))]
            if all(default[il] for il in between):
                resume[moe[i]] = moe[j]
        return resume

    def _residency(self, call: HookCall) -> npt.NDArray[np.int8]:
        residency = call.residency
        if residency is None:
            raise RuntimeError(f"policy {self.name!r} needs a device tier: pass --device-budget")
        return residency

    def _decide_batch(self, call: HookCall, residency: npt.NDArray[np.int8]) -> Plan:
        """A prompt batch: what the next layers' tokens will pick, by votes."""
        assert self.ctx is not None
        layer = call.layer
        used: list[int] = np.unique(call.ids).tolist()
        cells = residency.tobytes()
        if self.misses.default_batch[layer]:
            base = layer * residency.shape[1]
            busy = [e for e in used if cells[base + e] == RESIDENCY_RESIDENT]
            decision = MissDecision(None, [], busy)
        else:
            decision = self.misses.decide(layer, call.ids, call.weights, residency)
        if not self.config.prefetch:
            return Plan(actions=decision.actions, fetch=decision.fetch)
        predictions = look_ahead_batch(
            self.predictor,
            layer,
            call.ids if self.history is not None else call.hidden,
            self.ctx.n_expert_used,
            self.batch_depth[layer],
        )
        prefetch = self.planner.plan(layer, predictions, residency, decision.busy, cells)
        evict_from = () if self.retains else prefetch.evict_from
        return Plan(decision.actions, decision.fetch, prefetch.prefetch, prefetch.evict, evict_from)
