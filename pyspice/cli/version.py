"""`pyspice --version`: what is installed and which library llama_cpp loads."""

from __future__ import annotations

import ctypes
from pathlib import Path

from pyspice import __version__
from pyspice.build_info import BuildNotFoundError, load_build_info
from pyspice.runtime import device_count


def loaded_libllama() -> tuple[Path, str | None]:
    """Path of the libllama `llama_cpp` loaded and its patch series (None: not ours)."""
    # lazy: loads libllama, only to report what it is
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    path = Path(lib._name).resolve()
    try:
        fn = lib.llama_spice_patch_series
    except AttributeError:
        return path, None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    series = fn()
    return path, series.decode() if series is not None else None


def version_report() -> str:
    lines = [f"pyspice {__version__}"]
    try:
        info = load_build_info()
    except BuildNotFoundError as exc:
        return "\n".join([*lines, f"warning: {exc}"])
    try:
        path, series = loaded_libllama()
    except Exception as exc:  # a broken library must still let --version explain itself
        return "\n".join([*lines, f"warning: llama_cpp failed to load its library: {exc}"])
    lines.append(f"libllama: {path}")
    if series is None:
        lines.append(
            "warning: llama_cpp loaded a libllama that is not pyspice's patched build; run `make build`"
        )
        return "\n".join(lines)
    applied = [s for s in series.splitlines() if s]
    lines.append("patch series:")
    lines.extend(f"  {name}" for name in applied)
    if path.parent != info.lib_dir.resolve():
        lines.append(f"warning: expected the library in {info.lib_dir}")
    if tuple(applied) != info.patch_series:
        lines.append(
            "warning: the loaded library's patches differ from the installed build's; run `make build`"
        )
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
