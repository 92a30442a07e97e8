"""Options shared by subcommands, named as in llama.cpp where the meaning is the same."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pyspice.cli import numbers
from pyspice.cli.help_levels import advanced, brief
from pyspice.engine.config import ModelDefaults, RunConfig
from pyspice.engine.planning import Planning
from pyspice.models.builtin import MODEL_NAMES, builtin_of
from pyspice.models.default import default_model
from pyspice.models.smolmoe_recipe import RECIPE_NAME, text_or_corpus
from pyspice.policy import policy_names

if TYPE_CHECKING:
    from pyspice.api import Llama


def note(message: str) -> None:
    """A choice made for the user, printed once to standard error."""
    print(f"pyspice: {message}", file=sys.stderr)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="GGUF model (same as -m)")
    p.add_argument(
        "-m",
        "--model",
        help="GGUF path, or a built-in model built on first use: smolmoe (the default) or smolmoe-b "
        "(the default of bench, sim, eval predictor|surrogate)",
    )


def add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--ctx-size",
        type=numbers.integer(1),
        default=2048,
        metavar="N",
        help="context size in tokens (default 2048)",
    )
    advanced(
        p.add_argument(
            "-b",
            "--batch-size",
            type=numbers.integer(1),
            default=512,
            help="logical batch size (default 512)",
        )
    )
    advanced(
        p.add_argument(
            "-ub",
            "--ubatch-size",
            type=numbers.integer(1),
            default=512,
            help="physical batch size (default 512)",
        )
    )
    p.add_argument(
        "-t",
        "--threads",
        type=numbers.THREADS,
        default=None,
        metavar="N",
        help="threads (default: all cores)",
    )
    brief(
        p.add_argument(
            "-ngl",
            "--n-gpu-layers",
            type=int,
            default=None,
            metavar="N",
            help="layers to offload to the GPU (default: all on a CUDA build with a GPU, else 0); "
            "routed experts always stay on the host, where the device tier fetches them from",
        ),
        "layers on the GPU (default: all on a CUDA build with a GPU, else 0); routed experts stay "
        "on the host",
    )
    advanced(
        p.add_argument(
            "--no-mmap",
            dest="use_mmap",
            action="store_false",
            help="read the weights into RAM instead of mapping the file (as llama.cpp's --no-mmap); "
            "with --ram-budget the routed experts stay in the file either way",
        )
    )
    advanced(
        p.add_argument(
            "--mlock",
            dest="use_mlock",
            action="store_true",
            help="lock the model's pages in RAM so the system cannot page them out (as llama.cpp's "
            "--mlock); not with --ram-budget",
        )
    )
    names = ", ".join(policy_names())
    brief(
        p.add_argument(
            "--policy",
            choices=policy_names(),
            default=None,
            metavar="NAME",
            help=f"expert policy: {names} (default: auto where there is a tier to manage: "
            "--device-budget, --ram-budget or a GPU; else exact); auto runs the fastest lossless one "
            "as the simulator ranks them for this machine; see docs/design.md section 6",
        ),
        f"expert policy: {names} (default: auto where there is a tier to manage, else exact)",
    )
    p.add_argument(
        "--device-budget",
        type=numbers.budget_text,
        default=None,
        metavar="SIZE",
        help="device tier size: bytes with a unit (2GiB, 512MiB) or a share of all routed-expert "
        "bytes (25%%)",
    )
    brief(
        p.add_argument(
            "--ram-budget",
            type=numbers.budget_text,
            default=None,
            metavar="SIZE",
            help="edge mode: routed experts stay in the model file and a RAM slot pool of this size "
            "(2GiB, or a share of all routed-expert bytes: 50%%) holds the resident ones, read from "
            "the file as policies ask; every batch goes through the hook; not with --device-budget",
        ),
        "edge mode: experts stay in the file, a RAM pool of this size (2GiB, 50%%) holds the "
        "resident ones; not with --device-budget",
    )
    advanced(
        p.add_argument(
            "--emulate-bandwidth",
            type=numbers.positive_real("GB/s; PCIe 4.0 x16 is about 25"),
            default=None,
            metavar="GB/s",
            help="emulated device: bus bandwidth (CPU-only builds; default 12)",
        )
    )
    advanced(
        p.add_argument(
            "--emulate-latency",
            type=numbers.real(0.0, hint="microseconds per copy"),
            default=None,
            metavar="us",
            help="emulated device: latency per copy (default 10)",
        )
    )
    advanced(
        p.add_argument(
            "--device-executor",
            choices=("auto", "pool", "legacy"),
            default="auto",
            help="how a device that computes runs its experts: the slot-pool graph, one launch per "
            "layer (pool; on an emulated tier it runs on the CPU, for tests), one graph per expert "
            "(legacy, CUDA, for A/B runs); auto: pool where the layer's types allow",
        )
    )
    advanced(
        p.add_argument(
            "--max-hook-tokens",
            type=numbers.integer(0, hint="0: every micro-batch through the hook"),
            default=None,
            help="micro-batches with more tokens run upstream's path (0 = all through the hook; default: "
            "32 on a GPU tier, so prompts run as stock does, else 0)",
        )
    )
    add_planning_args(p)
    advanced(
        p.add_argument(
            "--max-plan-lag",
            type=numbers.integer(1, hint="MoE layers"),
            default=None,
            metavar="LAYERS",
            help="free-running asynchronous planning: drop plans older than this many MoE layers "
            "(default: the policy's horizon H_min)",
        )
    )


def add_planning_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--planning and --plan-lag (planning_of reads them): add_context_args's, and
    `pyspice calibrate --levels`'s, which tunes the lossy levels as they plan."""
    advanced(
        p.add_argument(
            "--planning",
            choices=("auto", "sync", "async"),
            default="auto",
            help="where spice:* and abl-* policies plan: on the hook's thread (sync), or on a planner "
            "thread while each call runs by the policy's rule (async); auto: async where the decode's "
            "threads leave the planner a core (the lossy levels then apply each plan exactly one layer "
            "late, as --plan-lag 1) or the experts are on disk, else sync; said once",
        )
    )
    advanced(
        p.add_argument(
            "--plan-lag",
            type=numbers.integer(0, 64, hint="0: free-running"),
            default=0,
            metavar="LAYERS",
            help="deterministic asynchronous planning: the plan of each MoE layer's call is applied "
            "exactly this many calls later, waiting for it (runs repeat exactly; 0: free-running)",
        )
    )


