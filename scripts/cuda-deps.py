#!/usr/bin/env python3
"""Fetch cuBLAS for a CUDA build on a machine whose CUDA toolkit lacks it.

ggml's CUDA backend links cuBLAS. Some machines have nvcc and the CUDA runtime
but no cuBLAS (this project's build machine is one); NVIDIA publishes it on
PyPI as the `nvidia-cublas` wheel (headers + shared libraries). This script
downloads the wheel matching nvcc's major version into DEST, unpacks it, adds
the unversioned .so links a linker needs, and prints the CMake arguments
that point ggml's FindCUDAToolkit at it (one per line), for `make cuda-check`.

At run time the same libraries must be found (LD_LIBRARY_PATH, or the
nvidia-cublas wheel installed beside torch, as on most GPU machines).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# nvcc major version -> the nvidia-cublas release built for it
CUBLAS_FOR_CUDA = {13: "nvidia-cublas==13.10.0.20", 12: "nvidia-cublas-cu12==12.9.3.13"}


def nvcc_major(nvcc: str) -> int:
    out = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.", out)
    if not found:
        sys.exit(f"cuda-deps: cannot read the CUDA version from `{nvcc} --version`")
    return int(found.group(1))


def default_nvcc() -> str:
    """The toolkit's own nvcc: $CUDA_HOME, then /usr/local/cuda, then PATH (a
    wrapper on PATH would not say where the toolkit is)."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or "nvcc"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument(
        "--nvcc", default=default_nvcc(), help="the toolkit's nvcc (its ../.. is the toolkit root)"
    )
    args = parser.parse_args()
    if not Path(args.nvcc).exists():
        sys.exit("cuda-deps: no nvcc found; install the CUDA toolkit (nvcc) or pass --nvcc")
    major = nvcc_major(args.nvcc)
    requirement = CUBLAS_FOR_CUDA.get(major)
    if requirement is None:
        sys.exit(f"cuda-deps: no cuBLAS wheel known for CUDA {major}; add one to CUBLAS_FOR_CUDA")
    dest = args.dest.resolve()
    root = dest / f"cu{major}"
    if not (root / "include" / "cublas_v2.h").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        print(f"cuda-deps: downloading {requirement} (~450 MB, once)", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(dest),
                requirement,
            ],
            check=True,
        )
        wheel = next(dest.glob("nvidia_cublas*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            members = [
                m for m in zf.namelist() if m.startswith("nvidia/") and ("/include/" in m or "/lib/" in m)
            ]
            zf.extractall(dest / "wheel", members)
        unpacked = (
            next((dest / "wheel" / "nvidia").glob("cu*"))
            if major >= 13
            else dest / "wheel" / "nvidia" / "cublas"
        )
        if root.exists():
            shutil.rmtree(root)
        shutil.move(str(unpacked), root)
        shutil.rmtree(dest / "wheel", ignore_errors=True)
        wheel.unlink()
    lib = root / "lib"
    for name in ("cublas", "cublasLt"):
        versioned = sorted(lib.glob(f"lib{name}.so.*"))
        link = lib / f"lib{name}.so"
        if versioned and not link.exists():
            link.symlink_to(versioned[0].name)
    cuda_root = Path(args.nvcc).parent.parent
    include = root / "include"
    for arg in (
        f"-DCUDAToolkit_ROOT={cuda_root}",
        f"-DCMAKE_CUDA_COMPILER={args.nvcc}",
        f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}",
        f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so'}",
        f"-DCMAKE_CUDA_FLAGS=-I{include}",
        f"-DCMAKE_CXX_FLAGS=-I{include}",
        f"-DCMAKE_C_FLAGS=-I{include}",
    ):
        print(arg)


if __name__ == "__main__":
    main()
