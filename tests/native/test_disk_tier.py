"""Edge mode: routed experts left in the GGUF file, a RAM slot pool filled by reads
of it (the disk tier). Lossless policies stay bit-identical to the in-RAM reference
at 25% and 50% RAM budgets on both architectures; llama.cpp never reads the experts
at load; a read error ends the decode with a clear error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader

from pyspice.api import Llama
from pyspice.runtime import DecodeFailedError

from .golden import AllDevice, AllHost, greedy_run, load

N_DECODE = 10


def load_on_disk(path: Path, budget: str, **kwargs: Any) -> Llama:
    return Llama(
        str(path),
        policy="exact",
        ram_budget=budget,
        logits_all=True,
        verbose=False,
        n_ctx=256,
        n_batch=128,
        n_ubatch=128,
        n_threads=2,
        n_threads_batch=2,
        **kwargs,
    )


@pytest.mark.parametrize("budget", ["25%", "50%"])
@pytest.mark.parametrize("arch,quant", [("qwen2moe", "Q4_K"), ("deepseek2", "Q5_K_M")])
def test_lossless_policies_are_bit_identical_with_experts_on_disk(
    synth_model, arch: str, quant: str, budget: str
) -> None:
    path = synth_model(arch, "tiny", quant)
    ram = load(path)
    try:
        ref = greedy_run(ram, "stock", n_decode=N_DECODE)
    finally:
        ram.close()
    llm = load_on_disk(path, budget)
    try:
        assert llm.spice_device is not None and llm.spice_device.disk
        # spice:exact plans asynchronously here, its rule fetching and keeping every miss
        for policy in ("exact", "lru", "ondemand", "spice:exact", AllHost(), AllDevice()):
            got = greedy_run(llm, policy, n_decode=N_DECODE)
            assert np.array_equal(got.logits, ref.logits), f"{policy} with experts on disk at {budget}"
            assert got.stats["disk_read_bytes"] > 0 or got.stats["hit_rate"] == 1.0
        # a host action on an absent expert reads it for that call only
        host = greedy_run(llm, AllHost(), n_decode=N_DECODE)
        assert host.stats["disk_scratch_reads"] > 0
    finally:
        llm.close()


def test_spice_keeps_the_misses_it_reads_when_planning_asynchronously(synth_model) -> None:
    """On this tier a host action reads its expert anyway: asynchronous SPICE (the
    default with --ram-budget) fetches every miss into the pool and keeps it by decayed
    use, where synchronous SPICE reads misses into scratch and drops them. Same logits."""
    from pyspice.engine.planning import Planning

    llm = load_on_disk(synth_model("qwen2moe", "tiny", "Q8_0"), "25%")
    try:
        kept = greedy_run(llm, "spice:exact", n_decode=N_DECODE)
        llm.spice_engine.set_planning(Planning(asynchronous=False))
        dropped = greedy_run(llm, "spice:exact", n_decode=N_DECODE)
    finally:
        llm.close()
    assert np.array_equal(kept.logits, dropped.logits)
    assert kept.stats["misses"]["fetched"] > 0
    assert kept.stats["disk_scratch_reads"] < dropped.stats["disk_scratch_reads"], (kept.stats, dropped.stats)


def test_the_widened_reads_are_counted(synth_model) -> None:
    """O_DIRECT reads whole 4 KiB blocks: the tier counts what it read, at least the
    experts' own bytes."""
    llm = load_on_disk(synth_model("qwen2moe", "tiny", "Q8_0"), "25%")
    try:
        run = greedy_run(llm, "ondemand", n_decode=N_DECODE)
        fetched = run.stats["misses"]["fetched"]
        assert fetched > 0
        per_expert = llm.spice_layers()[0].bytes_per_expert or llm.spice_layers()[1].bytes_per_expert
        assert run.stats["disk_read_bytes"] >= per_expert  # at least one expert's bytes
    finally:
        llm.close()


def test_ram_budget_refuses_what_it_cannot_do(synth_model) -> None:
    path = synth_model("qwen2moe", "tiny", "Q8_0")
    with pytest.raises(ValueError, match="cannot be combined"):
        Llama(str(path), ram_budget="50%", device_budget="50%", verbose=False)
    with pytest.raises(ValueError, match="stock"):
        Llama(str(path), ram_budget="50%", policy="stock", verbose=False)
    with pytest.raises(ValueError, match="max-hook-tokens"):
        Llama(str(path), ram_budget="50%", max_hook_tokens=8, verbose=False)
    llm = load_on_disk(path, "50%")
    try:
        with pytest.raises(ValueError, match="stock"):
            llm.set_policy("stock")
        with pytest.raises(ValueError, match="file only"):
            llm.clear_device()
    finally:
        llm.close()