def add_sidecar_arg(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    advanced(
        group.add_argument(
            "--sidecar",
            type=Path,
            default=None,
            help="calibration sidecar of the model (default: <model>.spice.gguf beside it, made by "
            "`pyspice calibrate`, and for the default model on first use)",
        )
    )
    advanced(
        group.add_argument(
            "--no-sidecar",
            action="store_true",
            help="run without a sidecar (the default model's first use then skips calibrating one)",
        )
    )
    advanced(
        p.add_argument(
            "--history-predictor",
            type=Path,
            default=None,
            metavar="NPZ",
            help="SPICE predicts from expert ids with this routing-history predictor (`pyspice trace "
            "fit` on a trace of the model) instead of the sidecar's draft predictor",
        )
    )


def add_prompt_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("-p", "--prompt", help="prompt text")
    group.add_argument("-f", "--file", "--text", dest="file", type=Path, help="read the prompt from a file")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n",
        "--n-predict",
        type=numbers.TOKENS,
        default=64,
        metavar="N",
        help="tokens to generate (default 64)",
    )
    advanced(p.add_argument("-s", "--seed", type=int, default=0xFFFFFFFF, help="RNG seed (default: random)"))
    p.add_argument(
        "--temp",
        type=numbers.real(0.0, hint="0 is greedy"),
        default=0.8,
        help="temperature; 0 = greedy (default 0.8)",
    )
    advanced(
        p.add_argument(
            "--top-k",
            type=numbers.integer(0, hint="0 keeps every token"),
            default=40,
            help="top-k sampling (default 40)",
        )
    )
    advanced(
        p.add_argument(
            "--top-p", type=numbers.real(0.0, 1.0), default=0.95, help="top-p sampling (default 0.95)"
        )
    )
    advanced(
        p.add_argument(
            "--repeat-penalty",
            type=numbers.positive_real("1.0 is off"),
            default=1.0,
            help="penalize repeated tokens (default 1.0 = off)",
        )
    )


