"""The device tier a policy runs on, at the slot precision it asks for where that
can be had: a lossy level asks for 4- or 5-bit slots (policy.base.slot_precision), and
libspice then keeps a low-precision copy of every routed expert in host memory.
Where the copies cannot be had (a disk tier, whose slots hold the file's bytes;
too little memory for them; libspice refusing, e.g. under SPICE_CUDA_VERIFY) the
tier keeps exact slots, which is never less exact, and says why once."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from tqdm import tqdm

from pyspice.engine.host_memory import ADVICE_USABLE, memory_for_this_process
from pyspice.engine.slot_cache import KeptCopies
from pyspice.runtime import SLOT_EXACT, SLOT_PRECISIONS, LayerInfo, Runtime, SpiceError, StoreParams
from pyspice.units import format_bytes

# Copies made per second per core, in output bytes. 4bit: IQ4_NL's quantizer searches
# scales per 32-weight block (smolmoe-b, Q8_0: 28.5 MiB in 5-9 s on 2 cores). 5bit:
# Q5_0's does not (34.8 MiB in 0.1 s); Q5_K's (from Q6_K experts) is not measured.
COPY_BYTES_PER_CORE_S = {"4bit": 2 << 20, "5bit": 128 << 20}
ANNOUNCE_AFTER_S = 2.0  # say beforehand, and show progress, when the copies take longer than this
READ_BYTES_S = 1 << 30  # kept copies read back from disk (slot_cache): about 1 GB/s


def copies_estimate_s(precision: str, need: int, cores: int) -> float:
    """Seconds libspice is expected to take making `need` bytes of `precision` copies on
    `cores`."""
    return need / (COPY_BYTES_PER_CORE_S[precision] * max(1, cores))


def copies_refusal(precision: str, need: int, room: int | None, experts: int = 0) -> str | None:
    """Why copies of `need` bytes are not made with `room` bytes of memory this process
    may use (None: they fit, or nothing is known to say otherwise). They stay in memory
    for the run, so they may take at most ADVICE_USABLE of what is available once the
    model's `experts` bytes are set aside: the kernel counts a mapped model's pages as
    available (clean page cache), yet the host runs its misses from them, and copies
    that pushed them out would have llama.cpp read them back from disk at every token."""
    if room is None or need <= ADVICE_USABLE * (room - experts):
        return None
    return (
        f"{precision} slots need {format_bytes(need)} of host memory for their expert copies and this "
        f"process may use {format_bytes(room)}, {format_bytes(experts)} of it the model's routed experts: "
        "the device tier keeps exact slots"
    )


def set_tier(
    runtime: Runtime,
    params: StoreParams,
    precision: str,
    layers: Sequence[LayerInfo],
    on_disk: bool,
    say: Callable[[str], None],
    kept: KeptCopies | None = None,
) -> None:
    """Give `runtime` the tier `params` describes with slots of `precision` ("exact",
    "4bit" or "5bit"), or exact ones where those cannot be had (said through `say`, which says a
    line once). Copies in `kept` are read instead of made, and copies made are kept
    there (slot_cache.py)."""
    wanted = SLOT_PRECISIONS[precision]
    if wanted != SLOT_EXACT and on_disk:
        say(
            f"{precision} slots are not used on a disk tier (its slots hold the file's bytes): "
            "the experts there stay exact"
        )
        wanted = SLOT_EXACT
    # copies of this precision already made (a bench's earlier row) are kept and reused
    reused = wanted != SLOT_EXACT and runtime.slot_copies_precision() == wanted
    loaded = False
    making, need = 0.0, 0  # seconds set_device is expected to spend making `need` bytes of copies
    if wanted != SLOT_EXACT and not reused:
        experts = sum(info.bytes_per_expert * info.n_expert for info in layers if info.is_moe)
        need = runtime.slot_copies_size(wanted)
        refusal = copies_refusal(precision, need, memory_for_this_process(), experts)
        if refusal is not None:
            say(refusal)
            wanted = SLOT_EXACT
        else:
            if kept is not None:
                with copies_progress(runtime, f"{precision} slots: reading", need, need / READ_BYTES_S):
                    loaded = kept.load(runtime, wanted, precision, say)
            if not loaded:
                cores = len(os.sched_getaffinity(0))
                making = copies_estimate_s(precision, need, cores)
                if making > ANNOUNCE_AFTER_S:
                    say(
                        f"{precision} slots: re-quantizing every routed expert for the device tier "
                        f"({format_bytes(need)}, about {making:.0f} s on {cores} cores; "
                        + ("kept for later runs)" if kept is not None else "once per run)")
                    )
    try:
        with copies_progress(runtime, f"{precision} slots: re-quantizing", need, making):
            runtime.set_device(replace(params, slot_precision=wanted))
    except SpiceError as err:
        if wanted == SLOT_EXACT:
            raise
        say(f"{precision} slots could not be made ({err}): the device tier keeps exact slots")
        runtime.set_device(replace(params, slot_precision=SLOT_EXACT))
        return
    size, seconds = runtime.slot_copies()
    if size > 0 and not reused:
        model_bytes = sum(info.bytes_per_expert for info in layers if info.is_moe)
        slots = sum(b for b in runtime.slot_expert_bytes() if b > 0)
        how = f"made in {seconds:.1f} s"
        if loaded and kept is not None:
            how = f"read in {seconds:.1f} s from {kept.path(precision)}"
        say(
            f"{precision} slots: every routed expert re-quantized for the device tier "
            f"({format_bytes(size)} of host memory, {how}); the budget holds "
            f"{model_bytes / max(1, slots):.2f}x the experts it would at the model's precision (lossy)"
        )
        if kept is not None and not loaded:
            kept.save(runtime, precision, say)


@contextmanager
def copies_progress(runtime: Runtime, desc: str, need: int, eta_s: float) -> Iterator[None]:
    """A progress bar on stderr over the `need` bytes of slot copies libspice makes or
    reads while the body runs (one native call that returns when done), where that is
    expected to take over ANNOUNCE_AFTER_S; a thread polls the runtime meanwhile."""
    if eta_s <= ANNOUNCE_AFTER_S:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        with tqdm(total=need, unit="B", unit_scale=True, desc=desc, file=sys.stderr, mininterval=1.0) as bar:
            while True:
                stopping = stop.wait(0.5)
                done, total = runtime.slot_copies_progress()
                if total > 0:
                    bar.total = total
                    bar.update(done - bar.n)
                if stopping:
                    return

    thread = threading.Thread(target=poll, name="pyspice-copies-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
