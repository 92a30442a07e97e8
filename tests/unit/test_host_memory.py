"""The memory a run may use (MemAvailable, or its cgroup's limit) and the one-line
advice on how a MoE should run in it (pyspice.engine.host_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspice.engine import host_memory
from pyspice.engine.config import RunConfig
from pyspice.engine.host_memory import cgroup_memory_limit, memory_advice, release_free_heap
from tests.unit.test_inspect_header import write_moe

MiB = 1 << 20
GiB = 1 << 30


def test_a_model_larger_than_memory_gets_a_ram_budget_that_fits() -> None:
    # 30 GiB file, 24 GiB of it routed experts, 16 GiB available: 0.8 x 16 - 6 - 1/8 GiB of
    # process = 6.675 GiB of room, 27% of the experts
    line = memory_advice("q.gguf", 30 * GiB, 24 * GiB, 16 * GiB, ram_budget_given=False)
    assert line is not None and line.startswith("warning: q.gguf is 30.00 GiB, more than the 16.00 GiB")
    assert "--ram-budget 27%" in line and "6.48 GiB RAM pool" in line


def test_a_model_whose_other_weights_alone_do_not_fit_is_told_so() -> None:
    line = memory_advice("q.gguf", 30 * GiB, 10 * GiB, 16 * GiB, ram_budget_given=False)
    assert line is not None and "leave no room" in line and "--ram-budget" not in line
    # smolmoe-b in 160 MiB: its 115 MiB of other weights and the process fill 0.8 x 160
    line = memory_advice("s.gguf", 169 * MiB, 54 * MiB, 160 * MiB, ram_budget_given=False)
    assert line is not None and "leave no room" in line


def test_a_model_that_fits_twice_over_is_told_edge_mode_is_slower() -> None:
    line = memory_advice("s.gguf", 169 * MiB, 54 * MiB, 20 * GiB, ram_budget_given=True)
    assert line is not None and "without --ram-budget every expert stays in RAM" in line


@pytest.mark.parametrize(
    ("file_bytes", "available", "given"),
    [
        (10 * GiB, 16 * GiB, False),  # fits: nothing to say
        (10 * GiB, 16 * GiB, True),  # fits, but not twice over: the budget may be wanted
        (30 * GiB, 16 * GiB, True),  # larger, and edge mode asked for: right
        (30 * GiB, None, False),  # unknown memory: no guess
    ],
)
def test_nothing_is_said_where_the_run_suits_its_memory(
    file_bytes: int, available: int | None, given: bool
) -> None:
    assert memory_advice("m.gguf", file_bytes, file_bytes // 2, available, given) is None


def test_cgroup_limits_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "v1" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("297795584\n")
    mounts = f"cgroup {tmp_path / 'v1'} cgroup rw,memory 0 0\n"
    assert cgroup_memory_limit(mounts, "4:memory:/box\n") == 297795584
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_limit(mounts, "4:memory:/box\n") is None
    v2 = tmp_path / "v2" / "user"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    mounts2 = f"cgroup2 {tmp_path / 'v2'} cgroup2 rw 0 0\n"
    assert cgroup_memory_limit(mounts2, "0::/user\n") is None
    (v2 / "memory.max").write_text("1073741824\n")
    assert cgroup_memory_limit(mounts2, "0::/user\n") == GiB
    assert cgroup_memory_limit("", "") is None


def test_resolve_says_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_moe(tmp_path / "m.gguf")
    monkeypatch.setattr(host_memory, "host_memory_available", lambda: 1024)  # far less than the file
    monkeypatch.setattr(host_memory, "cgroup_memory_limit", lambda mounts, own: None)
    notes: list[str] = []
    RunConfig(str(model), policy="exact", use_sidecar=False).resolve(notes.append)  # a str path too
    assert sum("more than the 1.00 KiB of memory" in n for n in notes) == 1, notes


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_release_free_heap_returns_freed_blocks_to_the_system() -> None:
    """Blocks below malloc's mmap threshold come from its heap and stay resident when
    freed: 64 MiB of 64 KiB blocks, all freed but the last (which keeps the heap's top
    from shrinking on its own), leave the resident set only on release_free_heap."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 -- glibc only
    except (OSError, AttributeError):
        pytest.skip("not glibc: nothing to trim")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, n = 64 << 10, 1024
    blocks = [libc.malloc(block) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, block)
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_anon()
    release_free_heap()
    after = _rss_anon()
    libc.free(blocks[-1])
    assert before - after > (n * block) // 2, (before, after)