def resolve_model(args: argparse.Namespace, *, sidecar: bool = True, role: str = "quality") -> Path:
    """The GGUF of -m or the positional MODEL (see model_path; `role`: which built-in model
    is the default); `sidecar`: a built-in model's own is made on first use, unless
    --no-sidecar or another --sidecar is given."""
    own = getattr(args, "sidecar", None) is None and not getattr(args, "no_sidecar", False)
    path = model_path(args.model or args.model_pos, sidecar=sidecar and own, role=role)
    args.model, args.model_pos = str(path), None  # resolved once per command
    return path


def model_path(chosen: str | None, *, sidecar: bool = True, role: str = "quality") -> Path:
    """A GGUF path, or a built-in model (its name, or nothing: the default for `role`, as
    ModelDefaults decides), built on first use, and its sidecar with it when `sidecar`."""
    if not chosen or chosen in MODEL_NAMES:
        name = chosen or ModelDefaults().for_role(role)
        if not chosen:
            note(f"no model given: using the default model {name} (built on first use)")
        return default_model(name, sidecar=sidecar, note=note)
    path = Path(chosen).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model file {path} does not exist (a synthetic one: `pyspice models synth --arch qwen2moe "
            "--shape tiny -o tiny.gguf`; the default model: leave -m out)"
        )
    return path


def read_text_or_corpus(path: Path | None, part: str, model: Path | None = None) -> str:
    """The text of `path`; with none, the `part` ("calibration" or "heldout") of the corpus
    of the built-in model `model` is (smolmoe's for any other model)."""
    return text_or_corpus(path, part, builtin_of(model) or RECIPE_NAME)


def add_text_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    """-f/--file/--text, a text file a command reads (None when not given)."""
    p.add_argument("-f", "--file", "--text", dest="file", type=Path, default=None, help=help_text)


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        return str(args.file.read_text(encoding="utf-8"))
    return str(args.prompt)


def run_config(
    args: argparse.Namespace, policy: str | None = None, *, model: Path | None = None
) -> RunConfig:
    """The RunConfig of the model options (add_model_args, add_context_args,
    add_sidecar_arg); `policy` stands for --policy, `model` for -m, when given."""
    return RunConfig(
        model=model if model is not None else resolve_model(args),
        policy=policy if policy is not None else args.policy,
        device_budget=args.device_budget,
        ram_budget=getattr(args, "ram_budget", None),
        emulate_bandwidth=args.emulate_bandwidth,
        emulate_latency=args.emulate_latency,
        sidecar=getattr(args, "sidecar", None),
        use_sidecar=not getattr(args, "no_sidecar", False),
        threads=args.threads,
        n_gpu_layers=args.n_gpu_layers,
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        max_hook_tokens=args.max_hook_tokens,
        planning=planning_of(args),
        device_executor=getattr(args, "device_executor", "auto"),
        replay_routing=getattr(args, "replay_routing", None),
        history_predictor=getattr(args, "history_predictor", None),
        use_mmap=getattr(args, "use_mmap", True),
        use_mlock=getattr(args, "use_mlock", False),
    )


def planning_of(args: argparse.Namespace) -> Planning:
    """The Planning of --planning, --plan-lag, --max-plan-lag."""
    mode = getattr(args, "planning", "auto")
    return Planning(
        asynchronous=None if mode == "auto" else mode == "async",
        deterministic_lag=getattr(args, "plan_lag", 0),
        max_lag=getattr(args, "max_plan_lag", None),
    )


def open_model(
    args: argparse.Namespace,
    policy: str | None = None,
    *,
    logits_all: bool = False,
    seed: int | None = None,
) -> Llama:
    """The model of the command's options, its defaults resolved by RunConfig."""
    from pyspice.api import Llama  # lazy: native code loads here, not at CLI start-up

    return Llama.from_config(run_config(args, policy), logits_all=logits_all, seed=seed, note=note)