def test_a_read_error_stops_the_decode_with_a_clear_error(synth_model) -> None:
    """The test-only fault hook: every read after the first few fails with EIO."""
    llm = load_on_disk(synth_model("qwen2moe", "tiny", "Q8_0"), "25%")
    try:
        llm.spice_engine.set_ram("25%", io_fault_after=3)
        with pytest.raises(DecodeFailedError, match="Input/output error"):
            greedy_run(llm, "ondemand", n_decode=N_DECODE)
        # the instance is still usable with a healthy tier
        llm.spice_engine.set_ram("25%")
        greedy_run(llm, "exact", n_decode=2)
    finally:
        llm.close()


def test_a_file_truncated_after_load_gives_a_clear_error(synth_model, tmp_path: Path) -> None:
    """The tier's own reads report it. The other weights are mmap'd by default, as
    upstream maps them, and a truncated mapping is fatal to any reader of it (SIGBUS):
    loaded with use_mmap=False they are in RAM and only the tier reads the file."""
    src = synth_model("deepseek2", "tiny", "Q4_K")
    path = tmp_path / "model.gguf"
    shutil.copyfile(src, path)
    llm = load_on_disk(path, "25%", use_mmap=False)
    try:
        first_expert = min(int(t.data_offset) for t in GGUFReader(path).tensors if "_exps" in t.name)
        os.truncate(path, first_expert)  # every expert gone
        with pytest.raises(DecodeFailedError, match=r"ends early|truncated"):
            greedy_run(llm, "ondemand", n_decode=N_DECODE)
    finally:
        llm.close()


_RSS_PROBE = """
import json, sys
from pyspice.api import Llama
kwargs = json.loads(sys.argv[2])
llm = Llama(sys.argv[1], verbose=False, n_ctx=128, n_threads=1, **kwargs)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}))
"""


def _rss_after_load(path: Path, **kwargs: Any) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), json.dumps(kwargs)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_rss_after_load_excludes_the_experts(builtin_model) -> None:
    """Loaded for edge mode (with a RAM budget of 1%, preloaded by `exact`), the process
    holds the model's other weights but not its routed experts: its RSS is below an
    in-RAM load's by nearly all routed-expert bytes (90%; the 1% pool and page
    rounding take the rest)."""
    path = builtin_model("smolmoe")
    expert_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if "_exps" in t.name)
    in_ram = _rss_after_load(path, policy="exact", use_mmap=False)
    on_disk = _rss_after_load(path, policy="exact", ram_budget="1%")
    assert in_ram["VmRSS"] - on_disk["VmRSS"] >= 0.9 * expert_bytes, (in_ram, on_disk, expert_bytes)


_CACHE_PROBE = """
import json, sys
from pathlib import Path
from pyspice.api import Llama
from pyspice.formats.model_info import read_header
from pyspice.measure.pagecache import drop, resident_bytes
path = Path(sys.argv[1])
header = read_header(path)
def ranges(pick):
    base = header.data_offset
    return [(base + t.offset, base + t.offset + t.nbytes) for t in header.tensors if pick(t.name)]
groups = {"token_embd": ranges(lambda n: n == "token_embd.weight"), "experts": ranges(lambda n: "_exps" in n)}
def cached():
    return {k: sum(resident_bytes(path, a, b) for a, b in r) for k, r in groups.items()}
drop(path)
before = cached()
llm = Llama(str(path), verbose=False, n_ctx=128, n_threads=1, policy="exact", ram_budget="1%")
llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog."))
sizes = {k: sum(b - a for a, b in r) for k, r in groups.items()}
print(json.dumps({"before": before, "after": cached(), "bytes": sizes}))
"""


def test_edge_mode_reads_only_the_token_embeddings_rows_it_looks_up(builtin_model) -> None:
    """With the experts on disk the token embeddings are a lazy tensor (patch 0006): a
    batch reads its tokens' rows, not the tensor; and prefetching the other weights
    whole (patch 0005) in a mapping without read-ahead (patch 0007) leaves no page
    fault and no read-ahead marker to read a window into the lazy tensors (before
    0007 about one run in ten read 44 MiB of experts during its eval). Page cache
    counted by mincore in a process of its own: on a disk with read_ahead_kb 8192
    both had pulled most of them into the cache (25 of 28 MiB of token embeddings,
    4 MiB of experts on smolmoe-b)."""
    path = builtin_model("smolmoe")
    probe = [sys.executable, "-c", _CACHE_PROBE, str(path)]
    out = subprocess.run(probe, check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if any(got["before"].values()):
        pytest.skip(f"another process keeps the model's pages in the page cache: {got['before']}")
    assert got["bytes"]["token_embd"] > 0, "the model has no token_embd.weight"
    assert got["after"]["token_embd"] < 0.25 * got["bytes"]["token_embd"], got
    assert got["after"]["experts"] < 0.05 * got["bytes"]["experts"], got
