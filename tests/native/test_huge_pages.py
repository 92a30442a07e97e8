"""Patch 0008: ggml's large CPU buffers start on a 2 MiB boundary and are advised
MADV_HUGEPAGE (the kernel's `hg` flag on the mapping), unless GGML_NO_HUGEPAGES is set;
small ones are left as upstream makes them.

Whether the kernel then backs them with huge pages depends on the machine (THP
"never", none free), so the test checks the advice, which is what the patch does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import ctypes, json, sys
base = ctypes.CDLL(sys.argv[1])
base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
base.ggml_backend_buft_alloc_buffer.restype = ctypes.c_void_p
base.ggml_backend_buft_alloc_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
base.ggml_backend_buffer_get_base.restype = ctypes.c_void_p
base.ggml_backend_buffer_get_base.argtypes = [ctypes.c_void_p]
out = {}
for size in (8 << 20, 64 << 10):
    buf = base.ggml_backend_buft_alloc_buffer(base.ggml_backend_cpu_buffer_type(), size)
    p = base.ggml_backend_buffer_get_base(buf)
    flags = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= p < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    out[size] = {"aligned_2mib": p % (2 << 20) == 0, "advised": "hg" in (flags or [])}
print(json.dumps(out))
"""


def advice(env: dict[str, str]) -> dict[str, dict[str, bool]]:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(lib)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="a kernel without transparent huge pages refuses the advice",
)
def test_large_cpu_buffers_are_advised_huge_pages_and_small_ones_are_not() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GGML_NO_HUGEPAGES"}
    got = advice(env)
    assert got[str(8 << 20)] == {"aligned_2mib": True, "advised": True}
    assert got[str(64 << 10)]["advised"] is False


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only: the advice is madvise's")
def test_ggml_no_hugepages_leaves_large_buffers_as_upstream_makes_them() -> None:
    got = advice({**os.environ, "GGML_NO_HUGEPAGES": "1"})
    assert got[str(8 << 20)]["advised"] is False
