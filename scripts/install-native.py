#!/usr/bin/env python3
"""Install the built native libraries where `llama_cpp` loads them.

Runs inside the project's venv. Copies libllama, libggml*, libspice (with
their soname links) into the installed llama_cpp package's lib/ folder, so a
plain `import llama_cpp` uses the patched build, and writes
`pyspice-build.json` beside them: where the build tree, the tools and the
patched upstream sources are, the applied patch series and the installed
libllama's sha256. pyspice reads that file (pyspice.build_info).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_package_dir() -> Path:
    # find_spec does not import: importing llama_cpp without a library would fail.
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install-native: llama_cpp is not installed in this environment; run `make venv`")
    return Path(next(iter(spec.submodule_search_locations)))


def cmake_cache_value(build_dir: Path, key: str) -> str:
    for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split("=", 1)[1]
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", type=Path, required=True)
    args = parser.parse_args()
    build_dir = args.build_dir.resolve()
    pkg = llama_cpp_package_dir()
    lib_dir = pkg / "lib"
    # remove what an earlier install left (e.g. a CUDA lib after a CPU rebuild)
    if lib_dir.exists():
        for old in lib_dir.iterdir():
            if old.name.startswith(("libllama", "libggml", "libspice", "pyspice-build", "spice.h")):
                old.unlink()
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or "cmake"
    subprocess.run(
        [cmake, "--install", str(build_dir), "--component", "pyspice-runtime", "--prefix", str(pkg)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    upstream = Path(cmake_cache_value(build_dir, "PYSPICE_UPSTREAM_DIR"))
    series = [
        line.strip()
        for line in (ROOT / "patches" / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    info = {
        "source_dir": str(ROOT),
        "build_dir": str(build_dir),
        "bin_dir": str(build_dir / "bin"),
        "upstream_dir": str(upstream),
        "lib_dir": str(lib_dir),
        "patch_series": series,
        # what tells this build's libllama from another (pyspice --version): the patched
        # library carries no mark of its own beyond the hook API
        "libllama_sha256": hashlib.sha256((lib_dir / "libllama.so").resolve().read_bytes()).hexdigest(),
        "cuda": cmake_cache_value(build_dir, "GGML_CUDA") in ("ON", "1", "TRUE"),
        "build_type": cmake_cache_value(build_dir, "CMAKE_BUILD_TYPE"),
    }
    (lib_dir / "pyspice-build.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"install-native: libraries installed into {lib_dir}")


if __name__ == "__main__":
    main()
