"""Options shared by subcommands, named as in llama.cpp where the meaning is the same."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pyspice.build_info import BuildNotFoundError, load_build_info
from pyspice.policy import policy_names, policy_spec
from pyspice.units import format_bytes

if TYPE_CHECKING:
    from pyspice.api import Llama


def note(message: str) -> None:
    """A choice made for the user, printed once to standard error."""
    print(f"pyspice: {message}", file=sys.stderr)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="GGUF model (same as -m)")
    p.add_argument(
        "-m", "--model", help="GGUF model path, or 'smolmoe' (the default model, also used without -m)"
    )


def add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size in tokens (default 2048)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size (default 512)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch size (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        type=int,
        default=None,
        help="layers to offload to the GPU (default: all on a CUDA build with a GPU, else 0); "
        "routed experts always stay on the host, where the device tier fetches them from",
    )
    p.add_argument(
        "--policy",
        choices=policy_names(),
        default=None,
        help="expert policy (default: exact on a CPU-only build; with a GPU, spice when the "
        "model has a sidecar, else lru); see DESIGN section 6",
    )
    p.add_argument(
        "--device-budget",
        default=None,
        help="device tier size: bytes with a unit (2GiB, 512MiB) or a share of all routed-expert "
        "bytes (25%%)",
    )
    p.add_argument(
        "--emulate-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="emulated device: bus bandwidth (CPU-only builds; default 12)",
    )
    p.add_argument(
        "--emulate-latency",
        type=float,
        default=None,
        metavar="us",
        help="emulated device: latency per copy (default 10)",
    )
    p.add_argument(
        "--max-hook-tokens",
        type=int,
        default=0,
        help="micro-batches with more tokens run upstream's path (0 = all through the hook)",
    )


def add_sidecar_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sidecar",
        type=Path,
        default=None,
        help="calibration sidecar of the model (<model>.spice.gguf, made by `pyspice calibrate`)",
    )


def add_prompt_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("-p", "--prompt", help="prompt text")
    group.add_argument("-f", "--file", "--text", dest="file", type=Path, help="read the prompt from a file")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("-s", "--seed", type=int, default=0xFFFFFFFF, help="RNG seed (default: random)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (default 0.95)")
    p.add_argument(
        "--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens (default 1.0 = off)"
    )


def resolve_model(args: argparse.Namespace) -> Path:
    """The GGUF to use: -m/positional path, the default model's name, or with
    neither the default model (smolmoe, built on first use)."""
    chosen = args.model or args.model_pos
    from pyspice.models.smolmoe_build import MODEL_NAMES, build_smolmoe

    if not chosen or chosen in MODEL_NAMES:
        if not chosen:
            note("no model given: using the default model smolmoe (built on first use)")
        path = build_smolmoe()
        args.model, args.model_pos = str(path), None  # resolved once per command
        return path
    path = Path(chosen).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model file {path} does not exist (a synthetic one: `pyspice models synth --arch qwen2moe "
            "--shape tiny -o tiny.gguf`; the default model: leave -m out)"
        )
    return path


def read_text_or_corpus(path: Path | None, part: str) -> str:
    """The text of `path`; with none, the `part` ("calibration" or "heldout") of the
    default model's corpus."""
    if path is None:
        from pyspice.models.smolmoe_recipe import corpus_part

        return str(corpus_part(part).text)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    return path.read_text(encoding="utf-8")


def add_text_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    """-f/--file/--text, a text file a command reads (None when not given)."""
    p.add_argument("-f", "--file", "--text", dest="file", type=Path, default=None, help=help_text)


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        return str(args.file.read_text(encoding="utf-8"))
    return str(args.prompt)


def gpu_present() -> bool:
    """A CUDA build that sees a GPU (the real device tier is available)."""
    from pyspice.runtime import device_count

    try:
        return device_count() > 0
    except BuildNotFoundError:
        return False


