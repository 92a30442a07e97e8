"""`pyspice.Llama`: a `llama_cpp.Llama` whose MoE layers run through pyspice.

Switching an app is one import: `from pyspice import Llama` (or
`pyspice.api.Llama`) accepts everything `llama_cpp.Llama` does, plus
`policy=` (docs/design.md section 6) and `max_hook_tokens=`. The model is loaded with
the settings the hook needs: routed-expert tensors in plain host memory,
never repacked (pinned host memory on GPU builds), everything else where
llama.cpp puts it. One model, one context, one library in the process.

`Llama` keeps llama-cpp-python's surface; what pyspice adds lives in the
`Engine` it composes (pyspice.engine). `Llama.from_config` opens a model
with the defaults the CLI uses (pyspice.engine.RunConfig).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp

from pyspice.engine import DeviceTier, Engine, ResolvedRun, RunConfig, SurrogateSet
from pyspice.engine.auto_policy import AutoChoice
from pyspice.engine.auto_policy import choose as choose_policy
from pyspice.engine.config import check_sidecar_weights
from pyspice.engine.disk import LLAMA_LAZY_MODE_EXPERTS
from pyspice.engine.llama_log import llama_load_reasons
from pyspice.engine.plain_llama import PlainLlama, TensorBuftOverride, override_array
from pyspice.engine.surrogates import SurrogateSource
from pyspice.formats.model_info import ModelFileError, read_header
from pyspice.formats.sidecar import Sidecar
from pyspice.formats.tensor_names import EXPERT_MATRIX_TAIL
from pyspice.interrupts import SigintGuard
from pyspice.policy import Policy, PolicyContext
from pyspice.policy.registry import AUTO
from pyspice.runtime import (
    DecodeFailedError,
    ExpertBufferType,
    IncompatibleModelError,
    LayerInfo,
    Runtime,
    device_count,
    native,
)
from pyspice.stats import StatsSnapshot
from pyspice.units import format_bytes

# llama.cpp matches this against tensor names with std::regex_search
EXPERT_TENSOR_PATTERN = EXPERT_MATRIX_TAIL.encode()


def _expert_overrides(buft: ExpertBufferType) -> ctypes.Array[TensorBuftOverride]:
    return override_array([(EXPERT_TENSOR_PATTERN, buft.address)])


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with the pyspice MoE runtime attached.

    policy: a name from `pyspice.policy.policy_names()` or a Policy object.
        "stock" leaves the hook unregistered; "auto" (the default where a
        device_budget or ram_budget gives a tier, else "exact") runs the fastest
        lossless policy the simulator ranks for this machine and tier
        (pyspice.engine.auto_policy: a probe and a routing sample on first use).
    max_hook_tokens: micro-batches with more tokens keep upstream's path
        (0 = every micro-batch goes through the hook; None: as the CLI decides,
        PREFILL_HOOK_TOKENS on a real GPU tier, else 0).
    device_budget: a device tier ("2GiB", "25%" of routed-expert bytes, or
        bytes); emulated on CPU-only builds, with a bus of emulate_bandwidth
        GB/s and emulate_latency us per copy.
    sidecar: the model's calibration sidecar (`<model>.spice.gguf`, or a loaded
        Sidecar), refused when it was made for another model or is corrupt.
    ram_budget: edge mode ("2GiB", "50%" of routed-expert bytes, or bytes): the
        routed experts stay in the GGUF file and are never read at load; resident
        ones live in a RAM slot pool of this size, filled by reads of the file
        (pyspice.engine.disk). Every micro-batch goes through the hook. Not
        combined with device_budget (one tier at a time).
    spice_note: where pyspice says what it chose (the default policy, the sidecar
        it picked up, auto's pick); default: stderr when `verbose`, else nothing.

    pyspice's settings resolve exactly as the CLI's (RunConfig.resolve): the default
    policy, the sidecar beside the model (`<model>.spice.gguf`) where there is one,
    -ngl and an automatic tier on a GPU, a dense model run as stock. llama.cpp's own
    settings (n_ctx, n_threads, batches) keep llama-cpp-python's defaults.
    """

    def __init__(
        self,
        model_path: str,
        *,
        policy: str | Policy | None = None,
        max_hook_tokens: int | None = None,
        device_budget: str | int | None = None,
        emulate_bandwidth: float | None = None,
        emulate_latency: float | None = None,
        sidecar: str | Path | Sidecar | None = None,
        ram_budget: str | int | None = None,
        device_executor: str = "auto",
        spice_note: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        # llama_cpp.Llama.__del__ closes self._stack: make it exist even if resolving fails
        self._stack = contextlib.ExitStack()
        # pyspice's settings resolve as the CLI's do (RunConfig.resolve: the default policy,
        # the sidecar beside the model, -ngl and the tier on a GPU, dense models run stock);
        # llama.cpp's own (n_ctx, threads, batches) keep llama-cpp-python's defaults, as a
        # drop-in must. A Policy object resolves as "exact" would (it runs through the hook).
        config = RunConfig(
            model=Path(model_path),
            policy=policy if isinstance(policy, str) or policy is None else "exact",
            device_budget=device_budget,
            ram_budget=ram_budget,
            emulate_bandwidth=emulate_bandwidth,
            emulate_latency=emulate_latency,
            sidecar=_sidecar_path(sidecar),
            threads=kwargs.get("n_threads"),
            n_gpu_layers=kwargs.get("n_gpu_layers"),
            max_hook_tokens=max_hook_tokens,
            device_executor=device_executor,
            use_mmap=bool(kwargs.get("use_mmap", True)),
            use_mlock=bool(kwargs.get("use_mlock", False)),
        )
        # llama-cpp-python's verbose (default on) prints the whole load log; our few lines
        # about what was chosen go with it, and stay quiet where it is off
        say = spice_note or (_note if kwargs.get("verbose", True) else _quiet)
        run = config.resolve(say)
        if isinstance(sidecar, Sidecar):
            run = dataclasses.replace(run, loaded_sidecar=sidecar)
        kwargs["n_gpu_layers"] = run.n_gpu_layers
        self._open(run, kwargs, say, policy if policy is not None and not isinstance(policy, str) else None)

    @classmethod
    def from_config(
        cls,
        config: RunConfig | ResolvedRun,
        *,
        logits_all: bool = False,
        seed: int | None = None,
        note: Callable[[str], None] | None = None,
    ) -> Llama:
        """The model of `config` with every default resolved as the CLI resolves it
        (RunConfig.resolve), llama.cpp's sizes and threads included; each choice made is
        said through `note` (default: stderr)."""
        say = note or _note
        run = config.resolve(say) if isinstance(config, RunConfig) else config
        llm = cls.__new__(cls)
        llm._stack = contextlib.ExitStack()
        llm._open(
            run,
            {
                **run.context_params(),
                "logits_all": logits_all,
                "seed": seed if seed is not None else 0xFFFFFFFF,
                "use_mmap": run.use_mmap,
                "use_mlock": run.use_mlock,
                "verbose": False,
            },
            say,
        )
        return llm

    def _open(
        self,
        run: ResolvedRun,
        llama_kwargs: dict[str, Any],
        say: Callable[[str], None],
        custom_policy: Policy | None = None,
    ) -> None:
        """Load the model of a resolved run and set it up in the order its parts need:
        the tier (sized from what the GPU has left once the model is loaded, where
        automatic), routing replay and history predictor, then the policy, which
        `auto` chooses on that tier."""
        self.spice_say: Callable[[str], None] = say  # where auto says what it chose
        self.spice_auto_choice: AutoChoice | None = None  # the last choice auto made
        # resolve() read the header first, with pyspice's checks: llama.cpp aborts the
        # process on some inconsistent headers (expert counts) and hides why it refuses others
        model_path = str(run.model)
        self._spice_experts_on_disk = run.ram_budget is not None
        # checked before loading: a sidecar made for another model fails in milliseconds
        self.spice_sidecar = run.loaded_sidecar or (
            load_sidecar(run.sidecar, model_path) if run.sidecar is not None else None
        )
        if self.spice_sidecar is not None and run.loaded_sidecar is None:
            check_sidecar_weights(self.spice_sidecar, run.policy)
        # the buffer type must outlive the model: the instance holds it until it is collected
        self._spice_buft = ExpertBufferType()
        self._spice_overrides = _expert_overrides(self._spice_buft)
        self._spice_model_params: Any = None  # see the model_params property
        self._spice_runtime: Runtime | None = None
        self._spice_twins: dict[tuple[int, tuple[tuple[str, str], ...]], llama_cpp.Llama] = {}
        kwargs = dict(llama_kwargs)
        if kwargs.get("n_gpu_layers", 0) == 0 and "op_offload" not in kwargs and device_count() > 0:
            # with no layer on the GPU, llama.cpp's op offload copies host weights over
            # for prompt batches; beside a real device tier those copies failed
            # (CUDA "invalid argument", H200, 2026-11-30); the tier does that job here
            kwargs["op_offload"] = False
        with llama_load_reasons(model_path):
            super().__init__(model_path, **kwargs)
        ctx_address = ctypes.cast(self._ctx.ctx, ctypes.c_void_p).value
        assert ctx_address is not None
        attach_error: IncompatibleModelError | None = None
        try:
            self._spice_runtime = Runtime(ctx_address)
        except IncompatibleModelError as exc:
            if run.policy != "stock":
                self.close()
                raise
            attach_error = exc
        if self._spice_runtime is not None:
            # runs before the context is freed (the stack unwinds last-in first-out)
            self._stack.callback(self._spice_runtime.close)
            if self.verbose:  # llama.cpp's whole log was asked for, debug lines included
                self._spice_runtime.keep_debug_log()
        arch = self.metadata.get("general.architecture", "")
        self.spice_engine = Engine(
            self._spice_runtime,
            Path(model_path),
            int(self.metadata.get(f"{arch}.expert_used_count", 0) or 0),
            sidecar=self.spice_sidecar,
            max_hook_tokens=run.max_hook_tokens,
            attach_error=attach_error,
            device_executor=run.device_executor,
            decode_threads=self.n_threads,
        )
        self.spice_engine.planning = run.planning
        try:
            self._set_up_tier(run, say)
            self.set_policy(custom_policy if custom_policy is not None else run.policy)
        except BaseException:
            self.close()
            raise

    def _set_up_tier(self, run: ResolvedRun, say: Callable[[str], None]) -> None:
        if run.device_budget is not None:
            self.set_device(run.device_budget, run.emulate_bandwidth, run.emulate_latency)
        if run.ram_budget is not None:
            self.spice_engine.set_ram(run.ram_budget)
        if run.replay_routing is not None:
            replay = self.spice_engine.set_routing_replay(run.replay_routing)
            assert replay is not None
            say(replay.note)
        if run.history_predictor is not None:
            say(self.spice_engine.set_history_predictor(run.history_predictor))
        if run.auto_budget:
            budget = self.automatic_device_budget()
            say(
                f"no --device-budget: using {format_bytes(budget)}, what the GPU has free after the "
                "model's other weights and the KV cache, less a margin (or all routed experts if less)"
            )
            self.set_device(budget)
        if self.spice_device is not None:
            say(self.spice_device.describe())

    # llama_cpp.Llama.__init__ assigns self.model_params and fills it before
    # loading; intercepting the assignment places the expert overrides there.
    @property
    def model_params(self) -> Any:
        return self._spice_model_params

    @model_params.setter
    def model_params(self, value: Any) -> None:
        value.tensor_buft_overrides = ctypes.addressof(self._spice_overrides)
        if self._spice_experts_on_disk:
            # experts mapped from the file and never read at load; the other weights stay
            # mmap'd as upstream runs them (file pages the kernel can reclaim under a limit)
            value.lazy_mode = LLAMA_LAZY_MODE_EXPERTS
        self._spice_model_params = value

    # ---- device tier ----------------------------------------------------------------

    def set_device(
        self,
        budget: str | int,
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        *,
        manual_clock: bool = False,
        executor: str | None = None,
    ) -> DeviceTier:
        """Give the model a device tier of `budget` (bytes, "2GiB", or "25%" of all
        routed-expert bytes). On a CUDA build with a GPU the tier is real (CUDA
        device 0) unless a bandwidth or latency to emulate is given; otherwise it
        is emulated: slots in their own host buffer, copies on a virtual bus of
        the given bandwidth/latency. `executor` ("auto", "pool", "legacy") picks
        how a computing device runs its experts: "pool" is the slot-pool graph
        (on an emulated tier it runs on ggml's CPU backend), "legacy" one graph
        per expert (CUDA, for A/B runs); None: the model's device_executor."""
        return self.spice_engine.set_device(
            budget, bandwidth_gbps, latency_us, manual_clock=manual_clock, executor=executor
        )

    def clear_device(self) -> None:
        self.spice_engine.clear_device()

    @property
    def spice_device(self) -> DeviceTier | None:
        return self.spice_engine.device

    def automatic_device_budget(self) -> int:
        """Bytes for a real device tier when none is given (docs/design.md section 11): the
        GPU's free memory now (after this model's other weights and KV cache are
        allocated), less the margin ggml's buffers need, and never more than all
        routed experts."""
        return self.spice_engine.automatic_budget()

    def spice_expert_bytes(self) -> int:
        """Bytes of a tier holding every routed expert (what a 100% budget means): the
        routed-expert bytes, or more where layers' experts differ in size (every slot
        is as large as the largest expert)."""
        return self.spice_engine.expert_bytes()

    def spice_layers(self) -> list[LayerInfo]:
        return self.spice_engine.layers()

    # ---- surrogates ------------------------------------------------------------------

    def set_surrogates(self, source: SurrogateSource) -> SurrogateSet:
        """Load LoRE surrogates for the policies that ask for them (plan action
        "surrogate"). `source` is anything with `surrogate(layer, expert) ->
        (alpha, A [rank, n_embd], B [n_embd, rank]) or None` (a
        pyspice.formats.sidecar.Sidecar). They replace any loaded before; they
        are f16 host copies whose bytes count against the device budget. Over
        budget: nothing stays loaded and ValueError says by how much. Exact
        policies never use them."""
        return self.spice_engine.set_surrogates(source)

    def clear_surrogates(self) -> None:
        """Unload every surrogate (their bytes go back to the device budget)."""
        self.spice_engine.clear_surrogates()

    def spice_surrogates(self) -> SurrogateSet:
        """How many surrogates are loaded and the budget bytes they take."""
        return self.spice_engine.surrogates()

    # ---- policy ----------------------------------------------------------------

    @property
    def spice_policy(self) -> str:
        """The policy in use (its registry name, or a custom policy's `name`)."""
        return self.spice_engine.policy_name

    def set_policy(self, policy: str | Policy, max_hook_tokens: int | None = None) -> None:
        """Switch policy without reloading (bench runs every policy on one model).
        "auto" ranks the lossless policies for this tier and sets the fastest, saying
        which through `spice_say` (first use: a probe and a routing sample)."""
        if policy == AUTO:
            policy = self._auto_policy()
        self.spice_engine.set_policy(policy, max_hook_tokens)

    def _auto_policy(self) -> str:
        choice = choose_policy(self, self.spice_say)  # the probe and the sample set their own plans
        self.spice_auto_choice = choice
        if choice is None:
            self.spice_say("auto: no device or RAM tier to manage: using 'exact'")
            return "exact"
        self.spice_say(choice.line())
        return choice.policy

    def policy_context(self) -> PolicyContext:
        return self.spice_engine.policy_context()

    # ---- evaluation ---------------------------------------------------------------

    def eval(self, tokens: Any) -> None:
        """llama_cpp.Llama.eval, timed for the stats record. Ctrl-C aborts the decode
        promptly under every policy and bus speed, prompts included (SigintGuard:
        a watcher thread asks libspice to abort while native code runs, and no
        callback of the decode sees the KeyboardInterrupt), and surfaces as
        KeyboardInterrupt once the decode is back; the context stays usable
        (llama.cpp drops the aborted batch's positions, and the next eval starts
        after the last complete one)."""
        rt = self._spice_runtime
        if rt is not None:
            rt.take_interrupt()  # a request left from before this eval is stale: no decode ran
            rt.sync_hook()  # graph inputs for a rule a plan installed during the last decode
        start = time.perf_counter()
        guard = SigintGuard(rt.request_abort if rt is not None else None)
        try:
            with guard:
                super().eval(tokens)
        except RuntimeError:
            self._raise_decode_failure()
            if rt is not None and (rt.take_interrupt() or guard.interrupted):
                raise KeyboardInterrupt from None
            raise
        except KeyboardInterrupt:
            if rt is not None:
                rt.take_interrupt()  # the request that cut the decode short must not stop the next
            raise
        self._raise_decode_failure()
        if guard.interrupted:  # the decode ended before it saw the request
            if rt is not None:
                rt.take_interrupt()
            raise KeyboardInterrupt
        self.spice_engine.record_eval(len(tokens), time.perf_counter() - start)
        if self._spice_runtime is not None:
            if self._spice_runtime.take_interrupt():
                raise KeyboardInterrupt
            self._spice_runtime.report_rejections()

    def _raise_decode_failure(self) -> None:
        failure = self._spice_runtime.take_failure() if self._spice_runtime is not None else None
        if failure is not None:
            raise DecodeFailedError(native().SPICE_ERR_INTERNAL, f"pyspice: {failure}")

    # ---- stats -----------------------------------------------------------------------

    def spice_snapshot(self) -> StatsSnapshot:
        return self.spice_engine.snapshot()

    def spice_stats(self) -> dict[str, Any]:
        """The stats record of docs/design.md section 11 since the last reset."""
        return self.spice_engine.stats()

    def spice_reset_stats(self) -> None:
        self.spice_engine.reset_stats()

    def spice_upstream_twin(
        self, n_gpu_layers: int | None = None, tensor_overrides: Sequence[tuple[str, str]] = ()
    ) -> llama_cpp.Llama:
        """The same model loaded by plain llama.cpp with upstream's defaults (weight
        repacking on, the hook never registered): what `bench` compares against as
        its `upstream*` rows. `n_gpu_layers` as `-ngl` (default: this instance's),
        `tensor_overrides` (pattern, buffer type) pairs as `-ot PATTERN=TYPE` takes
        them. Made on first use for each placement; shares nothing with this
        instance but the file."""
        ngl = self.model_params.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        key = (ngl, tuple(tensor_overrides))
        twin = self._spice_twins.get(key)
        if twin is None:
            cp = self.context_params
            twin = PlainLlama(
                self.model_path,
                tensor_overrides=tensor_overrides,
                n_ctx=cp.n_ctx,
                n_batch=cp.n_batch,
                n_ubatch=cp.n_ubatch,
                n_threads=cp.n_threads,
                n_threads_batch=cp.n_threads_batch,
                n_gpu_layers=ngl,
                verbose=False,
            )
            self._stack.callback(twin.close)
            self._spice_twins[key] = twin
        return twin


def load_sidecar(path: str | Path, model_path: str | Path) -> Sidecar:
    """The calibration sidecar for `model_path`, checked against the model."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"sidecar {path} does not exist (make one with `pyspice calibrate -m MODEL`)")
    try:
        read_header(path)  # the sidecar is a GGUF too: say what is wrong with it in one line
    except ModelFileError as exc:
        raise ValueError(f"bad sidecar: {exc}; remake it with `pyspice calibrate -m MODEL`") from None
    return Sidecar.load(Path(path), Path(model_path))


def _note(message: str) -> None:
    print(f"pyspice: {message}", file=sys.stderr)


def _sidecar_path(sidecar: str | Path | Sidecar | None) -> Path | None:
    if isinstance(sidecar, Sidecar):
        return sidecar.path
    return None if sidecar is None else Path(sidecar)


def _quiet(message: str) -> None:
    pass
