"""How fast the model file's disk serves the reads edge mode's tier makes.

The disk tier (native/src/spice-device-disk.c) reads experts with O_DIRECT on a
few reader threads, so that is what is timed here, on the model file itself:
latency from single random 64 KiB reads, bandwidth from expert-sized reads on
as many threads as the tier uses. Where the file system has no O_DIRECT the
reads go through the page cache, whose pages are dropped first (and the result
says so)."""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN = 4096
LATENCY_READ = 64 * 1024
READER_THREADS = 4  # the disk tier's default (DISK_THREADS_DEFAULT)


@dataclass(frozen=True)
class DiskFigures:
    gbps: float  # 1e9 bytes per second with READER_THREADS reads in flight
    latency_us: float  # median of single random 64 KiB reads
    direct: bool  # O_DIRECT was in effect


def _open(path: Path) -> tuple[int, bool]:
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass  # EINVAL: no direct I/O on this file system
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd, False


def _offsets(size: int, chunk: int, n: int, rng: np.random.Generator) -> list[int]:
    last = max(0, size - chunk) // ALIGN
    return [int(x) * ALIGN for x in rng.integers(0, last + 1, size=n)]


def measure_disk(
    path: Path, expert_bytes: int, *, latency_reads: int = 64, seconds: float = 1.0
) -> DiskFigures:
    """Time reads of `path` (the model file) as the disk tier makes them."""
    size = path.stat().st_size
    rng = np.random.default_rng(0)
    fd, direct = _open(path)
    try:
        buf = mmap.mmap(-1, LATENCY_READ)  # page-aligned, as O_DIRECT needs
        times = []
        for off in _offsets(size, LATENCY_READ, latency_reads, rng):
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            times.append(time.perf_counter() - t0)
        latency_us = statistics.median(times) * 1e6

        chunk = max(ALIGN, (expert_bytes + ALIGN - 1) // ALIGN * ALIGN)
        total = [0] * READER_THREADS
        stop = time.perf_counter() + seconds

        def reader(i: int) -> None:
            local = mmap.mmap(-1, chunk)
            offsets = _offsets(size, chunk, 1 << 16, np.random.default_rng(i + 1))
            for off in offsets:
                # the read first: a thread started late on a busy machine, after
                # `stop`, would otherwise read nothing (and a probe of all of them, 0 GB/s)
                total[i] += os.preadv(fd, [local], off)
                if time.perf_counter() >= stop:
                    break

        start = time.perf_counter()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(READER_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return DiskFigures(gbps=sum(total) / elapsed / 1e9, latency_us=latency_us, direct=direct)
