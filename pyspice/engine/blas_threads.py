"""Keep numpy's BLAS single-threaded while Python policies run inside the graph.

A Python policy is called from inside a ggml custom op: ggml's other worker
threads are waiting at a barrier (spinning first), so every core is already
taken. If numpy's BLAS (OpenBLAS in the numpy wheels) then starts its own
threads for a matrix product, they fight ggml's for the same cores; on two
cores a 0.5 ms product was measured at 10 ms. Limiting BLAS to one thread is
process-wide (that is how BLAS libraries work), so it happens only once a
Python policy is enabled, and lasts while the handle is held.
"""

from __future__ import annotations

from typing import Any

from threadpoolctl import threadpool_limits


def limit_blas_threads() -> Any:
    """Limit BLAS to one thread; returns a handle (keep it; `restore_original_limits()` undoes)."""
    return threadpool_limits(limits=1, user_api="blas")
