"""The discrete-event model: replay a workload through a policy on simulated hardware.

Per step (a prompt micro-batch or one decoded token) and layer, in order:

1. The device compute stream runs the layer's non-routed work (attention,
   norms, router, shared experts): `rest_us` for the step's tokens.
2. The hook call begins: the residency table is read (an activation whose
   expert is resident now is a hit), the policy decides (its measured or
   modelled microseconds per call, plus the fixed cost of reaching it).
3. The plan is validated and applied by the engine's own rules
   (pyspice.sim.plan: spice_plan_validate, spice_runtime_apply_store_plan):
   experts this call runs on the device are pinned, evictions, demand
   fetches (explicit, then implied by device actions), prefetches behind
   them; every needed device expert is waited for, in expert order; one that
   got no slot runs on the host. Activations are counted as count_actions
   counts them. On edge mode's disk tier (Costs.disk, pyspice.sim.disk) the
   host's weights are in the file too: the experts the call runs on the host
   without a slot are then read into scratch, and the call waits for them.
4. Routed experts run: device experts on the device stream once their copies
   are in, host experts on the host executor from the start of step 3's waits
   (the engine's host threads run the misses while thread 0 waits for the
   device's copies; on the disk tier, after their reads) -- its threads are
   folded into the per-expert time; the layer ends when both are done (a
   synchronisation per layer). A decode step costs each activation its
   per-activation time at one token; a batch costs each expert's activations
   at the rate of one expert running that many tokens (its weights read once
   for them: per_expert_points). On an emulated device the "device" is the
   host itself, so the two are serial, and a slot's bytes are copied into
   place by the host the first time it is used.

The copy engine (pyspice.sim.tier) runs on its own timeline meanwhile, so
prefetches issued at one layer land while later layers compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_HOST,
    ACTION_SURROGATE,
    HookCall,
    Plan,
    attach_policy,
    preloads_tier,
)
from pyspice.policy.context import PolicyContext, RouterLoader
from pyspice.policy.rule import Rule, declared_rule
from pyspice.policy.spice.cost import per_expert_points
from pyspice.sim.costs import BatchTable, Costs, interpolate
from pyspice.sim.disk import SimDiskTier
from pyspice.sim.plan import (
    InvalidPlan,
    Outcomes,
    SurrogateTable,
    apply_plan,
    begin_call,
    count_outcomes,
    default_actions,
    surrogate_table,
    validate_plan,
)
from pyspice.sim.planner import AsyncModel, PlannerModel
from pyspice.sim.rule import RuleState, rule_plan
from pyspice.sim.tier import OK, PRIORITY_DEMAND, SimTier
from pyspice.sim.workload import SimCall, Workload


@dataclass
class SimResult:
    policy: str
    tpot_ms: float
    decoded_tokens: int
    activations: int
    hits: int
    misses_fetched: int
    misses_host: int
    misses_surrogate: int
    dropped: int
    bytes_per_token: float
    stall_ms_per_token: float
    bus_utilization: float
    prefetch_issued: int
    prefetch_used: int
    prefetch_cancelled: int
    policy_us_per_call: float
    policy_fallbacks: int
    breakdown_ms_per_token: dict[str, float] = field(default_factory=dict)
    # asynchronous planning (run(asynchronous=...)): plans applied, their mean lag in
    # hook calls (MoE layers), plans dropped as too late, snapshots replaced unplanned
    plans_applied: int = 0
    plan_lag_layers: float = 0.0
    plans_stale: int = 0
    plans_skipped: int = 0
    # a disk tier (Costs.disk): what was read from the model file per decoded token,
    # widened as O_DIRECT reads it (copies into slots and reads into scratch alike), and
    # the experts host actions read into scratch, with the time calls waited for them
    disk_read_bytes_per_token: float | None = None
    disk_reads_per_token: float | None = None  # preads, as libspice counts them (3 per expert)
    disk_expert_reads_per_token: float | None = None
    scratch_reads: int | None = None
    scratch_ms_per_token: float | None = None
    # the prompt's steps (untimed in tpot_ms; they warm the tier): their time, and
    # their activations run on the host and fetched on demand
    prefill_ms: float = 0.0
    prompt_host: int = 0
    prompt_fetched: int = 0

    @property
    def misses(self) -> int:
        """Every activation that was not a hit (stats.Counters.misses): dropped ones too."""
        return self.misses_fetched + self.misses_host + self.misses_surrogate + self.dropped

    @property
    def hit_rate(self) -> float:
        return self.hits / self.activations if self.activations else 0.0

    @property
    def fallback_rate(self) -> float:
        return 1.0 - self.hit_rate if self.activations else 0.0

    def record(self) -> dict[str, Any]:
        disk = (
            {
                "disk_read_bytes_per_token": self.disk_read_bytes_per_token,
                "disk_reads_per_token": self.disk_reads_per_token,
                "disk_expert_reads_per_token": self.disk_expert_reads_per_token,
                "disk_scratch_reads": self.scratch_reads,
                "disk_scratch_ms_per_token": self.scratch_ms_per_token,
            }
            if self.disk_read_bytes_per_token is not None
            else {}
        )
        return {
            **disk,
            "policy": self.policy,
            "tpot_ms": self.tpot_ms,
            "decoded_tokens": self.decoded_tokens,
            "activations": self.activations,
            "hit_rate": self.hit_rate,
            "fallback_rate": self.fallback_rate,
            "misses": {
                "fetched": self.misses_fetched,
                "host": self.misses_host,
                "surrogate": self.misses_surrogate,
            },
            "dropped": self.dropped,
            "bytes_per_token": self.bytes_per_token,
            "stall_ms_per_token": self.stall_ms_per_token,
            "bus_utilization": self.bus_utilization,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_cancelled": self.prefetch_cancelled,
            "policy_us_per_call": self.policy_us_per_call,
            "policy_fallbacks": self.policy_fallbacks,
            "prefill_ms": self.prefill_ms,
            "prompt_misses": {"host": self.prompt_host, "fetched": self.prompt_fetched},
            "breakdown_ms_per_token": dict(self.breakdown_ms_per_token),
            "planning": {
                "applied": self.plans_applied,
                "lag_layers": self.plan_lag_layers,
                "stale": self.plans_stale,
                "skipped": self.plans_skipped,
            },
        }


@dataclass
class _Tally:
    outcomes: Outcomes = field(default_factory=Outcomes)
    policy_us: float = 0.0
    policy_calls: int = 0
    fallbacks: int = 0
    time_ns: int = 0
    resume_layer: int = -1  # the last plan's: decode calls before that layer are decided
    parts: dict[str, float] = field(default_factory=dict)

    def part(self, name: str, ns: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + ns


def _copies_started(tier: SimTier | None) -> int:
    """Copies the tier has started so far (each one CUDA calls on the hook's thread)."""
    return sum(c.device_copies for c in tier.counters) if tier is not None else 0


def _us(v: float) -> int:
    return round(v * 1e3)


def scratch_experts(ids: npt.NDArray[np.int32], actions: npt.NDArray[np.int32], n_expert: int) -> list[int]:
    """spice_runtime_read_host_experts: the experts a call reads into scratch on a tier
    whose host weights are not in memory, in the order it reads them -- each expert
    (once) of a host action that got no slot in this call, i.e. that none of the call's
    device actions (as applied: those that got a slot) runs, whether or not the tier
    holds it."""
    flat_ids, flat_actions = ids.ravel().tolist(), actions.ravel().tolist()
    slotted = {e for e, a in zip(flat_ids, flat_actions, strict=True) if a == ACTION_DEVICE}
    out: list[int] = []
    for e, a in zip(flat_ids, flat_actions, strict=True):
        if a in (ACTION_HOST, ACTION_DEVICE) and 0 <= e < n_expert and e not in slotted and e not in out:
            out.append(e)
    return out


_NO_TOTALS: tuple[int, ...] = (0,) * 11


class Simulator:
    """Replays `workload` through `policy` (a Policy object, or None for the
    engine's native default plan: resident experts on the device, the rest on
    the host) on a device tier of `budget_bytes` with `costs`."""

    def __init__(
        self,
        workload: Workload,
        costs: Costs,
        budget_bytes: int | None,
        *,
        router: RouterLoader | None = None,
        profile: Any = None,
        n_expert_used: int | None = None,
        context_extra: dict[str, Any] | None = None,
    ) -> None:
        """`context_extra`: further PolicyContext fields (a sidecar's predictor, surrogate
        errors, `reserved_bytes` of surrogates, which the tier charges to its budget)."""
        self.workload = workload
        self.costs = costs
        self.budget_bytes = budget_bytes
        self.router = router
        self.profile = profile
        self.n_expert_used = n_expert_used or workload.n_expert_used
        self.context_extra = dict(context_extra or {})
        # the loaded surrogates, which a plan's surrogate actions must name (spice_plan_validate)
        self.surrogates: SurrogateTable | None = surrogate_table(self.context())
        self._plan_rule: RuleState | None = None  # the rule plans installed (run() resets it)
        self.tier: SimTier | None = None  # the tier of the last run
        # the costs per activation keyed by the tokens one expert runs for, for a batch's
        # experts (a profile's tables are keyed by a step's tokens: per_expert_points)
        share = self.n_expert_used / max(1, max(workload.n_expert, default=1))
        self._host_per_expert = per_expert_points(costs.host_expert_us, share)
        self._dev_per_expert = per_expert_points(costs.device_expert_us, share)

    def context(self) -> PolicyContext:
        kwargs: dict[str, Any] = {}
        if self.router is not None:
            kwargs["router"] = self.router
        return PolicyContext(
            n_layers=self.workload.n_layers,
            n_expert=self.workload.n_expert,
            n_expert_used=self.n_expert_used,
            expert_bytes=self.costs.expert_bytes,
            budget_bytes=self.budget_bytes,
            profile=self.profile,
            **kwargs,
            **self.context_extra,
        )

    def make_tier(self) -> SimTier | None:
        if self.budget_bytes is None:
            return None
        common: dict[str, Any] = dict(
            n_expert=self.workload.n_expert,
            expert_bytes=self.costs.expert_bytes,
            budget_bytes=self.budget_bytes,
            bandwidth_gbps=self.costs.bus_gbps,
            latency_us=self.costs.bus_latency_us,
            prefetch_queue_max=self.costs.prefetch_queue_max,
            used_bytes=int(self.context_extra.get("reserved_bytes", 0)),
        )
        if self.costs.disk is not None:
            return SimDiskTier(**common, rules=self.costs.disk)
        return SimTier(**common)

    def run(
        self,
        name: str,
        policy: Any,
        *,
        policy_us: float | None = None,
        preload: bool = False,
        on_step: Callable[[int, int], None] | None = None,
        asynchronous: AsyncModel | None = None,
    ) -> SimResult:
        """`policy_us`: fixed microseconds per call (a measured figure); None times
        the policy's own decide() here and adds the cost of reaching Python.
        `preload`: the tier starts filled in layer order (the native `exact`); a policy
        that starts so itself (preloads_tier) gets it without asking, as in the engine.
        `asynchronous`: a policy with an asynchronous_rule plans on the modelled
        planner thread (sim/planner.py) while its rule runs each call; `policy_us`
        is then the hook thread's deciding time (posting, applying, the rule)."""
        wl, costs = self.workload, self.costs
        tier = self.make_tier()
        self.tier = tier  # the last run's, for tests and reports that look inside
        plans_async = asynchronous is not None and callable(getattr(policy, "asynchronous_rule", None))
        if asynchronous is not None and hasattr(policy, "plan_lag"):
            # as the engine does: a policy whose plans land late looks that much further
            policy.plan_lag = asynchronous.expected_lag() if plans_async else 0
        if policy is not None:
            attach_policy(policy, self.context())
        rule = declared_rule(policy) if policy is not None else None
        rule_state = RuleState(rule, wl.n_layers) if rule is not None else None  # kept from prompt to decode
        self._plan_rule = None  # a plan's Plan.rule, for quiet calls
        planner: PlannerModel | None = None
        if asynchronous is not None and rule is None and callable(getattr(policy, "asynchronous_rule", None)):
            # the rule every call runs by meanwhile (plans may replace it: Plan.rule)
            self._plan_rule = RuleState(policy.asynchronous_rule(), wl.n_layers)
            if asynchronous.max_lag == 0:  # the policy's own horizon
                horizon = policy.plan_horizon() if callable(getattr(policy, "plan_horizon", None)) else 1
                asynchronous = replace(asynchronous, max_lag=max(1, int(horizon)))
            planner = PlannerModel(asynchronous, lambda hook: self._plan_of(policy, hook))
        t = 0
        if tier is not None and (preload or preloads_tier(policy)):  # as the engine starts it
            t = self._preload(tier)
        tally = _Tally()
        prompt: _Tally | None = None  # the prompt's steps' tally, once decoding starts
        prompt_ns, t_start = 0, t
        base = _NO_TOTALS  # the tier's totals the decode's are counted from
        decode_started = False
        for si, step in enumerate(wl.steps):
            if step.decode and not decode_started:
                decode_started = True
                prompt_ns = t - t_start
                base = self._totals(tier, t)
                prompt, tally = tally, _Tally()
            start = t
            # a step after the decode began that is not timed (a later pass's prompt or
            # cold decode: workload.repeated) is left out of the decode's counts and bytes
            untimed = decode_started and not step.decode
            into = _Tally() if untimed else tally
            before = self._totals(tier, t) if untimed else _NO_TOTALS
            t = self._step(step.calls, step.n_tokens, t, tier, policy, policy_us, into, rule_state, planner)
            t += _us(costs.step_us)
            into.part("outside layers", _us(costs.step_us))
            if untimed:
                base = tuple(b + y - x for b, x, y in zip(base, before, self._totals(tier, t), strict=True))
            if step.decode:
                tally.time_ns += t - start
            if on_step is not None:
                on_step(si + 1, len(wl.steps))
        n_tok = max(1, wl.decoded_tokens)
        scale = costs.layer_scale
        if prompt is None:  # a prompt and nothing decoded
            prompt, prompt_ns = tally, t - t_start
        # bus bytes, copy and stall ns; prefetches issued, used, cancelled; disk bytes,
        # reads, expert reads, scratch reads; scratch wait ns
        d = [y - x for x, y in zip(base, self._totals(tier, t), strict=True)]
        decode_ns = max(1, tally.time_ns)
        disk: dict[str, Any] = {}
        if isinstance(tier, SimDiskTier):
            disk = {
                "disk_read_bytes_per_token": d[6] / n_tok * scale,
                "disk_reads_per_token": d[7] / n_tok * scale,
                "disk_expert_reads_per_token": d[8] / n_tok * scale,
                "scratch_reads": d[9],
                "scratch_ms_per_token": d[10] / 1e6 / n_tok * scale,
            }
        return SimResult(
            policy=name,
            tpot_ms=tally.time_ns / 1e6 / n_tok * scale,
            decoded_tokens=wl.decoded_tokens,
            activations=tally.outcomes.activations,
            hits=tally.outcomes.hits,
            misses_fetched=tally.outcomes.fetched,
            misses_host=tally.outcomes.host,
            misses_surrogate=tally.outcomes.surrogate,
            dropped=tally.outcomes.dropped,
            bytes_per_token=d[0] / n_tok * scale,
            stall_ms_per_token=d[2] / 1e6 / n_tok * scale,
            bus_utilization=min(1.0, d[1] / decode_ns),
            prefetch_issued=d[3],
            prefetch_used=d[4],
            prefetch_cancelled=d[5],
            prefill_ms=prompt_ns / 1e6 * scale,
            prompt_host=prompt.outcomes.host,
            prompt_fetched=prompt.outcomes.fetched,
            policy_us_per_call=tally.policy_us / max(1, tally.policy_calls),
            policy_fallbacks=tally.fallbacks + (planner.fallbacks if planner is not None else 0),
            breakdown_ms_per_token={k: v / 1e6 / n_tok * scale for k, v in tally.parts.items()},
            plans_applied=planner.applied if planner is not None else 0,
            plan_lag_layers=planner.mean_lag() if planner is not None else 0.0,
            plans_stale=planner.stale if planner is not None else 0,
            plans_skipped=planner.skipped if planner is not None else 0,
            **disk,
        )

    # -- pieces -------------------------------------------------------------------

    def _totals(self, tier: SimTier | None, t: int) -> tuple[int, ...]:
        """The tier's running totals at `t`, flat: bus (3), prefetch (3), disk reads (4),
        scratch wait (1); zeros without a tier."""
        if tier is None:
            return _NO_TOTALS
        tier.now_ns = t
        tier.refresh()
        disk = (*tier.read_totals(t), tier.scratch_ns) if isinstance(tier, SimDiskTier) else (0,) * 5
        return (*self._bus_totals(tier), *self._prefetch_totals(tier), *disk)

    @staticmethod
    def _bus_totals(tier: SimTier) -> tuple[int, int, int]:
        return (
            sum(k.bytes_h2d for k in tier.counters),
            sum(k.copy_ns for k in tier.counters),
            sum(k.stall_ns for k in tier.counters),
        )

    @staticmethod
    def _prefetch_totals(tier: SimTier) -> tuple[int, int, int]:
        return (
            sum(k.prefetch_issued for k in tier.counters),
            sum(k.prefetch_used for k in tier.counters),
            sum(k.prefetch_cancelled for k in tier.counters),
        )

    def _preload(self, tier: SimTier) -> int:
        """spice_runtime_preload: every expert in order while the budget lasts, each
        waited for; set-up, not service."""
        for il, n in enumerate(self.workload.n_expert):
            for e in range(n):
                if tier.request(il, e, PRIORITY_DEMAND) != OK:
                    break
            else:
                continue
            break
        for il, n in enumerate(self.workload.n_expert):
            for e in range(n):
                if tier.holds(il, e):
                    tier.wait(il, e)
        tier.filled = set(tier.resident)  # preload waits on every copy, which fills its slot
        tier.reset_counters()
        return tier.now_ns

    def _hook_call(self, call: SimCall, residency: Any) -> HookCall:
        n_expert = self.workload.n_expert[call.layer]
        return HookCall(
            call.layer,
            call.hidden if call.hidden is not None else np.zeros((call.n_tokens, 0), np.float32),
            call.probs if call.probs is not None else np.zeros((call.n_tokens, n_expert), np.float32),
            call.ids,
            call.weights,
            call.shared,
            residency,
        )

    def _plan_of(self, policy: Any, hook: HookCall) -> tuple[Plan | None, float]:
        """The planner thread's decision on a snapshot: the validated plan (None when the
        policy raised or the plan is invalid) and the microseconds it took."""
        start = time.perf_counter()
        try:
            plan = policy.decide(hook)
            if not isinstance(plan, Plan):
                raise InvalidPlan(f"the policy returned {type(plan).__name__}, not a Plan")
            validate_plan(plan, hook.layer, hook.ids, self.workload.n_expert, self.surrogates)
        except KeyboardInterrupt:
            raise
        except Exception:
            return None, (time.perf_counter() - start) * 1e6 + self.costs.python_call_us
        return plan, (time.perf_counter() - start) * 1e6 + self.costs.python_call_us

    def _decide(
        self, policy: Any, call: SimCall, residency: Any, policy_us: float | None, tally: _Tally
    ) -> tuple[npt.NDArray[np.int32] | None, Plan, float]:
        """The plan (or the default one) and the microseconds the decision took."""
        if policy is None:
            return None, Plan(), 0.0
        hook = self._hook_call(call, residency)
        start = time.perf_counter()
        try:
            plan = policy.decide(hook)
            if not isinstance(plan, Plan):
                raise InvalidPlan(f"the policy returned {type(plan).__name__}, not a Plan")
            actions = validate_plan(plan, call.layer, call.ids, self.workload.n_expert, self.surrogates)
        except KeyboardInterrupt:
            raise
        except Exception:  # a raising policy and a rejected plan both run the call exactly
            tally.fallbacks += 1
            plan, actions = Plan(), None
        spent = (time.perf_counter() - start) * 1e6
        us = policy_us if policy_us is not None else spent + self.costs.python_call_us
        return actions, plan, us

    @staticmethod
    def _per_expert_us(ids: npt.NDArray[np.int32], where: npt.NDArray[np.bool_], table: BatchTable) -> float:
        """A batch's work on one executor: for each expert, its activations there at the
        per-activation cost of one expert running that many tokens."""
        if not where.any():
            return 0.0
        _, counts = np.unique(ids[where], return_counts=True)
        return sum(int(c) * interpolate(table, int(c)) for c in counts.tolist())

    def _step(
        self,
        calls: list[SimCall],
        n_tokens: int,
        t: int,
        tier: SimTier | None,
        policy: Any,
        policy_us: float | None,
        tally: _Tally,
        rule_state: RuleState | None = None,
        planner: PlannerModel | None = None,
    ) -> int:
        costs = self.costs
        by_layer = {c.layer: c for c in calls}
        rest = _us(interpolate(costs.rest_us, n_tokens) * n_tokens)
        dev_us = interpolate(costs.device_expert_us, n_tokens)
        host_us = interpolate(costs.host_expert_us, n_tokens)
        for il in range(self.workload.n_layers):
            t += rest
            tally.part("non-expert compute", rest)
            call = by_layer.get(il)
            if call is None:
                continue
            ids = call.ids
            started = _copies_started(tier) if costs.copy_issue_us > 0 else 0
            if tier is not None:
                tier.now_ns = t
                residency, hit = begin_call(tier, il, ids)
            else:
                residency = None
                hit = np.ones(ids.shape, dtype=bool)
            if planner is not None:
                # asynchronous: the snapshot goes to the planner, the rule plans this call, and
                # the lists of the plans due join it (the hook waits only in deterministic mode)
                assert self._plan_rule is not None
                got = planner.call(il, n_tokens, t)
                if got.rule is not None and got.rule is not self._plan_rule.rule:  # take_plan_rule
                    self._plan_rule = RuleState(got.rule, self.workload.n_layers)
                t += got.wait_ns
                tally.part("planner wait", got.wait_ns)
                if costs.async_layer_us > 0:  # the planner's work slows the decode's (fitted)
                    contention = _us(costs.async_layer_us)
                    t += contention
                    tally.part("planner contention", contention)
                actions, plan, spent_us = None, Plan(), policy_us or 0.0
                if tier is not None:
                    actions, ruled = rule_plan(tier, self._plan_rule, il, ids, call.weights, call.hidden)
                    plan = Plan(
                        fetch=ruled.fetch,
                        prefetch=[*ruled.prefetch, *got.prefetch],
                        evict=[*ruled.evict, *got.evict],
                        evict_from=ruled.evict_from or got.evict_from,
                    )
            elif rule_state is not None:
                # a policy that is its rule: planned by the rule's twin, no call (a measured
                # policy_us stands for the rule's own time)
                actions, plan, spent_us = None, Plan(), policy_us or 0.0
                if tier is not None:
                    actions, plan = rule_plan(tier, rule_state, il, ids, call.weights, call.hidden)
            elif policy is not None and n_tokens == 1 and 0 <= tally.resume_layer != il:
                # decided in advance (spice_policy_call.resume_il; a batch always asks): the
                # rule's plan (the default one unless a plan installed a rule), no call (a
                # measured policy_us is per call served)
                actions, plan, spent_us = None, Plan(), policy_us or 0.0
                if self._plan_rule is not None and tier is not None:
                    actions, plan = rule_plan(tier, self._plan_rule, il, ids, call.weights, call.hidden)
            else:
                actions, plan, spent_us = self._decide(policy, call, residency, policy_us, tally)
                tally.resume_layer = plan.resume_layer
                installed = self._plan_rule.rule if self._plan_rule is not None else None
                if isinstance(plan.rule, Rule) and plan.rule is not installed:
                    self._plan_rule = RuleState(plan.rule, self.workload.n_layers)
            if actions is None:
                actions = default_actions(hit)
            tally.policy_us += spent_us
            tally.policy_calls += 1
            overhead = _us(spent_us + costs.hook_us)
            t += overhead
            tally.part("policy and hook", overhead)
            applied = t  # the host executor may start its misses here (below)
            if tier is not None:
                tier.now_ns = t
                t, actions = self._apply(tier, il, ids, actions, plan, t, tally)
            if costs.copy_issue_us > 0:  # the copies this call started, issued on the hook's thread
                issuing = _us((_copies_started(tier) - started) * costs.copy_issue_us)
                t += issuing
                tally.part("copy issue", issuing)
            if planner is not None and planner.posting:  # the snapshot, residency as the plan left it
                planner.post(self._hook_call(call, tier.states() if tier is not None else None), t)
            if isinstance(tier, SimDiskTier):
                tier.now_ns = t
                wait = tier.read_for_host(il, scratch_experts(ids, actions, self.workload.n_expert[il]))
                t += wait
                tally.part("disk reads for host actions", wait)
            tally.outcomes = tally.outcomes + count_outcomes(actions, hit)
            is_dev, is_host = actions == ACTION_DEVICE, actions == ACTION_HOST
            n_host = int(is_host.sum())
            if n_tokens == 1:
                dev_work, host_work = int(is_dev.sum()) * dev_us, n_host * host_us
            else:  # a batch: each expert's weights are read once for its own tokens
                dev_work = self._per_expert_us(ids, is_dev, self._dev_per_expert)
                host_work = self._per_expert_us(ids, is_host, self._host_per_expert)
            n_dev = int(is_dev.sum())
            dev_work += n_dev * costs.device_act_overhead_us + (costs.device_call_us if n_dev else 0.0)
            dev = _us(dev_work + int((actions == ACTION_SURROGATE).sum()) * costs.surrogate_us)
            host = _us(host_work + (costs.host_call_us if n_host else 0.0))
            # the host runs its misses while the device's copies are awaited (the engine's
            # launch_device_work), except where it reads them from disk first
            host_from = t if isinstance(tier, SimDiskTier) else applied
            if costs.bus_host_slowdown > 0 and tier is not None and host > 0:
                # copies share the host's memory bandwidth with the misses it runs
                busy = tier.bus_busy_ns(host_from, host_from + host) / host
                host = _us(host / 1e3 * (1.0 + costs.bus_host_slowdown * busy))
            if tier is None:  # no device tier: everything runs on the host executor
                host, dev = host + dev, 0
            if costs.device_shares_host:
                t += dev + host
                tally.part("expert compute", dev + host)
            else:
                end = max(t + dev, host_from + host)
                tally.part("expert compute", end - t)
                t = end
        return t

    def _apply(
        self,
        tier: SimTier,
        il: int,
        ids: npt.NDArray[np.int32],
        actions: npt.NDArray[np.int32],
        plan: Plan,
        t: int,
        tally: _Tally,
    ) -> tuple[int, npt.NDArray[np.int32]]:
        """apply_plan on the simulated tier, timing each wait; returns the time after
        the waits and the actions as applied (device experts without a slot on the host)."""
        costs = self.costs
        clock = t

        def wait(e: int) -> None:
            nonlocal clock
            fill = 0
            if costs.fill_gbps > 0 and (il, e) not in tier.filled:
                # the emulator copies the slot's bytes in, then sleeps out what is left of the transfer
                fill = int(costs.expert_bytes[il] / costs.fill_gbps)
                tier.filled.add((il, e))
            tier.now_ns = clock
            stall = tier.wait(il, e)
            elapsed = max(stall, fill) + (_us(costs.wake_us) if stall > fill else 0)
            tally.part("stall", stall)
            tally.part("slot fill and wake-up", elapsed - stall)
            clock += elapsed
            tier.now_ns = clock

        result = apply_plan(tier, il, ids, actions, plan, wait)
        return clock, result.actions
