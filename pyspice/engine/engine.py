"""The engine under `pyspice.Llama`: one model's device tier, surrogates and policy.

`Llama` owns the llama.cpp side (loading, the context, `eval`); the Engine owns
what pyspice adds on the Python side of the one crossing (libspice calls the
policy once per MoE layer through pyspice.runtime):

- the device tier: sizing a budget, refusing one the machine cannot hold;
- surrogates: loading those of a sidecar a lossy level may use, cut to a share of
  the budget;
- the cost profile policies weigh copies with;
- the policy lifecycle: each policy starts from an empty tier, gets its
  PolicyContext at attach, and the surrogates its kind needs; a lossy SPICE
  level by name gets the thresholds tuned for the model (its sidecar's);
- the stats record.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.engine.blas_threads import limit_blas_threads
from pyspice.engine.checks import check_budget_value, check_bus, check_executor, check_ram_budget_settings
from pyspice.engine.device import DeviceTier, automatic_budget, store_params
from pyspice.engine.disk import disk_store_params
from pyspice.engine.host_memory import release_free_heap
from pyspice.engine.planning import Planning, planner_may_poll, virtual_layer_ns
from pyspice.engine.profile import profile_for_tier, saved_disk, saved_profile
from pyspice.engine.replay import RoutingReplay, load_routing_replay
from pyspice.engine.slot_cache import SlotCache
from pyspice.engine.slot_tier import set_tier
from pyspice.engine.surrogates import (
    SURROGATE_BUDGET_SHARE,
    SurrogateSet,
    SurrogateSource,
    load_surrogates,
    loaded_surrogates,
    surrogate_errors,
    within_budget,
)
from pyspice.formats.routers import RouterReader
from pyspice.formats.sidecar import Sidecar
from pyspice.policy import Policy, PolicyContext, declared_rule, make_policy, policy_spec
from pyspice.policy.base import (
    attach_policy,
    is_lossless,
    policy_reads,
    preloads_tier,
    slot_precision,
    surrogate_limit,
)
from pyspice.policy.predictor import DraftPredictor
from pyspice.policy.profile import CostProfile
from pyspice.policy.spice.history_lookahead import HistoryLookahead
from pyspice.policy.spice.routing_history import RoutingHistory
from pyspice.runtime import (
    EXECUTORS,
    IncompatibleModelError,
    LayerInfo,
    Runtime,
    StoreParams,
    device_count,
    native,
)
from pyspice.stats import StatsSnapshot, Timing, stats_record
from pyspice.units import Budget, parse_budget, whole_tier_bytes


class Engine:
    """Device tier, surrogates, cost profile, policy and stats of one model.

    runtime: libspice attached to the model's context; None where attaching
        failed (`attach_error` says why: only `stock` runs then).
    sidecar: the model's calibration sidecar, checked against it, if any.
    n_expert_used: the model's top-k (from its metadata).
    """

    def __init__(
        self,
        runtime: Runtime | None,
        model_path: Path,
        n_expert_used: int,
        *,
        sidecar: Sidecar | None = None,
        max_hook_tokens: int = 0,
        attach_error: IncompatibleModelError | None = None,
        device_executor: str = "auto",
        decode_threads: int | None = None,
    ) -> None:
        check_executor(device_executor)
        self.runtime = runtime
        # ggml's threads in a decode step (None: unknown, taken as every core): whether an
        # asynchronous planner has a core of its own to poll on (planning.planner_may_poll)
        self.decode_threads = decode_threads
        self.device_executor = device_executor  # set_device's default (spice_executor by name)
        self.attach_error = attach_error
        self.model_path = model_path
        self.n_expert_used = n_expert_used
        self.sidecar = sidecar
        self.max_hook_tokens = max_hook_tokens
        self.device: DeviceTier | None = None
        self.device_params: StoreParams | None = None
        self.policy_name = "stock"
        self.custom_policy: Policy | None = None  # set_policy's object, if not a registry name
        self.profile: CostProfile | None = None  # the profile set; None: the saved one, if any
        self.timing = Timing()
        self._routers: RouterReader | None = None
        self._predictor: DraftPredictor | None = None
        self._history: HistoryLookahead | None = None  # set_history_predictor's, before the sidecar's
        self._errors: dict[int, npt.NDArray[np.float32] | None] = {}
        self._blas_limit: Any = None  # threadpoolctl's handle, held while it lasts
        self._said: set[str] = set()  # notes said once per engine
        # (error limit, budget bytes) the loaded surrogates were chosen and cut for (limit
        # None: all of them); None: not loaded by _sync_surrogates (none, or set_surrogates')
        self._synced: tuple[float | None, int | None] | None = None
        self.planning = Planning()  # where the shipped SPICE policies plan (engine/planning.py)
        # how the policy in use plans, every default taken (None: no Python policy plans)
        self.planning_used: Planning | None = None
        self.replay: RoutingReplay | None = None  # recorded expert ids the hook uses (timing only)
        # where lossy levels' low-precision slot copies are kept between runs (None: made each run)
        self.slot_cache: SlotCache | None = SlotCache.from_environment()

    def require_runtime(self) -> Runtime:
        if self.runtime is None:
            if self.attach_error is not None:
                raise self.attach_error
            raise IncompatibleModelError(
                native().SPICE_ERR_UNSUPPORTED, "this model has no MoE layers the pyspice hook can serve"
            )
        return self.runtime

    def layers(self) -> list[LayerInfo]:
        return self.require_runtime().layers()

    def expert_bytes(self) -> int:
        """Bytes of a tier holding every routed expert (what a 100% budget means): the
        routed-expert bytes, or more where layers' experts differ in size (units.whole_tier_bytes)."""
        moe = [info for info in self.layers() if info.is_moe]
        return whole_tier_bytes([i.bytes_per_expert for i in moe], [i.n_expert for i in moe])

    # ---- device tier ----------------------------------------------------------------

    def set_device(
        self,
        budget: str | int,
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        *,
        manual_clock: bool = False,
        executor: str | None = None,
        exec_fault_after: int = 0,
    ) -> DeviceTier:
        """A device tier of `budget`; real on a CUDA build with a GPU unless a bus to
        emulate (or a manual clock) is given. The policy in use restarts on it.
        exec_fault_after is a test-only fault hook (spice_store_params): device
        launches after that many fail (> 0), or collects after -that many (< 0)."""
        check_budget_value(budget)  # the API's entry point: RunConfig checked the CLI's already
        check_bus(bandwidth_gbps, latency_us)
        executor = executor if executor is not None else self.device_executor
        check_executor(executor)
        self.require_runtime()  # a model the hook cannot serve fails before any sizing
        total = self.expert_bytes()
        spec = parse_budget(budget) if isinstance(budget, str) else Budget(bytes=int(budget))
        real = bandwidth_gbps is None and latency_us is None and not manual_clock and device_count() > 0
        params = store_params(
            spec,
            total,
            real=real,
            bandwidth_gbps=bandwidth_gbps,
            latency_us=latency_us,
            manual_clock=manual_clock,
            executor=EXECUTORS[executor],
            exec_fault_after=exec_fault_after,
        )
        return self._install_tier(
            spec, total, params, emulated=not real, device_name="CUDA device 0" if real else ""
        )

    def set_ram(
        self,
        budget: str | int,
        *,
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        io_threads: int = 0,
        io_fault_after: int = 0,
        manual_clock: bool = False,
    ) -> DeviceTier:
        """Edge mode's tier (engine/disk.py): a RAM slot pool of `budget` ("2GiB", "50%"
        of routed-expert bytes, or bytes) filled by reads of the model file. The model
        must have been loaded with its experts left in the file (Llama(ram_budget=...)).
        `bandwidth_gbps`/`latency_us` are the disk as policies should estimate it
        (default: what `pyspice probe` saved, else DEFAULT_DISK_*); io_fault_after is a
        test-only fault hook: every read after that many fails."""
        check_budget_value(budget, "RAM budget")
        check_bus(bandwidth_gbps, latency_us)
        self.require_runtime()  # a model the hook cannot serve fails before any sizing
        total = self.expert_bytes()
        spec = parse_budget(budget) if isinstance(budget, str) else Budget(bytes=int(budget))
        measured = saved_disk(self.model_path)
        params = disk_store_params(
            spec,
            total,
            self.model_path,
            bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else measured[0],
            latency_us=latency_us if latency_us is not None else measured[1],
            io_threads=io_threads,
            io_fault_after=io_fault_after,
            manual_clock=manual_clock,
        )
        return self._install_tier(
            spec,
            total,
            params,
            emulated=False,
            device_name=f"RAM slot pool, experts read from {self.model_path.name}",
            disk=True,
        )

    def _install_tier(
        self,
        spec: Budget,
        total: int,
        params: StoreParams,
        *,
        emulated: bool,
        device_name: str,
        disk: bool = False,
    ) -> DeviceTier:
        """Give the runtime the tier `params` describes and say what it holds; the
        policy in use restarts on it (set_device and set_ram)."""
        self.require_runtime().set_device(params)
        self.device_params = params
        n_experts = sum(info.n_expert for info in self.layers() if info.is_moe)
        self.device = DeviceTier(
            budget=str(spec),
            budget_bytes=params.budget_bytes,
            holds=min(n_experts, params.budget_bytes * n_experts // max(1, total)),
            experts=n_experts,
            expert_bytes=total,
            bandwidth_gbps=params.bandwidth_gbps,
            latency_us=params.latency_us,
            emulated=emulated,
            device_name=device_name,
            disk=disk,
        )
        if self.custom_policy is not None:  # a policy object: re-attached to the new tier
            self.set_policy(self.custom_policy)
        elif self.policy_name != "stock":
            self.set_policy(self.policy_name)
        return self.device

    @property
    def experts_on_disk(self) -> bool:
        """The tier in use reads experts from the file (no host copy of them exists)."""
        return self.device is not None and self.device.disk

    def clear_device(self) -> None:
        if self.experts_on_disk:
            raise ValueError(
                "the model's routed experts are in its file only (loaded with a RAM budget): it cannot "
                "run without its RAM tier; give another budget with set_ram, or load it without one"
            )
        self.require_runtime().set_device(None)
        self.device_params = None
        self.device = None

    def automatic_budget(self) -> int:
        """Bytes for a real device tier when none is given (see device.automatic_budget)."""
        return automatic_budget(self.expert_bytes())

    def _reset_device(self, precision: str = "exact") -> None:
        """Each policy starts from an empty device tier (comparisons stay fair), its
        slots holding the experts at the policy's `precision` (policy.base.slot_precision)
        where that can be had (slot_tier.set_tier says where not)."""
        if self.device_params is not None:
            runtime = self.require_runtime()
            on_disk = self.experts_on_disk
            kept = self.slot_cache.for_model(self.model_path) if self.slot_cache is not None else None
            set_tier(runtime, self.device_params, precision, self.layers(), on_disk, self._note_once, kept)

    # ---- surrogates ------------------------------------------------------------------

    def set_surrogates(self, source: SurrogateSource) -> SurrogateSet:
        self._synced = None  # the caller's own: lossy policies keep them
        return load_surrogates(self.require_runtime(), source)

    def clear_surrogates(self) -> None:
        self._synced = None
        self.require_runtime().clear_surrogates()

    def surrogates(self) -> SurrogateSet:
        return loaded_surrogates(self.require_runtime())

    def _sync_surrogates(self, lossless: bool, limit: float | None = None) -> None:
        """A lossy policy gets the sidecar's surrogates within its error `limit` (the
        only ones it may substitute; None: all), a lossless one leaves the whole budget
        to experts (the surrogates would only take room). Surrogates loaded by
        set_surrogates stay for any lossy policy."""
        if self.sidecar is None:
            return
        runtime = self.require_runtime()
        loaded = runtime.n_surrogates() > 0
        if lossless:
            if loaded:
                self.clear_surrogates()
            self._synced = None
            return
        budget = self.device_params.budget_bytes if self.device_params is not None else None
        if self._synced == (limit, budget) or (loaded and self._synced is None):
            return
        source, rank = within_budget(self.sidecar, budget, limit)
        if rank is not None:
            which = "surrogates" if limit is None else f"surrogates within error <= {limit:g}"
            self._note_once(
                f"{which} cut from rank {self.sidecar.data.lore_rank} to rank {rank} so that they "
                f"hold at most {SURROGATE_BUDGET_SHARE:.0%} of the device budget (the error limit "
                "still reads the stored rank's errors)"
            )
        self._synced = None  # until they are in (a load over budget leaves none)
        load_surrogates(runtime, source)
        self.sidecar.release_pages()  # the runtime holds its own copies now
        self._synced = (limit, budget)

    def _note_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            print(f"pyspice: {message}", file=sys.stderr)

    def _surrogate_errors(self, layer: int) -> npt.NDArray[np.float32] | None:
        if self.sidecar is None:
            return None
        if layer not in self._errors:
            self._errors[layer] = surrogate_errors(self.sidecar, layer)
        return self._errors[layer]

    # ---- policy ----------------------------------------------------------------------

    def set_policy(self, policy: str | Policy, max_hook_tokens: int | None = None) -> None:
        """Switch policy without reloading (bench runs every policy on one model)."""
        try:
            self._set_policy(policy, max_hook_tokens)
        finally:
            release_free_heap()  # what setting it up freed (the predictor's float64 maps)

    @property
    def planning_label(self) -> str:
        """How the policy in use plans, as records name it (Planning.label); a policy no
        Python plans for (native, a rule, stock) is "sync": nothing runs off the hook."""
        return self.planning_used.label if self.planning_used is not None else "sync"

    def _set_policy(self, policy: str | Policy, max_hook_tokens: int | None) -> None:
        self.planning_used = None  # set again where a Python policy is enabled (_enable)
        if max_hook_tokens is not None:
            self.max_hook_tokens = max_hook_tokens
        if isinstance(policy, str):
            spec = policy_spec(policy)
            if self.experts_on_disk and self.device is not None:
                check_ram_budget_settings(self.device.budget, policy=spec.kind)
            if spec.kind == "auto":
                raise ValueError(
                    "policy 'auto' is a choice among the others, which pyspice.Llama.set_policy makes "
                    "(pyspice.engine.auto_policy.choose); give the engine the chosen policy"
                )
            if spec.kind == "stock":
                if self.runtime is not None:
                    self.runtime.disable()
                self.policy_name, self.custom_policy = "stock", None
                return
            runtime = self.require_runtime()
            if spec.needs_device and self.device is None:
                raise ValueError(f"policy {policy!r} manages a device tier: give it one with --device-budget")
            if spec.kind == "native":
                self._reset_device()  # exact slots: exact is lossless
                self._sync_surrogates(spec.lossless)
                if self.device is not None:
                    runtime.preload()  # `exact` means every expert resident (as far as the budget goes)
                runtime.enable_exact(self.max_hook_tokens)
            else:
                levels = self.sidecar.levels if self.sidecar is not None else None
                shipped = make_policy(policy, levels, self._note_once)
                assert shipped is not None
                rule = declared_rule(shipped)
                if rule is not None or spec.kind == "rule":
                    self._enable_rule(shipped)
                else:
                    self._enable(shipped, spec.lossless, shipped=True)  # type: ignore[arg-type]
            self.policy_name, self.custom_policy = policy, None
        else:
            if declared_rule(policy) is not None:
                self._enable_rule(policy)
            else:
                self._enable(policy, is_lossless(policy))
            # a user's object may lack even a name: its class stands for it
            self.policy_name = str(getattr(policy, "name", type(policy).__name__))
            self.custom_policy = policy

    def _enable_rule(self, policy: object) -> None:
        """A policy that is only a rule: attached once, then libspice plans every call
        from its rule with no Python per call."""
        runtime = self.require_runtime()
        self._reset_device(slot_precision(policy))
        self._sync_surrogates(is_lossless(policy), surrogate_limit(policy))
        # a rule never consults the draft predictor: not building it saves its memory
        # (8 MiB for smolmoe-b's), which counts on edge mode's RAM-limited boxes
        attach_policy(policy, self.policy_context(with_predictor=False))
        self._preload_for(policy)
        rule = declared_rule(policy)
        if self.device is not None and rule is not None:
            runtime.set_rule(rule)
        runtime.enable_exact(self.max_hook_tokens)

    def _preload_for(self, policy: object) -> None:
        """Fill the tier (what the surrogates left of it) in layer order for a policy that
        starts that way (policy.base.preloads_tier, asked once it is attached: a SPICE
        level with SpiceConfig.preload, on a device tier), as `exact` does."""
        if self.device is not None and preloads_tier(policy):
            self.require_runtime().preload()

    def set_planning(self, planning: Planning) -> None:
        """Where the shipped SPICE policies plan from now on (the policy in use restarts)."""
        self.planning = planning
        if self.custom_policy is None and self.policy_name != "stock" and self.runtime is not None:
            self.set_policy(self.policy_name)

    def _enable(self, policy: Policy, lossless: bool, shipped: bool = False) -> None:
        """A Python policy, on the hook's thread or on libspice's planner thread. It may
        plan on the planner thread if it declares the rule the calls run by meanwhile
        (asynchronous_rule) and a tier plans them; the shipped planners then plan where
        `planning` chooses, a user's object (a SpicePolicy of their own thresholds: the
        tuning script's) only when the user asked for it, else inline."""
        runtime = self.require_runtime()
        self._reset_device(slot_precision(policy))  # empty first: surrogates loaded next must find room
        self._sync_surrogates(lossless, surrogate_limit(policy))
        may_plan_async = (
            self.device is not None
            and callable(getattr(policy, "asynchronous_rule", None))
            and (shipped or self.planning.asked_asynchronous)
        )
        # how it plans, the defaults taken (told once); a policy that cannot plan
        # asynchronously is not told of a choice it does not have
        planning = (
            self.planning.chosen(
                self.experts_on_disk,
                say=self._note_once,
                decode_threads=self.decode_threads,
                lossy=not lossless,
            )
            if may_plan_async
            else replace(self.planning, asynchronous=False)
        )
        asynchronous = planning.asynchronous is True
        self.planning_used = planning
        if hasattr(policy, "plan_lag"):
            # its plans land this many layers late: it looks that much further ahead
            policy.plan_lag = planning.expected_lag() if asynchronous else 0  # type: ignore[attr-defined]
        ctx = self.policy_context()
        attach_policy(policy, ctx)
        self._preload_for(policy)
        if self._blas_limit is None:
            # Python policies run inside ggml's threads (or beside them, on the planner
            # thread): numpy's BLAS must not start its own
            self._blas_limit = limit_blas_threads()
        if asynchronous:
            # the policy's rule runs each call at once; its plans land calls later
            runtime.set_rule(policy.asynchronous_rule())  # type: ignore[attr-defined]
            horizon = int(policy.plan_horizon()) if callable(getattr(policy, "plan_horizon", None)) else 1  # type: ignore[attr-defined]
            probs, shared = policy_reads(policy)
            params = planning.params(
                horizon,
                with_probs=probs,
                with_shared=shared,
                idle_poll=planner_may_poll(self.decode_threads),
            )
            runtime.enable_policy(policy, self.max_hook_tokens, asynchronous=params)
            if planning.deterministic_lag > 0 and not runtime.device_is_real() and not self.experts_on_disk:
                # the plans repeat; which copies have landed when a call comes follows the
                # tier's clock: on an emulated tier a virtual one, a modelled layer per call
                runtime.set_clock_step(virtual_layer_ns(ctx))
        else:
            runtime.enable_policy(policy, self.max_hook_tokens)

    def policy_context(self, *, with_predictor: bool = True) -> PolicyContext:
        runtime = self.require_runtime()
        layers = runtime.layers()
        if self._routers is None:
            self._routers = RouterReader(self.model_path)
        return PolicyContext(
            n_layers=len(layers),
            n_expert=tuple(info.n_expert if info.is_moe else 0 for info in layers),
            n_expert_used=self.n_expert_used,
            # as the tier holds and copies them (low-precision slots: their copies' bytes)
            expert_bytes=tuple(runtime.slot_expert_bytes() or (info.bytes_per_expert for info in layers)),
            budget_bytes=self.device_params.budget_bytes if self.device_params else None,
            router=self._routers,
            profile=self._profile(),
            predictor=(self._history or self._sidecar_predictor()) if with_predictor else None,
            surrogate_error=self._surrogate_errors,
            surrogates_loaded=runtime.n_surrogates() > 0,
            reserved_bytes=runtime.surrogate_bytes(),
            host_weights_in_memory=not self.experts_on_disk,
            tier_bus=(
                (self.device_params.bandwidth_gbps, self.device_params.latency_us)
                if self.experts_on_disk and self.device_params is not None
                else None
            ),
        )

    def _profile(self) -> CostProfile | None:
        """The profile set, else the one `pyspice probe` saved for this model, with the
        bus of the device tier in use."""
        profile = self.profile if self.profile is not None else saved_profile(self.model_path)
        return profile_for_tier(profile, self.device_params)

    def set_history_predictor(self, path: str | Path) -> str:
        """SPICE predicts from expert ids with the routing-history predictor at `path`
        (fitted by `pyspice trace fit` on this model's MoE layers) from the next
        set_policy on; returns the line that says so."""
        moe = [info.il for info in self.require_runtime().layers() if info.is_moe]
        self._history = HistoryLookahead(RoutingHistory.load(Path(path)), moe)
        return f"SPICE predicts from expert ids with the routing-history predictor {path}"

    def _sidecar_predictor(self) -> DraftPredictor | None:
        if self.sidecar is None:
            return None
        if self._predictor is None:
            self._predictor = self.sidecar.predictor(self._routers)
            if self._routers is not None:
                # its maps hold what a rollout needs: the routers go (read again if asked for)
                self._predictor.drop_routers(self._routers)
                self._routers.release()
        return self._predictor

    # ---- routing replay ---------------------------------------------------------------

    def set_routing_replay(self, trace: str | Path | None) -> RoutingReplay | None:
        """Hook calls use the expert ids of the trace at `trace` instead of the router's
        (engine/replay.py: timing only; its note says how the trace maps onto the
        model), from its first token on; None: the router's again."""
        runtime = self.require_runtime()
        if trace is None:
            runtime.set_routing_replay(None)
            self.replay = None
            return None
        replay = load_routing_replay(Path(trace), runtime.layers(), self.n_expert_used)
        runtime.set_routing_replay(replay.ids)
        self.replay = replay
        return replay

    def seek_routing_replay(self, token: int) -> None:
        """The next micro-batch replays from trace token `token` (a no-op without a replay)."""
        if self.replay is not None:
            self.require_runtime().seek_routing_replay(token)

    def replay_prompt(self) -> None:
        """A prompt follows: it replays from the trace's start, so every row and repeat of
        a benchmark replays the same routing (a no-op without a replay)."""
        self.seek_routing_replay(0)

    def replay_decode(self, prompt_tokens: int) -> None:
        """The decode follows a prompt of `prompt_tokens`: it replays from where the
        trace's decode after that prompt starts (engine/replay.py; a no-op without a
        replay)."""
        if self.replay is not None:
            self.seek_routing_replay(self.replay.decode_start_after(prompt_tokens))

    # ---- stats -----------------------------------------------------------------------

    def record_eval(self, n_tokens: int, seconds: float) -> None:
        """Time one llama_decode of `n_tokens` into the stats record."""
        if n_tokens > 1:
            self.timing.prefill_tokens += n_tokens
            self.timing.prefill_s += seconds
        elif n_tokens == 1:
            self.timing.decoded_tokens += 1
            self.timing.decode_s += seconds

    def snapshot(self) -> StatsSnapshot:
        snap = StatsSnapshot(timing=Timing(**vars(self.timing)))
        rt = self.runtime
        if rt is not None:
            snap.total = rt.counters(-1)
            snap.layers = {info.il: rt.counters(info.il) for info in rt.layers() if info.is_moe}
        return snap

    def stats(self) -> dict[str, Any]:
        """The stats record of docs/design.md section 11 since the last reset."""
        record = stats_record(self.snapshot())
        record["policy"] = self.policy_name
        return record

    def reset_stats(self) -> None:
        self.timing = Timing()
        if self.runtime is not None:
            self.runtime.reset_counters()
