"""`pyspice --version`: what is installed and which library llama_cpp loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pyspice import __version__
from pyspice.build_info import BuildNotFoundError, load_build_info
from pyspice.runtime.ops import device_count

# The patched libllama carries no mark of its own: its MoE hook API tells it from an
# unpatched one, and the sha256 `make build` recorded tells it from another build.
HOOK_SYMBOL = "llama_set_moe_hook"


def loaded_libllama() -> tuple[Path, bool]:
    """Path of the libllama `llama_cpp` loaded, and whether it has the MoE hook."""
    # lazy: loads libllama, only to report what it is
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    return Path(lib._name).resolve(), hasattr(lib, HOOK_SYMBOL)


def file_sha256(path: Path) -> str:
    """As scripts/install-native.py records it (a libllama is a few MiB)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def built_patch_series() -> list[str]:
    """The series libspice was built with, alongside its libllama (spice_build_patch_series)."""
    from pyspice.runtime.loader import _Native

    n = _Native.get()
    return [s for s in n.ffi.string(n.lib.spice_build_patch_series()).decode().splitlines() if s]


def version_report() -> str:
    lines = [f"pyspice {__version__}"]
    try:
        info = load_build_info()
    except BuildNotFoundError as exc:
        return "\n".join([*lines, f"warning: {exc}"])
    try:
        path, hooked = loaded_libllama()
    except Exception as exc:  # a broken library must still let --version explain itself
        return "\n".join([*lines, f"warning: llama_cpp failed to load its library: {exc}"])
    lines.append(f"libllama: {path}")
    if not hooked:
        lines.append(
            "warning: llama_cpp loaded a libllama that is not pyspice's patched build (it has no MoE "
            "hook); run `make build`"
        )
        return "\n".join(lines)
    try:
        applied = built_patch_series()
    except Exception as exc:
        applied = list(info.patch_series)
        lines.append(f"warning: libspice failed to load ({exc}); the series below is the build record's")
    lines.append("patch series:")
    lines.extend(f"  {name}" for name in applied)
    if path.parent != info.lib_dir.resolve():
        lines.append(f"warning: expected the library in {info.lib_dir}")
    if info.libllama_sha256 and file_sha256(path) != info.libllama_sha256:
        lines.append(
            "warning: the loaded libllama is not the one `make build` installed (another build of the "
            "hook); run `make build`"
        )
    if tuple(applied) != info.patch_series:
        lines.append("warning: libspice's patch series differs from the installed build's; run `make build`")
    lines.append(f"build: {info.build_type}{' + CUDA' if info.cuda else ''}, {info.build_dir}")
    lines.append(f"device tier: {device_tier_kind(info.cuda)}")
    return "\n".join(lines)


def device_tier_kind(cuda_build: bool) -> str:
    """What --device-budget gives on this machine."""
    if not cuda_build:
        return "emulated (CPU-only build)"

    try:
        n = device_count()
    except Exception as exc:  # the CUDA runtime itself may be what is broken
        return f"emulated (CUDA build, but the CUDA runtime failed: {exc})"
    return f"CUDA, {n} device{'s' if n != 1 else ''}" if n else "emulated (CUDA build, no GPU found)"
