"""`pyspice.Llama`: a `llama_cpp.Llama` whose MoE layers run through pyspice.

Switching an app is one import: `from pyspice import Llama` (or
`pyspice.api.Llama`) accepts everything `llama_cpp.Llama` does, plus
`policy=` (DESIGN section 6) and `max_hook_tokens=`. The model is loaded with
the settings the hook needs: routed-expert tensors in plain host memory,
never repacked (pinned host memory on GPU builds), everything else where
llama.cpp puts it. One model, one context, one library in the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from pyspice.blas_threads import limit_blas_threads
from pyspice.policy import Policy, PolicyContext, make_policy, policy_spec
from pyspice.routers import RouterReader
from pyspice.runtime import (
    DEVICE_CUDA,
    ExpertBufferType,
    IncompatibleModelError,
    Runtime,
    SpiceError,
    StoreParams,
    device_count,
    device_memory,
)
from pyspice.stats import StatsSnapshot, Timing, stats_record
from pyspice.units import Budget, format_bytes, parse_budget

# The emulated device when no --emulate-bandwidth/latency is given: about a
# Lossy policies keep their surrogates on the device; they get at most this share
# of its budget (the rank is cut to fit), the rest stays for experts.
SURROGATE_BUDGET_SHARE = 0.25

# PCIe 4.0 x8 link as seen by real copies (RTX 4060-class machines).
DEFAULT_EMULATED_GBPS = 12.0
DEFAULT_EMULATED_LATENCY_US = 10.0

# A real device measures its own copies; these only seed the store's guess of
# when a queued prefetch lands (PCIe 4.0 x16 as seen by pinned copies).
REAL_BUS_GUESS_GBPS = 25.0
REAL_BUS_GUESS_LATENCY_US = 10.0

# Device memory a real budget leaves free for ggml's own buffers (the
# executor's activations, the other layers' weights when offloaded).
REAL_DEVICE_MARGIN = 0.9


@dataclass(frozen=True)
class DeviceTier:
    """What a device budget turned into (printed once by the CLI)."""

    budget: str
    budget_bytes: int
    holds: int  # experts of average size the budget holds
    experts: int
    expert_bytes: int
    bandwidth_gbps: float
    latency_us: float
    emulated: bool
    device_name: str = ""

    def describe(self) -> str:
        kind = "emulated device" if self.emulated else (self.device_name or "device")
        return (
            f"{kind}: budget {self.budget} = {format_bytes(self.budget_bytes)} of "
            f"{format_bytes(self.expert_bytes)} routed-expert bytes, "
            f"about {self.holds} of {self.experts} experts"
            + (
                f", bus {self.bandwidth_gbps:g} GB/s + {self.latency_us:g} us per copy"
                if self.emulated
                else ""
            )
        )


@dataclass(frozen=True)
class SurrogateSet:
    """The loaded LoRE surrogates: how many (layer, expert) pairs, device bytes."""

    count: int
    device_bytes: int


# llama.cpp matches this against tensor names with std::regex_search
EXPERT_TENSOR_PATTERN = rb"\.ffn_(gate|up|down)_exps\.weight$"


class _TensorBuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _expert_overrides(buft: ExpertBufferType) -> ctypes.Array[_TensorBuftOverride]:
    overrides = (_TensorBuftOverride * 2)()
    overrides[0].pattern = EXPERT_TENSOR_PATTERN
    overrides[0].buft = buft.address
    overrides[1].pattern = None
    overrides[1].buft = None
    return overrides


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with the pyspice MoE runtime attached.

    policy: a name from `pyspice.policy.policy_names()` (default "exact") or a
        Policy object. "stock" leaves the hook unregistered.
    max_hook_tokens: micro-batches with more tokens keep upstream's path
        (0 = every micro-batch goes through the hook).
    device_budget: a device tier ("2GiB", "25%" of routed-expert bytes, or
        bytes); emulated on CPU-only builds, with a bus of emulate_bandwidth
        GB/s and emulate_latency us per copy.
    sidecar: the model's calibration sidecar (`<model>.spice.gguf`), refused
        when it was made for another model.
    """

    def __init__(
        self,
        model_path: str,
        *,
        policy: str | Policy = "exact",
        max_hook_tokens: int = 0,
        device_budget: str | int | None = None,
        emulate_bandwidth: float | None = None,
        emulate_latency: float | None = None,
        sidecar: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        # llama_cpp.Llama.__del__ closes self._stack: make it exist even if loading fails early
        self._stack = contextlib.ExitStack()
        # checked before loading: a sidecar made for another model fails in milliseconds
        self.spice_sidecar: Any = load_sidecar(sidecar, model_path) if sidecar is not None else None
        # the buffer type must outlive the model: the instance holds it until it is collected
        self._spice_buft = ExpertBufferType()
        self._spice_overrides = _expert_overrides(self._spice_buft)
        self._spice_runtime: Runtime | None = None
        self._spice_timing = Timing()
        self._spice_policy_name = "stock"
        self._spice_custom_policy: Policy | None = None  # set_policy's object, if not a registry name
        self._spice_max_hook_tokens = max_hook_tokens
        self._spice_device_params: StoreParams | None = None
        self._spice_routers: RouterReader | None = None
        self._spice_profile: Any = None
        if kwargs.get("n_gpu_layers", 0) == 0 and "op_offload" not in kwargs and device_count() > 0:
            # with no layer on the GPU, llama.cpp's op offload copies host weights over
            # for prompt batches; beside a real device tier those copies failed
            # (CUDA "invalid argument", H200, 2026-11-30); the tier does that job here
            kwargs["op_offload"] = False
        super().__init__(model_path, **kwargs)
        ctx_address = ctypes.cast(self._ctx.ctx, ctypes.c_void_p).value
        assert ctx_address is not None
        self._spice_attach_error: IncompatibleModelError | None = None
        try:
            self._spice_runtime = Runtime(ctx_address)
        except IncompatibleModelError as exc:
            if policy != "stock":
                self.close()
                raise
            self._spice_attach_error = exc
        if self._spice_runtime is not None:
            # runs before the context is freed (the stack unwinds last-in first-out)
            self._stack.callback(self._spice_runtime.close)
        self.spice_device: DeviceTier | None = None
        if device_budget is not None:
            self.set_device(device_budget, emulate_bandwidth, emulate_latency)
        self.set_policy(policy)

    # ---- device tier ----------------------------------------------------------------

    def set_device(
        self,
        budget: str | int,
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        *,
        manual_clock: bool = False,
    ) -> DeviceTier:
        """Give the model a device tier of `budget` (bytes, "2GiB", or "25%" of all
        routed-expert bytes). On a CUDA build with a GPU the tier is real (CUDA
        device 0) unless a bandwidth or latency to emulate is given; otherwise it
        is emulated: slots in their own host buffer, copies on a virtual bus of
        the given bandwidth/latency."""
        runtime = self._require_runtime()
        layers = [info for info in runtime.layers() if info.is_moe]
        total = self.spice_expert_bytes()
        spec = parse_budget(budget) if isinstance(budget, str) else Budget(bytes=int(budget))
        real = bandwidth_gbps is None and latency_us is None and not manual_clock and device_count() > 0
        if real:
            check_real_budget(spec, spec.resolve(total))
            params = StoreParams(
                budget_bytes=spec.resolve(total),
                bandwidth_gbps=REAL_BUS_GUESS_GBPS,
                latency_us=REAL_BUS_GUESS_LATENCY_US,
                device_kind=DEVICE_CUDA,
            )
        else:
            check_emulated_budget(spec, spec.resolve(total), total)
            params = StoreParams(
                budget_bytes=spec.resolve(total),
                bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else DEFAULT_EMULATED_GBPS,
                latency_us=latency_us if latency_us is not None else DEFAULT_EMULATED_LATENCY_US,
                manual_clock=manual_clock,
            )
        runtime.set_device(params)
        self._spice_device_params = params
        n_experts = sum(info.n_expert for info in layers)
        self.spice_device = DeviceTier(
            budget=str(spec),
            budget_bytes=params.budget_bytes,
            holds=min(n_experts, int(params.budget_bytes * n_experts / max(1, total))),
            experts=n_experts,
            expert_bytes=total,
            bandwidth_gbps=params.bandwidth_gbps,
            latency_us=params.latency_us,
            emulated=not real,
            device_name="CUDA device 0" if real else "",
        )
        if self._spice_custom_policy is not None:  # a policy object: re-attached to the new tier
            self.set_policy(self._spice_custom_policy)
        elif self._spice_policy_name != "stock":
            self.set_policy(self._spice_policy_name)
        return self.spice_device

    @property
    def spice_policy_name(self) -> str:
        """The policy in use (its registry name, or a custom policy's `name`)."""
        return self._spice_policy_name

    def automatic_device_budget(self) -> int:
        """Bytes for a real device tier when none is given (DESIGN section 11): the
        GPU's free memory now (after this model's other weights and KV cache are
        allocated), less the margin ggml's buffers need, and never more than all
        routed experts."""
        free, _ = device_memory(0)
        return int(min(self.spice_expert_bytes(), REAL_DEVICE_MARGIN * free))

    def spice_expert_bytes(self) -> int:
        """Bytes of all routed experts (what a 100% device budget holds)."""
        return sum(info.bytes_per_expert * info.n_expert for info in self.spice_layers() if info.is_moe)

    def clear_device(self) -> None:
        self._require_runtime().set_device(None)
        self._spice_device_params = None
        self.spice_device = None

    def set_profile(self, profile: Any) -> None:
        """A cost profile (pyspice.probe.CostProfile) for policies that weigh costs."""
        self._spice_profile = profile

    # ---- surrogates ------------------------------------------------------------------

    def set_surrogates(self, sidecar: Any) -> SurrogateSet:
        """Load LoRE surrogates for the policies that ask for them (plan action
        "surrogate"). `sidecar` is anything with `surrogate(layer, expert) ->
        (alpha, A [rank, n_embd], B [n_embd, rank]) or None` (pyspice.sidecar.Sidecar).
        They replace any loaded before; their f16 bytes count against the
        device budget. Over budget: nothing stays loaded and ValueError says
        by how much. Exact policies never use them."""
        runtime = self._require_runtime()
        runtime.clear_surrogates()
        try:
            for info in runtime.layers():
                if not info.is_moe:
                    continue
                for e in range(info.n_expert):
                    entry = sidecar.surrogate(info.il, e)
                    if entry is None:
                        continue
                    alpha, a, b = entry
                    if np.shape(a)[-1:] != (info.n_embd,):
                        raise ValueError(
                            f"surrogate ({info.il}, {e}): A has shape {np.shape(a)}; this model needs "
                            f"[rank, {info.n_embd}] (a sidecar for another model?)"
                        )
                    runtime.set_surrogate(info.il, e, float(alpha), a, b)
        except SpiceError as exc:
            runtime.clear_surrogates()
            if exc.status == 6:
                raise ValueError(
                    f"the surrogates do not fit the device budget: {exc}; give a larger "
                    "--device-budget or a lower rank"
                ) from exc
            raise
        except Exception:
            runtime.clear_surrogates()
            raise
        return self.spice_surrogates()

    def clear_surrogates(self) -> None:
        """Unload every surrogate (their device bytes go back to the budget)."""
        self._require_runtime().clear_surrogates()

    def spice_surrogates(self) -> SurrogateSet:
        """How many surrogates are loaded and the device bytes they hold."""
        runtime = self._require_runtime()
        return SurrogateSet(count=runtime.n_surrogates(), device_bytes=runtime.surrogate_bytes())

    # llama_cpp.Llama.__init__ assigns self.model_params and fills it before
    # loading; intercepting the assignment places the expert overrides there.
    @property
    def model_params(self) -> Any:
        return self.__dict__["_spice_model_params"]

    @model_params.setter
    def model_params(self, value: Any) -> None:
        value.tensor_buft_overrides = ctypes.addressof(self._spice_overrides)
        self.__dict__["_spice_model_params"] = value

    # ---- policy ----------------------------------------------------------------

    @property
    def spice_policy(self) -> str:
        return self._spice_policy_name

    def set_policy(self, policy: str | Policy, max_hook_tokens: int | None = None) -> None:
        """Switch policy without reloading (bench runs every policy on one model)."""
        if max_hook_tokens is not None:
            self._spice_max_hook_tokens = max_hook_tokens
        max_tokens = self._spice_max_hook_tokens
        if isinstance(policy, str):
            spec = policy_spec(policy)
            if spec.kind == "stock":
                if self._spice_runtime is not None:
                    self._spice_runtime.disable()
                self._spice_policy_name = "stock"
                self._spice_custom_policy = None
                return
            runtime = self._require_runtime()
            if spec.needs_device and self.spice_device is None:
                raise ValueError(f"policy {policy!r} manages a device tier: give it one with --device-budget")
            self._reset_device()  # empty first: surrogates loaded next must find room
            self._sync_surrogates(spec.lossless)
            if spec.kind == "native":
                if self.spice_device is not None:
                    runtime.preload()  # `exact` means every expert resident (as far as the budget goes)
                runtime.enable_exact(max_tokens)
            else:
                policy_obj = make_policy(policy)
                assert policy_obj is not None
                self._attach(policy_obj)
                self._limit_blas()
                runtime.enable_policy(policy_obj, max_tokens)
            self._spice_policy_name = policy
            self._spice_custom_policy = None
        else:
            runtime = self._require_runtime()
            self._reset_device()
            self._sync_surrogates(bool(getattr(policy, "lossless", True)))
            self._attach(policy)
            self._limit_blas()
            runtime.enable_policy(policy, max_tokens)
            self._spice_policy_name = getattr(policy, "name", type(policy).__name__)
            self._spice_custom_policy = policy

    def _sync_surrogates(self, lossless: bool) -> None:
        """A lossy policy gets the sidecar's surrogates on the device; a lossless one
        leaves the whole budget to experts (the surrogates would only take room)."""
        if self.spice_sidecar is None:
            return
        loaded = self._require_runtime().n_surrogates() > 0
        if lossless and loaded:
            self.clear_surrogates()
        elif not lossless and not loaded:
            self.set_surrogates(self._surrogates_for_budget())

    def _surrogates_for_budget(self) -> Any:
        """The sidecar's surrogates, cut to the rank that keeps them within
        SURROGATE_BUDGET_SHARE of the device budget (the rest stays for experts)."""
        sidecar = self.spice_sidecar
        params = self._spice_device_params
        if params is None:
            return sidecar
        data = sidecar.data
        count = sum(int((s.rank > 0).sum()) for s in data.surrogates.values())
        per_rank = 2 * data.n_embd * 2  # A row + B column, f16
        cap = SURROGATE_BUDGET_SHARE * params.budget_bytes
        if count == 0 or sidecar.surrogate_bytes() <= cap:
            return sidecar
        from pyspice.sidecar import TruncatedSurrogates

        rank = max(1, int(cap // (count * per_rank)))
        if self.__dict__.setdefault("_spice_warned_rank", rank) == rank and not self.__dict__.get(
            "_spice_rank_said"
        ):
            self.__dict__["_spice_rank_said"] = True
            warn(
                f"surrogates cut from rank {data.lore_rank} to rank {rank} so that they hold at most "
                f"{SURROGATE_BUDGET_SHARE:.0%} of the device budget"
            )
        return TruncatedSurrogates(sidecar, rank)

    def _policy_profile(self) -> Any:
        """The cost profile policies weigh copies with: the one set, else the one
        `pyspice probe` saved for this model, with the bus of the device tier in use."""
        profile = self._spice_profile
        if profile is None:
            from pyspice.probe import load_profile, profile_path

            path = profile_path(Path(self.model_path))
            if path.is_file():
                try:
                    profile = load_profile(path)
                except (ValueError, OSError, TypeError, KeyError):
                    return None  # an old or damaged profile: policies fall back to their defaults
        params = self._spice_device_params
        emulated_profile = profile is not None and str(profile.bus_source).startswith("emulated")
        if emulated_profile and params is not None and params.device_kind == DEVICE_CUDA:
            return None  # measured against an emulated bus: says nothing about this GPU
        if emulated_profile and params is not None:
            profile = dataclasses.replace(
                profile, bus_gbps=params.bandwidth_gbps, bus_latency_us=params.latency_us
            )
        return profile

    def _sidecar_predictor(self) -> Any:
        if self.spice_sidecar is None:
            return None
        if getattr(self, "_spice_predictor", None) is None:
            self._spice_predictor = self.spice_sidecar.predictor(self._spice_routers)
        return self._spice_predictor

    def _limit_blas(self) -> None:
        """Python policies run inside ggml's threads: numpy's BLAS must not start its own."""
        if getattr(self, "_spice_blas_limit", None) is None:
            self._spice_blas_limit = limit_blas_threads()

    def _reset_device(self) -> None:
        """Each policy starts from an empty device tier (comparisons stay fair)."""
        if self._spice_device_params is not None:
            self._require_runtime().set_device(self._spice_device_params)

    def policy_context(self) -> PolicyContext:
        runtime = self._require_runtime()
        layers = runtime.layers()
        if self._spice_routers is None:
            self._spice_routers = RouterReader(Path(self.model_path))
        return PolicyContext(
            n_layers=len(layers),
            n_expert=tuple(info.n_expert if info.is_moe else 0 for info in layers),
            n_expert_used=int(
                self.metadata.get(f"{self.metadata.get('general.architecture', '')}.expert_used_count", 0)
                or 0
            ),
            expert_bytes=tuple(info.bytes_per_expert for info in layers),
            budget_bytes=self._spice_device_params.budget_bytes if self._spice_device_params else None,
            router=self._spice_routers,
            profile=self._policy_profile(),
            predictor=self._sidecar_predictor(),
            surrogate_error=self._surrogate_errors,
            surrogates_loaded=runtime.n_surrogates() > 0,
            reserved_bytes=runtime.surrogate_bytes(),
        )

    def _surrogate_errors(self, layer: int) -> npt.NDArray[np.float32] | None:
        """Held-out relative error of each of a layer's surrogates (inf: none fitted)."""
        if self.spice_sidecar is None:
            return None
        cache = self.__dict__.setdefault("_spice_surrogate_errors", {})
        if layer not in cache:
            errors = self.spice_sidecar.surrogate_error.get(layer)
            if errors is not None:
                errors = np.nan_to_num(np.asarray(errors, dtype=np.float32), nan=np.inf)
                for e in range(errors.shape[0]):  # no surrogate loaded: never a candidate
                    if self.spice_sidecar.surrogate(layer, e) is None:
                        errors[e] = np.inf
            cache[layer] = errors
        return cache[layer]  # type: ignore[no-any-return]

    def _attach(self, policy: Any) -> None:
        attach = getattr(policy, "attach", None)
        if attach is not None:
            attach(self.policy_context())

    def _require_runtime(self) -> Runtime:
        if self._spice_runtime is None:
            if self._spice_attach_error is not None:
                raise self._spice_attach_error
            raise IncompatibleModelError(2, "this model has no MoE layers the pyspice hook can serve")
        return self._spice_runtime

    # ---- evaluation ---------------------------------------------------------------

    def eval(self, tokens: Any) -> None:
        """llama_cpp.Llama.eval, timed for the stats record; Ctrl-C inside a
        Python policy aborts the decode and surfaces as KeyboardInterrupt."""
        start = time.perf_counter()
        try:
            super().eval(tokens)
        except RuntimeError:
            if self._spice_runtime is not None and self._spice_runtime.take_interrupt():
                raise KeyboardInterrupt from None
            raise
        elapsed = time.perf_counter() - start
        n = len(tokens)
        if n > 1:
            self._spice_timing.prefill_tokens += n
            self._spice_timing.prefill_s += elapsed
        elif n == 1:
            self._spice_timing.decoded_tokens += 1
            self._spice_timing.decode_s += elapsed
        if self._spice_runtime is not None:
            if self._spice_runtime.take_interrupt():
                raise KeyboardInterrupt
            self._spice_runtime.report_rejections()

    # ---- stats -----------------------------------------------------------------------

    def spice_snapshot(self) -> StatsSnapshot:
        snap = StatsSnapshot(timing=Timing(**vars(self._spice_timing)))
        rt = self._spice_runtime
        if rt is not None:
            snap.total = rt.counters(-1)
            snap.layers = {info.il: rt.counters(info.il) for info in rt.layers() if info.is_moe}
        return snap

    def spice_stats(self) -> dict[str, Any]:
        """The stats record of DESIGN section 11 since the last reset."""
        record = stats_record(self.spice_snapshot())
        record["policy"] = self._spice_policy_name
        return record

    def spice_reset_stats(self) -> None:
        self._spice_timing = Timing()
        if self._spice_runtime is not None:
            self._spice_runtime.reset_counters()

    def spice_upstream_twin(self) -> llama_cpp.Llama:
        """The same model loaded by plain llama_cpp.Llama with upstream's defaults
        (weight repacking on), made on first use: what `bench` compares against
        as "upstream". Shares nothing with this instance but the file."""
        twin = self.__dict__.get("_spice_twin")
        if twin is None:
            cp = self.context_params
            twin = llama_cpp.Llama(
                self.model_path,
                n_ctx=cp.n_ctx,
                n_batch=cp.n_batch,
                n_ubatch=cp.n_ubatch,
                n_threads=cp.n_threads,
                n_threads_batch=cp.n_threads_batch,
                n_gpu_layers=self.model_params.n_gpu_layers,
                verbose=False,
            )
            self.__dict__["_spice_twin"] = twin
            self._stack.callback(twin.close)
        return twin

    def spice_layers(self) -> list[Any]:
        return self._require_runtime().layers()


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (None: unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return None


def check_real_budget(spec: Budget, budget_bytes: int) -> None:
    """A real device's budget must fit its free memory, with room left for ggml."""
    free, total = device_memory(0)
    if budget_bytes > REAL_DEVICE_MARGIN * free:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} does not fit CUDA device 0: "
            f"{format_bytes(free)} of {format_bytes(total)} are free and "
            f"{1 - REAL_DEVICE_MARGIN:.0%} of that stays for ggml's buffers; give a smaller --device-budget"
        )


def check_emulated_budget(spec: Budget, budget_bytes: int, expert_bytes_total: int) -> None:
    """The emulated device keeps its slots in host memory: a budget the machine
    cannot hold would end in swapping or the OOM killer mid-run, so refuse it now."""
    try:
        physical = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        physical = 0
    if physical and budget_bytes > physical:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} is more than this machine's "
            f"{format_bytes(physical)} of memory, which holds the emulated device; give a smaller "
            "--device-budget (e.g. 25%)"
        )
    need = min(budget_bytes, expert_bytes_total)  # a budget above the model holds all of it
    free = host_memory_available()
    if free is not None and need > free:
        raise ValueError(
            f"device budget {spec} = {format_bytes(budget_bytes)} does not fit this machine: the emulated "
            f"device keeps {format_bytes(need)} of expert copies in host memory and only "
            f"{format_bytes(free)} is available; give a smaller --device-budget (e.g. 25%)"
        )


def load_sidecar(path: str | Path, model_path: str | Path) -> Any:
    """The calibration sidecar for `model_path`, checked against the model."""
    if importlib.util.find_spec("pyspice.sidecar") is None:
        raise ValueError(
            f"cannot use sidecar {path}: this pyspice has no calibration support (pyspice.sidecar) yet; "
            "run without --sidecar"
        )
    if not Path(path).is_file():
        raise FileNotFoundError(f"sidecar {path} does not exist (make one with `pyspice calibrate -m MODEL`)")
    from pyspice.model_info import ModelFileError, read_header

    try:
        read_header(path)  # the sidecar is a GGUF too: say what is wrong with it in one line
    except ModelFileError as exc:
        raise ValueError(f"bad sidecar: {exc}; remake it with `pyspice calibrate -m MODEL`") from None
    sidecar_module = importlib.import_module("pyspice.sidecar")
    return sidecar_module.Sidecar.load(Path(path), Path(model_path))


def warn(message: str) -> None:
    print(f"pyspice: {message}", file=sys.stderr)
