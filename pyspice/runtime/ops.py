"""libspice's standalone functions on plain values: device queries, the outcomes of a call's
actions, the rule's router logits, and the surrogate executor."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pyspice.build_info import load_build_info
from pyspice.runtime.constants import _COUNTER_FIELDS
from pyspice.runtime.errors import SpiceError
from pyspice.runtime.loader import _Native
from pyspice.stats import Counters


def device_count() -> int:
    """CUDA devices this libspice can use: 0 on a CPU-only build (answered from the
    build record, without loading libspice) or with no GPU."""
    if not load_build_info().cuda:
        return 0
    return int(_Native.get().lib.spice_device_count())


def device_memory(index: int = 0) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `index`."""
    n = _Native.get()
    free, total = n.ffi.new("uint64_t *"), n.ffi.new("uint64_t *")
    status = n.lib.spice_device_memory(index, free, total)
    if status != 0:
        raise SpiceError(status, f"no CUDA device {index} in this build")
    return int(free[0]), int(total[0])


def add_outcomes(actions: npt.ArrayLike, hit: npt.ArrayLike) -> Counters:
    """spice_counters_add_outcomes: each activation's outcome, from its action and
    whether its expert was resident as the call began."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    acts = np.ascontiguousarray(actions, dtype=np.int32).ravel()
    hits = np.ascontiguousarray(hit, dtype=np.uint8).ravel()
    if acts.shape != hits.shape:
        raise ValueError(f"{acts.size} actions but {hits.size} hit flags")
    c = ffi.new("spice_counters *")
    lib.spice_counters_add_outcomes(
        c, ffi.from_buffer("int32_t[]", acts), ffi.from_buffer("uint8_t[]", hits), acts.size
    )
    return Counters(**{name: int(getattr(c, name)) for name in _COUNTER_FIELDS})


def rule_router_logits(router: npt.ArrayLike, hidden: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The logits the rule's next-layer prefetch ranks when a call carries none from
    the graph (spice_rule_router_logits): router [n_expert, n_embd] in int16 and
    hidden rows [n, n_embd] in 15 bits, each row with its own scale. Returns
    [n, n_expert] float64."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    r = np.ascontiguousarray(router, dtype=np.float32)
    h = np.ascontiguousarray(np.atleast_2d(hidden), dtype=np.float32)
    if r.ndim != 2 or h.ndim != 2 or h.shape[1] != r.shape[1]:
        raise ValueError(f"shapes: router {r.shape}, hidden {h.shape}")
    out = np.zeros((h.shape[0], r.shape[0]), np.float64)
    status = lib.spice_rule_router_logits(
        r.shape[0],
        r.shape[1],
        ffi.from_buffer("float[]", r),
        h.shape[0],
        ffi.from_buffer("float[]", h),
        ffi.from_buffer("double[]", out, require_writable=True),
    )
    if status != 0:
        raise SpiceError(
            status, f"spice_rule_router_logits: {ffi.string(lib.spice_status_string(status)).decode()}"
        )
    return out


def surrogate_apply(
    a: npt.ArrayLike,
    b: npt.ArrayLike,
    alpha: float,
    hidden: npt.ArrayLike,
    weights: npt.ArrayLike,
    shared: npt.ArrayLike | None = None,
    out: npt.NDArray[np.float32] | None = None,
    n_threads: int = 1,
) -> npt.NDArray[np.float32]:
    """libspice's surrogate executor on plain arrays (spice_surrogate_apply):
    out[i] += weights[i] * (alpha * shared[i] + B @ (A @ hidden[i])), with A and
    B rounded to f16 as a loaded surrogate is and the work split as n_threads
    graph threads split it. Returns out (zeros when not given)."""
    n = _Native.get()
    ffi, lib = n.ffi, n.lib
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    b32 = np.ascontiguousarray(b, dtype=np.float32)
    h = np.ascontiguousarray(hidden, dtype=np.float32)
    w = np.ascontiguousarray(weights, dtype=np.float32).ravel()
    rows, n_embd = h.shape
    rank = int(a32.shape[0])
    if a32.shape != (rank, n_embd) or b32.shape != (n_embd, rank) or w.shape != (rows,):
        raise ValueError(f"shapes: A {a32.shape}, B {b32.shape}, hidden {h.shape}, weights {w.shape}")
    sh = None if shared is None else np.ascontiguousarray(shared, dtype=np.float32)
    if sh is not None and sh.shape != h.shape:
        raise ValueError(f"shared has shape {sh.shape}; hidden has {h.shape}")
    result = np.zeros_like(h) if out is None else out
    if result.shape != h.shape or result.dtype != np.float32 or not result.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 array shaped like hidden")
    row_bytes = n_embd * 4
    status = lib.spice_surrogate_apply(
        n_embd,
        rank,
        float(alpha),
        ffi.from_buffer("float[]", a32) if rank else ffi.NULL,
        ffi.from_buffer("float[]", b32) if rank else ffi.NULL,
        rows,
        ffi.from_buffer("float[]", h),
        row_bytes,
        ffi.from_buffer("float[]", sh) if sh is not None else ffi.NULL,
        row_bytes,
        ffi.from_buffer("float[]", w),
        ffi.from_buffer("float[]", result, require_writable=True),
        row_bytes,
        n_threads,
    )
    if status != 0:
        raise SpiceError(
            status, f"spice_surrogate_apply: {ffi.string(lib.spice_status_string(status)).decode()}"
        )
    return result
