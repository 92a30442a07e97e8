"""One run's settings, and the one place their defaults are resolved.

`RunConfig` is what a user chooses (every field may be left to its default);
`RunConfig.resolve()` turns it into a `ResolvedRun` with every default decided
(policy, sidecar, threads, GPU layers, whether the device budget is sized
automatically), saying each choice it makes through `note`. The CLI, the
scripts and `pyspice.Llama.from_config` all go through it, so they get the
same defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pyspice.build_info import BuildNotFoundError, load_build_info
from pyspice.engine.checks import (
    check_at_least,
    check_budget_value,
    check_bus,
    check_executor,
    check_ram_budget_settings,
    check_threads,
    warn_threads_above_cores,
)
from pyspice.engine.host_memory import memory_advice, memory_for_this_process
from pyspice.engine.planning import Planning
from pyspice.formats.model_info import inspect_model
from pyspice.formats.sidecar import Sidecar, default_sidecar_path
from pyspice.policy import policy_spec
from pyspice.policy.registry import AUTO
from pyspice.runtime import device_count

Note = Callable[[str], None]

# every layer's non-expert weights on the GPU: more than any model has
ALL_LAYERS = 999
# The slot-pool executor's largest token bucket (SPICE_POOL_MAX_BUCKET in
# native/src/spice-pool-exec.h): on a GPU tier, larger micro-batches keep upstream's path.
PREFILL_HOOK_TOKENS = 32


def _quiet(message: str) -> None:
    pass


def gpu_present() -> bool:
    """A CUDA build that sees a GPU (the real device tier is available)."""
    try:
        return device_count() > 0
    except BuildNotFoundError:
        return False


def cuda_build() -> bool:
    try:
        return load_build_info().cuda
    except BuildNotFoundError:
        return False


@dataclass(frozen=True)
class ModelDefaults:
    """The built-in model a command runs when given none, by what the command is for.

    Policy measurements (bench, sim traces, eval predictor|surrogate) run where
    the targets route: few experts per token (smolmoe-b, 4 of 32, as
    Qwen2-57B-A14B's 8 of 64). Text for a reader (chat, generate, serve, eval
    ppl) runs the model with the better held-out perplexity, smolmoe (top-12):
    docs/results/models.md has both."""

    benchmark: str = "smolmoe-b"
    quality: str = "smolmoe"

    def for_role(self, role: str) -> str:
        if role not in ("benchmark", "quality"):
            raise ValueError(f"unknown model role {role!r} (benchmark or quality)")
        return self.benchmark if role == "benchmark" else self.quality


@dataclass(frozen=True)
class RunConfig:
    """What to run: the model, its device tier, policy, sidecar and threads.

    None means "the default", decided by resolve()."""

    model: Path
    policy: str | None = None  # a registry name (pyspice.policy.policy_names())
    device_budget: str | int | None = None  # bytes, "2GiB" or "25%" (units.whole_tier_bytes)
    ram_budget: str | int | None = None  # edge mode: experts stay in the file, a RAM slot pool this size
    emulate_bandwidth: float | None = None  # GB/s of an emulated device's bus
    emulate_latency: float | None = None  # us per copy on it
    sidecar: Path | None = None  # None: the one beside the model, if any
    use_sidecar: bool = True  # False: run without one even where one is beside the model
    threads: int | None = None
    n_gpu_layers: int | None = None
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    # None: on a real GPU tier, prompt batches above the pool executor's largest bucket
    # keep upstream's path (PREFILL_HOOK_TOKENS); elsewhere every micro-batch goes through the hook
    max_hook_tokens: int | None = None
    planning: Planning = field(default_factory=Planning)  # where SPICE policies plan
    device_executor: str = "auto"  # how a computing device runs its experts: auto, pool, legacy
    replay_routing: Path | None = None  # a trace whose expert ids the hook uses (timing only)
    # SPICE predicts from expert ids with this routing-history predictor (`pyspice trace fit`)
    history_predictor: Path | None = None
    use_mmap: bool = True  # llama.cpp maps the file (False: reads the weights into RAM, --no-mmap)
    use_mlock: bool = False  # lock the model's pages in RAM (--mlock)

    def __post_init__(self) -> None:
        # paths given as strings (Python callers) become Paths, as the CLI makes them
        for name in ("model", "sidecar", "replay_routing", "history_predictor"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, Path(value))
        # every setting checked here, before anything loads (engine/checks.py)
        if self.policy is not None:
            policy_spec(self.policy)  # an unknown name fails now, not after the model loads
        check_threads(self.threads)
        check_at_least("-c/--ctx-size", self.n_ctx, 1)
        check_at_least("-b/--batch-size", self.n_batch, 1)
        check_at_least("-ub/--ubatch-size", self.n_ubatch, 1)
        check_at_least("-ngl/--n-gpu-layers", self.n_gpu_layers, 0)
        check_at_least(
            "--max-hook-tokens", self.max_hook_tokens, 0, "0 sends every micro-batch through the hook"
        )
        check_budget_value(self.device_budget)
        check_ram_budget_settings(
            self.ram_budget,
            device_budget=self.device_budget,
            policy=self.policy,
            max_hook_tokens=self.max_hook_tokens,
            use_mlock=self.use_mlock,
        )
        check_bus(self.emulate_bandwidth, self.emulate_latency)
        check_executor(self.device_executor)

    @property
    def emulated(self) -> bool:
        return self.emulate_bandwidth is not None or self.emulate_latency is not None

    def default_policy(self, note: Note = _quiet) -> str:
        """The policy when none is given: `auto` wherever there is a tier to manage (a
        device budget, a RAM budget, or a GPU, whose budget is then sized
        automatically): the simulator ranks the lossless policies on this machine and
        the run takes the fastest (engine/auto_policy.py). With no tier, `exact`."""
        if self.policy is not None:
            return self.policy
        if self.ram_budget is not None or self.device_budget is not None:
            return AUTO
        if self.emulate_bandwidth is None and gpu_present():
            return AUTO
        if cuda_build():
            note("no device budget given; using policy 'exact' (all experts exact)")
        else:
            note(
                "CPU-only build: no device tier to manage; using policy 'exact' "
                "(routed experts run exactly on the host)"
            )
        return "exact"

    def _sidecar_beside(self) -> Path | None:
        if not self.use_sidecar:
            return None
        path = self.sidecar or default_sidecar_path(self.model)
        return path if path.is_file() else None

    def resolve(self, note: Note = _quiet) -> ResolvedRun:
        """Every default decided, each choice said through `note`."""
        policy = self.default_policy(note)
        gpu = not self.emulated and gpu_present()
        n_gpu_layers = self.n_gpu_layers
        if n_gpu_layers is None:
            n_gpu_layers = ALL_LAYERS if gpu else 0
            if gpu:
                note("GPU found: every layer's non-expert weights go to it (-ngl to change)")
        if self.device_budget is None and self.emulated:
            raise ValueError("--emulate-bandwidth/--emulate-latency need --device-budget")
        # header only: a truncated or foreign file fails here with a precise message
        summary = inspect_model(self.model)
        threads = self.threads or max(1, os.cpu_count() or 1)
        warn_threads_above_cores(threads, note)
        budget = self.device_budget
        if not summary.is_moe and policy != "stock":
            note(
                f"{self.model.name} is a dense {summary.architecture} model: no routed experts, nothing "
                "to offload; running it with policy 'stock'"
            )
            policy = "stock"
            if budget is not None:
                note("--device-budget ignored: a dense model has no experts to place")
                budget = None
        if summary.is_moe:
            advice = memory_advice(
                self.model.name,
                summary.file_size,
                summary.expert_bytes,
                memory_for_this_process(),
                self.ram_budget is not None,
            )
            if advice:
                note(advice)
        sidecar = self.sidecar if self.use_sidecar else None
        loaded: Sidecar | None = None
        if sidecar is None and self.use_sidecar and policy != "stock":
            loaded = self._sidecar_beside_checked(policy, note)
            sidecar = loaded.path if loaded is not None else None
        return ResolvedRun(
            model=self.model,
            policy=policy,
            device_budget=budget,
            ram_budget=self.ram_budget if summary.is_moe else None,
            auto_budget=budget is None
            and self.ram_budget is None
            and gpu
            and summary.is_moe
            and manages_tier(policy),
            emulate_bandwidth=self.emulate_bandwidth,
            emulate_latency=self.emulate_latency,
            sidecar=sidecar,
            threads=threads,
            n_gpu_layers=n_gpu_layers,
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            max_hook_tokens=self._max_hook_tokens(gpu, budget, policy, note),
            planning=self.planning,
            device_executor=self.device_executor,
            loaded_sidecar=loaded,
            replay_routing=self.replay_routing,
            history_predictor=self.history_predictor,
            use_mmap=self.use_mmap,
            use_mlock=self.use_mlock,
        )

    def _max_hook_tokens(self, gpu: bool, budget: str | int | None, policy: str, note: Note) -> int:
        """--max-hook-tokens when given; otherwise PREFILL_HOOK_TOKENS on a real GPU tier
        (prompt batches through the hook measured 0.24-0.79x of stock on an H200,
        docs/results/gpu.md; upstream's path runs them as stock does), else 0."""
        if self.max_hook_tokens is not None:
            return self.max_hook_tokens
        if (
            gpu
            and self.ram_budget is None
            and policy != "stock"
            and (budget is not None or manages_tier(policy))
        ):
            note(
                f"GPU tier: micro-batches above {PREFILL_HOOK_TOKENS} tokens (prompts) keep upstream's path "
                "(--max-hook-tokens 0 sends them through the hook)"
            )
            return PREFILL_HOOK_TOKENS
        return 0

    def _sidecar_beside_checked(self, policy: str, note: Note) -> Sidecar | None:
        """The sidecar beside the model, loaded and checked, when one is there. One
        picked up automatically that cannot be used (another model's, truncated,
        non-finite weights) fails only a policy that uses it; for any other it is a
        warning, and the run goes on without it."""
        beside = default_sidecar_path(self.model)
        if not beside.is_file():
            return None
        try:
            loaded = Sidecar.load(beside, self.model)
            check_sidecar_weights(loaded, policy)
        except (ValueError, OSError) as exc:  # ModelFileError, SidecarDataError, mismatch
            if uses_sidecar(policy):
                raise ValueError(
                    f"the sidecar beside the model cannot be used: {exc} (or run without it: --no-sidecar)"
                ) from None
            note(f"warning: ignoring {beside}, which policy {policy!r} does not use: {exc}")
            return None
        note(f"using the model's calibration sidecar {beside}")
        return loaded


def check_sidecar_weights(sidecar: Sidecar, policy: str) -> None:
    """Check now the parts of the sidecar `policy` reads (the draft transitions; a
    lossy level's surrogates too), so that a corrupt one fails before the model
    loads; the parts it never reads stay unread (Sidecar.check_weights)."""
    if uses_sidecar(policy):
        sidecar.check_weights(surrogates=not policy_spec(policy).lossless)


def manages_tier(policy: str) -> bool:
    """Whether a policy wants a device tier where a GPU gives one: those that manage it,
    and `auto`, which chooses among them."""
    return policy == AUTO or policy_spec(policy).needs_device


def uses_sidecar(policy: str) -> bool:
    """Whether a policy reads the sidecar (predictor, surrogates, error tables), as the
    registry says of it (PolicySpec.reads_sidecar: the SPICE family and its ablations)."""
    return policy_spec(policy).reads_sidecar


@dataclass(frozen=True)
class ResolvedRun:
    """A RunConfig with every default decided (RunConfig.resolve)."""

    model: Path
    policy: str
    device_budget: str | int | None
    ram_budget: str | int | None
    auto_budget: bool  # size the tier after loading, from what the GPU has left
    emulate_bandwidth: float | None
    emulate_latency: float | None
    sidecar: Path | None
    threads: int
    n_gpu_layers: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    max_hook_tokens: int
    planning: Planning = field(default_factory=Planning)
    device_executor: str = "auto"
    # the sidecar as resolve() loaded and checked it, so loading the model reads it once
    loaded_sidecar: Sidecar | None = field(default=None, compare=False, repr=False)
    replay_routing: Path | None = None
    history_predictor: Path | None = None
    use_mmap: bool = True
    use_mlock: bool = False

    def context_params(self) -> dict[str, int]:
        """llama.cpp's model and context sizes for this run, as keyword arguments of
        llama_cpp.Llama: pyspice's rows and bench's `upstream` row take the same ones,
        so a comparison runs both with equal threads and batches."""
        return {
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "n_threads": self.threads,
            "n_threads_batch": self.threads,
            "n_gpu_layers": self.n_gpu_layers,
        }
