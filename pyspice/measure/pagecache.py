"""A file's pages in the page cache: dropped (posix_fadvise DONTNEED) before each
row of `bench --memory-limit`, and counted (mincore) to show the drop worked.

DONTNEED drops only clean pages no process has mapped: pages of a model some
other process has loaded with mmap stay, which resident_bytes() shows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np

_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop(path: Path) -> None:
    """Ask the kernel to drop `path`'s cached pages (dirty ones are written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(path: Path, start: int = 0, end: int | None = None) -> int:
    """Bytes of `path` (of [start, end) of it, in whole pages) in the page cache now
    (mincore over a mapping that touches nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            page = mmap.PAGESIZE
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            pages = np.frombuffer(memoryview(vec).cast("B"), dtype=np.uint8) & 1
            first, last = start // page, (size if end is None else min(end, size) + page - 1) // page
            return min(size, int(pages[first:last].sum()) * page)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