def default_policy(args: argparse.Namespace) -> str:
    if args.policy is not None:
        return str(args.policy)
    try:
        cuda = load_build_info().cuda
    except BuildNotFoundError:
        cuda = False
    if args.device_budget is None and args.emulate_bandwidth is None and gpu_present():
        from pyspice.sidecar import default_sidecar_path

        sidecar = getattr(args, "sidecar", None) or default_sidecar_path(resolve_model(args))
        if sidecar.is_file():
            note("GPU found, no --policy: using 'spice' (the model has a calibration sidecar)")
            return "spice"
        note("GPU found, no --policy: using 'lru' (no calibration sidecar; `pyspice calibrate` makes one)")
        return "lru"
    if args.device_budget is not None:
        note("device budget given, no --policy: using 'exact' (the tier preloaded as far as it goes)")
    elif cuda:
        note("no device budget given; using policy 'exact' (all experts exact)")
    else:
        note(
            "CPU-only build: no device tier to manage; using policy 'exact' "
            "(routed experts run exactly on the host)"
        )
    return "exact"


def thread_count(args: argparse.Namespace) -> int:
    return int(args.threads) if args.threads else max(1, os.cpu_count() or 1)


def open_model(
    args: argparse.Namespace, policy: str, *, logits_all: bool = False, seed: int | None = None
) -> Llama:
    from pyspice.api import Llama  # native code loads here, not at CLI start-up
    from pyspice.model_info import inspect_model

    threads = thread_count(args)
    emulation = args.emulate_bandwidth is not None or args.emulate_latency is not None
    gpu = not emulation and gpu_present()
    n_gpu_layers = args.n_gpu_layers
    if n_gpu_layers is None:
        n_gpu_layers = 999 if gpu else 0
        if gpu:
            note("GPU found: every layer's non-expert weights go to it (-ngl to change)")
    if args.device_budget is None and emulation:
        raise ValueError("--emulate-bandwidth/--emulate-latency need --device-budget")
    path = resolve_model(args)
    # header only: a truncated or foreign file fails here with a precise message
    summary = inspect_model(path)
    device_budget = args.device_budget
    if not summary.is_moe and policy != "stock":
        note(
            f"{path.name} is a dense {summary.architecture} model: no routed experts, nothing to "
            "offload; running it with policy 'stock'"
        )
        policy = "stock"
        if device_budget is not None:
            note("--device-budget ignored: a dense model has no experts to place")
            device_budget = None
    sidecar = getattr(args, "sidecar", None)
    if sidecar is None and policy != "stock":
        from pyspice.sidecar import default_sidecar_path

        beside = default_sidecar_path(path)
        if beside.is_file():
            note(f"using the model's calibration sidecar {beside}")
            sidecar = beside
    auto_budget = device_budget is None and gpu and summary.is_moe and policy_needs_device(policy)
    llm = Llama(
        str(path),
        policy="stock" if auto_budget else policy,  # the policy starts once its tier exists
        max_hook_tokens=args.max_hook_tokens,
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=n_gpu_layers,
        logits_all=logits_all,
        seed=seed if seed is not None else 0xFFFFFFFF,
        # an automatic budget is sized after loading, from what the GPU has left
        device_budget=device_budget,
        emulate_bandwidth=args.emulate_bandwidth,
        emulate_latency=args.emulate_latency,
        sidecar=sidecar,
        verbose=False,
    )
    if auto_budget:
        budget = llm.automatic_device_budget()
        note(
            f"no --device-budget: using {format_bytes(budget)}, what the GPU has free after the "
            "model's other weights and the KV cache, less a margin (or all routed experts if less)"
        )
        llm.set_device(budget)
        llm.set_policy(policy)
    if llm.spice_device is not None:
        note(llm.spice_device.describe())
    return llm


def policy_needs_device(policy: str) -> bool:
    return bool(policy_spec(policy).needs_device)
